"""Expert-parallel MoE on the Triton path, on the CPU: the fast path's swap of `ExpertParallelMoE` (stacking), and
`moe_experts` with -1 slots plus the module's Triton forward under the Triton interpreter.

The interpreter is chosen when a kernel is decorated (at import), so those checks run in a subprocess started
with TRITON_INTERPRET=1 (this file as a script). Its fp32 -> fp8 casts are not CUDA's (act_quant is not
bit-exact there), so the kernels are held to their own results, not to the fp8 references: the -1 slots
must give bit for bit the full-stack result with those slots' weights zeroed, exactly 0 for a token without a
local expert, and ranks that sum to the one-rank result. tests/kernels/test_kernels_gpu.py compares with the
references on a GPU.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mtp.backends.fast_path import FastMoE, disable_fast_path, fast_module
from mtp.kernels.dispatch import expert_map, local_ids
from mtp.model.fp8 import weight_quant
from mtp.model.layers import Linear
from mtp.model.moe import MoE
from mtp.parallel import Comm, ParallelPlan, RankLayout
from mtp.checkpoint.synthetic import random_model
from mtp.parallel.comm import init_process_group
from mtp.parallel.load import rank_part
from mtp.parallel.modules import ExpertParallelMoE, set_static_moe
from mtp.parallel.synthetic import random_parallel_model
from mtp.model.presets import tiny_config, tiny_parallel_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`
from tests.interp import patch_interpreter_loop_bounds, run_interpreted  # noqa: E402
from tests.parallel.test_parallel import run_ranks  # noqa: E402



class SumLaterComm(Comm):
    """Rank `rank` of `world` without a process group: all_reduce is the identity and the caller sums the
    ranks' outputs (fp32 model: the final cast is a no-op, so that sum is what the all-reduce returns)."""

    def __init__(self, rank: int, world: int):
        self.group, self.rank, self.world = None, rank, world

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t


def random_moe(cfg, seed: int = 0) -> MoE:
    """The single-rank MoE with random FP8 experts (weights ~ N(0, 1/in)) and a random router."""
    g = torch.Generator().manual_seed(seed)
    moe = MoE(cfg, torch.float32)
    for lin in moe.modules():
        if isinstance(lin, Linear):
            w = torch.randn(lin.out_features, lin.in_features, generator=g) * lin.in_features ** -0.5
            if lin.is_fp8:
                w8, s = weight_quant(w)
                lin.weight = torch.nn.Parameter(w8, requires_grad=False)
                lin.weight_scale_inv = torch.nn.Parameter(s, requires_grad=False)
            else:
                lin.weight = torch.nn.Parameter(w, requires_grad=False)
    moe.gate.weight.data = torch.randn(moe.gate.weight.shape, generator=g) * cfg.hidden_size ** -0.5
    moe.gate.e_score_correction_bias.data = torch.randn(cfg.n_routed_experts, generator=g) * 0.05
    return moe


def ep_modules(moe: MoE, cfg, world: int) -> list[ExpertParallelMoE]:
    """Every rank's `ExpertParallelMoE` holding its slice of `moe` (experts [e0, e1), shared-expert channels
    [lo, hi) in whole 128-blocks, as the loader cuts them)."""
    out = []
    for rank in range(world):
        layout = RankLayout(cfg, ParallelPlan(world), rank)
        ep = ExpertParallelMoE(cfg, layout, torch.float32, SumLaterComm(rank, world))
        lo, hi = layout.shared
        b0, b1 = lo // 128, -(-hi // 128)
        sd = {}
        for k, v in moe.state_dict().items():
            part = k.split(".")
            if part[0] == "experts":
                if layout.is_local_expert(int(part[1])):
                    sd[k] = v
            elif part[0] == "shared_experts":
                rows = slice(b0, b1) if k.endswith("weight_scale_inv") else slice(lo, hi)
                sd[k] = v[:, rows] if part[1] == "down_proj" else v[rows]
            else:
                sd[k] = v
        ep.load_state_dict(sd)
        out.append(ep)
    return out


def test_enable_fast_path_stacks_local_experts():
    cfg = tiny_config()
    moe = random_moe(cfg)
    ep = ep_modules(moe, cfg, world=2)[1]
    x = torch.randn(5, cfg.hidden_size)
    before = {k: v.clone() for k, v in ep.state_dict().items()}
    y_before = ep(x)
    assert not isinstance(ep, FastMoE)
    fast_module(ep)
    assert isinstance(ep, FastMoE) and isinstance(ep, ExpertParallelMoE)
    assert ep.expert_layout is None  # one rank's range: the persistent layout for few active experts (by size)
    E_loc = ep.e1 - ep.e0
    I, D = cfg.moe_intermediate_size, cfg.hidden_size
    s = ep.stacked
    assert s["gate_proj.weight"].shape == (E_loc, I, D) and s["down_proj.weight"].shape == (E_loc, D, I)
    assert s["down_proj.weight_scale_inv"].shape == (E_loc, D // 128, I // 128)
    for i, e in enumerate(range(ep.e0, ep.e1)):  # parameters are views of the stack (memory not doubled)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            for attr in ("weight", "weight_scale_inv"):
                p = getattr(getattr(ep.experts[str(e)], proj), attr)
                assert p.data_ptr() == s[f"{proj}.{attr}"][i].data_ptr(), (e, proj, attr)
    after = ep.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    fast_module(ep)  # idempotent: the same stack
    assert ep.stacked is s
    disable_fast_path(ep)
    assert type(ep) is ExpertParallelMoE
    assert torch.equal(ep(x), y_before)
    dense = ep_modules(random_moe(tiny_config(fp8_weights=False)), tiny_config(fp8_weights=False), world=2)[0]
    with pytest.raises(ValueError, match="FP8"):
        fast_module(dense)


@pytest.mark.slow
def test_minus_one_slots_and_ep_forward_interpreted():
    run_interpreted(__file__)


# ----------------------------------------------------------------------------- expert layouts (mtp.placement)
LAYOUTS = ("contiguous", "interleaved", "permuted", "split")


def layout_config():
    """tiny_parallel_config(2) with 2 blocks per routed expert, so 'split' gives each of 2 ranks one whole block."""
    return dataclasses.replace(tiny_parallel_config(2), moe_intermediate_size=256)


def rank_moes(moe: MoE, cfg, plan: ParallelPlan, layer: int = 1) -> list[ExpertParallelMoE]:
    """Every rank's `ExpertParallelMoE` of `plan`, its parameters cut from `moe` by the loader's own `rank_part`."""
    full = {f"model.layers.{layer}.mlp.{k}": v for k, v in moe.state_dict().items()}
    out = []
    for rank in range(plan.world):
        layout = RankLayout(cfg, plan, rank)
        ep = ExpertParallelMoE(cfg, layout, moe.gate.weight.dtype, SumLaterComm(rank, plan.world))
        sd = {}
        for k in ep.state_dict():
            name = f"model.layers.{layer}.mlp.{k}"
            wshape = full[name.replace(".weight_scale_inv", ".weight")].shape if k.endswith("_scale_inv") else None
            sd[k] = rank_part(layout, name, full[name], wshape)
        ep.load_state_dict(sd)
        out.append(ep)
    return out


def fast_moe(moe: MoE) -> MoE:
    """`moe` and its submodules swapped to their fast classes (`fast_module`), all on the MoE's kernel switches, as
    `install_fast_modules` does for a model; returns it."""
    fast_module(moe)
    for mod in moe.modules():
        if mod is not moe:
            fast_module(mod, moe.fast_options)
    return moe


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("static", [False, True])
def test_expert_layouts_sum_to_the_one_rank_moe(layout, world, static):
    """float64: every layout's ranks, cut by the loader, sum to the single-rank MoE (eager loop and static path)."""
    cfg = layout_config()
    moe = random_model(cfg, device="cpu", dtype=torch.float64, seed=3).model.layers[1].mlp
    x = torch.randn(2, 3, cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    want = moe(x)
    eps = rank_moes(moe, cfg, ParallelPlan(world, expert_layout=layout, expert_seed=5))
    for ep in eps:
        ep.static = static
    got = sum(ep(x) for ep in eps)
    assert (got - want).abs().max().item() <= 1e-12 * want.abs().max().item(), (layout, world, static)
    held = [len(ep.experts) for ep in eps]
    assert held == ([cfg.n_routed_experts] * world if layout == "split" else [cfg.n_routed_experts // world] * world)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [2, 4])
def test_fast_path_stacks_every_layout(layout, world):
    """`fast_module` on every layout's ranks: the stack holds `local_ids()` in order (parameters are views of it),
    `id_map` sends each held expert's global id to its stack index and the others to -1, by its table (torch) and by
    what the router kernel takes (a range for 'contiguous', the table for the scattered layouts, none for 'split'),
    and the expert kernels' default grid follows (the persistent one for a rank's share of the experts, the pair
    grid where every expert is held). A 'split' rank stacks its shared slice last (the routed experts' shapes)."""
    cfg = layout_config()
    E = cfg.n_routed_experts
    moe = random_model(cfg, device="cpu", dtype=torch.float32, seed=3).model.layers[1].mlp
    seen = []
    plan = ParallelPlan(world, expert_layout=layout, expert_seed=5)
    for ep in rank_moes(moe, cfg, plan):
        fast_module(ep)
        ids = list(ep.local_ids())
        s = ep.stacked
        i0, i1 = RankLayout(cfg, plan, ep.comm.rank).expert_inter  # 'split' at 4 ranks: 128 or none (2 blocks)
        I_loc = i1 - i0
        n = len(ids) + (layout == "split")  # a 'split' rank's shared slice has its experts' shapes: stacked last
        assert ep.shared_index == (len(ids) if layout == "split" else None), (layout, ep.shared_index)
        assert s["gate_proj.weight"].shape[:2] == (n, I_loc)
        assert s["down_proj.weight"].shape[:2] == (n, cfg.hidden_size)
        for i, e in enumerate(ids):
            assert ep.experts[str(e)].up_proj.weight.data_ptr() == s["up_proj.weight"][i].data_ptr(), (layout, e)
        want = torch.tensor([ids.index(e) if e in ids else -1 for e in range(E)])
        for local in (ep.id_map.table, ep.id_map.router):
            got = local_ids(torch.arange(E), local)
            assert torch.equal(got.long(), want), (layout, ep.comm.rank, got.tolist())
        kind = {"contiguous": tuple, "split": type(None)}.get(layout, torch.Tensor)
        assert isinstance(ep.id_map.router, kind), (layout, type(ep.id_map.router))
        assert (ep.id_map.table is None) == (layout == "split")
        assert ep.expert_layout == ("pairs" if layout == "split" else None)
        seen += ids
    assert sorted(seen) == sorted(list(range(E)) * (world if layout == "split" else 1))


def test_expert_map_kinds_and_errors():
    """`expert_map`: no table for all experts; else an int32 table, and the range when the experts are one run of
    ids (what the router kernel then maps by); `local_ids` applies each (the table as one gather); ids must be
    distinct, ascending and in range."""
    every = expert_map(range(8), 8, "cpu")
    assert every.table is None and every.span is None and every.router is None
    run = expert_map([2, 3, 4], 8, "cpu")
    assert run.span == (2, 5) and run.router == (2, 5) and run.table.tolist() == [-1, -1, 0, 1, 2, -1, -1, -1]
    scattered = expert_map([1, 4, 6], 8, "cpu")
    table = scattered.table
    assert scattered.span is None and scattered.router is table and table.dtype == torch.int32
    assert table.tolist() == [-1, 0, -1, -1, 1, -1, 2, -1]
    ids = torch.tensor([[6, 1, 0], [4, 7, 2]])
    assert local_ids(ids, table).tolist() == [[2, 0, -1], [1, -1, -1]] and local_ids(ids, table).dtype == torch.int32
    assert local_ids(ids, (2, 5)).tolist() == [[-1, -1, -1], [2, -1, 0]] == local_ids(ids, run.table).tolist()
    assert local_ids(ids, None) is ids
    for bad in ([], [3, 1], [1, 1, 2], [-1, 2], [2, 8]):
        with pytest.raises(ValueError, match=r"distinct, ascending, in \[0, 8\)"):
            expert_map(bad, 8, "cpu")


@pytest.mark.slow
def test_every_layout_fast_moe_equals_the_reference_interpreted():
    run_interpreted(__file__, 600, "layouts")


def _layout_worker(rank: int, init: str, out_dir: str) -> None:
    init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2,
                       timeout=datetime.timedelta(seconds=90))
    torch.set_num_threads(1)
    try:
        cfg, res = layout_config(), {}
        for layout in LAYOUTS:
            m = random_parallel_model(cfg, Comm(), ParallelPlan(2, expert_layout=layout), device="cpu",
                                      dtype=torch.float64, seed=3)
            for static in (False, True):
                set_static_moe(m, static)
                res[layout, static] = _logits(m)
        torch.save(res, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _logits(model) -> dict:
    """Logits of a prefill past the indexer's top-k and of a cached 3-token step."""
    ids = torch.randint(0, model.cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = model.new_cache(2, 40)
        return {"prefill": model(ids, cache).logits, "decode": model(ids[:, :3], cache).logits}


@pytest.mark.slow
def test_expert_layouts_over_gloo_equal_the_reference(tmp_path):
    """2 gloo ranks of the whole float64 model per layout (eager and static MoE paths): logits equal the
    single-process model's to 1e-12 relative (only the order of float64 additions differs), on both ranks."""
    run_ranks(_layout_worker, (str(tmp_path / "rendezvous"), str(tmp_path)), timeout_s=180)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    want = _logits(random_model(layout_config(), device="cpu", dtype=torch.float64, seed=3))
    for (layout, static), out in got[0].items():
        for key, ref in want.items():
            assert torch.equal(out[key], got[1][layout, static][key]), (layout, static, key, "ranks disagree")
            err = (out[key] - ref).abs().max().item()
            assert err <= 1e-12 * ref.abs().max().item(), (layout, static, key, err)


# ----------------------------------------------------------------------------- run under TRITON_INTERPRET=1
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _interpreted_checks() -> None:
    from mtp.kernels.moe import moe_experts

    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_interpreter_loop_bounds()
    torch.manual_seed(0)
    # the kernel: 8 experts, "rank 0" holds 0..2, "rank 1" 3..7
    E, D, I, J = 8, 256, 128, 4
    ws = []
    for N, K in ((I, D), (I, D), (D, I)):
        w8, s = zip(*[weight_quant(torch.randn(N, K) * 0.05) for _ in range(E)])
        ws += [torch.stack(w8), torch.stack(s)]
    for T in (1, 17):  # (the module checks below cover the sum over ranks; the interpreter is slow)
        x = torch.randn(T, D).bfloat16()
        idx = torch.stack([torch.randperm(E)[:J] for _ in range(T)]).int()
        idx[T // 2] = torch.randperm(E - 3)[:J].int() + 3  # a token without any expert of rank 0
        rw = torch.rand(T, J)
        assert T == 1 or ((idx < 3).sum(1) >= 2).any()  # tokens with several -1 slots on both ranks
        for e0, e1 in ((0, 3), (3, 8)):
            loc = torch.where((idx >= e0) & (idx < e1), idx - e0, -1).int()
            y = moe_experts(x, loc, rw, *[w[e0:e1].contiguous() for w in ws], out_dtype=torch.float32)
            masked = moe_experts(x, idx, rw * (loc >= 0), *ws, out_dtype=torch.float32)
            assert torch.equal(y, masked), f"T={T} experts [{e0}, {e1}): not the full result restricted to them"
            assert torch.equal((y != 0).any(1), (loc >= 0).any(1)), f"T={T}: only tokens without local experts get 0"
    # the persistent layout (default for T * J <= 64) against the pairs layout, widths 1..4, -1 slots,
    # several K-slice / grid choices (summation order differs: fp32-close, not bit-equal)
    for w in (1, 2, 3, 4):
        xw = torch.randn(w, D).bfloat16()
        loc = torch.where(idx[:w] < 5, idx[:w], -1).int()  # "rank" of experts 0..4
        ref = moe_experts(xw, loc, rw[:w], *ws, out_dtype=torch.float32, layout="pairs")
        for kw in (dict(), dict(splits=(2, 1), programs=(3, 2)), dict(splits=(1, 1), programs=(1, 1))):
            got = moe_experts(xw, loc, rw[:w], *ws, out_dtype=torch.float32, layout="persistent", **kw)
            assert _rel(got, ref) < 1e-5, (w, kw, _rel(got, ref))
            assert torch.equal((got != 0).any(1), (loc >= 0).any(1)), f"w={w} {kw}: a token without experts gets 0"
    try:
        moe_experts(x, idx.clamp(max=E), rw, *[w[:3].contiguous() for w in ws])
    except ValueError as e:
        assert "expert ids" in str(e)
    else:
        raise AssertionError("ids outside [0, E) must be refused on the CPU")
    # the module: 2 and 4 ranks of ExpertParallelMoE on the Triton backend sum to MoE's Triton path
    cfg = tiny_config()
    moe = random_moe(cfg)
    fast_module(moe)
    for world, shape in ((2, (1, 1)), (2, (2, 3)), (4, (2, 3))):
        eps = ep_modules(moe, cfg, world)
        for ep in eps:
            fast_module(ep)
        x = torch.randn(*shape, cfg.hidden_size)
        want = moe(x)
        got = sum(ep(x) for ep in eps)
        assert got.shape == want.shape and _rel(got, want) < 1e-5, (world, shape, _rel(got, want))
    print("interpreted checks ok")


def _layout_checks() -> None:
    """Every layout's ranks (2, and 4 for 'split') on the fast path against the same rank modules on the reference
    path, fp32, the interpreter's e4m3 cast made CUDA's (so only fp32 summation order differs): the router kernel
    at 5 tokens (its grouped tail) on the rank's default expert grid, then on the pair grid (~4x cheaper under the
    interpreter; the grids read the same local ids) the router kernel at 2 tokens (its serial tail), switch
    `router` off (the unfused router, the torch mapping) and the reference router above `kernel_route_tokens` (the
    table's gather), those three on each layout's rank 0 (the interpreter is slow). Both tails' mapping bit for bit:
    tests/kernels/test_fused_kernels.py. A 'split' rank may hold
    no 128-block of the experts' width (4 ranks of 2 blocks): it adds its shared-expert share alone, 0 where it holds
    no block of that either."""
    from tests.interp import patch_interpreter_fp8_rounding

    patch_interpreter_loop_bounds()
    patch_interpreter_fp8_rounding()
    cfg = layout_config()
    moe = random_model(cfg, device="cpu", dtype=torch.float32, seed=3).model.layers[1].mlp
    g = torch.Generator().manual_seed(0)
    xs = {T: torch.randn(T, cfg.hidden_size, generator=g) for T in (2, 5)}
    default_route = FastMoE.kernel_route_tokens
    # (tokens, expert grid (None: the rank's default), router switch, kernel_route_tokens)
    variants = {"router kernel": (5, None, True, default_route), "serial tail": (2, "pairs", True, default_route),
                "router off": (5, "pairs", False, default_route), "reference router": (5, "pairs", True, 0)}
    for layout, world in [(lay, 2) for lay in LAYOUTS] + [("split", 4)]:
        for ep in rank_moes(moe, cfg, ParallelPlan(world, expert_layout=layout, expert_seed=5)):
            want = {T: ep(x) for T, x in xs.items()}
            fast_module(ep)
            grid, r = ep.expert_layout, ep.comm.rank
            # a 'split' rank: the pair grid, but the persistent layout up to SPLIT_PERSISTENT_TOKENS tokens
            from mtp.backends.fast_path import SPLIT_PERSISTENT_TOKENS

            split = layout == "split"
            assert ep.persistent_tokens == (SPLIT_PERSISTENT_TOKENS if split else 0), (layout, ep.persistent_tokens)
            assert ep.kernel_layout(1) == ("persistent" if split else grid)
            assert ep.kernel_layout(SPLIT_PERSISTENT_TOKENS + 1) == grid
            for what, (T, kernels, router, route_tokens) in variants.items():
                if (world == 4 or r > 0) and what != "router kernel":  # the interpreter is slow: rank 0's view
                    continue
                ep.expert_layout, ep.fast_options.router, ep.kernel_route_tokens = kernels or grid, router, route_tokens
                got = ep(xs[T])
                if not want[T].any():  # no block of the routed or the shared expert on this rank
                    assert layout == "split" and not got.any(), (layout, world, r, what)
                    continue
                assert _rel(got, want[T]) < 1e-5, (layout, world, r, T, what, _rel(got, want[T]))
            ep.fast_options.router, ep.kernel_route_tokens, ep.expert_layout = True, default_route, grid
            if ep.stacked["gate_proj.weight"].shape[1] == 0:
                assert torch.equal(ep(xs[5]), ep.shared(xs[5])), (layout, world, r, "the shared share alone")
    print("interpreted checks ok")


if __name__ == "__main__":
    {"layouts": _layout_checks}.get(sys.argv[1] if len(sys.argv) > 1 else "", _interpreted_checks)()
