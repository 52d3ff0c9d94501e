"""Weight-streaming GEMV for the bf16 weights of a decode step (lm_head, MTP shared head, eh_proj).

y [M, N] = x [M, K] @ W [N, K]^T for M <= 16 rows, fp32 accumulation. At w = 1 the lm_head (129280 x 7168
bf16, 1.85 GB) is half the bytes of a 3-layer step; torch's bf16 GEMV reads it at ~70% of copy bandwidth.
Each program owns BN output columns and streams its [BN, K] slab of W once, in [BN, BK] tiles (16-byte loads
along K), and multiplies each tile with every row of x before loading the next. Reference: `gemv_ref`.
"""

from __future__ import annotations

import torch

from mtp.kernels._triton import require, tl, triton

MAX_M = 16


def gemv_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float() @ w.float().t()).to(x.dtype)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, stride_xm, stride_wn, stride_ym, K: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):  # K constexpr: a few distinct widths (7168, 14336); pipelined loop
        kk = k0 + rk
        w = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K),
                    other=0.0).to(tl.float32)
        for m in tl.static_range(BM):  # the weight tile is read once and used for every row
            x = tl.load(x_ptr + m * stride_xm + kk, mask=(kk < K) & (m < M), other=0.0).to(tl.float32)
            part = tl.sum(w * x[None, :], axis=1)
            acc += tl.where(rm[:, None] == m, part[None, :], 0.0)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def gemv(x: torch.Tensor, w: torch.Tensor, bn: int = 16, bk: int = 512, num_warps: int = 4,
         num_stages: int = 3) -> torch.Tensor:
    """x [..., K] (<= 16 rows in all) @ w [N, K]^T -> [..., N] in x's dtype."""
    require(x, "gemv")
    K = x.shape[-1]
    N = w.shape[0]
    if w.shape[1] != K or w.stride(-1) != 1:
        raise ValueError(f"gemv: weight must be [N, {K}] with a contiguous last dim, got {list(w.shape)}")
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if M > MAX_M:
        raise ValueError(f"gemv: at most {MAX_M} rows, got {M}")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    bm = max(1, triton.next_power_of_2(M))
    _gemv_kernel[(triton.cdiv(N, bn),)](x2, w, y, M, N, x2.stride(0), w.stride(0), y.stride(0), K=K,
                                       BM=bm, BN=bn, BK=bk, num_warps=num_warps, num_stages=num_stages)
    return y.reshape(*x.shape[:-1], N)
