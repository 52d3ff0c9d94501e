"""Block-scaled FP8 linear layers (Triton): y = x W^T with DeepSeek's FP8 numerics.

Reference: `fp8_linear_ref` (act_quant + `mtp.model.fp8.fp8_gemm_ref`, plain PyTorch). Shape legend: M rows,
K input channels (a multiple of 128), N output channels (any), G = K // 128 groups, S split-K slices.
w8_NK float8_e4m3fn, sw [ceil(N/128), G] fp32.

Two paths:
- M <= 64 (decode / verify): the weight is streamed once. Each program owns a 64- or 128-row slab of W
  and a slice of the K groups (split-K, so that N = 2048 still fills 132 SMs); per 128-wide group it loads
  one [BN, 128] fp8 tile (16-byte cp.async, software-pipelined `num_stages` deep), takes the matching
  [M, 128] activation tile (pre-quantized by act_quant, or quantized in registers: bit-identical scales)
  and issues one fp8 wgmma with N in the MMA's M slot ("swap AB": the MMA needs >= 64 rows, M is 1..64).
  `default_plan` picks the row block, split and quant placement from measurements. The fp32 group product is scaled by s_x * s_w and added in fp32, as DeepSeek promotes every
  128 K. Split-K partials go to an fp32 workspace; the last slice of each N-block to finish (an atomic
  counter) sums them in slice order and writes y: one launch, deterministic.
- M > 64 (prefill): act_quant kernel, then a 128x128-tiled fp8 tl.dot kernel with the same per-group
  promotion (the layout of DeepSeek's reference fp8_gemm kernel).
"""

from __future__ import annotations

import math

import torch

from mtp.model.fp8 import BLOCK, FP8_DTYPE, fp8_gemm_ref
from mtp.model.fp8 import act_quant as act_quant_ref
from mtp.kernels._triton import pdl_kwargs, pdl_launch, pdl_mode, pdl_wait, prefetch_rows_l2, require, tl, triton
from mtp.kernels.act_quant import act_quant, quant_e4m3, ue8m0_scale

__all__ = ["fp8_linear", "fp8_gemm", "fp8_linear_ref", "default_plan", "default_splits", "SMALL_M", "FUSE_M"]

SMALL_M = 64  # rows up to which the weight-streaming path is used
FUSE_M = 16  # rows up to which that path may quantize x in-kernel (small weights only, see default_plan)
_NUM_SMS: dict[int, int] = {}


def fp8_linear_ref(x: torch.Tensor, w8: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch reference: act_quant(x) then the block-scaled GEMM, fp32 math, output in x's dtype."""
    K = x.shape[-1]
    x8, sx = act_quant_ref(x.reshape(-1, K))
    y = fp8_gemm_ref(x8, sx, w8, scale_inv)
    return y.to(x.dtype).reshape(*x.shape[:-1], w8.shape[0])


@triton.jit
def _gemv_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, part_ptr, y_ptr, cnt_ptr, M, N, G, groups_per_split, n_splits,
                 stride_xm, stride_wn, stride_swn,
                 QUANT_X: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 PDL: tl.constexpr, PREFETCH: tl.constexpr):
    pdl_launch(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    offs_k = tl.arange(0, 128)
    nmask = offs_n < N
    mmask = offs_m < M
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    sw_ptrs = sw_ptr + (offs_n // 128) * stride_swn
    g0 = pid_s * groups_per_split
    g1 = tl.minimum(g0 + groups_per_split, G)
    if PDL and PREFETCH:  # the program's weight slab (constant, 1-byte elements: 128 per line) asked of L2 while
        # the previous kernel finishes; the pipelined loads below then find it there (the same bits)
        prefetch_rows_l2(w_ptr + tl.where(nmask, offs_n, 0).to(tl.int64) * stride_wn + g0 * 128, (g1 - g0) * 128, 128)
    pdl_wait(PDL)  # x (and its scales) come from the previous kernel; every store and the counters after it
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for g in range(g0, g1):
        w = tl.load(w_ptrs + g * 128, mask=nmask[:, None], other=0.0)
        sw = tl.load(sw_ptrs + g, mask=nmask, other=0.0)
        if QUANT_X:
            xf = tl.load(x_ptrs + g * 128, mask=mmask[:, None], other=0.0).to(tl.float32)
            sx, inv = ue8m0_scale(tl.max(tl.abs(xf), axis=1))
            x8 = quant_e4m3(xf, inv[:, None])
        else:
            x8 = tl.load(x_ptrs + g * 128, mask=mmask[:, None], other=0.0)
            sx = tl.load(sx_ptr + offs_m * G + g, mask=mmask, other=0.0)
        d = tl.dot(w, tl.trans(x8))  # [BN, BM] fp32, one 128-wide group
        acc += d * sw[:, None] * sx[None, :]
    y_ptrs = y_ptr + offs_m[None, :] * N + offs_n[:, None]
    ymask = mmask[None, :] & nmask[:, None]
    if SPLIT:
        # Serial split-K fix-up inside the same launch: every slice stores its fp32 partial, then bumps its
        # N-block's counter; the slice that arrives last sums all partials in slice order (deterministic),
        # writes y and re-arms the counter at 0 for the next launch (graph replays included).
        p_ptrs = part_ptr + pid_s * M * N + offs_m[None, :] * N + offs_n[:, None]
        tl.store(p_ptrs, acc, mask=ymask)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == n_splits - 1:
            tot = tl.zeros((BN, BM), dtype=tl.float32)
            for s in range(n_splits):
                tot += tl.load(part_ptr + s * M * N + offs_m[None, :] * N + offs_n[:, None], mask=ymask,
                               other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, tot.to(y_ptr.dtype.element_ty), mask=ymask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ymask)


@triton.jit
def _gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, G, stride_bs,
                 BM: tl.constexpr, BN: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, 128)
    mmask = offs_m < M
    nmask = offs_n < N
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :]
    b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * K + offs_k[:, None]
    as_ptrs = as_ptr + offs_m * G
    bs_ptrs = bs_ptr + (offs_n // 128) * stride_bs
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for g in range(G):
        a = tl.load(a_ptrs + g * 128, mask=mmask[:, None], other=0.0)
        b = tl.load(b_ptrs + g * 128, mask=nmask[None, :], other=0.0)
        a_s = tl.load(as_ptrs + g, mask=mmask, other=0.0)
        b_s = tl.load(bs_ptrs + g, mask=nmask, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter (TRITON_INTERPRET=1) on CPU: pretend an H100
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def _check_weight(w8: torch.Tensor, sw: torch.Tensor, K: int, name: str) -> int:
    if w8.dtype != FP8_DTYPE:
        raise TypeError(f"{name}: weight must be {FP8_DTYPE}, got {w8.dtype}")
    N, Kw = w8.shape
    if Kw != K:
        raise ValueError(f"{name}: x has {K} input channels, weight has {Kw}")
    if K % BLOCK:
        raise ValueError(f"{name}: K = {K} must be a multiple of {BLOCK}")
    want = (math.ceil(N / BLOCK), K // BLOCK)
    if tuple(sw.shape) != want:
        raise ValueError(f"{name}: scale_inv must be {list(want)} for a weight {list(w8.shape)}, got {list(sw.shape)}")
    return N


_COUNTERS: dict[torch.device, list] = {}
_COUNTER_SLOTS = 1 << 16


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """n zeroed int32 split-K counters. The kernel re-arms them to 0 itself; slices are handed out round-robin
    so that launches in flight at the same time (on other streams) do not share one."""
    entry = _COUNTERS.get(device)
    if entry is None:
        entry = _COUNTERS[device] = [torch.zeros(_COUNTER_SLOTS, dtype=torch.int32, device=device), 0]
    buf, off = entry
    if off + n > _COUNTER_SLOTS:
        off = 0
    entry[1] = off + n
    return buf[off:off + n]


SMALL_N = 4096  # weights with at most this many rows take the small-weight launch plan


def default_plan(M: int, N: int, G: int, device: torch.device) -> dict:
    """Launch plan of the weight-streaming path, from H200 sweeps of 5-16 variants (BENCHMARKS_kernels.md):
    64-row blocks (1-4% faster than 128 on the large weights, 1.2-2x on N <= 1536); split-K so that there
    are ~4 programs per SM with >= 4 K groups each (18432 x 7168 -> 2 slices, 7168 x 18432 -> 5, 2048 x 7168
    -> 14); x quantized by a separate act_quant launch except for small weights (N <= 4096) at M <= 16,
    where the saved launch matters more at 7-10 us. For large weights the in-loop quant sits on every
    iteration's critical path (80% vs 74% of copy bandwidth), and above M = 16 it loses everywhere
    (M = 64 on 18432 x 7168: 64 vs 99 us)."""
    bn = 64
    return dict(bn=bn, splits=default_splits(N, G, device, bn), fuse_quant=N <= SMALL_N and M <= FUSE_M)


def default_splits(N: int, G: int, device: torch.device, bn: int = 128) -> int:
    """Split-K factor for a given row block: about 2 programs per SM (4 for bn < 128), >= 8 (4) groups each."""
    min_gps, per_sm = (4, 4) if bn < 128 else (8, 2)
    splits = max(1, min(triton.cdiv(G, min_gps), triton.cdiv(per_sm * _num_sms(device), triton.cdiv(N, bn))))
    return triton.cdiv(G, triton.cdiv(G, splits))


def _gemv(x, sx, w8, sw, out_dtype, quant_x, splits=None, num_stages=3, num_warps=4, bn=None, pdl=False,
          prefetch=True):
    M, K = x.shape
    N = w8.shape[0]
    G = K // BLOCK
    bm = max(16, triton.next_power_of_2(M))
    if bn is None:
        bn = default_plan(M, N, G, x.device)["bn"]
    if splits is None:
        splits = default_splits(N, G, x.device, bn)
    gps = triton.cdiv(G, splits)
    splits = triton.cdiv(G, gps)
    nb = triton.cdiv(N, bn)
    y = torch.empty(M, N, dtype=out_dtype, device=x.device)
    part = torch.empty(splits, M, N, dtype=torch.float32, device=x.device) if splits > 1 else y
    cnt = _counters(x.device, nb) if splits > 1 else y
    sw = sw.contiguous()
    launch = pdl_kwargs(pdl, x)
    _gemv_kernel[(nb, splits)](x, sx if sx is not None else x, w8, sw, part, y, cnt, M, N, G, gps, splits,
                               x.stride(0), w8.stride(0), sw.stride(0),
                               QUANT_X=quant_x, SPLIT=splits > 1, BM=bm, BN=bn, PDL=pdl_mode(pdl, launch),
                               PREFETCH=bool(launch) and prefetch, num_stages=num_stages, num_warps=num_warps, **launch)
    return y


def _gemm(x8, sx, w8, sw, out_dtype, bm=128, bn=128, num_stages=4, num_warps=8):
    M, K = x8.shape
    N = w8.shape[0]
    y = torch.empty(M, N, dtype=out_dtype, device=x8.device)
    sw = sw.contiguous()
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    _gemm_kernel[grid](x8, sx.contiguous(), w8, sw, y, M, N, K, K // BLOCK, sw.stride(0),
                       BM=bm, BN=bn, num_stages=num_stages, num_warps=num_warps)
    return y


def fp8_linear(x: torch.Tensor, w8: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype | None = None,
               fuse_quant: bool | None = None, pdl: bool = False, prefetch: bool = True, **tune) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequant(w8, scale_inv)^T with per-128 activation quant; y in x's dtype by default.

    fuse_quant: quantize x inside the weight-streaming kernel rather than in one act_quant launch first
    (default: `default_plan`). `tune` (splits, num_stages, num_warps, bn) overrides the small-M launch. pdl: the
    small-M path's launches (act_quant, the weight-streaming kernel, which asks L2 for its weight slab before
    the wait) with programmatic dependent launch (`_triton.pdl_kwargs`); the prefill GEMM stays plain. prefetch
    (with pdl; `FastPathOptions.prefetch_at`): False compiles that L2 prefetch out (constexpr PREFETCH), the
    launch and the wait stay; the same bits either way (a prefetch is a hint).
    """
    require(x, "fp8_linear")
    K = x.shape[-1]
    N = _check_weight(w8, scale_inv, K, "fp8_linear")
    out_dtype = out_dtype or x.dtype
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if fuse_quant is None:
        fuse_quant = default_plan(M, N, K // BLOCK, x.device)["fuse_quant"]
    if M <= SMALL_M and fuse_quant:
        y = _gemv(x2, None, w8, scale_inv, out_dtype, quant_x=True, pdl=pdl, prefetch=prefetch, **tune)
    elif M <= SMALL_M:
        x8, sx = act_quant(x2, pdl=pdl)
        y = _gemv(x8, sx, w8, scale_inv, out_dtype, quant_x=False, pdl=pdl, prefetch=prefetch, **tune)
    else:
        x8, sx = act_quant(x2)
        y = _gemm(x8, sx, w8, scale_inv, out_dtype)
    return y.reshape(*x.shape[:-1], N)


def fp8_gemm(x8: torch.Tensor, sx: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor,
             out_dtype: torch.dtype = torch.float32, pdl: bool = False, prefetch: bool = True,
             **tune) -> torch.Tensor:
    """Kernel twin of `mtp.model.fp8.fp8_gemm_ref` on pre-quantized x8 [M, K] / sx [M, G]: returns [M, N] in out_dtype.
    pdl, prefetch: as `fp8_linear`'s (M <= SMALL_M)."""
    require(x8, "fp8_gemm")
    M, K = x8.shape
    _check_weight(w8, sw, K, "fp8_gemm")
    if tuple(sx.shape) != (M, K // BLOCK):
        raise ValueError(f"fp8_gemm: sx must be [{M}, {K // BLOCK}], got {list(sx.shape)}")
    x8 = x8.contiguous()
    sx = sx.contiguous()
    if M <= SMALL_M:
        return _gemv(x8, sx, w8, sw, out_dtype, quant_x=False, pdl=pdl, prefetch=prefetch, **tune)
    return _gemm(x8, sx, w8, sw, out_dtype)
