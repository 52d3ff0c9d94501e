"""FP8 (e4m3) block-scaled arithmetic: the plain-PyTorch reference of DeepSeek's inference numerics.

Shape legend: M rows (tokens), K input channels, N output channels, G = K // 128 channel groups.

- Weights: `w8_NK` float8_e4m3fn with `scale_inv` float32 [ceil(N/128), ceil(K/128)];
  W[n, k] = w8[n, k] * scale_inv[n // 128, k // 128].
- Activations: per token, per 128-channel group, amax = max(|x|, 1e-4), s = amax / 448, rounded UP to a
  power of two when the scale format is ue8m0; x8 = clamp(x / s, +-448) cast to e4m3 (round to nearest even).
- GEMM: y[m, n] = sum_g (x8[m, g] . w8[n, g]) * s_x[m, g] * s_w[n // 128, g], accumulated in fp32.

These functions are the reference every fast kernel in `mtp/kernels/` is held to.
"""

from __future__ import annotations

import math

import torch

BLOCK = 128
FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
AMAX_FLOOR = 1e-4
# The block scales a real checkpoint holds. Quantizing a weight gives scale = amax / 448 (rounded up to a power of
# two for ue8m0) with amax >= AMAX_FLOOR, so no scale below 2^-22 comes from weight_quant; 2^-32 leaves room for
# other quantizers. Above: 2^16 lets a block hold |w| up to 448 * 2^16 ~ 2.9e7, orders of magnitude past any
# trained linear (init N(0, 1/in), weight decay); a scale past it is a corrupt file. Its weights are finite, so
# the non-finite checks pass it, and one block at 2^60 drives the residual to ~3.5e21, RMSNorm's mean square to
# inf and every logit to exactly 0 (token 0 forever).
SCALE_MIN, SCALE_MAX = 2.0 ** -32, 2.0 ** 16


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 for a float64 model, float32 otherwise. A float64 model computes the same
    FP8 formulas with ~1e-16 noise, so results stop depending on batch shape / summation order (exact-equality
    tests of speculative vs plain decoding use it at widths where fp32 noise flips FP8 roundings)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def round_scale_ue8m0(s: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= s (exponent-only 'ue8m0' scale), computed exactly in fp32."""
    r = torch.exp2(torch.ceil(torch.log2(s)))
    # fp32 log2 is not exact: for s = 2^k * (1 + 2^-23) it returns exactly k for k >= 4 or k <= -5, so r = 2^k < s
    # and the group's amax would saturate at 448. Doubling / halving is exact, so correct the off-by-one both ways.
    r = torch.where(r < s, r * 2, r)
    return torch.where(r * 0.5 >= s, r * 0.5, r)


def act_quant(x: torch.Tensor, block: int = BLOCK, scale_fmt: str | None = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the last dim of x in groups of `block`. Returns (x8 float8 [..., K], scale fp32 [..., K // block])."""
    K = x.shape[-1]
    if K % block:
        raise ValueError(f"act_quant: last dim {K} is not a multiple of the block {block}")
    xg = x.to(acc_dtype(x.dtype)).unflatten(-1, (K // block, block))
    x8, s = quant_groups(xg, xg.abs().amax(dim=-1), scale_fmt)
    return x8.flatten(-2), s


def quant_groups(xg: torch.Tensor, amax: torch.Tensor, scale_fmt: str | None = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize groups xg [..., G, n] (accumulation dtype) with their amax [..., G]: (x8 [..., G, n], scale fp32
    [..., G]). The amax may come from elsewhere: ranks that each hold part of a group agree on the group's."""
    s = amax.clamp_min(AMAX_FLOOR) / FP8_MAX
    if scale_fmt == "ue8m0":
        s = round_scale_ue8m0(s)
    x8 = (xg / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x8, s.float()


def act_dequant(x8: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32, block: int = BLOCK) -> torch.Tensor:
    """Inverse of act_quant: x8 [..., K] float8 and s [..., K // block] -> dtype [..., K]."""
    K = x8.shape[-1]
    a = acc_dtype(dtype)
    xg = x8.to(a).unflatten(-1, (K // block, block)) * s.to(a).unsqueeze(-1)
    return xg.flatten(-2).to(dtype)


def fake_quant(x: torch.Tensor, block: int = BLOCK, scale_fmt: str | None = "ue8m0") -> torch.Tensor:
    """act_quant then dequant, in x's dtype: the value an FP8 round trip leaves."""
    x8, s = act_quant(x, block, scale_fmt)
    return act_dequant(x8, s, x.dtype, block)


def weight_dequant(w8: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
                   rows: int = BLOCK) -> torch.Tensor:
    """Expand [ceil(N/rows), ceil(K/128)] block scales over w8 [N, K] and multiply. rows < 128: a rank's slice
    re-blocked on finer row blocks (`mtp.parallel.reblock`); checkpoints always have 128."""
    N, K = w8.shape
    a = acc_dtype(dtype)
    s = scale_inv.to(a).repeat_interleave(rows, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]
    return (w8.to(a) * s).to(dtype)


def weight_quant(w: torch.Tensor, scale_fmt: str | None = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float weight [N, K] into FP8 with one scale per 128x128 block (what the checkpoint stores).

    The scale is amax / 448 (rounded up to a power of two for ue8m0), so no element saturates.
    """
    N, K = w.shape
    nb, kb = math.ceil(N / BLOCK), math.ceil(K / BLOCK)
    wp = torch.zeros(nb * BLOCK, kb * BLOCK, dtype=torch.float32, device=w.device)
    wp[:N, :K] = w.float()
    blocks = wp.view(nb, BLOCK, kb, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(AMAX_FLOOR)
    s = amax / FP8_MAX
    if scale_fmt == "ue8m0":
        s = round_scale_ue8m0(s)
    q = (blocks / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(nb * BLOCK, kb * BLOCK)[:N, :K].contiguous(), s.contiguous()


def fp8_gemm_ref(x8: torch.Tensor, sx: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor,
                 acc: torch.dtype = torch.float32, rows: int = BLOCK) -> torch.Tensor:
    """Block-scaled GEMM: x8 [M, K] float8, sx [M, G] fp32, w8 [N, K] float8, sw [ceil(N/rows), G] -> fp32 [M, N].

    Each 128-wide K group is one fp32 product scaled by s_x * s_w, as DeepSeek's fp8_gemm accumulates. `rows`:
    output rows per weight-scale block (128 in a checkpoint; fewer on a re-blocked rank slice).
    """
    M, K = x8.shape
    N = w8.shape[0]
    G = K // BLOCK
    xg = x8.to(acc).view(M, G, BLOCK)
    wg = w8.to(acc).view(N, G, BLOCK)
    partial = torch.einsum("mgk,ngk->mgn", xg, wg)  # [M, G, N]
    sw_full = sw.to(acc).repeat_interleave(rows, 0)[:N]  # [N, G]
    return (partial * sx.to(acc).unsqueeze(-1) * sw_full.t().unsqueeze(0)).sum(dim=1)


def hadamard_matrix(n: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Sylvester Hadamard matrix H_n (n a power of two), entries +-1, H = H^T."""
    if n & (n - 1):
        raise ValueError(f"hadamard_matrix: n must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rotate_activation(x: torch.Tensor) -> torch.Tensor:
    """Walsh-Hadamard transform over the last dim scaled by dim^-0.5 (orthonormal, as DeepSeek's indexer)."""
    n = x.shape[-1]
    a = acc_dtype(x.dtype)
    h = hadamard_matrix(n, device=x.device, dtype=a)
    return (x.to(a) @ h * n ** -0.5).to(x.dtype)
