"""The elementwise ops between the fast path's GEMMs as Triton kernels: one launch each, and no compiler at start-up.

References: the plain-PyTorch functions `mtp.model.layers` and `mtp.model.fp8` hold (imported here as `*_ref`; the
reference path calls them through `mtp.model.layers.ElementwiseOps`). `triton_ops()` is the ops object
`enable_fast_path(model, elementwise='triton')` (the default) gives a model. It replaces the torch.compile'd ops
(`layers.compiled_ops()`), which fuse the same launches but cost ~33 s on a cold start and ~13 s warm on an H100
(29 dynamo graphs and 21 recompiles in one generation, over dtype, tensor rank and size-1 specialisation); these
kernels are JIT-compiled by Triton once per dtype / shape class and then cached on disk like the others.

Shape legend: n rows (the leading dims flattened), D channels, N intermediate channels, B batch, T tokens,
H heads (3-D inputs: H = 1), R rotary dims, R/2 rotary pairs, K channels quantized in groups of 128.

Each op takes the reference's arguments and returns what it returns (dtype, shape, contiguous). A kernel takes
fp32 / bf16 / fp16 CUDA tensors (CPU tensors too under the Triton interpreter, TRITON_INTERPRET=1) of the shapes
listed at each op; anything else -- float64 (a float64 model), a CPU tensor, a shape the kernel does not cover,
a tensor that needs autograd -- goes to the reference function unchanged. `reference_reason(name, *args)` says
why a call goes there (None: the kernel runs it); tests hold both sides. Inputs are read through their row
stride (a slice of a fused projection's output, `q[..., P:]`, `gu[..., :N]`, is read in place) as long as the
last dim is contiguous; otherwise `reshape` may copy. act_quant / fake_quant copy a strided input (`contiguous`,
as `kernels.act_quant` does): their call sites pass contiguous tensors.

Numerics (fp32 inside, like the references' `fp8.acc_dtype`): every kernel is built with FP contraction off
(`enable_fp_fusion=False`), so each product and sum rounds where the reference's separate torch ops round.
- Bit-exact on a GPU: rope_interleaved, rope_half (same products and sums), act_quant (the existing
  `kernels.act_quant`), fake_quant (its quantization, then the exact dequant product), silu_mul (libdevice
  `expf` and IEEE division: what torch's CUDA silu computes; the Triton interpreter uses numpy's exp instead).
- Rounding order differs, within an ulp bound (tests/kernels/test_elementwise*.py): rms_norm and layer_norm
  (the row sums are tree sums in another order than torch's reductions; bf16 output: at most one bf16 ulp),
  rotate_activation (a tl.dot, below, sums the n products in another order than cuBLAS / the CPU GEMM).

Start-up: a kernel compiles once per dtype combination, layout and row width (the norms); token and row counts and
the rank of a rotary input are not specialised on (`do_not_specialize`, fixed head and column blocks), so one
generation of the bundled model compiles 10 of them (20 with Triton's default integer specialisation). Start-up
with these vs the eager and the torch.compile'd glue: BENCHMARKS.md ("Session 8: start-up cut ..."); the decode
step with each, side by side: `mtp-bench --elementwise triton|compile|eager` (TP=1 and `--tp N`).

rotate_activation is a tl.dot of a [rows, n] tile with the n x n Sylvester Hadamard matrix, generated in registers
per 32-row chunk (sign = parity of popcount(i & j), as `mla_prologue._hadamard`), in fp32 with
input_precision='ieee' (no TF32: the products x * +-1 are exact and the sums fp32, as the reference's fp32
GEMM). A butterfly (log2 n add/sub stages) does fewer flops, but each stage is a register shuffle (reshape,
permute, split) in Triton; at n = 128 the decode call is a few hundred rows, one launch either way, and the
prefill call (rows = tokens x 64 heads) does the same flops as the reference's GEMM.
"""

from __future__ import annotations

import torch

from mtp.kernels._triton import HAS_TRITON, interpreting, pdl_kwargs, pdl_launch, pdl_mode, pdl_wait, tl, triton
from mtp.kernels.act_quant import act_quant as act_quant_kernel
from mtp.kernels.act_quant import quant_e4m3, ue8m0_scale
from mtp.model.fp8 import BLOCK
from mtp.model.fp8 import act_quant as act_quant_ref
from mtp.model.fp8 import fake_quant as fake_quant_ref
from mtp.model.fp8 import rotate_activation as rotate_activation_ref
from mtp.model.layers import ElementwiseOps
from mtp.model.layers import layer_norm as layer_norm_ref
from mtp.model.layers import rms_norm as rms_norm_ref
from mtp.model.layers import rope_half as rope_half_ref
from mtp.model.layers import rope_interleaved as rope_interleaved_ref
from mtp.model.layers import silu_mul as silu_mul_ref

__all__ = ["act_quant", "act_quant_ref", "fake_quant", "fake_quant_ref", "layer_norm", "layer_norm_ref",
           "reference_reason", "rms_norm", "rms_norm_ref", "rope_half", "rope_half_ref", "rope_interleaved",
           "rope_interleaved_ref", "rotate_activation", "rotate_activation_ref", "silu_mul", "silu_mul_ref",
           "triton_ops"]

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_ROW = 16384  # rms_norm / layer_norm hold a row in registers (next power of two of D); DeepSeek's widest is 7168
HADAMARD_DIMS = (16, 32, 64, 128)  # tl.dot needs >= 16; the indexer's is 128
_LAUNCH = {"enable_fp_fusion": False}  # round where the reference's separate ops round (no FMA contraction)


# ----------------------------------------------------------------------------- which calls the kernels take
def _tensors_reason(*ts: torch.Tensor) -> str | None:
    if not HAS_TRITON:
        return "triton is not installed"
    for t in ts:
        if t.dtype not in KERNEL_DTYPES:
            return f"dtype {t.dtype} (kernels: {', '.join(str(d) for d in KERNEL_DTYPES)})"
        if not (t.is_cuda or (interpreting() and t.device.type == "cpu")):
            return f"device {t.device} (kernels: CUDA)"
        if t.requires_grad and torch.is_grad_enabled():
            return "autograd (the kernels have no backward)"
    if len({t.device for t in ts}) > 1:
        return f"tensors on several devices {sorted({str(t.device) for t in ts})}"
    return None


def _dtype_reason(dtype: torch.dtype) -> str | None:
    return None if dtype in KERNEL_DTYPES else f"output dtype {dtype}"


def _row_reason(x: torch.Tensor, D: int) -> str | None:
    if x.dim() == 0 or D == 0:
        return f"shape {list(x.shape)}"
    return None if triton.next_power_of_2(D) <= MAX_ROW else f"rows of {D} channels (at most {MAX_ROW})"


def _why_rms_norm(x, weight, eps, out_dtype):
    return (_tensors_reason(x, weight) or _dtype_reason(out_dtype) or _row_reason(x, x.shape[-1] if x.dim() else 0)
            or (None if tuple(weight.shape) == (x.shape[-1],) else f"weight {list(weight.shape)}"))


def _why_layer_norm(x, weight, bias, eps):
    D = x.shape[-1] if x.dim() else 0
    return (_tensors_reason(x, weight, bias) or _row_reason(x, D)
            or (None if tuple(weight.shape) == tuple(bias.shape) == (D,) else
                f"weight {list(weight.shape)} / bias {list(bias.shape)}"))


def _why_silu_mul(g, u, out_dtype):
    return (_tensors_reason(g, u) or _dtype_reason(out_dtype)
            or (None if g.shape == u.shape and g.dim() and g.shape[-1] else f"gate {list(g.shape)} / up {list(u.shape)}"))


def _why_rope(x, cos, sin):
    r = _tensors_reason(x, cos, sin)
    if r:
        return r
    if x.dim() not in (3, 4) or x.shape[-1] % 2 or not x.shape[-1]:
        return f"x {list(x.shape)} (kernels: [B, T, R] or [B, T, H, R], R even)"
    B, T, R = x.shape[0], x.shape[1], x.shape[-1]
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[-1] != R // 2 or cos.shape[0] not in (1, B) \
            or cos.shape[1] not in (1, T):
        return f"cos {list(cos.shape)} / sin {list(sin.shape)} (kernels: [B, T, R/2] = [{B}, {T}, {R // 2}], B or T may be 1)"
    return None


def _why_quant(x, block, scale_fmt):
    r = _tensors_reason(x)
    if r:
        return r
    if block != BLOCK or scale_fmt != "ue8m0":
        return f"block {block}, scale_fmt {scale_fmt!r} (kernels: {BLOCK}, 'ue8m0')"
    return None if x.dim() and x.shape[-1] % BLOCK == 0 else f"x {list(x.shape)} (last dim a multiple of {BLOCK})"


def _why_rotate(x):
    r = _tensors_reason(x)
    if r:
        return r
    return None if x.dim() and x.shape[-1] in HADAMARD_DIMS else \
        f"x {list(x.shape)} (kernels: last dim one of {HADAMARD_DIMS})"


_WHY = {"rms_norm": _why_rms_norm, "layer_norm": _why_layer_norm, "silu_mul": _why_silu_mul,
        "rope_interleaved": _why_rope, "rope_half": _why_rope,
        "act_quant": lambda x, block=BLOCK, scale_fmt="ue8m0": _why_quant(x, block, scale_fmt),
        "fake_quant": lambda x, block=BLOCK, scale_fmt="ue8m0": _why_quant(x, block, scale_fmt),
        "rotate_activation": _why_rotate}


def reference_reason(name: str, *args, **kwargs) -> str | None:
    """Why the op `name` (one of `ElementwiseOps.NAMES`) sends this call to its reference function, or None when
    the kernel runs it."""
    if name not in _WHY:
        raise ValueError(f"reference_reason: unknown op {name!r}; known: {list(_WHY)}")
    return _WHY[name](*args, **kwargs)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [n, D] with a unit last stride, read through its row stride (a view where reshape gives one)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 or x2.shape[0] == 0 else x2.contiguous()


def _row_warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


# ----------------------------------------------------------------------------- rms_norm / layer_norm
@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, stride_x, inv_d, eps, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl_launch(PDL)
    pdl_wait(PDL)  # x is an earlier kernel's
    _rms_norm_row(x_ptr, w_ptr, y_ptr, tl.program_id(0).to(tl.int64), D, stride_x, D, inv_d, eps, BLOCK_D)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype,
             pdl: bool = False) -> torch.Tensor:
    """Kernel twin of `layers.rms_norm` (x [..., D], weight [D]): one program per row. pdl: programmatic dependent
    launch (`_triton.pdl_kwargs`; the fast path's final norm asks for it, switch `pdl`)."""
    if reference_reason("rms_norm", x, weight, eps, out_dtype):
        return rms_norm_ref(x, weight, eps, out_dtype)
    D = x.shape[-1]
    x2 = _rows(x)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if x2.shape[0]:
        bd = triton.next_power_of_2(D)
        launch = pdl_kwargs(pdl, x2)
        _rms_norm_kernel[(x2.shape[0],)](x2, weight.contiguous(), y, D, x2.stride(0), 1.0 / D, eps, BLOCK_D=bd,
                                         PDL=pdl_mode(pdl, launch), num_warps=_row_warps(bd), **_LAUNCH, **launch)
    return y


@triton.jit
def _rms_norm_row(x_ptr, w_ptr, y_ptr, row, D, stride_x, stride_y, inv_d, eps, BLOCK_D: tl.constexpr):
    """One row of `_rms_norm_kernel` (and of the MTP norm pair's halves): the same sum, so the same bits at the same
    warps."""
    d = tl.arange(0, BLOCK_D)
    m = d < D
    x = tl.load(x_ptr + row * stride_x + d, mask=m, other=0.0).to(tl.float32)
    ms = tl.sum(x * x, axis=0) * inv_d  # torch's mean: the sum times 1/D
    w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
    y = x * tl.math.rsqrt(ms + eps) * w
    tl.store(y_ptr + row * stride_y + d, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rms_norm_pair_kernel(a_ptr, wa_ptr, b_ptr, wb_ptr, y_ptr, D, stride_a, stride_b, inv_d, eps_a, eps_b,
                          BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl_launch(PDL)
    # a and b are earlier kernels'; the weights are not, but `_rms_norm_row` issues their load right after x's (one
    # row of 7168 bf16: 14 KB), so loading them before the wait would hide next to nothing, and the row's code is
    # shared with `_rms_norm_kernel` (the same bits)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 0:
        _rms_norm_row(a_ptr, wa_ptr, y_ptr, row, D, stride_a, 2 * D, inv_d, eps_a, BLOCK_D)
    else:
        _rms_norm_row(b_ptr, wb_ptr, y_ptr + D, row, D, stride_b, 2 * D, inv_d, eps_b, BLOCK_D)


def rms_norm_pair_takes(a: torch.Tensor, wa: torch.Tensor, b: torch.Tensor, wb: torch.Tensor,
                        out_dtype: torch.dtype) -> bool:
    """Whether `rms_norm_pair` takes these: `rms_norm`'s kernel takes each half (`reference_reason`), and a, b have
    one shape and dtype."""
    return (a.shape == b.shape and a.dtype == b.dtype and reference_reason("rms_norm", a, wa, 0.0, out_dtype) is None
            and reference_reason("rms_norm", b, wb, 0.0, out_dtype) is None)


def rms_norm_pair(a: torch.Tensor, wa: torch.Tensor, eps_a: float, b: torch.Tensor, wb: torch.Tensor, eps_b: float,
                  out_dtype: torch.dtype, pdl: int = 0) -> torch.Tensor:
    """torch.cat((rms_norm(a, wa, eps_a, out_dtype), rms_norm(b, wb, eps_b, out_dtype)), -1) in one launch (a, b
    [..., D] of one shape and dtype; `rms_norm_pair_takes`): program (row, 0) norms a's row into the first D channels,
    (row, 1) b's into the last D, each as `rms_norm`'s kernel does (the same code, the same warps: the same bits). An
    MTP module's enorm and hnorm with the cat before eh_proj (`fast_path.FastMTPLayer`): 1 launch where they are 3.
    pdl: programmatic dependent launch (`_triton.pdl_kwargs`; `FastPathOptions.glue_pdl_at`'s value)."""
    if not rms_norm_pair_takes(a, wa, b, wb, out_dtype):
        raise ValueError(f"rms_norm_pair: takes two inputs of one shape and dtype that rms_norm's kernel takes; got "
                         f"{a.dtype} {list(a.shape)} and {b.dtype} {list(b.shape)}, out {out_dtype}")
    D = a.shape[-1]
    a2, b2 = _rows(a), _rows(b)
    y = torch.empty((*a.shape[:-1], 2 * D), dtype=out_dtype, device=a.device)
    if a2.shape[0]:
        bd = triton.next_power_of_2(D)
        launch = pdl_kwargs(pdl, a2)
        _rms_norm_pair_kernel[(a2.shape[0], 2)](a2, wa.contiguous(), b2, wb.contiguous(), y, D, a2.stride(0),
                                                b2.stride(0), 1.0 / D, eps_a, eps_b, BLOCK_D=bd,
                                                PDL=pdl_mode(pdl, launch), num_warps=_row_warps(bd), **_LAUNCH,
                                                **launch)
    return y


@triton.jit
def _layer_norm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, D, stride_x, inv_d, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    m = d < D
    x = tl.load(x_ptr + row * stride_x + d, mask=m, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) * inv_d
    xc = tl.where(m, x - mean, 0.0)
    var = tl.sum(xc * xc, axis=0) * inv_d  # biased, as F.layer_norm; two passes over registers
    w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + d, mask=m, other=0.0).to(tl.float32)
    y = xc * tl.math.rsqrt(var + eps) * w + b
    tl.store(y_ptr + row * D + d, y.to(y_ptr.dtype.element_ty), mask=m)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """Kernel twin of `layers.layer_norm` (x [..., D], weight and bias [D]; output in x's dtype)."""
    if reference_reason("layer_norm", x, weight, bias, eps):
        return layer_norm_ref(x, weight, bias, eps)
    D = x.shape[-1]
    x2 = _rows(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        bd = triton.next_power_of_2(D)
        _layer_norm_kernel[(x2.shape[0],)](x2, weight.contiguous(), bias.contiguous(), y, D, x2.stride(0), 1.0 / D, eps, BLOCK_D=bd,
                                           num_warps=_row_warps(bd), **_LAUNCH)
    return y


# ----------------------------------------------------------------------------- silu_mul
@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, N, stride_g, stride_u, BLOCK_N: tl.constexpr, LIBDEVICE: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_launch(PDL)
    pdl_wait(PDL)  # g and u are the gate | up GEMV's
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = c < N
    g = tl.load(g_ptr + row * stride_g + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + c, mask=m, other=0.0).to(tl.float32)
    if LIBDEVICE:  # expf as CUDA's math library computes it (tl.exp is the faster, less accurate ex2.approx)
        e = tl.extra.cuda.libdevice.exp(-g)
    else:  # the interpreter: numpy's exp
        e = tl.exp(-g)
    s = tl.math.div_rn(g, 1.0 + e)  # torch's silu: x / (1 + exp(-x)), IEEE division
    tl.store(y_ptr + row * N + c, (s * u).to(y_ptr.dtype.element_ty), mask=m)


def silu_mul(g: torch.Tensor, u: torch.Tensor, out_dtype: torch.dtype, pdl: bool = False) -> torch.Tensor:
    """Kernel twin of `layers.silu_mul`: silu(g) * u in out_dtype (g, u [..., N], e.g. the two halves of a fused
    gate | up output, read in place). pdl: programmatic dependent launch (`_triton.pdl_kwargs`; the fast path's
    gate | up asks for it, switch `pdl`)."""
    if reference_reason("silu_mul", g, u, out_dtype):
        return silu_mul_ref(g, u, out_dtype)
    N = g.shape[-1]
    g2, u2 = _rows(g), _rows(u)
    y = torch.empty(g.shape, dtype=out_dtype, device=g.device)
    n = g2.shape[0]
    if n:
        bn = 1024  # whatever N is (a narrow row masks the rest): one compiled kernel per dtype pair
        launch = pdl_kwargs(pdl, g2)
        _silu_mul_kernel[(n, triton.cdiv(N, bn))](g2, u2, y, N, g2.stride(0), u2.stride(0), BLOCK_N=bn,
                                                  LIBDEVICE=not interpreting(), PDL=pdl_mode(pdl, launch), num_warps=4,
                                                  **_LAUNCH, **launch)
    return y


# ----------------------------------------------------------------------------- rotary
# one compiled kernel per layout and dtypes: for w = 1 and w > 1 (T, the batch strides), 3-D and 4-D (H = 1 or not)
@triton.jit(do_not_specialize=["T", "H", "sxb", "scb", "ssb"])
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, T, H, sxb, sxt, sxh, scb, sct, scr, ssb, sst, ssr,
                 HALF: tl.constexpr, NP: tl.constexpr, BP: tl.constexpr, BH: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)  # token b * T + t
    b = n // T
    t = n - b * T
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    i = tl.arange(0, BP)  # pair index
    im = i < NP
    m = (h < H)[:, None] & im[None, :]
    if HALF:  # pairs (x[i], x[i + R/2])
        ia = i
        ib = i + NP
    else:  # pairs (x[2i], x[2i + 1])
        ia = 2 * i
        ib = 2 * i + 1
    cs = tl.load(cos_ptr + b * scb + t * sct + i * scr, mask=im, other=0.0).to(tl.float32)[None, :]
    sn = tl.load(sin_ptr + b * ssb + t * sst + i * ssr, mask=im, other=0.0).to(tl.float32)[None, :]
    src = x_ptr + b * sxb + t * sxt + h.to(tl.int64)[:, None] * sxh
    xa = tl.load(src + ia[None, :], mask=m, other=0.0).to(tl.float32)
    xb = tl.load(src + ib[None, :], mask=m, other=0.0).to(tl.float32)
    dst = y_ptr + (n * H + h.to(tl.int64)[:, None]) * (2 * NP)
    dt = y_ptr.dtype.element_ty
    tl.store(dst + ia[None, :], (xa * cs - xb * sn).to(dt), mask=m)
    tl.store(dst + ib[None, :], (xa * sn + xb * cs).to(dt), mask=m)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: bool) -> torch.Tensor:
    """x [B, T, R] or [B, T, H, R] (any strides, unit last stride read in place) rotated by cos / sin
    [B, T, R/2] (broadcast over the heads, and over B or T where they have size 1): a contiguous copy of x's shape."""
    B, T, R = x.shape[0], x.shape[1], x.shape[-1]
    H = x.shape[2] if x.dim() == 4 else 1
    if x.stride(-1) != 1:
        x = x.contiguous()
    sxh = x.stride(2) if x.dim() == 4 else 0
    c, s = cos.expand(B, T, R // 2), sin.expand(B, T, R // 2)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if y.numel():
        bp = triton.next_power_of_2(R // 2)
        bh = 16  # heads per program, whatever H is (a 3-D input masks 15 of 16 rows): one kernel for both ranks
        _rope_kernel[(B * T, triton.cdiv(H, bh))](x, c, s, y, T, H, x.stride(0), x.stride(1), sxh, *c.stride(),
                                                  *s.stride(), HALF=half, NP=R // 2, BP=bp, BH=bh, num_warps=4,
                                                  **_LAUNCH)
    return y


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Kernel twin of `layers.rope_interleaved` (pairs (x[2i], x[2i+1]); MLA's q_pe and k_pe)."""
    if reference_reason("rope_interleaved", x, cos, sin):
        return rope_interleaved_ref(x, cos, sin)
    return _rope(x, cos, sin, half=False)


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Kernel twin of `layers.rope_half` (pairs (x[i], x[i + R/2]); the indexer's queries and keys)."""
    if reference_reason("rope_half", x, cos, sin):
        return rope_half_ref(x, cos, sin)
    return _rope(x, cos, sin, half=True)


# ----------------------------------------------------------------------------- FP8 activation quant
def act_quant(x: torch.Tensor, block: int = BLOCK, scale_fmt: str | None = "ue8m0"):
    """`fp8.act_quant` on the existing bit-exact kernel (`kernels.act_quant`) where it applies (block 128,
    ue8m0 scales), else the reference."""
    if reference_reason("act_quant", x, block, scale_fmt):
        return act_quant_ref(x, block, scale_fmt)
    return act_quant_kernel(x)


@triton.jit(do_not_specialize=["n_groups"])
def _fake_quant_kernel(x_ptr, y_ptr, n_groups, ROWS: tl.constexpr):
    # x viewed as [n_groups, 128]: `kernels.act_quant`'s quantization, then the dequant product (exact: an e4m3
    # value times a power of two), stored in x's dtype
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = (rows < n_groups)[:, None]
    offs = rows.to(tl.int64)[:, None] * 128 + tl.arange(0, 128)[None, :]
    xf = tl.load(x_ptr + offs, mask=rmask, other=0.0).to(tl.float32)
    s, inv = ue8m0_scale(tl.max(tl.abs(xf), axis=1))
    q = quant_e4m3(xf, inv[:, None]).to(tl.float32)
    tl.store(y_ptr + offs, (q * s[:, None]).to(y_ptr.dtype.element_ty), mask=rmask)


def fake_quant(x: torch.Tensor, block: int = BLOCK, scale_fmt: str | None = "ue8m0") -> torch.Tensor:
    """Kernel twin of `fp8.fake_quant` (the value an FP8 round trip leaves, in x's dtype) in one launch, where
    it applies (block 128, ue8m0 scales); x is made contiguous first."""
    if reference_reason("fake_quant", x, block, scale_fmt):
        return fake_quant_ref(x, block, scale_fmt)
    xc = x.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_groups = xc.numel() // BLOCK
    if n_groups:
        rows = 16
        _fake_quant_kernel[(triton.cdiv(n_groups, rows),)](xc, y, n_groups, ROWS=rows, num_warps=4, **_LAUNCH)
    return y


# ----------------------------------------------------------------------------- Hadamard rotation
@triton.jit(do_not_specialize=["M"])
def _hadamard_kernel(x_ptr, y_ptr, M, stride_x, N: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                     SCALE: tl.constexpr):
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    rm = (r < M)[:, None]
    src = x_ptr + r.to(tl.int64)[:, None] * stride_x
    j = tl.arange(0, N)
    acc = tl.zeros((BM, N), dtype=tl.float32)
    for k0 in tl.static_range(0, N, BK):
        k = k0 + tl.arange(0, BK)
        x = tl.load(src + k[None, :], mask=rm, other=0.0).to(tl.float32)
        p = k[:, None] & j[None, :]  # H[k, j] = (-1)^popcount(k & j): parity by xor-folding (N <= 128: 7 bits)
        p = p ^ (p >> 4)
        p = p ^ (p >> 2)
        p = p ^ (p >> 1)
        sign = 1.0 - 2.0 * (p & 1).to(tl.float32)
        acc = tl.dot(x, sign, acc, input_precision="ieee")
    y = acc * SCALE
    tl.store(y_ptr + r.to(tl.int64)[:, None] * N + j[None, :], y.to(y_ptr.dtype.element_ty), mask=rm)


def rotate_activation(x: torch.Tensor) -> torch.Tensor:
    """Kernel twin of `fp8.rotate_activation` (x [..., n], n in `HADAMARD_DIMS`): (x @ H_n) * n^-0.5."""
    if reference_reason("rotate_activation", x):
        return rotate_activation_ref(x)
    n = x.shape[-1]
    x2 = _rows(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    M = x2.shape[0]
    if M:
        bm = 32
        _hadamard_kernel[(triton.cdiv(M, bm),)](x2, y, M, x2.stride(0), N=n, BM=bm, BK=min(n, 32),
                                               SCALE=n ** -0.5, num_warps=4, **_LAUNCH)
    return y


# ----------------------------------------------------------------------------- the ops object
_TRITON: list[ElementwiseOps] = []


def triton_ops() -> ElementwiseOps:
    """The Triton elementwise ops (`ElementwiseOps` of kind 'triton'), built once per process; each kernel is
    JIT-compiled at its first call (or read from Triton's disk cache)."""
    if not _TRITON:
        _TRITON.append(ElementwiseOps("triton", impl={
            "rms_norm": rms_norm, "layer_norm": layer_norm, "silu_mul": silu_mul, "rope_interleaved": rope_interleaved,
            "rope_half": rope_half, "act_quant": act_quant, "fake_quant": fake_quant,
            "rotate_activation": rotate_activation}))
    return _TRITON[0]

