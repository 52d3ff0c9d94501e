"""The shared expert inside the routed experts' kernels: `fast_path.stack_experts` stacks it last where its slice has
the routed experts' shapes (one process with n_shared = 1, a 'split' rank), `moe_experts(shared=True)` runs that
last stack entry S for every token as an implicit last slot of weight 1, and `FastMoE.shared_in_stack` takes that
path (switch `shared_in_experts`) instead of the shared expert's own 3 launches.

Kernel checks run under the Triton interpreter (a subprocess: the interpreter is chosen when a kernel is decorated),
its e4m3 cast made CUDA's (`tests.interp.patch_interpreter_fp8_rounding`):
- `moe_experts(shared=True)` equals, bit for bit, the call without it plus the shared expert alone as `add` (the
  routed slots' bits do not change; the shared slot's K slices are summed apart, then added: routed + shared), on
  the pair and persistent grids, 1..5 tokens, -1 slots; and `moe_experts_ref` with S as an explicit last column
  within the expert kernels' tolerance (bf16 x);
- `FastMoE.forward(x, xq)` with the switch on against off on a tiny fp32 MoE at TP=1 and on 'split' ranks (2 ranks,
  and 4 ranks of 2 blocks: ranks without a block): bit for bit at 2..5 tokens (the separate path's tiled GEMM
  sums the K groups in the expert kernels' order), within 1e-6 at 1 token (its split-K GEMV sums K slices in
  another order); in bf16 the fused path within the expert kernels' tolerance of `moe_experts_ref` (stack entry S
  as an explicit last slot), and within 3e-2 of the separate path, which rounds g | u and silu(g) * u to bf16
  where the expert kernels keep them in fp32 (~1 in 16 of h's e4m3 roundings move a step: 1.4e-2 observed).
- `moe_experts(splits='waves')` (K slices by `moe.wave_splits`) equals those slices given explicitly, and the switch
  `moe_wave_splits` hands it to a split rank's persistent experts.
GPU twin at the real TP=8 split rank's shapes: tests/kernels/test_fused_kernels_gpu.py::test_moe_experts_shared_slot.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`
from tests.interp import interpreted_main, run_interpreted  # noqa: E402

from mtp.backends.fast_path import FastMoE, disable_fast_path, fast_module, shared_fits_stack  # noqa: E402
from mtp.model.presets import tiny_config  # noqa: E402
from mtp.parallel import ParallelPlan  # noqa: E402

PROJ = ("gate_proj", "up_proj", "down_proj")


def _views_of_stack(moe, e: int, mlp) -> bool:
    return all(getattr(getattr(mlp, p), a).data_ptr() == moe.stacked[f"{p}.{a}"][e].data_ptr()
               for p in PROJ for a in ("weight", "weight_scale_inv"))


def test_stack_takes_the_shared_expert_at_tp1():
    """One process, n_shared = 1: the shared expert is stack entry E (its parameters views of it, the state_dict
    unchanged); its gate | up GEMV (switch off) reads a copy, and the reference path is unchanged after disable."""
    from tests.parallel.test_moe_ep import random_moe

    cfg = tiny_config()
    moe = random_moe(cfg)
    x = torch.randn(3, cfg.hidden_size)
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    want = moe(x)
    fast_module(moe)
    fast_module(moe.shared_experts, moe.fast_options)
    E = cfg.n_routed_experts
    assert isinstance(moe, FastMoE) and moe.shared_index == E
    assert moe.stacked["gate_proj.weight"].shape[0] == moe.stacked["down_proj.weight_scale_inv"].shape[0] == E + 1
    assert _views_of_stack(moe, E, moe.shared_experts) and _views_of_stack(moe, 3, moe.expert(3))
    se = moe.shared_experts
    w, s = se.fused_gate_up
    assert w.data_ptr() != se.gate_proj.weight.data_ptr()  # a copy: the parameters stay views of the stack
    assert torch.equal(w, torch.cat([se.gate_proj.weight, se.up_proj.weight]))
    assert torch.equal(s, torch.cat([se.gate_proj.weight_scale_inv, se.up_proj.weight_scale_inv]))
    after = moe.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert moe.shared_in_stack(1) and moe.shared_in_stack(moe.grouped_above) and not moe.shared_in_stack(
        moe.grouped_above + 1)
    moe.fast_options.shared_in_experts = False
    assert not moe.shared_in_stack(1)
    disable_fast_path(moe)
    assert torch.equal(moe(x), want)


def test_stack_keeps_the_shared_expert_apart_where_shapes_differ():
    """n_shared = 2 (twice as wide as an expert) and a 'contiguous' rank (its shared slice half an expert) keep the
    separate shared expert; 'split' ranks stack it, also ranks without a 128-block of the width (zero-wide)."""
    from tests.parallel.test_moe_ep import layout_config, random_moe, rank_moes

    moe = random_moe(dataclasses.replace(tiny_config(), n_shared_experts=2))
    assert not shared_fits_stack(moe)
    fast_module(moe)
    assert moe.shared_index is None and moe.stacked["gate_proj.weight"].shape[0] == moe.gate.n_experts
    cfg = layout_config()
    moe = random_moe(cfg)
    for ep in rank_moes(moe, cfg, ParallelPlan(2, expert_layout="contiguous")):
        fast_module(ep)
        assert ep.shared_index is None, ep.comm.rank
    widths = []
    for world in (2, 4):
        for ep in rank_moes(moe, cfg, ParallelPlan(world, expert_layout="split")):
            fast_module(ep)
            E = cfg.n_routed_experts
            assert ep.shared_index == E and ep.stacked["up_proj.weight"].shape[0] == E + 1, (world, ep.comm.rank)
            assert _views_of_stack(ep, E, ep.shared_experts)
            widths.append(ep.stacked["gate_proj.weight"].shape[1])
    assert widths == [128, 128, 0, 128, 0, 128], widths  # 4 ranks of 2 blocks: ranks 0 and 2 hold none


def test_unfused_shared_kernel_variant():
    """`mtp-bench --kernel-variants unfused_shared` turns the switch off (and names a real switch)."""
    from mtp.bench.rank import KERNEL_VARIANTS
    from mtp.kernels.dispatch import FastPathOptions

    flags, options = KERNEL_VARIANTS["unfused_shared"]
    o = FastPathOptions()
    assert o.shared_in_experts
    o.set(**flags)
    assert not o.shared_in_experts and options == {}


def test_moe_shared_interpreted():
    run_interpreted(__file__, 600)


# ----------------------------------------------------------------------------- run under TRITON_INTERPRET=1
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _kernel_checks() -> None:
    import mtp.kernels.moe as moe_mod
    from mtp.kernels.moe import moe_experts, moe_experts_ref
    from tests.kernels.test_moe_grouped import TOL, _experts

    E, D, I, J = 6, 256, 256, 3  # 6 routed experts + the shared one at S = 6; 2 K groups each way (2 K slices)
    S = E
    ws = _experts(E + 1, D, I, seed=0)
    g = torch.Generator().manual_seed(1)
    kw = dict(out_dtype=torch.float32)
    for layout, tokens in (("pairs", (1, 5)), ("persistent", (1, 4))):  # one token and several (CI time)
        for T in tokens:
            x = torch.randn(T, D, generator=g).bfloat16()
            idx = torch.stack([torch.randperm(E, generator=g)[:J] for _ in range(T)]).int()
            idx[0, 1] = -1  # a slot on another rank
            if T > 2:
                idx[2] = -1  # a token without a routed expert here: it still gets the shared one
            rw = torch.rand(T, J, generator=g)
            alone = moe_experts(x, torch.full((T, 1), S, dtype=torch.int32), torch.ones(T, 1), *ws, layout=layout, **kw)
            want = moe_experts(x, idx, rw, *ws, layout=layout, add=alone, **kw)
            got = moe_experts(x, idx, rw, *ws, layout=layout, shared=True, **kw)
            assert torch.equal(got, want), (layout, T, (got - want).abs().max().item())
            if T > 1:
                add = torch.randn(T, D, generator=g)
                both = moe_experts(x, idx, rw, *ws, layout=layout, shared=True, add=add, **kw)
                assert torch.equal(both, got + add), (layout, T, "add is summed after the shared slot")
            ref = moe_experts_ref(x, torch.cat([idx, torch.full((T, 1), S, dtype=torch.int32)], 1),
                                  torch.cat([rw, torch.ones(T, 1)], 1), *ws, out_dtype=torch.float32)
            assert _rel(got, ref) < TOL, (layout, T, _rel(got, ref))
            if layout == "pairs" and T == 1:  # the default by size: persistent while T * (J + 1) <= 64
                assert torch.equal(moe_experts(x, idx, rw, *ws, shared=True, **kw),
                                   moe_experts(x, idx, rw, *ws, shared=True, layout="persistent", **kw))
    x, idx, rw = torch.randn(2, D), torch.tensor([[0, 1, -1], [2, 3, 4]], dtype=torch.int32), torch.rand(2, J)
    for bad, match in ((dict(shared=True, layout="grouped"), "grouped"), (dict(shared=1), "must be a bool"),
                       (dict(shared=True, idx=idx.clamp(max=S) + 2), "ids must be in [0, 6)"),
                       (dict(idx=torch.tensor([[0, -1, -1], [2, 4, 2]], dtype=torch.int32)),
                        "token 1's expert ids repeat ([2, 4, 2])")):
        try:
            moe_experts(x, bad.pop("idx", idx), rw, *ws, **bad)
        except ValueError as e:
            assert match in str(e), (bad, str(e))
        else:
            raise AssertionError(f"moe_experts must refuse {bad}")
    try:  # 8 tokens x (8 + 1) slots: more pairs than the persistent grid compares
        moe_experts(torch.randn(8, D), torch.full((8, 8), -1, dtype=torch.int32), torch.rand(8, 8), *ws,
                    shared=True, layout="persistent")
    except ValueError as e:
        assert "slots = 9" in str(e), str(e)
    else:
        raise AssertionError("the persistent layout must refuse T * (J + 1) > 64")
    assert moe_mod.default_layout(7, 9) == "persistent" and moe_mod.default_layout(8, 9) == "pairs"
    # splits='waves' (every pair a distinct local expert: `wave_splits` per kernel) = those slices given explicitly,
    # and within the kernels' tolerance of the reference; bad splits are refused by name
    for T in (1, 3):
        x = torch.randn(T, D, generator=g).bfloat16()
        idx = torch.stack([torch.randperm(E, generator=g)[:J] for _ in range(T)]).int()
        rw = torch.rand(T, J, generator=g)
        ks = moe_mod.waves_for(T * (J + 1), E + 1, D, I, (132, 264))  # the interpreter's grid: 132 SMs
        got = moe_experts(x, idx, rw, *ws, layout="persistent", shared=True, splits="waves", **kw)
        assert torch.equal(got, moe_experts(x, idx, rw, *ws, layout="persistent", shared=True, splits=ks, **kw)), T
        ref = moe_experts_ref(x, torch.cat([idx, torch.full((T, 1), S, dtype=torch.int32)], 1),
                              torch.cat([rw, torch.ones(T, 1)], 1), *ws, out_dtype=torch.float32)
        assert _rel(got, ref) < TOL, ("waves", T, _rel(got, ref))
    for bad, layout in (("wave", "persistent"), ((0, 1), "persistent"), ((2,), "persistent"),
                        ((1.0, 2), "persistent"), ((0, 1), "pairs")):  # refused whatever the layout
        try:
            moe_experts(x, idx, rw, *ws, layout=layout, splits=bad)
        except ValueError as e:
            assert "splits must be 'waves'" in str(e), (bad, str(e))
        else:
            raise AssertionError(f"moe_experts must refuse splits={bad!r}")


def _module_checks() -> None:
    """FastMoE.forward(x, xq) with switch `shared_in_experts` on against off (module docstring)."""
    from mtp.kernels.moe import moe_experts_ref
    from mtp.model.fp8 import act_quant
    from tests.kernels.test_moe_grouped import TOL
    from tests.parallel.test_moe_ep import fast_moe, layout_config, random_moe, rank_moes

    def on_off(moe, name: str, tokens=(1, 2, 3, 4, 5), dtype=torch.float32) -> None:
        g = torch.Generator().manual_seed(2)
        calls = []
        separate = moe._shared_q  # the shared expert's own launches (`FastMoE._shared_q`), counted per call

        def counted(*a):
            calls.append(1)
            return separate(*a)

        moe._shared_q = counted
        for T in tokens:
            x = torch.randn(T, moe.gate.weight.shape[1], generator=g).to(dtype)
            out = {}
            for on in (True, False):
                moe.fast_options.shared_in_experts = on
                calls.clear()
                out[on] = moe(x, act_quant(x), rounded=False, reduce=False)
                assert len(calls) == (0 if on else 1), (name, T, on, "which path ran")
            moe.fast_options.shared_in_experts = True
            if dtype == torch.bfloat16:  # the fused path is the reference's formulas in fp32 (kernel tolerance) ...
                w, ids = moe.gate(x)
                slot = torch.full((T, 1), moe.shared_index, dtype=torch.int32)
                st = moe.stacked
                ref = moe_experts_ref(x, torch.cat([ids.int(), slot], 1), torch.cat([w.float(), torch.ones(T, 1)], 1),
                                      *[st[f"{p}.{a}"] for p in PROJ for a in ("weight", "weight_scale_inv")],
                                      out_dtype=torch.float32)
                assert _rel(out[True], ref) < TOL, (name, T, _rel(out[True], ref))
                # ... and the separate path's bf16 g | u and silu * up move ~1 in 16 of h's e4m3 roundings by a step
                # (observed 1.4e-2 of the whole MoE output under the interpreter); without the shared expert: ~0.5
                assert _rel(out[True], out[False]) < 3e-2, (name, T, _rel(out[True], out[False]))
            else:  # fp32: the same formulas in other launches, summed by the interpreter's BLAS (numpy's, by CPU:
                # equal bits past one token on some, 6e-8 apart on an AMD EPYC runner, session 15)
                assert _rel(out[True], out[False]) < 1e-6, (name, T, _rel(out[True], out[False]))
        del moe._shared_q

    def waves_switch(moe, name: str) -> None:
        """Switch `moe_wave_splits`: a split rank's persistent experts (T <= persistent_tokens) get
        splits='waves' with it on, the default slices with it off; the K slices' order only (fp32, 1e-6)."""
        import mtp.backends.fast_path as fp

        seen, kernel = [], fp.moe_experts

        def spy(*a, **k):
            seen.append((k.get("layout"), k.get("splits")))
            return kernel(*a, **k)

        fp.moe_experts = spy
        before = moe.fast_options.moe_wave_splits
        try:
            assert moe.all_local and moe.persistent_tokens >= 1, name
            x = torch.randn(1, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(5))
            out = {}
            for on in (False, True):
                moe.fast_options.moe_wave_splits = on
                seen.clear()
                out[on] = moe(x, act_quant(x), rounded=False, reduce=False)
                assert seen == [("persistent", "waves" if on else None)], (name, on, seen)
            assert _rel(out[True], out[False]) < 1e-6, (name, _rel(out[True], out[False]))
            # the layout by size (set_kernel_options(moe_layout=None)): persistent at 1 token, so 'waves' too
            kept = moe.expert_layout, moe.persistent_tokens
            moe.expert_layout, moe.persistent_tokens = None, 0
            seen.clear()
            assert torch.equal(moe(x, act_quant(x), rounded=False, reduce=False), out[True]), name
            assert seen == [(None, "waves")], (name, seen)
            moe.expert_layout, moe.persistent_tokens = kept
        finally:
            fp.moe_experts = kernel
            moe.fast_options.moe_wave_splits = before

    moe = fast_moe(random_moe(tiny_config()))
    assert moe.shared_index is not None and moe.all_local
    on_off(moe, "tp1", (1, 4))  # 2 and 3 tokens on the split ranks below
    on_off(moe, "tp1 bf16", (1,), torch.bfloat16)
    cfg = layout_config()
    full = random_moe(cfg, seed=4)
    for world in (2, 4):
        for ep in rank_moes(full, cfg, ParallelPlan(world, expert_layout="split")):
            fast_moe(ep)
            assert ep.shared_index is not None
            if world == 2:  # 1..5 tokens over the two ranks
                on_off(ep, f"split r{ep.comm.rank}", ((1, 3), (2, 5))[ep.comm.rank])
                waves_switch(ep, f"split r{ep.comm.rank}")
            elif ep.stacked["gate_proj.weight"].shape[1] == 0:  # no block of the experts' width: nor of the shared
                for T in (2,):
                    x = torch.randn(T, cfg.hidden_size)
                    y = ep(x, act_quant(x), rounded=False, reduce=False)
                    assert y.shape == x.shape and not y.any(), (world, ep.comm.rank, T)
            else:
                on_off(ep, f"split4 r{ep.comm.rank}", (1,))


if __name__ == "__main__":
    interpreted_main([_kernel_checks, _module_checks], fp8_rounding=True)


def test_wave_splits():
    """`moe.wave_splits` at the TP=8 shapes (D = 7168: 56 K groups; 132 SMs): a split rank's tokens (8 routed + the
    shared expert, 2 N-blocks each: 18 items a slice per token) take 7 / 4 / 2 / 2 gate/up slices at 1..4 tokens
    (the measured fastest at 1, 3 and 4 tokens) and 1 down slice; a contiguous rank's one expert (16 N-blocks) 8,
    the default's; one item a slice takes every group as its own slice, many items one slice."""
    from mtp.kernels.moe import default_splits, wave_splits, waves_for

    assert [wave_splits(18 * T, 56, 132) for T in (1, 2, 3, 4)] == [7, 4, 2, 2]
    # what moe_experts(splits='waves') runs there: 257 stack entries (256 routed + the shared one), I = 256 a rank
    assert [waves_for(9 * T, 257, 7168, 256, (132, 264)) for T in (1, 2, 3, 4)] == [(7, 1), (4, 1), (2, 1), (2, 1)]
    assert wave_splits(16, 56, 132) == default_splits(1, 56, 16)[0] == 8
    assert all(wave_splits(9 * T * 56, 2, 264) == 1 for T in (1, 2, 3, 4))  # down: >= 504 items on 264 programs
    assert wave_splits(1, 56, 132) == 56 and wave_splits(1000, 56, 132) == 1
    for ks_items in range(1, 300, 7):  # never more slices than K groups, never fewer than one
        assert 1 <= wave_splits(ks_items, 56, 132) <= 56
    for bad in ((0, 56, 132), (18, 0, 132), (18, 56, 0)):
        try:
            wave_splits(*bad)
        except ValueError as e:
            assert "must be >= 1" in str(e)
        else:
            raise AssertionError(f"wave_splits{bad} must be refused")
