"""Residual add + RMSNorm + FP8 activation quant in one launch (Triton), for the decode step's norms.

Reference: `add_rms_norm_quant_ref` (plain PyTorch: `h + delta.to(h.dtype)`, `mtp.model.layers.rms_norm`,
`mtp.model.fp8.act_quant`). Shape legend: M rows (tokens), D channels (a multiple of 128 when quantizing),
G = D // 128.

A decoder block today spends 3-4 launches per norm site on a CUDA-graph step: the cast of the sublayer's
output to the residual dtype, the add, the (compiled) norm, and the act_quant in front of the next FP8 GEMV
(or inside it, per program, redone by every split-K slice). Here one program per row
- adds delta to the residual in the residual's dtype (the reference's `h + delta.to(h.dtype)`, the same
  fp32 add, so h_new is bit-identical; with round_dtype an fp32 delta, a row-parallel sublayer's all-reduced sum,
  is first rounded to the model dtype, the sublayer's `.to(x.dtype)` without its launch) and stores h_new,
- normalizes in fp32 (`w * x * rsqrt(mean(x^2) + eps)`; the sum of squares is a tree sum, not torch's order,
  so y can differ from the reference in its last bit, as the compiled elementwise norm already may),
- stores y in out_dtype (bf16: the gate, the indexer weights and the MoE read it), and
- quantizes y (as stored, i.e. after the out_dtype rounding: what `act_quant(y)` would see) per 128 channels
  with ue8m0 scales, bit-identical to `act_quant` on that y, for the next GEMV (`gemv_splitk.fp8_gemv(xq=..)`).
Every output is optional (the q_a / kv_a norms need only the quantized y, or only y).
"""

from __future__ import annotations

import torch

from mtp.model.fp8 import BLOCK, FP8_DTYPE
from mtp.model.fp8 import act_quant as act_quant_ref
from mtp.kernels._triton import pdl_kwargs, pdl_launch, pdl_mode, pdl_wait, require, tl, triton
from mtp.kernels.act_quant import quant_e4m3, ue8m0_scale

__all__ = ["ROW_WARPS", "WIDE_ROW_WARPS", "add_rms_norm_quant", "add_rms_norm_quant_ref", "add_rounded",
           "add_rounded_ref", "row_tiles"]

# the dtype a sublayer's fp32 output is rounded to before its residual add, as the kernels' ROUND constexpr
_ROUND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def add_rms_norm_quant_ref(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                           out_dtype: torch.dtype = torch.bfloat16, quant: bool = True,
                           round_dtype: torch.dtype | None = None):
    """(h_new, y, x8, sx): h_new = h + delta.to(round_dtype).to(h.dtype) (no rounding when round_dtype is None; h
    itself when delta is None), y = RMSNorm(h_new) in out_dtype, (x8, sx) = act_quant(y) (None when quant is
    False)."""
    from mtp.model.layers import rms_norm

    if delta is not None and round_dtype is not None:
        delta = delta.to(round_dtype)
    hn = h if delta is None else h + delta.to(h.dtype)
    y = rms_norm(hn, weight, eps, out_dtype)
    x8, sx = act_quant_ref(y) if quant else (None, None)
    return hn, y, x8, sx


@triton.jit
def _add_norm_quant_kernel(h_ptr, d_ptr, w_ptr, hout_ptr, y_ptr, x8_ptr, sx_ptr, D, eps,
                           stride_h, stride_d, stride_ho, stride_y, stride_x8, stride_sx,
                           ADD: tl.constexpr, STORE_H: tl.constexpr, STORE_Y: tl.constexpr,
                           QUANT: tl.constexpr, BG: tl.constexpr, PDL: tl.constexpr, ROUND: tl.constexpr):
    pdl_launch(PDL)
    pdl_wait(PDL)  # every input may come from the previous kernel: only the launch overlaps it
    _add_norm_quant_row(tl.program_id(0).to(tl.int64), h_ptr, d_ptr, w_ptr, hout_ptr, y_ptr, x8_ptr, sx_ptr, D,
                        eps, stride_h, stride_d, stride_ho, stride_y, stride_x8, stride_sx,
                        ADD, STORE_H, STORE_Y, QUANT, BG, ROUND)


@triton.jit
def _add_norm_quant_row(row, h_ptr, d_ptr, w_ptr, hout_ptr, y_ptr, x8_ptr, sx_ptr, D, eps,
                        stride_h, stride_d, stride_ho, stride_y, stride_x8, stride_sx,
                        ADD: tl.constexpr, STORE_H: tl.constexpr, STORE_Y: tl.constexpr,
                        QUANT: tl.constexpr, BG: tl.constexpr, ROUND: tl.constexpr):
    """One row (int64 index) of `_add_norm_quant_kernel`; also the q_a norm's programs of
    `mla_prologue_fused`'s kv launch (the same code, so the same bits)."""
    g = tl.arange(0, BG)
    k = tl.arange(0, 128)
    offs = g[:, None] * 128 + k[None, :]  # [BG, 128]: the row viewed as its 128-groups
    mask = offs < D
    h = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0)
    if ADD:
        d = tl.load(d_ptr + row * stride_d + offs, mask=mask, other=0.0)
        if ROUND == 0:  # the sublayer's `.to(x.dtype)` of its fp32 sum (`_ROUND`)
            d = d.to(tl.bfloat16)
        elif ROUND == 1:
            d = d.to(tl.float16)
        h = h + d.to(h.dtype)
        if STORE_H:
            tl.store(hout_ptr + row * stride_ho + offs, h, mask=mask)
    xf = h.to(tl.float32)
    ms = tl.sum(tl.sum(xf * xf, axis=1), axis=0) / D
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (xf * tl.math.rsqrt(ms + eps) * w).to(y_ptr.dtype.element_ty)
    if STORE_Y:
        tl.store(y_ptr + row * stride_y + offs, y, mask=mask)
    if QUANT:
        yf = y.to(tl.float32)
        s, inv = ue8m0_scale(tl.max(tl.abs(yf), axis=1))
        gmask = g * 128 < D
        tl.store(x8_ptr + row * stride_x8 + offs, quant_e4m3(yf, inv[:, None]), mask=mask)
        tl.store(sx_ptr + row * stride_sx + g, s, mask=gmask)


# The warps of a row of 32 or more groups of 128 (the model width: D = 7168 on DeepSeek-V3.2, 64 groups). Alone on an
# H200 (`python -m mtp.bench.small_kernels --only norm`, BENCHMARKS.md session 17, h200b / h200h) the row of 7168
# took 4.58-4.60 us at one row with 8 warps (the default before), 4.32-4.35 at 16, 3.84-3.86 at 32 (3.94-3.98 at four
# rows): each thread's chain of loads, squares and adds is shorter. Compiled for sm_90 at 32 warps it holds 46-62
# registers a thread (the 64 that 1024 threads may have), no spill (tests/kernels/test_norm_warps.py).
WIDE_ROW_WARPS = 32
# the warp counts a caller may ask of a row (`add_rms_norm_quant(num_warps=)`, `FastPathOptions.norm_warps`); 4 on a
# row of 7168 with a delta spills (64 bytes of stack at 255 registers, sm_90), 5.71 / 4.94 us alone (session 17)
ROW_WARPS = (4, 8, 16, 32)


def row_tiles(D: int) -> tuple[int, int]:
    """(BG, num_warps) of a row of D channels: its 128-groups rounded up to a power of two, and WIDE_ROW_WARPS (32)
    from 32 groups, 4 below (a launch that runs `_add_norm_quant_row` must use these to keep its bits: the warps set
    the sums' order; the q_a norm of `mla_prologue_fused`'s kv launch runs on 4 warps up to 16 groups)."""
    bg = triton.next_power_of_2(triton.cdiv(D, BLOCK))
    return bg, WIDE_ROW_WARPS if bg >= 32 else 4


def _rows(t: torch.Tensor, D: int) -> torch.Tensor:
    t2 = t.reshape(-1, D)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def add_rms_norm_quant(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                       out_dtype: torch.dtype = torch.bfloat16, quant: bool = True, store_y: bool = True,
                       store_h: bool = True, pdl: bool = False, round_dtype: torch.dtype | None = None,
                       num_warps: int | None = None):
    """Kernel twin of `add_rms_norm_quant_ref`: returns (h_new, y, x8, sx) with None for what is not asked
    (h_new is h when delta is None; y when store_y is False; x8, sx when quant is False). pdl: programmatic
    dependent launch (`_triton.pdl_kwargs`). round_dtype (bf16 / fp16 / fp32 / None): delta, a row-parallel
    sublayer's fp32 sum, rounded to it before the add, in this kernel instead of a cast launch before it (the
    same bits: round to nearest even, then an exact widening). num_warps: one of ROW_WARPS, or None for `row_tiles`'
    (the warps set the row sum's order, so every path that must give the same bits as another passes the same
    count: the fast path passes `FastPathOptions.norm_warps` for every row of the model's width, and keeps the
    default for the q_a norm, whose fused launch in `mla_prologue_fused` runs row_tiles' 4 warps; other counts for
    benchmarks, `mtp.bench.small_kernels`)."""
    require(h, "add_rms_norm_quant")
    D = h.shape[-1]
    lead = h.shape[:-1]
    if weight.shape != (D,):
        raise ValueError(f"add_rms_norm_quant: weight must be [{D}], got {list(weight.shape)}")
    if delta is not None and delta.shape != h.shape:
        raise ValueError(f"add_rms_norm_quant: delta {list(delta.shape)} must match h {list(h.shape)}")
    if quant and D % BLOCK:
        raise ValueError(f"add_rms_norm_quant: D = {D} must be a multiple of {BLOCK} to quantize")
    if h.dtype != torch.float32 and (delta is not None or h.dtype not in (torch.bfloat16, torch.float16)):
        raise TypeError(f"add_rms_norm_quant: h must be fp32 (the residual stream), or bf16 / fp16 without a "
                        f"delta; got {h.dtype}" + (" with a delta" if delta is not None else ""))
    if num_warps is not None and (not isinstance(num_warps, int) or num_warps not in ROW_WARPS):
        raise ValueError(f"add_rms_norm_quant: num_warps must be one of {ROW_WARPS} or None, got {num_warps!r}")
    if round_dtype is not None and round_dtype not in _ROUND:
        raise ValueError(f"add_rms_norm_quant: round_dtype must be one of {list(_ROUND)} or None, got {round_dtype}")
    h2 = _rows(h, D)
    M = h2.shape[0]
    dev = h.device
    d2 = _rows(delta, D) if delta is not None else h2
    add = delta is not None
    hout = torch.empty_like(h2) if add and store_h else h2
    y = torch.empty(M, D, dtype=out_dtype, device=dev) if store_y else None
    x8 = torch.empty(M, D, dtype=FP8_DTYPE, device=dev) if quant else None
    sx = torch.empty(M, D // BLOCK, dtype=torch.float32, device=dev) if quant else None
    if M:
        bg, warps = row_tiles(D)
        warps = num_warps or warps
        # a y buffer is needed for its dtype even when it is not stored: point at a 1-element stand-in
        y_arg = y if y is not None else torch.empty(1, 1, dtype=out_dtype, device=dev)
        launch = pdl_kwargs(pdl, h2)
        _add_norm_quant_kernel[(M,)](h2, d2, weight, hout, y_arg, x8 if quant else h2, sx if quant else h2, D, eps,
                                     h2.stride(0), d2.stride(0), hout.stride(0), y_arg.stride(0),
                                     x8.stride(0) if quant else 0, sx.stride(0) if quant else 0,
                                     ADD=add, STORE_H=add and store_h, STORE_Y=store_y, QUANT=quant, BG=bg,
                                     PDL=pdl_mode(pdl, launch), ROUND=_ROUND.get(round_dtype, 2), num_warps=warps, **launch)
    G = D // BLOCK
    return (hout.view(*lead, D) if add and store_h else (h if not add else None),
            y.view(*lead, D) if y is not None else None,
            x8.view(*lead, D) if quant else None,
            sx.view(*lead, G) if quant else None)


# ----------------------------------------------------------------------------- the block's last residual add


def add_rounded_ref(h: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """h + y rounded to dtype first: the block's `h + ffn(x)` where the FFN's fp32 sum is returned in the
    model dtype (`MoE.forward`'s `.to(x.dtype)`)."""
    return h + y.to(dtype).to(h.dtype)


@triton.jit
def _add_rounded_kernel(h_ptr, y_ptr, out_ptr, n, ROUND: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    pdl_launch(PDL)
    pdl_wait(PDL)  # h and y come from earlier kernels
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = offs < n
    y = tl.load(y_ptr + offs, mask=m, other=0.0)
    if ROUND == 0:
        y = y.to(tl.bfloat16).to(tl.float32)
    elif ROUND == 1:
        y = y.to(tl.float16).to(tl.float32)
    tl.store(out_ptr + offs, tl.load(h_ptr + offs, mask=m, other=0.0) + y, mask=m)


def add_rounded(h: torch.Tensor, y: torch.Tensor, dtype: torch.dtype, pdl: bool = False) -> torch.Tensor:
    """Kernel twin of `add_rounded_ref` in one launch (instead of the cast and a mixed-dtype add): h and y
    fp32, same shape, contiguous; dtype bf16 / fp16 / fp32 (no rounding). pdl: programmatic dependent launch
    (`_triton.pdl_kwargs`)."""
    require(h, "add_rounded")
    if h.dtype != torch.float32 or y.dtype != torch.float32 or h.shape != y.shape or dtype not in _ROUND:
        raise ValueError(f"add_rounded: h and y must be fp32 of one shape and dtype one of {list(_ROUND)}; got "
                         f"{h.dtype} {list(h.shape)}, {y.dtype} {list(y.shape)}, {dtype}")
    if not (h.is_contiguous() and y.is_contiguous()):
        return add_rounded_ref(h, y, dtype)
    out = torch.empty_like(h)
    n = h.numel()
    if n:
        launch = pdl_kwargs(pdl, h)
        _add_rounded_kernel[(triton.cdiv(n, 2048),)](h, y, out, n, ROUND=_ROUND[dtype], BLOCK_N=2048,
                                                     PDL=pdl_mode(pdl, launch), num_warps=4, **launch)
    return out
