"""Per-token, per-128-channel FP8 activation quantization (Triton), bit-exact with `mtp.model.fp8.act_quant`.

Reference: `act_quant_ref` = `mtp.model.fp8.act_quant` (plain PyTorch). Shapes: x [..., K] with K % 128 == 0 ->
x8 [..., K] float8_e4m3fn, s [..., K // 128] float32.

The ue8m0 scale is computed from the fp32 bits (the smallest power of two >= amax / 448) instead of
exp2(ceil(log2(.))): the two agree on every input where log2 rounds honestly, and the bit form has no
approximate transcendental in it. Dividing by a power of two is exact, so multiplying by its exact
reciprocal gives the same fp32 value as the reference's division; the e4m3 cast rounds to nearest even
on both sides.
"""

from __future__ import annotations

import torch

from mtp.model.fp8 import AMAX_FLOOR, BLOCK, FP8_DTYPE, FP8_MAX
from mtp.model.fp8 import act_quant as act_quant_ref
from mtp.kernels._triton import pdl_kwargs, pdl_launch, pdl_mode, pdl_wait, require, tl, triton

__all__ = ["act_quant", "act_quant_ref"]


@triton.jit
def ue8m0_scale(amax):
    """amax (fp32, > 0) -> (s, 1/s): s the smallest power of two >= amax / 448, both exact."""
    # div_rn: Triton's plain fp32 '/' is the approximate div.full.f32 (2 ulp), which would push an s that is
    # exactly a power of two (amax = 1.75 * 2^k, common in bf16 data) one ulp up and double the scale.
    s = tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0)
    bits = s.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    s_pow2 = (e << 23).to(tl.float32, bitcast=True)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)
    return s_pow2, inv


@triton.jit
def quant_e4m3(xf, inv):
    """xf * inv clamped to +-448, cast to e4m3 (round to nearest even)."""
    y = xf * inv
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    return y.to(tl.float8e4nv)


@triton.jit(do_not_specialize=["n_groups"])  # one compiled kernel for any count (Triton would specialize 1 and 16k)
def _act_quant_kernel(x_ptr, y_ptr, s_ptr, n_groups, ROWS: tl.constexpr, PDL: tl.constexpr):
    # x viewed as [n_groups, 128]; each program quantizes ROWS groups.
    pdl_launch(PDL)
    pdl_wait(PDL)  # x is the previous kernel's
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, 128)
    rmask = rows < n_groups
    offs = rows.to(tl.int64)[:, None] * 128 + cols[None, :]
    xf = tl.load(x_ptr + offs, mask=rmask[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(xf), axis=1)
    s, inv = ue8m0_scale(amax)
    tl.store(y_ptr + offs, quant_e4m3(xf, inv[:, None]), mask=rmask[:, None])
    tl.store(s_ptr + rows, s, mask=rmask)


def act_quant(x: torch.Tensor, block: int = BLOCK, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `mtp.model.fp8.act_quant(x, 128, 'ue8m0')`: returns (x8 float8 [..., K], s fp32
    [..., K // 128]). pdl: programmatic dependent launch (`_triton.pdl_kwargs`)."""
    require(x, "act_quant")
    K = x.shape[-1]
    if block != BLOCK:
        raise ValueError(f"act_quant: only block {BLOCK} is implemented, got {block}")
    if K % BLOCK:
        raise ValueError(f"act_quant: last dim {K} is not a multiple of the block {BLOCK}")
    assert AMAX_FLOOR == 1e-4 and FP8_MAX == 448.0  # baked into ue8m0_scale
    xc = x.contiguous()
    y = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(*x.shape[:-1], K // BLOCK, dtype=torch.float32, device=x.device)
    n_groups = xc.numel() // BLOCK
    if n_groups:
        rows = 16
        launch = pdl_kwargs(pdl, xc)
        _act_quant_kernel[(triton.cdiv(n_groups, rows),)](xc, y, s, n_groups, ROWS=rows, PDL=pdl_mode(pdl, launch), num_warps=4,
                                                          **launch)
    return y, s
