"""Forced routes (`mtp.bench.forced_route`) and the busiest rank's drawn routes (`mtp.bench.experts.busiest_routes`)
on one expert-parallel rank of the tiny config (16 experts, K = 4, 2 ranks: 8 local), on the CPU: the experts the
module computes are the drawn ones (counts above K included), with the draw's tokens; the reference output is
the table's weighted sum; with no table set the output is the same bits as before; the fast path's expert kernels
(pairs, persistent, grouped) under the Triton interpreter give the reference's output under the same table.
The GPU checks (real widths, graphs, `mtp-bench --route busiest`): tests/bench/test_rank_gpu.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mtp.bench import experts
from mtp.bench.forced_route import ForcedGate, clear_routes, force_routes
from mtp.model.moe import Gate
from mtp.model.presets import tiny_parallel_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`
from tests.interp import interpreted_main, run_interpreted  # noqa: E402
from tests.parallel.test_moe_ep import ep_modules, random_moe  # noqa: E402

CFG = tiny_parallel_config(2, layers=4, dense_layers=1)


def rank0(seed: int = 0):
    """Rank 0 of 2 (experts 0..7) of a random tiny MoE."""
    return ep_modules(random_moe(CFG, seed), CFG, 2)[0]


def expert_calls(moe) -> tuple[dict[int, int], list]:
    """{expert id: tokens it was run on} over the next forwards (the reference CPU path runs each chosen local
    expert once, on its tokens), and the hooks to remove."""
    seen: dict[int, int] = {}
    hooks = [moe.experts[str(e)].register_forward_hook(
        lambda m, i, o, e=e: seen.__setitem__(e, seen.get(e, 0) + i[0].shape[0])) for e in moe.local_ids()]
    return seen, hooks


def table_tokens(ids_TK: torch.Tensor, local) -> dict[int, int]:
    """{local expert id: tokens whose row names it} of a table."""
    return {e: int((ids_TK == e).any(1).sum()) for e in local if (ids_TK == e).any()}


def test_busiest_routes_realise_the_drawn_counts_uncapped():
    """Per layer the module computes exactly the drawn count of distinct local experts (above K = 4 at several
    tokens: no cap), each on the tokens the table sends it; the counts are `draw_busiest`'s, for every layout."""
    moe = rank0()
    local = moe.local_ids()
    K = CFG.num_experts_per_tok
    above_k = 0
    for layout in ("contiguous", "interleaved", "permuted"):
        for T in (1, 3, 8):
            draws = experts.busiest_routes(CFG, layout, 2, T, 4, seed=T, local=local)
            assert [d.count for d in draws] == experts.draw_busiest(CFG, layout, 2, T, 4, seed=T)
            x = torch.randn(T, CFG.hidden_size, generator=torch.Generator().manual_seed(T))
            for d in draws:
                force_routes(moe, d.w_TK, d.ids_TK)
                seen, hooks = expert_calls(moe)
                try:
                    moe(x)
                finally:
                    for h in hooks:
                        h.remove()
                assert len(seen) == d.count, (layout, T, seen, d.count)
                assert seen == table_tokens(d.ids_TK, local), (layout, T)
                above_k += d.count > K
    assert above_k > 0  # some draws exceed K: the old force capped exactly these
    clear_routes(moe)


def test_split_routes_are_the_draw():
    draws = experts.busiest_routes(CFG, "split", 2, 5, 3, seed=1, local=range(16))
    ids = experts.uniform_routes(16, CFG.n_group, CFG.topk_group, 4, 5, 3, seed=1)
    assert all(torch.equal(d.ids_TK, ids[s]) for s, d in enumerate(draws))
    assert [d.count for d in draws] == [len(set(i.flatten().tolist())) for i in ids]
    with pytest.raises(ValueError, match="local must be all distinct expert ids"):
        experts.busiest_routes(CFG, "split", 2, 5, 3, seed=1, local=range(8))
    with pytest.raises(ValueError, match="local must be 8 distinct"):
        experts.busiest_routes(CFG, "contiguous", 2, 5, 3, seed=1, local=[0, 0, 1, 2, 3, 4, 5, 6])


def test_reference_output_is_the_tables_weighted_sum():
    """Under a table, the output is sum over each token's local slots of weight x expert(x) (+ shared), on the
    CPU loop and the static path (every expert, 0 weight where not chosen) alike; a table equal to the gate's
    own routing gives the unforced output bit for bit."""
    moe = rank0(1)
    T = 6
    x = torch.randn(T, CFG.hidden_size, generator=torch.Generator().manual_seed(2))
    d = experts.busiest_routes(CFG, "contiguous", 2, T, 1, seed=3, local=moe.local_ids())[0]
    force_routes(moe, d.w_TK, d.ids_TK)
    got = moe(x)
    want = moe.shared(x).clone()
    for t in range(T):
        for w, e in zip(d.w_TK[t].tolist(), d.ids_TK[t].tolist()):
            if e in moe.local_ids():
                want[t] += w * moe.expert(e)(x[t:t + 1])[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    moe.static = True
    torch.testing.assert_close(moe(x), got, rtol=1e-5, atol=1e-6)
    moe.static = False
    clear_routes(moe)
    plain = moe(x)
    force_routes(moe, *moe.gate(x))
    assert torch.equal(moe(x), plain)
    clear_routes(moe)


def test_override_off_is_bit_identical_and_leaves_no_state():
    moe = rank0(2)
    x = torch.randn(5, CFG.hidden_size, generator=torch.Generator().manual_seed(4))
    keys, before = set(moe.state_dict()), moe(x)
    weight = moe.gate.weight.clone()
    d = experts.busiest_routes(CFG, "interleaved", 2, 5, 1, seed=0, local=moe.local_ids())[0]
    assert force_routes(moe, d.w_TK, d.ids_TK) and type(moe.gate) is ForcedGate
    assert set(moe.state_dict()) == keys  # the table is not a checkpoint tensor
    assert not torch.equal(moe(x), before)
    assert clear_routes(moe) and type(moe.gate) is Gate and not clear_routes(moe)
    assert torch.equal(moe(x), before) and torch.equal(moe.gate.weight, weight)
    assert not hasattr(moe.gate, "ids_RK") and set(moe.state_dict()) == keys


def test_table_rows_in_place_tiled_and_checked():
    """A table that fits is written into the same buffers (a captured graph replays it); fewer tokens take the
    first rows, more (a prefill) repeat the rows; bad tables are refused, naming what was expected."""
    moe = rank0()
    gate = moe.gate
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
    w = torch.rand(3, 4)
    assert force_routes(moe, w, ids)
    ptr = gate.ids_RK.data_ptr()
    assert not force_routes(moe, w[:1], ids[:1] + 1)  # fits: rewritten in place, tiled over the 3 rows
    assert gate.ids_RK.data_ptr() == ptr and torch.equal(gate.ids_RK, (ids[:1] + 1).expand(3, 4))
    assert not force_routes(moe, w, ids)
    x = torch.zeros(7, CFG.hidden_size)
    assert torch.equal(gate(x[:2])[1], ids[:2]) and torch.equal(gate(x)[1], ids[torch.arange(7) % 3])
    assert torch.equal(gate(x)[0], w[torch.arange(7) % 3])
    assert force_routes(moe, torch.rand(5, 4), torch.arange(20).view(5, 4) % 16)  # longer: new buffers
    for bad_w, bad_ids, match in ((w, ids[:, :3], r"\[T >= 1, K = 4\]"), (w[:2], ids, "both be"),
                                  (w, ids.clamp(max=5), "distinct expert ids"), (w, ids + 8, r"in \[0, 16\)")):
        with pytest.raises(ValueError, match=match):
            force_routes(moe, bad_w, bad_ids)
    clear_routes(moe)


def test_fast_moe_under_forced_routes_interpreted():
    run_interpreted(__file__, 600, "fast")


# ----------------------------------------------------------------------------- run under TRITON_INTERPRET=1
def _fast_checks() -> None:
    """FastMoE (rank 0 of 2) under a drawn table against the reference module under the same table, on the
    persistent (T = 5), pairs (T = 5, expert_layout='pairs') and grouped (T = 20) expert kernels, with the
    interpreter's fp8 cast in the reference (tests/kernels/test_moe_grouped.py says why); with the table cleared,
    the router kernel's output is the same bits as before it was set."""
    from mtp.backends.fast_path import FastMoE, disable_fast_path, fast_module
    from mtp.model import fp8
    from tests.kernels.test_moe_grouped import TOL, _rel, interp_act_quant

    moe = rank0(5)
    quant = fp8.act_quant
    fp8.act_quant = interp_act_quant
    try:
        for T, layout in ((5, None), (5, "pairs"), (20, None)):
            x = torch.randn(T, CFG.hidden_size, generator=torch.Generator().manual_seed(T))
            d = experts.busiest_routes(CFG, "contiguous", 2, T, 1, seed=T, local=moe.local_ids())[0]
            assert d.count > CFG.num_experts_per_tok or T == 5
            disable_fast_path(moe)
            force_routes(moe, d.w_TK, d.ids_TK)
            want = moe(x)
            clear_routes(moe)
            fast_module(moe)
            assert isinstance(moe, FastMoE)
            moe.expert_layout = layout
            plain = moe(x)
            force_routes(moe, d.w_TK, d.ids_TK)
            got = moe(x)
            assert _rel(got, want) < TOL, (T, layout, _rel(got, want))
            clear_routes(moe)
            assert torch.equal(moe(x), plain), (T, layout)
    finally:
        fp8.act_quant = quant


if __name__ == "__main__":
    interpreted_main({"fast": _fast_checks}, seed=None)
