"""The elementwise kernels (`mtp/kernels/elementwise.py`) against their references, which calls go to the
references, the ops objects that hold them, and the fast path's choice among them.

Under the Triton interpreter (one subprocess for every check: this file as a script): fp32, bf16 and fp16 inputs,
3-D and 4-D, w = 1 and w = 3 tokens, strided views of a fused projection's output, cos / sin broadcast over the
heads and over a batch of one. The interpreter rounds fp32 -> bf16 toward zero (CUDA: to nearest even) and its fp8
casts are not CUDA's, so a bf16 result of the same arithmetic (rotary) is held to the reference's fp32 value
rounded toward zero, and fake_quant to the interpreter's own act_quant kernel; the GPU test
(test_elementwise_gpu.py) holds them bit for bit to the references. Tolerances (`_check`): exact where the
arithmetic is the same (rotary, fake_quant, the quant routing); else |kernel - reference| <= one ulp of the output
dtype at |reference| (rounding of a bf16 / fp16 output; 0 for fp32) + k fp32 ulps of the scale the rounding errors
grow with: rms_norm k = 8 of |reference|; silu_mul k = 8 of |reference| (numpy's exp vs torch's, one division, one
product); layer_norm k = 16 of (|x| + |mean|) rstd |w| + |b| (sums in another order; the CPU reference computes
x rstd w - mean rstd w + b, whose terms may cancel); rotate_activation k = 8 of sum |x| / sqrt(n) (n products
summed in another order). Measured here: at most 2.2, 9.3 and 1.1 of those units.
In this process (no interpreter): CPU and float64 inputs go to the references, exactly; the ops kinds; the fast
path's default.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import warnings

import pytest
import torch

from mtp.kernels import elementwise as E
from mtp.model import fp8, layers
from mtp.model.layers import REFERENCE_OPS, ElementwiseOps, compiled_ops

from tests.interp import run_interpreted

EPS32 = torch.finfo(torch.float32).eps


# ----------------------------------------------------------------------------- in this process
def _cases(dtype=torch.float32):
    """One call of every op (name, args, kwargs) on CPU tensors of `dtype`."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    cos, sin = r(2, 3, 4).float(), r(2, 3, 4).float()
    return [("rms_norm", (r(2, 3, 64), r(64), 1e-6, dtype), {}),
            ("layer_norm", (r(2, 3, 32), r(32), r(32), 1e-6), {}),
            ("silu_mul", (r(2, 3, 16), r(2, 3, 16), dtype), {}),
            ("rope_interleaved", (r(2, 3, 5, 8), cos, sin), {}),
            ("rope_half", (r(2, 3, 8), cos, sin), {}),
            ("act_quant", (r(2, 3, 256),), {}),
            ("fake_quant", (r(2, 3, 256),), {}),
            ("rotate_activation", (r(2, 3, 2, 128),), {})]


def _equal(a, b) -> bool:
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                              b.view(torch.uint8) if b.element_size() == 1 else b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_and_float64_calls_go_to_the_reference(dtype):
    """Off the GPU (and float64 anywhere) every Triton op is its reference function, bit for bit, and says why."""
    ops = E.triton_ops()
    for name, args, kw in _cases(dtype):
        why = E.reference_reason(name, *args, **kw)
        assert why is not None and ("device cpu" if dtype == torch.float32 else "dtype torch.float64") in why, (name, why)
        assert _equal(getattr(ops, name)(*args, **kw), getattr(REFERENCE_OPS, name)(*args, **kw)), name


def test_without_triton_every_call_goes_to_the_reference():
    """A CPU-only install without Triton imports the module (its kernels are stand-ins) and runs the references."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, mtp.kernels.elementwise as E\n"
            "x = torch.randn(2, 3, 128)\n"
            "assert E.reference_reason('rotate_activation', x) == 'triton is not installed'\n"
            "assert torch.equal(E.triton_ops().rotate_activation(x), E.rotate_activation_ref(x))\n"
            "print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_reference_reason_knows_every_op():
    assert set(E._WHY) == set(ElementwiseOps.NAMES)
    with pytest.raises(ValueError, match="unknown op 'gelu'"):
        E.reference_reason("gelu", torch.zeros(1))


def test_ops_objects_of_each_kind():
    assert REFERENCE_OPS.kind == "reference" and REFERENCE_OPS.rms_norm is layers.rms_norm
    ops = E.triton_ops()
    assert ops is E.triton_ops() and ops.kind == "triton"
    assert all(getattr(ops, n) is getattr(E, n) for n in ElementwiseOps.NAMES)
    comp = compiled_ops()
    assert comp.kind == "compile" and comp is compiled_ops()
    assert all(getattr(comp, n) is not getattr(REFERENCE_OPS, n) for n in ElementwiseOps.NAMES)
    assert comp.act_quant._torchdynamo_orig_callable is fp8.act_quant  # a torch.compile wrapper of the reference
    with pytest.raises(ValueError, match="kind must be one of"):
        ElementwiseOps("fused")
    with pytest.raises(ValueError, match="kind 'triton' takes `impl`"):
        ElementwiseOps("triton")
    with pytest.raises(ValueError, match="kind 'triton' takes `impl`"):
        ElementwiseOps("triton", impl={"rms_norm": E.rms_norm})
    with pytest.raises(ValueError, match="kind 'triton' takes `impl`"):
        ElementwiseOps("reference", impl={n: getattr(E, n) for n in ElementwiseOps.NAMES})


def test_fast_path_default_is_the_triton_glue(monkeypatch):
    """enable_fast_path gives the model the Triton ops unless told otherwise; 'compile' still builds the
    torch.compile'd ones, 'eager' the plain ones; the old keyword warns and still works. (On the CPU: the
    device checks are told it is a GPU; the module swaps run as under the interpreter.)"""
    from mtp.backends import fast_path as fp
    from mtp.model.deepseek import DeepseekV32
    from mtp.model.presets import tiny_config

    assert inspect.signature(fp.enable_fast_path).parameters["elementwise"].default == "triton"
    monkeypatch.setattr(fp, "available", lambda: True)
    monkeypatch.setattr(fp, "_mm_out_fp32", lambda: False)
    monkeypatch.setattr(DeepseekV32, "device", property(lambda self: torch.device("cuda")))
    model = DeepseekV32(tiny_config(), n_mtp=1)

    def ops_of(m):
        got = {id(mod.ops): mod.ops for mod in m.modules() if hasattr(type(mod), "ops")}
        assert len(got) == 1, "every module of a model shares its ops"
        return next(iter(got.values()))

    v = model.version
    fp.enable_fast_path(model)
    assert ops_of(model) is E.triton_ops() and model.version > v
    fp.enable_fast_path(model, elementwise="compile")
    assert ops_of(model) is compiled_ops()
    fp.enable_fast_path(model, elementwise="eager")
    assert ops_of(model) is REFERENCE_OPS
    with pytest.warns(DeprecationWarning, match="compile_elementwise"):
        fp.enable_fast_path(model, compile_elementwise=True)
    assert ops_of(model) is compiled_ops()
    with pytest.raises(ValueError, match=r"elementwise must be one of \('triton', 'compile', 'eager'\), got 'fused'"):
        fp.enable_fast_path(model, elementwise="fused")
    v = model.version
    fp.set_elementwise(model, "triton")
    assert ops_of(model) is E.triton_ops() and model.version == v + 1  # kept graphs are captured again
    fp.disable_fast_path(model)
    assert ops_of(model) is REFERENCE_OPS


def test_elementwise_kernels_interpreted():
    run_interpreted(__file__, 600)


# ----------------------------------------------------------------------------- the interpreted checks
def _rounded(v32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An fp32 value in `dtype` as a kernel stores it here: the interpreter truncates fp32 -> bf16."""
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return (v32.contiguous().view(torch.int32) & -65536).view(torch.float32).to(dtype)
    return v32.to(dtype)


def _check(name: str, got: torch.Tensor, want: torch.Tensor, ulps: float = 0, scale: torch.Tensor | None = None):
    """got == want in shape and dtype, and |got - want| <= (one `got.dtype` ulp unless fp32) * |want| + ulps fp32
    ulps * scale (default |want|); ulps = 0 with an fp32 output: bit for bit."""
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape, got.dtype, want.dtype)
    a, b = got.double(), want.double()
    out_eps = 0.0 if got.dtype == torch.float32 else torch.finfo(got.dtype).eps
    bound = out_eps * b.abs() + ulps * EPS32 * (b.abs() if scale is None else scale.double())
    bad = ~((a - b).abs() <= bound)
    if bool(bad.any()):
        i = tuple(torch.nonzero(bad)[0].tolist())
        raise AssertionError(f"{name}: {int(bad.sum())} of {bad.numel()} elements differ beyond the bound; first at "
                             f"{list(i)}: {a[i].item()!r} vs {b[i].item()!r} (bound {bound[i].item():.3e})")


def _check_exact(name: str, got: torch.Tensor, want32: torch.Tensor):
    """Same arithmetic as the reference: got equals its fp32 value as the output dtype stores it."""
    want = _rounded(want32, got.dtype)
    assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want), (
        name, int((got != want).sum()), got.shape)


def _norm_checks(dt, w) -> None:
    B, D = 2, 300  # not a power of two: a masked row tail
    fused = torch.randn(B, w, 512 + D) * 3  # a slice of a fused projection's output: row stride 812
    x = fused[..., 512:].to(dt)
    for wdt in (torch.float32, torch.bfloat16):
        weight = (torch.rand(D) + 0.5).to(wdt)
        for out in (dt, torch.float32):
            got = E.rms_norm(x, weight, 1e-6, out)
            _check(f"rms_norm {dt} w={w} weight {wdt} -> {out}", got, E.rms_norm_ref(x, weight, 1e-6, out), 8)
    h = (torch.randn(B, w, 7, 128) * 5).to(torch.float32)  # 4-D: residual-stream fp32 in, bf16 out
    wb = (torch.rand(128) + 0.5).bfloat16()
    _check("rms_norm 4-D fp32 -> bf16", E.rms_norm(h, wb, 1e-6, torch.bfloat16),
           E.rms_norm_ref(h, wb, 1e-6, torch.bfloat16), 8)
    lw, lb = torch.rand(128) + 0.5, torch.randn(128) * 0.3  # the indexer key norm: fp32 weight and bias
    k = (torch.randn(B, w, 600) * 2 + 1)[..., 100:228].to(dt)  # wk's slice of the fused output, mean 1
    ref = E.layer_norm_ref(k, lw, lb, 1e-6)
    kf = k.double()
    rstd = torch.rsqrt(kf.var(-1, unbiased=False, keepdim=True) + 1e-6)
    scale = (kf.abs() + kf.mean(-1, keepdim=True).abs()) * rstd * lw.double() + lb.double().abs()
    _check(f"layer_norm {dt} w={w}", E.layer_norm(k, lw, lb, 1e-6), ref, 16, scale)


def _silu_checks(dt, w) -> None:
    N = 200
    gu = (torch.randn(2, w, 2 * N) * 4).to(dt)  # gate | up of one fused GEMV, read as two strided halves
    g, u = gu[..., :N], gu[..., N:]
    for out in (dt, torch.float32):
        _check(f"silu_mul {dt} w={w} -> {out}", E.silu_mul(g, u, out), E.silu_mul_ref(g, u, out), 8)
    g4 = (torch.randn(3, w, 5, 70) * 30).to(dt)  # 4-D, large |g| (exp under- and overflow sides)
    u4 = torch.randn(3, w, 5, 70).to(dt)
    _check(f"silu_mul 4-D {dt}", E.silu_mul(g4, u4, dt), E.silu_mul_ref(g4, u4, dt), 8)


def _rope_checks(dt, w) -> None:
    B, H, P, R, C = 2, 4, 32, 64, 128
    pos = torch.arange(B * w).view(B, w) * 7 + 3
    cos, sin = layers.Rotary(_rope_cfg()).angles(pos)  # [B, w, R/2] fp32
    q = (torch.randn(B, w, H * (P + R) + 16) * 2).to(dt)[..., :H * (P + R)].view(B, w, H, P + R)
    q_pe = q[..., P:]  # the q_b output's rope channels: strided over heads and tokens
    kv = (torch.randn(B, w, C + R) * 2).to(dt)
    k_pe = kv[..., C:]  # 3-D: one rope key per token
    for name, x in (("q_pe 4-D", q_pe), ("k_pe 3-D", k_pe)):
        got = E.rope_interleaved(x, cos, sin)
        assert got.is_contiguous()
        _check_exact(f"rope_interleaved {name} {dt} w={w}", got, E.rope_interleaved_ref(x.float(), cos, sin))
        if dt != torch.bfloat16 or os.environ.get("TRITON_INTERPRET") != "1":
            assert torch.equal(got, E.rope_interleaved_ref(x, cos, sin))
    # one row of angles for a batch (B = 1 broadcast): what every row of a batch at equal positions sees
    c1, s1 = cos[:1], sin[:1]
    _check_exact("rope_interleaved cos [1, T, R/2]", E.rope_interleaved(q_pe, c1, s1),
                 E.rope_interleaved_ref(q_pe.float(), c1, s1))
    # the indexer's half rotary on the first R channels of its [B, T, Hi, Dk] queries and [B, T, Dk] keys
    iq = (torch.randn(B, w, 8, 128) * 2).to(dt)
    ik = (torch.randn(B, w, 128) * 2).to(dt)
    for name, x in (("queries 4-D", iq[..., :R]), ("keys 3-D", ik[..., :R])):
        _check_exact(f"rope_half {name} {dt} w={w}", E.rope_half(x, cos, sin), E.rope_half_ref(x.float(), cos, sin))


def _rope_cfg():
    from mtp.model.presets import tiny_config

    return tiny_config()


def _quant_checks(dt, w) -> None:
    from mtp.kernels.act_quant import act_quant as act_quant_kernel

    x = torch.randn(2, w, 8, 256) * torch.logspace(-3, 2, 256)
    x[0, 0, 0, :128] *= 1e-4  # a group under the amax floor
    x = x.to(dt)
    assert E.reference_reason("act_quant", x) is None
    x8, s = E.act_quant(x)
    k8, ks = act_quant_kernel(x)  # the existing kernel, routed to (not a copy of it)
    assert torch.equal(x8.view(torch.uint8), k8.view(torch.uint8)) and torch.equal(s, ks)
    y = E.fake_quant(x)
    assert y.dtype == dt and y.shape == x.shape
    assert torch.equal(y, fp8.act_dequant(k8, ks, dt)), f"fake_quant {dt}: not the dequantized act_quant"
    xs = x[..., :128]  # a strided view: copied, then quantized
    assert torch.equal(E.fake_quant(xs), fp8.act_dequant(*act_quant_kernel(xs.contiguous()), dt))


def _rotate_checks(dt, w) -> None:
    for shape in ((2, w, 128), (2, w, 5, 128), (3, w, 16)):
        n = shape[-1]
        wide = torch.randn(*shape[:-1], n + 8) * 3
        x = wide[..., 4:4 + n].to(dt)  # strided rows
        scale = x.double().abs().sum(-1, keepdim=True) * n ** -0.5
        got = E.rotate_activation(x)
        _check(f"rotate_activation {list(shape)} {dt}", got, E.rotate_activation_ref(x), 8, scale.expand(x.shape))
    x = torch.zeros(1, w, 128, dtype=dt)
    x[..., 5] = 1  # one basis vector: row 5 of H / sqrt(128), every entry +-2^-3.5
    h = fp8.hadamard_matrix(128)[5] * 128 ** -0.5
    _check_exact("rotate_activation basis vector", E.rotate_activation(x), h.expand(1, w, 128).contiguous())


def _fallback_checks() -> None:
    """Under the interpreter too: what a kernel does not cover is the reference function's result, bit for bit."""
    cos, sin = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    f64 = [(name, args, kw) for name, args, kw in _cases(torch.float64)]
    odd = [("rotate_activation", (torch.randn(2, 256),), {}, "last dim one of"),
           ("rotate_activation", (torch.randn(2, 8),), {}, "last dim one of"),
           ("rope_interleaved", (torch.randn(2, 3, 2, 2, 8), cos, sin), {}, "[B, T, R] or [B, T, H, R]"),
           ("rope_half", (torch.randn(3, 3, 8), cos, sin), {}, "B or T may be 1"),
           ("act_quant", (torch.randn(2, 64),), {"block": 64}, "block 64"),
           ("fake_quant", (torch.randn(2, 128),), {"scale_fmt": None}, "scale_fmt None"),
           ("rms_norm", (torch.randn(2, 40000), torch.ones(40000), 1e-6, torch.float32), {}, "at most"),
           ("silu_mul", (torch.randn(2, 8), torch.randn(2, 8), torch.float64), {}, "output dtype")]
    for name, args, kw, *said in [(*c, "dtype torch.float64") for c in f64] + odd:
        why = E.reference_reason(name, *args, **kw)
        assert why is not None and said[0] in why, (name, why, said[0])
        try:
            want = getattr(REFERENCE_OPS, name)(*args, **kw)
        except (RuntimeError, ValueError) as e:  # the reference's own error, raised by the op too
            with pytest.raises(type(e)):
                getattr(E, name)(*args, **kw)
            continue
        assert _equal(getattr(E, name)(*args, **kw), want), name
    leaf = torch.randn(2, 64, requires_grad=True)
    with torch.enable_grad():
        assert "autograd" in E.reference_reason("rms_norm", leaf, torch.ones(64), 1e-6, torch.float32)
        assert E.rms_norm(leaf, torch.ones(64), 1e-6, torch.float32).grad_fn is not None
    with torch.no_grad():
        assert E.reference_reason("rms_norm", leaf, torch.ones(64), 1e-6, torch.float32) is None


def _main() -> None:
    from tests.interp import patch_interpreter_loop_bounds

    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_interpreter_loop_bounds()
    torch.manual_seed(0)
    warnings.simplefilter("ignore", RuntimeWarning)  # numpy's exp overflow inside silu (inf, as torch's)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        for w in (1, 3):
            _norm_checks(dt, w)
            _silu_checks(dt, w)
            _rope_checks(dt, w)
            _rotate_checks(dt, w)
            _quant_checks(dt, w)
    _fallback_checks()
    print("interpreted checks ok")


if __name__ == "__main__":
    sys.exit(_main())
