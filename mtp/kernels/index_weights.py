"""The lightning indexer's head weights in one launch (Triton), with a torch reference.

Shape legend: N rows (the block's tokens, B * T), K = D the hidden size (7168), H indexer heads (64).
w_NH = (x_NK @ W_HK^T) * scale in fp32, W = `Indexer.weights_proj.weight` in the model dtype, x the block's
input in the model dtype, scale = H^-0.5 * Dk^-0.5. The reference (`Indexer.select`) takes
F.linear(x.to(fp32), W.to(fp32)) * H^-0.5 and applies Dk^-0.5 in its score einsum; the fast path folds both
factors into one (one rounding apart), and `kernels.indexer.indexer_topk` takes w as it comes.

Why a kernel: the fast path ran torch.mm(x, W^T, out_dtype=fp32).mul_(scale), and cuBLAS runs that small GEMM
(M = N, 64 columns, K = 7168) split-K with a separate reduce kernel, for some row counts (8, 32 on an H200) with one
more: 3-4 launches per layer at every step past 2048 keys (the session-4 H200 profile at w = 1: GEMM 4.4 us +
reduce 1.5 us + scale 1.0 us per layer), and a launch count that follows cuBLAS's heuristics.

Kernel: program (hb, mb) owns BH heads x BM rows and all of K, so there is no split-K: no workspace, no atomics,
one program's fixed sum per output (deterministic, CUDA-graph safe). A lane holds 16-byte vectors of K (VEC
elements); with K = 7168 in bf16 the program's 16 warps cover all of K in one tile of 1024 vectors, so every byte
it reads can be requested at once. Compiled for sm_90 on the CPU, the default plans' SASS issues 70-100% of its
loads before the first FMA (all, or all but one, up to 4 rows); with 4 warps and K walked in 7 chunks, ptxas
issued 6 of 14 before its first FMA: 3-4 DRAM round trips where one will do, and the weight is only 64 x 7168
bf16 = 917 KB, less than the bytes in flight it takes to reach HBM bandwidth, so latency is what it costs.
Products accumulate in fp32 on CUDA cores, BM x BH sums per lane, then one tree over the lanes and warps.
Traffic from L2 is N*K*(H/BH) of x plus H*K*(N/BM) of W, so BH and BM grow with N while the programs stay
64..128 (`index_weights_plan`). Not measured yet: `python -m mtp.bench.fused --only index_weights --sweep`.

Numerics: a bf16 x bf16 product is exact in fp32, and the sum is fp32 in a fixed order (per lane over its
vectors and chunks, then a tree over the lanes and warps): the reference's fp32 math in another order. An fp32
model's x and W multiply in fp32 (fused multiply-add), as F.linear; a float64 x is rounded to fp32 on load, as the
fast path's x.float() did. Tolerances: tests/kernels/test_index_weights.py.
"""

from __future__ import annotations

import torch

from mtp.kernels._triton import pdl_kwargs, pdl_launch, pdl_mode, pdl_wait, require, tl, triton

__all__ = ["index_weights", "index_weights_plan", "index_weights_ref"]

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def index_weights_ref(x: torch.Tensor, weight_HK: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 reference: F.linear(x.to(fp32), W.to(fp32)) * scale, [*x.shape[:-1], H]."""
    return torch.nn.functional.linear(x.float(), weight_HK.float()) * scale


def index_weights_plan(N: int, H: int = 64, K: int = 7168, vec: int = 8) -> tuple[int, int, int, int]:
    """(BM rows, BH heads, KV vectors of K per chunk, warps) per program for N rows of K features loaded VEC at a
    time. Up to 4 rows one head per program (H programs, each reading 14 KB of W and its rows of x); more rows,
    more heads per program (2, then 4 past 16 rows), so that x is read from L2 fewer times, and as many rows as keep
    >= 64 programs (4 at most up to 32 rows, then 8): 64..128 programs for H = 64 (N = 8: 64 of 4 x 2; 16: 128 of
    4 x 2; 32: 128 of 4 x 4; 64: 128 of 8 x 4). Tiles from the H100 sweep (BENCHMARKS.md, session 10: 16 rows 4.9 ->
    4.1 us, 32 rows 7.1 -> 5.1 against the first plan's 4 x 4 and 8 x 4). A chunk is two vectors a lane: with 2-byte elements 16 warps, so a K of 7168 is one
    chunk (at 8 x 4 a lane holds 128 registers, no spill on sm_90); wider ones (fp32, fp64 models) 8 warps, up
    to 255 registers a lane (16 warps cap a lane at 128, and fp32 at 8 x 4 spilled)."""
    bh = min(1 if N <= 4 else 2 if N <= 16 else 4, triton.next_power_of_2(H))
    bm = min(4 if N <= 32 else 8, triton.next_power_of_2(max(N, 1)))
    while bm > 1 and triton.cdiv(N, bm) * triton.cdiv(H, bh) < 64:
        bm //= 2
    nw = 16 if vec >= 8 else 8
    return bm, bh, min(64 * nw, triton.next_power_of_2(triton.cdiv(K, vec))), nw


@triton.jit
def _index_weights_kernel(x_ptr, w_ptr, out_ptr, N, stride_x, stride_w, scale, H: tl.constexpr, K: tl.constexpr,
                          BM: tl.constexpr, BH: tl.constexpr, KV: tl.constexpr, VEC: tl.constexpr,
                          PDL: tl.constexpr):
    pdl_launch(PDL)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    heads = tl.program_id(0) * BH + tl.arange(0, BH)
    rmask = rows < N
    hmask = heads < H
    # a chunk of K as KV vectors of VEC elements (16 bytes), spread over the lanes, so that x's [KV, BM, 1, VEC]
    # and W's [KV, 1, BH, VEC] tiles load in one layout and broadcast in registers (no shared-memory shuffle).
    # K leads: the compiler orders dims of equal contiguity by index and must spread the lanes over K, not over
    # the rows (with rows first it split the warps over them and shuffled x through shared memory).
    koff = tl.arange(0, KV)[:, None, None, None] * VEC + tl.arange(0, VEC)[None, None, None, :]
    xrow = x_ptr + rows.to(tl.int64)[None, :, None, None] * stride_x
    wrow = w_ptr + heads[None, None, :, None] * stride_w
    acc = tl.zeros([KV, BM, BH], dtype=tl.float32)
    for k0 in tl.static_range(0, K, KV * VEC):  # one chunk for a bf16 K of 7168 (unrolled when more)
        k = k0 + koff
        wmask = hmask[None, None, :, None] & (k < K)
        xmask = rmask[None, :, None, None] & (k < K)
        if PDL and k0 == 0 and BM * BH <= 16:
            # W's first chunk (constant; all of it for a bf16 K of 7168) in flight before the wait; up to 32 rows
            # (the 8 x 4 tile spilled 24 bytes with W first, compiled for sm_90)
            w = tl.load(wrow + k, mask=wmask, other=0.0).to(tl.float32)
            pdl_wait(PDL)  # x comes from the block's norm, several kernels before
            x = tl.load(xrow + k, mask=xmask, other=0.0).to(tl.float32)
        else:
            if k0 == 0:
                pdl_wait(PDL)
            x = tl.load(xrow + k, mask=xmask, other=0.0).to(tl.float32)
            w = tl.load(wrow + k, mask=wmask, other=0.0).to(tl.float32)
        acc += tl.sum(x * w, axis=3)  # within a lane
    y = tl.sum(acc, axis=0) * scale  # [BM, BH]: across lanes and warps, once
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * H + heads[None, :], y, mask=rmask[:, None] & hmask[None, :])


def index_weights(x: torch.Tensor, weight_HK: torch.Tensor, scale: float,
                  plan: tuple[int, int, int, int] | None = None, pdl: bool = False) -> torch.Tensor:
    """Kernel twin of `index_weights_ref`: w [*x.shape[:-1], H] fp32 in one launch. x: any rows of K features
    (bf16, fp16, fp32 or fp64); weight_HK: [H, K] in one of those dtypes (the model's `weights_proj.weight`,
    read in place: no copy). plan: (BM, BH, KV, warps) instead of `index_weights_plan` (the benchmark's sweep).
    pdl: programmatic dependent launch (`_triton.pdl_kwargs`): W's first chunk is loaded before the wait."""
    require(x, "index_weights")
    if weight_HK.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight_HK.shape[1] or x.shape[-1] == 0:
        raise ValueError(f"index_weights: x must be [..., K] and weight_HK [H, K] with K >= 1; got x "
                         f"{list(x.shape)}, weight_HK {list(weight_HK.shape)}")
    H, K = weight_HK.shape
    if x.dtype not in DTYPES or weight_HK.dtype not in DTYPES:
        raise TypeError(f"index_weights: x and weight_HK must be one of {DTYPES}, got {x.dtype}, {weight_HK.dtype}")
    if x.device != weight_HK.device:
        raise ValueError(f"index_weights: x is on {x.device}, weight_HK on {weight_HK.device}")
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight_HK.stride(-1) != 1:
        weight_HK = weight_HK.contiguous()
    N = x2.shape[0]
    out = torch.empty(*x.shape[:-1], H, dtype=torch.float32, device=x.device)
    if N == 0 or H == 0:
        return out
    vec = 16 // max(x2.element_size(), weight_HK.element_size(), 2)  # 16-byte loads of the wider dtype
    bm, bh, kv, nw = plan or index_weights_plan(N, H, K, vec)
    launch = pdl_kwargs(pdl, x2)
    _index_weights_kernel[(triton.cdiv(H, bh), triton.cdiv(N, bm))](
        x2, weight_HK, out, N, x2.stride(0), weight_HK.stride(0), float(scale), H=H, K=K, BM=bm, BH=bh,
        KV=kv, VEC=vec, PDL=pdl_mode(pdl, launch), num_warps=nw, **launch)
    return out
