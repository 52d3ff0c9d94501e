"""FP8 block-scaled GEMV for a few rows and small weights (Triton, split-K, one launch; CUDA cores or tensor cores).

Reference: `fp8_gemv_ref` (act_quant + `mtp.model.fp8.fp8_gemm_ref`, plain PyTorch). Shape legend: M rows (1..8:
decode / verify widths), K input channels (a multiple of 128), N output rows, G = K // 128 groups,
S split-K slices, GPS groups per slice. w8_NK float8_e4m3fn, sw [ceil(N/128), G] fp32.

Why another GEMV (the tensor-core one in `fp8_gemm` stays for M > 8 and as the switchable old path): at
TP=8 rank shapes the weights are 2-17 MB (q_a | wk | kv_a 2240 x 7168, q_b | wq_b 11264 x 1536, o_proj
7168 x 2048, the shared expert 512 x 7168 / 7168 x 256), 0.5-4 us of HBM time each, and the old kernel
takes 6.7-10 us on them (H200: N=576 K=7168 at 14.7% of copy bandwidth, BENCHMARKS_kernels.md). What it
does that costs latency rather than bytes:
- each program walks its K groups in a software pipeline 3 stages deep, so only 2-3 of its 8 KB tiles are
  in flight; a small weight needs the whole weight in flight at once (4.2 TB/s x ~0.8 us of DRAM latency
  = ~3.4 MB) to reach the floor;
- the split-K fix-up sums the S partials in a serial loop of dependent L2 loads (S = 14 for K = 7168);
- wgmma needs >= 16 (swap-AB: the MMA's N) rows, so M = 1 pads 16x and stages tiles through shared memory.
Here a program owns a [BN, GPS * 128] weight tile (16 KB by default: BN = 16 rows x 8 groups for
K = 7168) and issues all of it as one load, so every program's bytes are requested at once; it multiplies
on CUDA cores in fp32 (an e4m3 x e4m3 product is exact in fp32, so each group's dot is the fp32 sum the
reference takes, in another order), scales each group's dot by s_x * s_w and sums the groups in fp32, as
DeepSeek's FP8 GEMM promotes every 128 K. Activations come pre-quantized (x8, sx: from the fused
norm + quant kernel, `norm_quant`) or are quantized per 128 in registers (bit-identical to act_quant).
Split-K partials go to an fp32 workspace [S, M, N]; the last slice of an N-block to arrive (an atomic
counter, re-armed by that slice: CUDA-graph safe) loads all S partials of a row in one [S, BN] load (one L2
round trip, not S) and sums them: one launch, deterministic (a fixed reduction tree).
Predicted (H200, from bytes and round trips; to be measured by `mtp.bench.fused`): ~3-4 us where the
old kernel takes 6.7-10 us on the rank-sized weights above. Measured (BENCHMARKS.md): ~6.9 us per launch at
w = 1 but 16.5 us at w = 4 on the rank, and 19-38% slower than the old kernel at TP=1 full width for M = 2..4:
the FMAs and the cross-lane sums of each row grow with M.

`mma=True` (`_gemv_mma_kernel`) keeps the tile, the single load and the fix-up, and multiplies on tensor cores:
one batched fp8 tl.dot per program, a batch entry per 128-group ([GPS, BN, 128] x [GPS, 128, 8]), x's rows
padded to 8 by masked loads (mma.sync's n8; triton 3.6 takes fp8 dots down to 1 x 1 x 32 and pads itself);
each group's fp32 product is scaled by s_x * s_w and the groups summed in fp32 (the CUDA-core kernel's
contract; the MMA sums a group in its own order, so it is held to fp8_gemv_ref within the old tensor-core
kernel's tolerance). Triton 3.6 lowers the batched dot for sm_90 to mma.sync.m16n8k16 on f16 operands (the
e4m3 codes upcast exactly), not wgmma. Compiled for sm_90 (tests/kernels/test_fused_kernels.py does so on the CPU),
neither kernel spills. Per thread, on the 16 KB tile of BN = 16, GPS = 8, 8 warps (with the JIT's 16-divisibility of
pointers and strides), the CUDA-core kernel issues 528 / 1344 / 2384 instructions at M = 1 / 4 / 8 (its FMAs
and shuffle sums per row: on 2240 x 7168, 4.1 / 10.5 / 18.6 us of issue time on 132 SMs against 3.8 us of HBM
time, which is the M-growth measured), the mma kernel 384 / 464 / 584 (3.0 / 3.6 / 4.6 us), and on its own
default tile (`gemv_plan`: 32 KB, 4 warps) ~135 warp-instructions per KB at M = 8.
Predicted: flat in M (issue time below HBM time at every M on its default tile); at TP=1 full width
(36864 x 7168: old ~78 us) within 10% of the old kernel or faster at M = 1..8; at the rank's sizes at or below
the CUDA-core kernel's M = 1 time (2240 x 7168: ~5-7 us at every M).
"""

from __future__ import annotations

import torch

from mtp.model.fp8 import BLOCK, FP8_DTYPE, fp8_gemm_ref
from mtp.model.fp8 import act_quant as act_quant_ref
from mtp.kernels._triton import pdl_kwargs, pdl_launch, pdl_mode, pdl_wait, require, tl, triton
from mtp.kernels.act_quant import quant_e4m3, ue8m0_scale
from mtp.kernels.fp8_gemm import _check_weight, _counters, _num_sms

__all__ = ["fp8_gemv", "fp8_gemv_ref", "gemv_plan", "MAX_M"]

MAX_M = 8  # rows this kernel takes (CUDA-core FMAs: at M = 8 the math is ~the HBM time of a 16 KB tile)
TILE_BYTES = 16384  # weight bytes per program by default
MMA_MIN_BN = 16  # the weight rows are the MMA's M: mma.sync's m16
WAVES_4_WARPS = 32  # programs per SM above which the CUDA-core tile takes 4 warps (gemv_plan says why)
MMA_TILE_BYTES = 32768  # weight bytes per program of the mma variant by default (gemv_plan says why)
MMA_ROWS = 8  # x's rows padded to mma.sync's n8 (= MAX_M)


def fp8_gemv_ref(x: torch.Tensor | None, w8: torch.Tensor, sw: torch.Tensor, xq=None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain-PyTorch reference: y [M, N] = act_quant(x) (or the given xq = (x8, sx)) times the block-scaled
    weight, fp32 math, in out_dtype (default x's dtype, fp32 when only xq is given)."""
    x8, sx = xq if xq is not None else act_quant_ref(x)
    K = x8.shape[-1]
    y = fp8_gemm_ref(x8.reshape(-1, K), sx.reshape(-1, K // BLOCK), w8, sw)
    return y.to(out_dtype or (x.dtype if x is not None else torch.float32)).reshape(*x8.shape[:-1], w8.shape[0])


@triton.jit
def _splitk_fixup(part_ptr, y_ptr, cnt_ptr, pid_n, offs_n, nmask, N, n_splits, M: tl.constexpr,
                  SPAD: tl.constexpr):
    """After this slice stored its partials part[slice, m, offs_n]: the last slice of the N-block to arrive loads
    all S partials of a row in one [S, BN] load, sums them (a fixed tree: deterministic), writes y and re-arms
    the block's counter at 0."""
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    if arrived == n_splits - 1:
        offs_s = tl.arange(0, SPAD)
        pmask = (offs_s < n_splits)[:, None] & nmask[None, :]
        for m in tl.static_range(M):
            p = tl.load(part_ptr + (offs_s[:, None] * M + m) * N + offs_n[None, :], mask=pmask, other=0.0,
                        cache_modifier=".cg")
            tl.store(y_ptr + m * N + offs_n, tl.sum(p, axis=0).to(y_ptr.dtype.element_ty), mask=nmask)
        tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")


@triton.jit
def _tile(N, G, BN: tl.constexpr, GPS: tl.constexpr):
    """This program's tile: its N-block (rows), its K-slice (128-groups), their offsets and bounds masks."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_g = pid_s * GPS + tl.arange(0, GPS)
    return pid_n, pid_s, offs_n, offs_g, tl.arange(0, 128), offs_n < N, offs_g < G


@triton.jit
def _gemv_fma_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, part_ptr, y_ptr, cnt_ptr, N, G, n_splits,
                     stride_xm, stride_sxm, stride_wn, stride_swn,
                     M: tl.constexpr, PREQUANT: tl.constexpr, SPLIT: tl.constexpr,
                     BN: tl.constexpr, GPS: tl.constexpr, SPAD: tl.constexpr, PDL: tl.constexpr):
    pdl_launch(PDL)  # programmatic dependent launch: let the next kernel start its own weight loads
    pid_n, pid_s, offs_n, offs_g, offs_k, nmask, gmask = _tile(N, G, BN, GPS)
    # the whole [BN, GPS, 128] tile in one load: every byte of this program in flight at once
    w_offs = (offs_n.to(tl.int64)[:, None, None] * stride_wn + offs_g[None, :, None] * 128
              + offs_k[None, None, :])
    w = tl.load(w_ptr + w_offs, mask=nmask[:, None, None] & gmask[None, :, None], other=0.0)
    sw = tl.load(sw_ptr + (offs_n // 128)[:, None] * stride_swn + offs_g[None, :],
                 mask=nmask[:, None] & gmask[None, :], other=0.0)  # [BN, GPS]
    pdl_wait(PDL)  # the weights are constant: their loads overlap the previous kernel; x and every store wait
    wf = w.to(tl.float32)
    x_offs = offs_g[:, None] * 128 + offs_k[None, :]  # [GPS, 128]
    for m in tl.static_range(M):
        if PREQUANT:
            x8 = tl.load(x_ptr + m * stride_xm + x_offs, mask=gmask[:, None], other=0.0).to(tl.float32)
            sx = tl.load(sx_ptr + m * stride_sxm + offs_g, mask=gmask, other=0.0)
        else:
            xf = tl.load(x_ptr + m * stride_xm + x_offs, mask=gmask[:, None], other=0.0).to(tl.float32)
            sx, inv = ue8m0_scale(tl.max(tl.abs(xf), axis=1))
            x8 = quant_e4m3(xf, inv[:, None]).to(tl.float32)
        d = tl.sum(wf * x8[None, :, :], axis=2)  # [BN, GPS]: one fp32 dot per 128-group
        acc = tl.sum(d * sw * sx[None, :], axis=1)  # [BN]
        if SPLIT:
            tl.store(part_ptr + (pid_s * M + m) * N + offs_n, acc, mask=nmask)
        else:
            tl.store(y_ptr + m * N + offs_n, acc.to(y_ptr.dtype.element_ty), mask=nmask)
    if SPLIT:
        _splitk_fixup(part_ptr, y_ptr, cnt_ptr, pid_n, offs_n, nmask, N, n_splits, M, SPAD)


@triton.jit
def _gemv_mma_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, part_ptr, y_ptr, cnt_ptr, N, G, n_splits,
                     stride_xm, stride_sxm, stride_wn, stride_swn,
                     M: tl.constexpr, PREQUANT: tl.constexpr, SPLIT: tl.constexpr,
                     BN: tl.constexpr, GPS: tl.constexpr, SPAD: tl.constexpr, PDL: tl.constexpr,
                     MP: tl.constexpr):
    """The tile of `_gemv_fma_kernel`, multiplied on tensor cores: one batched fp8 x fp8 dot, a batch entry
    per 128-group ([GPS, BN, 128] x [GPS, 128, MP] -> [GPS, BN, MP] fp32), the rows padded to MP (8: the
    n of mma.sync's m16n8) with masked (zero) loads. The work per program no longer grows with M."""
    pdl_launch(PDL)
    pid_n, pid_s, offs_n, offs_g, offs_k, nmask, gmask = _tile(N, G, BN, GPS)
    offs_m = tl.arange(0, MP)
    mmask = offs_m < M
    # the whole tile in one load, as [GPS, BN, 128]: every byte of this program in flight at once
    w_offs = (offs_g[:, None, None] * 128 + offs_n.to(tl.int64)[None, :, None] * stride_wn
              + offs_k[None, None, :])
    w = tl.load(w_ptr + w_offs, mask=gmask[:, None, None] & nmask[None, :, None], other=0.0)
    sw = tl.load(sw_ptr + (offs_n // 128)[None, :] * stride_swn + offs_g[:, None],
                 mask=gmask[:, None] & nmask[None, :], other=0.0)  # [GPS, BN]
    pdl_wait(PDL)  # the weights are constant: their loads overlap the previous kernel; x and every store wait
    x_offs = offs_m[None, None, :] * stride_xm + offs_g[:, None, None] * 128 + offs_k[None, :, None]  # [GPS, 128, MP]
    xmask = gmask[:, None, None] & mmask[None, None, :]
    if PREQUANT:
        x8 = tl.load(x_ptr + x_offs, mask=xmask, other=0.0)
        sx = tl.load(sx_ptr + offs_m[None, :] * stride_sxm + offs_g[:, None], mask=gmask[:, None] & mmask[None, :],
                     other=0.0)  # [GPS, MP]
    else:
        xf = tl.load(x_ptr + x_offs, mask=xmask, other=0.0).to(tl.float32)
        sx, inv = ue8m0_scale(tl.max(tl.abs(xf), axis=1))
        x8 = quant_e4m3(xf, inv[:, None, :])
    d = tl.dot(w, x8)  # [GPS, BN, MP]: one fp32 dot per 128-group
    acc = tl.sum(d * sw[:, :, None] * sx[:, None, :], axis=0)  # [BN, MP]: promoted per group, as DeepSeek's
    ymask = nmask[:, None] & mmask[None, :]
    if SPLIT:
        tl.store(part_ptr + (pid_s * M + offs_m[None, :]) * N + offs_n[:, None], acc, mask=ymask)
        _splitk_fixup(part_ptr, y_ptr, cnt_ptr, pid_n, offs_n, nmask, N, n_splits, M, SPAD)
    else:
        tl.store(y_ptr + offs_m[None, :] * N + offs_n[:, None], acc.to(y_ptr.dtype.element_ty), mask=ymask)


def gemv_plan(N: int, G: int, device: torch.device, mma: bool = False, one_slice: int = 0) -> dict:
    """Tile of the split-K GEMV: GPS = the largest power of two <= 8 dividing G (no masked groups, so
    K = 7168 -> 8 groups per slice, 7 slices; K = 1536 -> 4, 3 slices; K = 2048 -> 8, 2 slices), BN rows so
    that a tile holds ~16 KB (CUDA cores, 8 warps from 8 KB) or ~32 KB (mma, 4 warps), halved (down to 8, or to
    the 16 rows of mma.sync's m16) while the grid has fewer programs than SMs.
    Why 32 KB / 4 warps for mma: its SASS for sm_90 issues ~135 warp-instructions per KB of weight at M = 8
    (BN 32, GPS 8, 4 warps; 106 registers) against ~290 at the CUDA-core tile (BN 16, 8 warps): 35 us vs 75 us
    of issue time for a 264 MB weight on 132 SMs, whose HBM time is ~63 us.
    one_slice (CUDA cores; `FastPathOptions.gemv_one_slice`): where G is a power of two above 8 and at most this,
    the whole K in one slice (GPS = G: no split-K partials, no fix-up), BN for the same ~16 KB tile, 4 warps.
    Measured on an H200 (`mtp.bench.small_kernels`, BENCHMARKS.md session 17), the TP=8 rank's o_proj (7168 x 2048,
    G = 16, one row, x quantized in the kernel) in graph replays: 7.41 us (BN 8, GPS 16, 4 warps) against 10.20
    (BN 16, GPS 8, 8 warps: 78 registers, 3 programs per SM, its 896 programs in 2.3 waves, then the fix-up);
    8 warps 7.85, 2 warps 8.24; BN 16 x GPS 16 (32 KB) 8.41 at 8 warps, 140 at 2 (spills).
    A grid of more than WAVES_4_WARPS programs per SM (a large weight: the drafts' FP8 head shard, 16160 x 7168, is
    1010 x 7 programs) takes 4 warps: more programs resident per SM keep more tiles in flight. Measured there (H200,
    `mtp.bench.small_kernels --only head`, BENCHMARKS.md session 21, one row): 42.2 us at 4 warps against 52.1 at 8
    (byte floor 27.3, the bf16 head's cuBLAS GEMM 59.9)."""
    if not mma and 8 < G <= one_slice and G & (G - 1) == 0:
        return dict(bn=max(8, TILE_BYTES // (G * BLOCK)), gps=G, num_warps=4)
    gps = 1
    while gps < 8 and G % (2 * gps) == 0:
        gps *= 2
    min_bn = MMA_MIN_BN if mma else 8
    bn = max(min_bn, min(128, (MMA_TILE_BYTES if mma else TILE_BYTES) // (gps * BLOCK)))
    splits = triton.cdiv(G, gps)
    sms = _num_sms(device) if device.type == "cuda" else 1  # the interpreter: fewest programs (speed)
    while bn > min_bn and triton.cdiv(N, bn) * splits < sms:
        bn //= 2
    many_waves = triton.cdiv(N, bn) * splits > WAVES_4_WARPS * sms
    num_warps = 4 if mma or bn * gps * BLOCK < 8192 or many_waves else 8
    return dict(bn=bn, gps=gps, num_warps=num_warps)


def fp8_gemv(x: torch.Tensor | None, w8: torch.Tensor, sw: torch.Tensor, xq=None,
             out_dtype: torch.dtype | None = None, bn: int | None = None, gps: int | None = None,
             num_warps: int | None = None, pdl: bool = False, mma: bool = False, one_slice: int = 0) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequant(w8, sw)^T with DeepSeek's FP8 numerics, for <= MAX_M rows.

    xq = (x8 [..., K] float8, sx [..., G] fp32): the activations already quantized (x may then be None);
    else x is quantized per 128 in the kernel. out_dtype: default x's dtype (fp32 when only xq is given).
    bn / gps / num_warps override `gemv_plan`. pdl: launch with programmatic dependent launch (Hopper; see
    `_triton.pdl_kwargs`): the weight tile is requested while the previous kernel finishes. mma: multiply on
    tensor cores (`_gemv_mma_kernel`: rows padded to MMA_ROWS, cost flat in M) instead of CUDA-core FMAs.
    one_slice: `gemv_plan`'s (K in one slice where K / 128 is a power of two above 8 and at most this)."""
    src = x if xq is None else xq[0]
    if src is None:
        raise ValueError("fp8_gemv: give x or xq = (x8, sx)")
    require(src, "fp8_gemv")
    K = src.shape[-1]
    N = _check_weight(w8, sw, K, "fp8_gemv")
    if N and w8.stride(-1) != 1:
        raise ValueError(f"fp8_gemv: weight rows must be contiguous, got strides {w8.stride()}")
    G = K // BLOCK
    lead = src.shape[:-1]
    if xq is not None:
        x8, sx = xq
        if x8.dtype != FP8_DTYPE or not isinstance(sx, torch.Tensor) or tuple(sx.shape) != (*lead, G):
            got = f"{list(sx.shape)}" if isinstance(sx, torch.Tensor) else type(sx).__name__
            raise ValueError(f"fp8_gemv: xq must be (float8 [..., {K}], fp32 [..., {G}]), got {x8.dtype} "
                             f"{list(x8.shape)} and {got}")
        a = x8.reshape(-1, K)
        s = sx.reshape(-1, G)
        if a.stride(-1) != 1:
            a = a.contiguous()
        if s.stride(-1) != 1:
            s = s.contiguous()
    else:
        a = x.reshape(-1, K)
        if a.stride(-1) != 1:
            a = a.contiguous()
        s = a
    M = a.shape[0]
    if not 1 <= M <= MAX_M:
        raise ValueError(f"fp8_gemv: takes 1..{MAX_M} rows, got {M} (use kernels.fp8_gemm.fp8_linear)")
    out_dtype = out_dtype or (x.dtype if x is not None else torch.float32)
    plan = gemv_plan(N, G, a.device, mma=mma, one_slice=one_slice)
    bn, gps = bn or plan["bn"], gps or plan["gps"]
    if mma and (bn < MMA_MIN_BN or bn & (bn - 1) or gps & (gps - 1)):
        raise ValueError(f"fp8_gemv: mma needs bn a power of two >= {MMA_MIN_BN} and gps a power of two, got bn "
                         f"{bn}, gps {gps}")
    splits = triton.cdiv(G, gps)
    nb = triton.cdiv(N, bn)
    y = torch.empty(M, N, dtype=out_dtype, device=a.device)
    part = torch.empty(splits, M, N, dtype=torch.float32, device=a.device) if splits > 1 else y
    cnt = _counters(a.device, nb) if splits > 1 else y
    sw = sw if sw.stride(-1) == 1 else sw.contiguous()
    launch = pdl_kwargs(pdl, a)
    kernel, extra = (_gemv_mma_kernel, dict(MP=MMA_ROWS)) if mma else (_gemv_fma_kernel, {})
    kernel[(nb, splits)](a, s, w8, sw, part, y, cnt, N, G, splits, a.stride(0), s.stride(0), w8.stride(0),
                         sw.stride(0), M=M, PREQUANT=xq is not None, SPLIT=splits > 1, BN=bn, GPS=gps,
                         SPAD=triton.next_power_of_2(splits), PDL=pdl_mode(pdl, launch),
                         num_warps=num_warps or plan["num_warps"], **extra, **launch)
    return y.reshape(*lead, N)
