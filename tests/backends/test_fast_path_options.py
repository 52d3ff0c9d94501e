"""Backend state belongs to the model it changes: each model carries its own kernel switches (`FastPathOptions`,
`model.fast_options`) and its own elementwise ops, so two models in one process run differently, and its version
has one writer (`bump_version`). On the CPU: the linear dispatch with the kernels replaced by recorders (as
tests/kernels/test_fused_kernels.py does), the elementwise ops through a counting set."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mtp.backends.fast_path import (FastLinear, FastPathOptions, disable_fast_path, install_fast_modules,
                                    set_kernels)
from mtp.checkpoint.files import load_model
from mtp.checkpoint.tiny import default_checkpoint
from mtp.model.deepseek import DeepseekV32
from mtp.model.layers import REFERENCE_OPS, ElementwiseOps, use_elementwise
from mtp.model.presets import tiny_config


def _fast_model(options: FastPathOptions) -> DeepseekV32:
    model = DeepseekV32(tiny_config(), n_mtp=0)
    install_fast_modules(model, options=options)
    return model


def _kernel_of(model: DeepseekV32, monkeypatch) -> list[str]:
    """Which kernel the model's FP8 linears run for one row: the GEMV or the GEMM (recorders, no Triton)."""
    import mtp.kernels.fp8_gemm as gemm
    import mtp.kernels.gemv_splitk as gemv

    took: list[str] = []
    monkeypatch.setattr(gemv, "fp8_gemv", lambda x, w8, sw, **kw: took.append("gemv"))
    monkeypatch.setattr(gemm, "fp8_linear", lambda x, w8, sw, **kw: took.append("gemm"))
    lins = [m for m in model.modules() if isinstance(m, FastLinear)]
    assert lins, "the tiny model has FP8 linears the fast path swaps"
    for lin in lins:
        lin.matmul(torch.zeros(1, lin.in_features))
    return sorted(set(took))


def test_two_models_run_their_own_kernel_switches(monkeypatch):
    a = _fast_model(FastPathOptions())  # the split-K GEMV for one row (gemv_rows = 1)
    b = _fast_model(FastPathOptions(gemv=False))
    fast_a = [m for m in a.modules() if hasattr(m, "fast_options")]
    assert all(m.fast_options is a.fast_options for m in fast_a), "a model's fast modules share its switches"
    assert _kernel_of(a, monkeypatch) == ["gemv"] and _kernel_of(b, monkeypatch) == ["gemm"]
    va, vb = a.version, b.version
    old = set_kernels(a, gemv=False)
    assert old.gemv is True and a.version == va + 1 and b.version == vb
    assert _kernel_of(a, monkeypatch) == ["gemm"]
    set_kernels(b, **vars(old))  # b takes a's old switches; a keeps its own
    assert _kernel_of(b, monkeypatch) == ["gemv"] and _kernel_of(a, monkeypatch) == ["gemm"]
    disable_fast_path(a)
    assert a.fast_options is None and b.fast_options.gemv is True
    with pytest.raises(ValueError, match="set_kernels: the model has no fast path"):
        set_kernels(a, gemv=True)


class CountingOps(ElementwiseOps):
    """The reference functions, each call counted."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        for name in self.NAMES:
            setattr(self, name, self._counted(getattr(self, name)))

    def _counted(self, fn):
        def call(*args, **kw):
            self.calls += 1
            return fn(*args, **kw)

        return call


def test_two_models_use_their_own_elementwise_ops():
    a = load_model(default_checkpoint(), dtype=torch.float32)
    b = load_model(default_checkpoint(), dtype=torch.float32)
    ops = CountingOps()
    use_elementwise(a, ops)
    ids = torch.tensor([[1, 5, 9, 13]])
    with torch.no_grad():
        want = b(ids).logits
        assert ops.calls == 0, "another model's ops must not be called"
        got = a(ids).logits
    assert ops.calls > 0 and torch.equal(got, want)  # the same functions, counted
    use_elementwise(a, REFERENCE_OPS)
    assert all(m.ops is REFERENCE_OPS for m in a.modules() if hasattr(type(m), "ops"))


def test_version_has_one_writer():
    model = DeepseekV32(tiny_config(), n_mtp=0)
    v = model.version
    model.bump_version()
    model.set_runtime(model.runtime)
    assert model.version == v + 2
    with pytest.raises(AttributeError):
        model.version = 0


def test_pdl_takes_the_launches_of_calls_up_to_pdl_tokens():
    """Switch pdl with `pdl_tokens` (64 by default since session 15, with the trigger after the wait past one token;
    1 before): `pdl_at(n)` says whether a call of n tokens launches with PDL; bad values are refused by name, also
    through `set`."""
    o = FastPathOptions()
    assert o.pdl and o.pdl_tokens == 64
    assert o.pdl_at(4) and o.pdl_at(64) and not o.pdl_at(65)
    o.set(pdl_tokens=1)
    assert o.pdl_at(1) and not o.pdl_at(2) and not o.pdl_at(4)
    o.set(pdl=False)
    assert not o.pdl_at(1)
    for bad in (-1, True, 1.5):
        try:
            FastPathOptions(pdl_tokens=bad)
        except ValueError as e:
            assert "pdl_tokens" in str(e)
        else:
            raise AssertionError(f"pdl_tokens={bad!r} must be refused")
    try:
        FastPathOptions().set(pdl_tokens=-2)
    except ValueError as e:
        assert "pdl_tokens" in str(e)
    else:
        raise AssertionError("set(pdl_tokens=-2) must be refused")


def test_pdl_early_tokens_picks_where_kernels_trigger():
    """Option pdl_early_tokens (1 by default since session 15: one-token calls trigger their successor at their start,
    wider ones after their wait): `pdl_at(n)` is 0 without PDL, `_triton.PDL_EARLY` up to pdl_early_tokens tokens,
    PDL_AFTER_WAIT above; `_triton.pdl_mode` gives a kernel that constexpr (0 without a PDL launch; a bool asks for
    PDL_EARLY); bad values are refused by name; the bench's variants set it (pdl_all, pdl_w1: the start trigger of
    sessions 12-14)."""
    from mtp.bench.rank import KERNEL_VARIANTS
    from mtp.kernels._triton import PDL_AFTER_WAIT, PDL_EARLY, pdl_mode

    o = FastPathOptions()
    assert o.pdl_early_tokens == 1
    assert [o.pdl_at(n) for n in (1, 2, 64, 65)] == [PDL_EARLY, PDL_AFTER_WAIT, PDL_AFTER_WAIT, 0]
    o.set(pdl_early_tokens=0)
    assert o.pdl_at(1) == PDL_AFTER_WAIT
    o.set(pdl=False)
    assert o.pdl_at(1) == 0
    launch = {"launch_pdl": True}
    assert [pdl_mode(p, launch) for p in (True, 1, PDL_AFTER_WAIT)] == [PDL_EARLY, PDL_EARLY, PDL_AFTER_WAIT]
    assert pdl_mode(PDL_AFTER_WAIT, {}) == 0 and pdl_mode(True, {}) == 0
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="pdl_early_tokens must be an integer"):
            FastPathOptions(pdl_early_tokens=bad)
    for name, want in (("pdl_all_aw", [PDL_EARLY, PDL_AFTER_WAIT]), ("pdl_all_aw1", [PDL_AFTER_WAIT] * 2),
                       ("pdl_aw", [PDL_AFTER_WAIT, 0]), ("pdl_all", [PDL_EARLY] * 2), ("pdl_w1", [PDL_EARLY, 0])):
        flags, options = KERNEL_VARIANTS[name]
        v = FastPathOptions()
        v.set(**flags)
        assert not options and [v.pdl_at(1), v.pdl_at(4)] == want, name


def test_defaults_for_world():
    """`FastPathOptions.for_world`: a tensor-parallel rank takes the defaults (PDL at every decode width), one
    process PDL for one-token calls only (measured slower past one token at full width, session 15); flags on top;
    `fast_path.model_world` reads a model's group size (a simulated TP=4 rank: 4; a model of one process: 1), which
    `install_fast_modules` picks the defaults by. One process also keeps the few-row GEMV's default plan
    (gemm_deep_rows 0: the deep plan measured faster at a TP=8 rank's shapes, slower at TP=1's, session 24)."""
    from mtp.backends.fast_path import model_world
    from mtp.checkpoint.synthetic import random_model
    from mtp.model.presets import tiny_parallel_config
    from mtp.parallel import ParallelPlan
    from mtp.parallel.simulate import simulated_rank
    from mtp.parallel.synthetic import random_parallel_model

    assert FastPathOptions.for_world(8) == FastPathOptions() and FastPathOptions().pdl_tokens == 64
    assert FastPathOptions.for_world(1).pdl_tokens == 1
    assert FastPathOptions.for_world(1, pdl_tokens=4, gemv=False) == FastPathOptions(
        pdl_tokens=4, gemv=False, gemm_deep_rows=0, moe_down_pf_experts=0, moe_gate_up_aw=False)
    with pytest.raises(ValueError, match="world must be >= 1"):
        FastPathOptions.for_world(0)
    assert model_world(random_model(tiny_config(), "cpu", torch.float32, seed=0)) == 1
    with simulated_rank(4, 1) as comm:
        m = random_parallel_model(tiny_parallel_config(4, layers=1), comm, ParallelPlan(4), device="cpu",
                                  dtype=torch.float32, seed=0)
        assert model_world(m) == 4


def test_pdl_prefetch_tokens_is_an_int_handed_to_the_prefetching_kernels(monkeypatch):
    """Option pdl_prefetch_tokens (64 by default: the PDL that was measured, prefetches wherever PDL runs) is an integer
    >= 0, refused otherwise by name (`set` and the bench's `--kernels` take it as an integer); `linear` hands
    `prefetch_at(rows)` to the few-row GEMM (x or x quantized) and `route` to the router kernel as `prefetch`
    (recorders, no Triton); the bench's variants pdl_nopf / pdl_all_nopf turn it off with PDL on, at the default
    widths and at every width, and pdl_all_pf1 keeps it for one-token calls only."""
    import mtp.kernels.fp8_gemm as gemm
    import mtp.kernels.router as router
    from mtp.bench.cli import parse_switches
    from mtp.bench.rank import KERNEL_VARIANTS
    from mtp.kernels.dispatch import linear, route
    from mtp.model.moe import Gate

    assert FastPathOptions().pdl_prefetch_tokens == 64 and FastPathOptions().prefetch_at(64)
    for bad in (-1, True, 1.5, "no", None):
        with pytest.raises(ValueError, match="pdl_prefetch_tokens must be an integer"):
            FastPathOptions(pdl_prefetch_tokens=bad)
    o = FastPathOptions()
    o.set(pdl_prefetch_tokens=0)
    assert o.pdl_prefetch_tokens == 0 and not o.prefetch_at(1) and o.pdl_at(1)
    assert parse_switches(["pdl_prefetch_tokens=1"]) == {"pdl_prefetch_tokens": 1}
    took = []
    monkeypatch.setattr(gemm, "fp8_linear", lambda x, w8, sw, **kw: took.append(("linear", kw["pdl"], kw["prefetch"])))
    monkeypatch.setattr(gemm, "fp8_gemm", lambda x8, sx, w8, sw, **kw: took.append(("gemm", kw["pdl"],
                                                                                    kw["prefetch"])) or x8[:, :128])
    monkeypatch.setattr(router, "moe_route_fused", lambda x, w, b, **kw: took.append(("router", kw["pdl"],
                                                                                      kw["prefetch"])))
    gate = Gate(tiny_config(), torch.float32)
    cases = [(64, 1, True), (0, 1, False), (1, 1, True), (1, 2, False)]  # (pdl_prefetch_tokens, rows, prefetch)
    for n, rows, _ in cases:
        opts = FastPathOptions(gemv_rows=0, pdl_tokens=64, pdl_early_tokens=64, pdl_prefetch_tokens=n)
        x = torch.zeros(rows, 256)
        linear(x, torch.zeros(128, 256), torch.ones(1, 2), opts)
        linear(None, torch.zeros(128, 256), torch.ones(1, 2), opts, xq=(x, torch.ones(rows, 2)))
        route(torch.zeros(rows, gate.weight.shape[1]), gate, opts)
    assert took == [(k, True, pf) for _, _, pf in cases for k in ("linear", "gemm", "router")], took
    for name, every_width, pf_tokens in (("pdl_nopf", False, 0), ("pdl_all_nopf", True, 0), ("pdl_all_pf1", True, 1)):
        flags, options = KERNEL_VARIANTS[name]
        v = FastPathOptions()
        v.set(**flags)
        assert not options and v.pdl and v.pdl_prefetch_tokens == pf_tokens and v.pdl_at(4) == every_width, name


def test_fused_histogram_rows():
    """`FastPathOptions.topk_impl_at`: 'radix' becomes 'radix_fused' (the histogram in the scores kernel) for calls of
    at most fused_hist_rows score rows (default 1), other impls and wider calls unchanged; 0 turns it off; the field
    is an integer >= 0, set like the other counts."""
    o = FastPathOptions()
    assert o.fused_hist_rows == 1
    assert o.topk_impl_at("radix", 1) == "radix_fused"
    assert o.topk_impl_at("radix", 2) == "radix"
    assert o.topk_impl_at("torch", 1) == "torch" and o.topk_impl_at("radix_fused", 4) == "radix_fused"
    assert FastPathOptions(fused_hist_rows=0).topk_impl_at("radix", 1) == "radix"
    assert FastPathOptions(fused_hist_rows=4).topk_impl_at("radix", 4) == "radix_fused"
    for bad in (-1, True, 1.0, "1"):
        with pytest.raises(ValueError, match="fused_hist_rows"):
            FastPathOptions(fused_hist_rows=bad)
    old = o.set(fused_hist_rows=3)
    assert o.fused_hist_rows == 3 and old.fused_hist_rows == 1


def test_gemv_one_slice(monkeypatch):
    """Option gemv_one_slice (16 by default since session 17): `dispatch.linear` hands it to the split-K GEMV, whose
    plan takes K in one slice where K / 128 is a power of two in (8, gemv_one_slice]; 0 keeps the split plan; the
    field is an integer >= 0, refused otherwise by name (constructor and `set`)."""
    import mtp.kernels.gemv_splitk as gemv
    from mtp.kernels.dispatch import linear
    from mtp.kernels.gemv_splitk import gemv_plan

    assert FastPathOptions().gemv_one_slice == 16
    seen = []
    monkeypatch.setattr(gemv, "fp8_gemv", lambda x, w8, sw, **kw: seen.append((kw["one_slice"], kw["num_warps"])))
    for n, warps in ((16, 0), (0, 4)):
        linear(torch.zeros(1, 2048), torch.zeros(128, 2048), torch.ones(1, 16),
               FastPathOptions(gemv_one_slice=n, gemv_warps=warps))
    assert seen == [(16, None), (0, 4)]  # gemv_warps 0: the plan's warps
    for bad in (2, 16, True):
        with pytest.raises(ValueError, match="gemv_warps"):
            FastPathOptions(gemv_warps=bad)
    cpu = torch.device("cpu")
    assert gemv_plan(7168, 16, cpu, one_slice=16) == dict(bn=8, gps=16, num_warps=4)
    assert gemv_plan(7168, 16, cpu, one_slice=8)["gps"] == 8  # above the limit: split
    assert gemv_plan(7168, 16, cpu, mma=True, one_slice=16)["gps"] == 8  # the mma kernel keeps its plan
    for bad in (-1, True, 1.5, "16"):
        with pytest.raises(ValueError, match="gemv_one_slice"):
            FastPathOptions(gemv_one_slice=bad)
        with pytest.raises(ValueError, match="gemv_one_slice"):
            FastPathOptions().set(gemv_one_slice=bad)
    o = FastPathOptions()
    old = o.set(gemv_one_slice=0)
    assert o.gemv_one_slice == 0 and old.gemv_one_slice == 16


def test_gemm_deep_rows(monkeypatch):
    """Option gemm_deep_rows (4 since session 24, 0 in one process): `dispatch.linear` hands the few-row GEMV of
    2..N rows 8 K groups a slice and 4 stages where K / 128 is a multiple of 8, q_b's shape its own plan (option
    gemm_deep_q_b), nothing otherwise (`deep_tune`); an integer >= 0, refused otherwise by name."""
    import mtp.kernels.fp8_gemm as fg
    import mtp.kernels.gemv_splitk as gemv
    from mtp.kernels.dispatch import linear

    assert FastPathOptions().gemm_deep_rows == 4 and FastPathOptions.for_world(1).gemm_deep_rows == 0
    seen = []
    monkeypatch.setattr(fg, "fp8_linear", lambda x, w8, sw, **kw: seen.append(
        {k: v for k, v in kw.items() if k in ("splits", "num_stages")}))
    monkeypatch.setattr(gemv, "fp8_gemv", lambda x, w8, sw, **kw: seen.append("split-K GEMV"))
    o = FastPathOptions(gemm_deep_rows=4, gemv_rows=1)
    for M, K in ((4, 7168), (2, 2048), (1, 7168), (5, 7168), (4, 1536), (4, 1024)):
        linear(torch.zeros(M, K), torch.zeros(128, K), torch.ones(1, K // 128), o)
    # 1 row: the split-K GEMV (gemv_rows); 5 rows: past the option; K = 1536: q_b's 12 groups (gemm_deep_q_b);
    # K = 1024: one slice of 8
    assert seen == [dict(splits=7, num_stages=4), dict(splits=2, num_stages=4), "split-K GEMV", {},
                    dict(splits=4, num_stages=4), dict(splits=1, num_stages=4)]
    assert FastPathOptions.for_world(1).deep_tune(4, 7168, 2240) == {}
    # q_b's plan: 12 groups into at most 4096 rows (not a long context's q_b | wq_b), 2..gemm_deep_rows rows, switchable
    assert o.deep_tune(3, 1536, 3072) == dict(splits=4, num_stages=4) and o.deep_tune(3, 1536, 11264) == {}
    assert replace(o, gemm_deep_q_b=False).deep_tune(3, 1536, 3072) == {} and o.deep_tune(1, 1536, 3072) == {}
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="gemm_deep_rows"):
            FastPathOptions(gemm_deep_rows=bad)


def test_norm_warps():
    """Option norm_warps (0 by default: `norm_quant.row_tiles`' choice, 32 warps on a row of 7168 since session 18):
    0 or one of `norm_quant.ROW_WARPS`, refused otherwise by name (constructor, `set`, the bench's `--kernels`);
    variant norm_8_warps is the default before (that `FastBlock` hands it to the kernel: tests/kernels/
    test_norm_warps.py)."""
    from mtp.bench.cli import parse_switches
    from mtp.bench.rank import KERNEL_VARIANTS

    assert FastPathOptions().norm_warps == 0
    for n in (0, 4, 8, 16, 32):
        assert FastPathOptions(norm_warps=n).norm_warps == n
    for bad in (-1, 1, 2, 3, 12, 64, True, 8.0, "8", None):
        with pytest.raises(ValueError, match="norm_warps must be 0"):
            FastPathOptions(norm_warps=bad)
        with pytest.raises(ValueError, match="norm_warps must be 0"):
            FastPathOptions().set(norm_warps=bad)
    o = FastPathOptions()
    old = o.set(norm_warps=16)
    assert o.norm_warps == 16 and old.norm_warps == 0
    assert parse_switches(["norm_warps=8"]) == {"norm_warps": 8}
    with pytest.raises(ValueError, match="norm_warps must be 0"):
        parse_switches(["norm_warps=3"])
    assert KERNEL_VARIANTS["norm_8_warps"] == (dict(norm_warps=8), dict())
