"""A MoE layer's post-attention add + norm + quant in its router's launch (`router.moe_route_norm`, switch
`FastPathOptions.route_norm`), on the CPU.

- Under the Triton interpreter (a subprocess: the interpreter is chosen when the kernels are decorated): the one
  launch against the two it replaces (`norm_quant.add_rms_norm_quant`, then `router.moe_route_fused` on its x),
  torch.equal on every output (h_new, x, x8 and sx as bytes, weights, ids, logits) at T = 1, 3, 4 and 7 tokens, widths
  of 3 and 5 groups of 128 with slices that do not divide them, an fp32 delta rounded to bf16 / fp16 or not, a bf16
  delta, bf16 and fp32 outputs, a rank's expert range and table, DeepSeek's 8 groups of 32 experts; impl 'grouped' at
  T = 2, where 'auto' runs the serial tail apart; the errors. Then a one-MoE-layer tiny model over decode steps of 1,
  2 and 3 tokens: logits with the switch on equal off, the one launch taken at 1 and 3 tokens and not at 2.
- Compiled for sm_90 (TTGIR, specialized as the JIT would at the real TP=8 rank's shapes, D = 7168, E = 256): the one
  launch's row sums run on the layout of the add + norm + quant kernel's own launch (its warps, 8, and its tile),
  and its one order-dependent float sum of the routing (the weights' normalization over the top-k) on the lanes of
  the router's launch at its 4 warps; the other reductions of the routing are exact (integer counts, maxima, sums of
  one nonzero term). So the GPU's bits are the two launches' too: tests/kernels/test_route_norm_gpu.py holds them.
- The launches of a step with the switch on: tests/plan/test_kernel_count.py.
"""

from __future__ import annotations

import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`

from tests.interp import run_interpreted  # noqa: E402


def test_route_norm_interpreted():
    run_interpreted(__file__, 300)


def test_route_norm_options_and_variants():
    """Switch route_norm (off) and its token limit (1; an integer >= 0, checked by name), `route_norm_at`, the bench's
    variants."""
    from mtp.bench.rank import KERNEL_VARIANTS
    from mtp.kernels.dispatch import FastPathOptions

    o = FastPathOptions()
    assert not o.route_norm and o.route_norm_tokens == 1 and not o.route_norm_at(1)
    o.set(route_norm=True)
    assert [o.route_norm_at(n) for n in (1, 2)] == [True, False]
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="route_norm_tokens must be an integer"):
            FastPathOptions(route_norm_tokens=bad)
    for name, limit in (("route_norm", 16), ("route_norm_w1", 1)):
        flags, options = KERNEL_VARIANTS[name]
        v = FastPathOptions()
        v.set(**flags)
        assert v.route_norm and v.route_norm_tokens == limit and not options


# ----------------------------------------------------------------------------- compiled for sm_90
@contextmanager
def _ttgir_of_launches():
    """Inside, each Triton launch is not run but compiled for sm_90 up to TTGIR, specialized as the JIT would at its
    arguments (16-byte alignment, integers equal to 1): yields the list of (kernel name, TTGIR, warps) it fills."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    target = GPUTarget("cuda", 90, 32)
    got = []

    class Device:  # what a launch asks of the driver before it compiles
        def get_current_target(self):
            return target

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    def ttgir(self, key, signature, device, constexprs, options, attrs, warmup):
        src = self.ASTSource(self, signature, constexprs, attrs)
        backend = make_backend(target)
        stages = {}
        backend.add_stages(stages, options, src.language)
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        module = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                             context)
        metadata = {}
        for stage in ("ttir", "ttgir"):
            module = stages[stage](module, metadata)
        got.append((self.fn.__name__, str(module), options.num_warps))
        return None  # no kernel: the launch returns without running

    compile_fn, active = JITFunction._do_compile, driver._active
    old_env = os.environ.get("TRITON_INTERPRET")
    JITFunction._do_compile = ttgir
    driver.set_active(Device())
    os.environ["TRITON_INTERPRET"] = "1"  # `_triton.require` takes the CPU tensors (the kernels were compiled ones)
    try:
        yield got
    finally:
        JITFunction._do_compile = compile_fn
        driver.set_active(active)  # none on a machine without a GPU: made again when next asked for
        if old_env is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = old_env


_REDUCE = re.compile(r'"tt\.reduce"\(%[\w]+\) <\{axis = (\d+) : i32\}> \(\{(.*?)\}\) : \((tensor<[^>]*?'
                     r'(?:<[^>]*>[^>]*)*>)\) -> ', re.S)
_BLOCKED = re.compile(r"#ttg\.blocked<\{sizePerThread = \[([\d, ]+)\], threadsPerWarp = \[([\d, ]+)\], "
                      r"warpsPerCTA = \[([\d, ]+)\], order = \[([\d, ]+)\]\}>")


def _float_sums(ttgir: str) -> list[tuple[int, str]]:
    """(axis, operand type with its layouts written out) of every float-add reduction in a TTGIR module."""
    aliases = dict(re.findall(r"^(#[\w]+) = (#ttg\.[^\n]+)$", ttgir, re.M))
    out = []
    for m in _REDUCE.finditer(ttgir):
        if "arith.addf" in m.group(2):
            out.append((int(m.group(1)), re.sub(r"#(?:blocked|linear|mma)\d*\b", lambda a: aliases[a.group(0)],
                                                m.group(3))))
    return out


def _lanes(ty: str, axis: int) -> tuple:
    """What sets a reduction's order along `axis` on a blocked layout: elements per thread, threads per warp and the
    dimension order, and the warps along the axis (warps along the others hold other rows, or copies)."""
    spt, tpw, wpc, order = (tuple(int(v) for v in g.split(",")) for g in _BLOCKED.search(ty).groups())
    return spt, tpw, order, wpc[axis], re.match(r"tensor<([\dx]+)x", ty).group(1)


def test_route_norm_sums_on_the_two_launches_layouts():
    """At D = 7168 (64-group tiles, the norm's 8 warps) and T = 1, 4 (the rows unrolled 1 and 4 times): every row sum of
    the one launch has the add + norm + quant launch's operand layout exactly, and its routing weights'
    normalization the lanes of the router launch's ('auto': grouped, 4 warps). ~6 s on a CPU core."""
    pytest.importorskip("triton")
    from mtp.kernels.norm_quant import add_rms_norm_quant, row_tiles
    from mtp.kernels.router import moe_route_fused, moe_route_norm

    D, E = 7168, 256
    g = torch.Generator().manual_seed(0)
    wg, bias, nw = torch.randn(E, D, generator=g).bfloat16(), torch.randn(E, generator=g), torch.ones(D).bfloat16()
    with _ttgir_of_launches() as got:
        for T in (1, 4):
            h = torch.randn(T, D, generator=g)
            moe_route_norm(h, h, nw, 1e-6, wg, bias, round_dtype=torch.bfloat16)
            moe_route_fused(h.bfloat16(), wg, bias)
        add_rms_norm_quant(h, h, nw, 1e-6, round_dtype=torch.bfloat16)
    names = [n for n, _, _ in got]
    assert names == ["_route_norm_kernel", "_route_grouped_kernel"] * 2 + ["_add_norm_quant_kernel"], names
    (_, norm_ir, norm_warps) = got[-1]
    bg, warps = row_tiles(D)
    assert norm_warps == warps == 8
    row = _float_sums(norm_ir)
    assert [ty.split(",")[0] for _, ty in row] == [f"tensor<{bg}x128xf32", f"tensor<{bg}xf32"], row
    for T, (fused, route) in zip((1, 4), (got[0:2], got[2:4])):
        assert fused[2] == warps and route[2] == 4, (T, fused[2], route[2])
        sums = _float_sums(fused[1])
        rows = [s for s in sums if s[1].startswith(f"tensor<{bg}")]
        assert rows == row * T, (T, rows, row)  # every unrolled row: the norm launch's sums, operand for operand
        weights = [s for s in sums if s[1].startswith(f"tensor<{T}x8xf32")]
        want = [s for s in _float_sums(route[1]) if s[1].startswith(f"tensor<{T}x8xf32")]
        assert len(weights) == len(want) == 1, (sums, want)
        assert _lanes(weights[0][1], weights[0][0]) == _lanes(want[0][1], want[0][0]), (T, weights, want)
        # and nothing else summed in floats but the candidates' weights (one nonzero term per slot: exact)
        assert len(sums) == len(rows) + 2, (T, sums)


# ----------------------------------------------------------------------------- run under TRITON_INTERPRET=1
def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits: fp8 compared as bytes (its NaN codes too)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b)


def _kernel_checks() -> None:
    from mtp.kernels.dispatch import expert_map
    from mtp.kernels.norm_quant import add_rms_norm_quant
    from mtp.kernels.router import moe_route_fused, moe_route_norm

    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    g = torch.Generator().manual_seed(3)
    # T, D, E, n_group, topk_group, topk, splits, round_dtype, delta's dtype, out_dtype, local
    cases = [(1, 640, 64, 4, 2, 6, None, bf16, f32, bf16, None), (3, 384, 16, 4, 2, 4, None, None, bf16, f32, "range"),
             (4, 640, 32, 4, 2, 4, 3, f16, f32, bf16, "table"), (7, 384, 256, 8, 4, 8, None, bf16, f32, bf16, None)]
    for T, D, E, ng, tg, k, splits, rd, ddt, out, local in cases:
        h = torch.randn(T, D, generator=g) * 3
        h[0, :128] = 0  # with delta, a group of small values
        d = (torch.randn(T, D, generator=g) * 2).to(ddt)
        nw = (torch.rand(D, generator=g) + 0.5).to(bf16)
        wg = torch.randn(E, D, generator=g) * 0.05  # fp32: the interpreter's bf16 tl.dot is wrong
        bias = torch.randn(E, generator=g) * 0.05
        if local == "range":
            local = (E // 4, E // 2)
        elif local == "table":
            local = expert_map(sorted(set(range(1, E, 3)) | {0}), E, "cpu").router
        kw = dict(n_group=ng, topk_group=tg, topk=k, splits=splits, local=local, return_logits=True)
        got = moe_route_norm(h, d, nw, 1e-6, wg, bias, out, rd, **kw)
        hn, x, x8, sx = add_rms_norm_quant(h, d, nw, 1e-6, out, round_dtype=rd)
        want = (hn, x, x8, sx, *moe_route_fused(x, wg, bias, **kw))
        for name, a, b in zip(("h", "x", "x8", "sx", "weights", "ids", "logits"), got, want):
            assert _same(a, b), (name, T, D, E, rd, ddt)
        again = moe_route_norm(h, d, nw, 1e-6, wg, bias, out, rd, **kw)  # the counters re-armed themselves
        assert all(_same(a, b) for a, b in zip(again, got))
    # impl 'grouped' at T = 2 (where 'auto' runs the serial tail apart): the grouped router's bits
    h, d = torch.randn(2, 384, generator=g), torch.randn(2, 384, generator=g)
    wg, bias, nw = torch.randn(16, 384, generator=g) * 0.05, torch.zeros(16), torch.ones(384)
    kw = dict(n_group=4, topk_group=2, topk=4)
    got = moe_route_norm(h, d, nw, 1e-6, wg, bias, impl="grouped", **kw)
    want = (*add_rms_norm_quant(h, d, nw, 1e-6), *moe_route_fused(got[1], wg, bias, impl="grouped", **kw))
    assert all(_same(a, b) for a, b in zip(got, want))
    for bad, match in (
            (lambda: moe_route_norm(h, d, nw, 1e-6, wg, bias, **kw), "impl='auto' at T = 2 runs the serial"),
            (lambda: moe_route_norm(h, d, nw, 1e-6, wg, bias, impl="serial", **kw), "only the grouped tail"),
            (lambda: moe_route_norm(h.bfloat16(), d, nw, 1e-6, wg, bias, **kw), "h must be an fp32 [T, D]"),
            (lambda: moe_route_norm(h, d[:1], nw, 1e-6, wg, bias, **kw), "delta of its shape"),
            (lambda: moe_route_norm(h, d, nw[:128], 1e-6, wg, bias, **kw), "norm weight must be [384]"),
            (lambda: moe_route_norm(torch.randn(17, 384), torch.randn(17, 384), nw, 1e-6, wg, bias, impl="grouped",
                                    **kw), "impl='grouped' takes 1..16 tokens")):
        try:
            bad()
        except ValueError as e:
            assert match in str(e), str(e)
        else:
            raise AssertionError(f"moe_route_norm accepted bad input ({match})")


def _model_checks() -> None:
    """One MoE layer of the tiny model (bf16, the fast path, one process: no all-reduce, so the attention's output is
    the delta, unrounded), decode steps of 1, 2 and 3 tokens on one cache: the switch on gives the logits of off."""
    import mtp.backends.fast_path as fp
    from mtp.checkpoint.synthetic import random_model
    from mtp.model.presets import tiny_config

    cfg = tiny_config(layers=1, dense_layers=0, mtp_modules=0)
    model = random_model(cfg, "cpu", torch.bfloat16, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    calls = []
    fused = fp.moe_route_norm
    fp.moe_route_norm = lambda h, *a, **k: calls.append(h.shape[0]) or fused(h, *a, **k)
    out = {}
    with torch.no_grad():
        fp.install_fast_modules(model)
        fp.set_elementwise(model, "triton")
        for on in (False, True):
            fp.set_kernels(model, route_norm=on, route_norm_tokens=3)
            cache = model.new_cache(1, 8)
            out[on] = [model(ids[:, a:b], cache).logits for a, b in ((0, 1), (1, 3), (3, 6))]
    fp.moe_route_norm = fused
    assert calls == [1, 3], calls
    assert all(torch.equal(a, b) for a, b in zip(out[True], out[False]))


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from tests.interp import patch_interpreter_bf16_dot, patch_interpreter_loop_bounds

    patch_interpreter_loop_bounds()
    patch_interpreter_bf16_dot()  # the model's gate is bf16: its routes as on a GPU, on both sides
    _kernel_checks()
    _model_checks()
    print("interpreted checks ok")
