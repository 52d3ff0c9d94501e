"""The indexer's radix top-k (`mtp.kernels.topk`, and in one launch `mtp.kernels.topk_one_launch`) on the CPU: its
reference against the stable-sort rule of `Indexer.select`, the one-launch grid's host decision, and the kernels
under the Triton interpreter (a subprocess started with TRITON_INTERPRET=1, this file as a script: the interpreter
is chosen when the kernels are decorated; there the one-launch kernel runs its phases as three launches).
tests/kernels/test_kernels_gpu.py and test_topk_one_launch_gpu.py hold the kernels to the reference on a GPU at full
sizes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from mtp.kernels.topk import topk_select_ref

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`
from tests.interp import patch_interpreter_loop_bounds, run_interpreted  # noqa: E402


def tie_scores(B, T, S, g):
    """Scores with many exact ties (5 values, -0.0 beside +0.0), a -inf and some negatives."""
    sc = torch.randint(0, 5, (B, T, S), generator=g).float() * 0.5 - 1.0
    sc[..., ::3] = torch.where(sc[..., ::3] == 0, -0.0, sc[..., ::3])
    sc[..., 5] = float("-inf")
    return sc


def brute(sc_S: torch.Tensor, limit: int, k: int) -> list[int]:
    """Kept positions by the rule written out: sort candidates by (score desc, position asc), keep k."""
    cand = [s for s in range(min(limit, sc_S.numel())) if sc_S[s] != float("-inf")]
    return sorted(sorted(cand, key=lambda s: (-float(sc_S[s]), s))[:k])


def test_topk_select_ref_is_the_stable_sort_rule():
    g = torch.Generator().manual_seed(0)
    B, T, S, k = 2, 3, 200, 37
    lens = torch.tensor([150, 20])
    sc = tie_scores(B, T, S, g)
    out = topk_select_ref(sc, lens, k)
    assert out.shape == (B, T, k) and out.dtype == torch.int32
    for b in range(B):
        for t in range(T):
            want = brute(sc[b, t], int(lens[b]) + t + 1, k)
            assert out[b, t].tolist() == want + [-1] * (k - len(want)), (b, t)


def test_radix_topk_interpreted():
    run_interpreted(__file__)


def test_split_v2_compiles_for_hopper():
    """The top-k kernels compile for sm_90 with V2 on and off (the interpreter runs neither through the compiler),
    PDL on; V2's split kernel reads the candidate count with a plain load: one acq_rel atomic (the arrival) where V1
    has two (the arrival, then the count's read, a fence that holds back the loads after it)."""
    pytest.importorskip("triton")
    from mtp.kernels.topk import _topk_hist_kernel, _topk_split_kernel, _topk_write_kernel
    from mtp.kernels.topk_one_launch import _topk_one_launch_kernel

    from .test_fused_kernels import _compile_for_hopper

    i32 = {n: "*i32" for n in ("lens_ptr", "h16_ptr", "h8_ptr", "ncand_ptr", "arrive_ptr", "ck_ptr", "ci_ptr",
                               "gt_ptr", "off_ptr", "thr_ptr", "out_ptr")}
    split = dict(BLK=1024, NB=1024, CPAD=64, KB=1024, SMALL=128, PDL=1)
    atoms = {}
    for v2 in (False, True):
        ptx = _compile_for_hopper(_topk_split_kernel, i32, dict(split, V2=v2), num_warps=4).asm["ptx"]
        atoms[v2] = len([ln for ln in ptx.splitlines() if "atom.global.gpu.acq_rel" in ln])
        _compile_for_hopper(_topk_hist_kernel, i32, dict(BLK=1024, PDL=1, V2=v2), num_warps=4)
        _compile_for_hopper(_topk_write_kernel, i32, dict(BLK=1024, REARM=True, PDL=1, V2=v2), num_warps=4)
        _compile_for_hopper(_topk_one_launch_kernel, i32, dict(TILE=1024, HIST=True, PHASE=0, REARM=True, NB=1024,
                                                               CPAD=64, KB=1024, SMALL=128, V2=v2), num_warps=4)
    assert atoms == {False: 2, True: 1}, atoms


def test_one_launch_grid_fits_the_sms_or_declines():
    """R x C never exceeds the SMs (co-residency: the barriers cannot deadlock); a chunk is a power of two of at
    most MAX_TILE positions, MIN_TILE at least by default; shapes that cannot fit get None (three launches)."""
    from mtp.kernels.topk_one_launch import MAX_TILE, MIN_TILE, one_launch_grid

    assert one_launch_grid(1, 32768, 132) == (1024, 32)
    assert one_launch_grid(4, 32768, 132) == (1024, 32)  # 128 programs
    assert one_launch_grid(8, 32768, 132) == (2048, 16)
    assert one_launch_grid(8, 65536, 132) == (4096, 16)
    assert one_launch_grid(1, 777, 132) == (1024, 1)
    assert one_launch_grid(1, 5, 132) == (64, 1)
    assert one_launch_grid(1, 32768, 132, chunks=128) == (256, 128)
    assert one_launch_grid(2, 32768, 132, chunks=128) is None  # 256 programs on 132 SMs
    assert one_launch_grid(133, 4096, 132) is None and one_launch_grid(0, 4096, 132) is None
    assert one_launch_grid(8, 16 * MAX_TILE + 1, 132) is None  # a chunk past MAX_TILE
    for R in range(1, 140, 3):
        for S in (1, 63, 1000, 2049, 32768 + 5, 131072, 10 ** 6):
            for chunks in (None, 1, 7, 64, 200):
                g = one_launch_grid(R, S, 132, chunks)
                if g is None:
                    continue
                tile, C = g
                assert R * C <= 132 and C == -(-S // tile) and tile & (tile - 1) == 0 and 64 <= tile <= MAX_TILE
                assert chunks is not None or tile >= MIN_TILE or tile >= S


def test_set_kernel_options_switches_and_refuses_unknown():
    from mtp.backends.fast_path import FastMLA, _swap, disable_fast_path, fast_module, set_kernel_options
    from mtp.model.presets import tiny_config
    from mtp.model.attention import MLA
    from mtp.model.moe import MoE

    cfg = tiny_config()
    model = torch.nn.ModuleList([MLA(cfg, torch.float32), MoE(cfg, torch.float32)])
    set_kernel_options(model, indexer_topk="torch", moe_layout=None)  # reference modules hold no switch
    assert not hasattr(model[0], "topk_impl") and not hasattr(model[1], "expert_layout")
    _swap(model[0], FastMLA)  # (the tiny MLA is too small for fast_module's kernels; the switch is the same)
    fast_module(model[1])
    assert model[0].topk_impl == "radix" and model[1].expert_layout == "pairs"  # a whole MoE keeps pairs
    set_kernel_options(model, indexer_topk="torch", moe_layout=None)
    assert model[0].topk_impl == "torch" and model[1].expert_layout is None
    set_kernel_options(model, indexer_topk="radix")  # the layout is kept
    assert model[0].topk_impl == "radix" and model[1].expert_layout is None
    assert model[0].scores_tune == {}  # the scores kernel's `SCORES_DEFAULT`
    set_kernel_options(model, indexer_scores=dict(programs=264, num_stages=2))
    set_kernel_options(model, indexer_topk="torch")  # the settings are kept
    assert model[0].scores_tune == dict(programs=264, num_stages=2) and model[0].topk_impl == "torch"
    with pytest.raises(ValueError, match="indexer_scores"):
        set_kernel_options(model, indexer_scores=dict(stages=2))
    with pytest.raises(ValueError, match="indexer_topk"):
        set_kernel_options(model, indexer_topk="bitonic")
    with pytest.raises(ValueError, match="moe_layout"):
        set_kernel_options(model, moe_layout="grouped")
    disable_fast_path(model)
    assert type(model[0]) is MLA and type(model[1]) is MoE


def _one_launch_checks(g: torch.Generator) -> None:
    """`radix_topk_one_launch`, its phases as three launches of one kernel here, against the reference and the
    three-launch kernels: odd S, 1..5 rows, ties, -inf, short rows, k > S, > 128 candidates of the last stage (the
    radix threshold), chunkings; with the kept workspace it is zero after every call; the histograms filled by the
    scores kernel (no histogram phase); a grid past the SMs falls back to the three launches."""
    from mtp.kernels import topk_one_launch as tol
    from mtp.kernels.indexer import indexer_topk
    from mtp.kernels.topk import kept_workspace, radix_topk
    from mtp.model.fp8 import act_quant

    narrow = 1.0 + torch.randint(0, 3000, (1, 2, 3001), generator=g).float() * 1e-7  # one prefix: radix threshold
    few = torch.randn(1, 1, 2500, generator=g).clamp(max=0.9)
    few[..., 7:90] = 1.0 + torch.randint(0, 4, (1, 1, 83), generator=g).float() * 1e-7  # <= 128, ties at the edge
    cases = [  # (scores, lens, k, chunks, rearm)
        (tie_scores(1, 1, 3001, g), [3000], 256, None, False),
        (tie_scores(1, 2, 2999, g), [2997], 100, 3, True),
        (narrow, [2999], 512, None, True),
        (few, [2499], 50, 5, False),
        (torch.randn(1, 3, 2001, generator=g), [1500], 300, 8, True),
        (torch.randn(2, 2, 1111, generator=g), [1109, 40], 64, None, True),  # a short row: fewer than k
        (tie_scores(5, 1, 700, g), [699, 0, 350, 698, 12], 48, 3, True),
        (torch.randn(1, 4, 300, generator=g), [0], 512, None, False),  # k > S
        (torch.full((1, 1, 500), float("-inf")), [499], 64, 2, True),
    ]
    for sc, lens, k, chunks, rearm in cases:
        L = torch.tensor(lens)
        where = f"S={sc.shape[-1]} rows={sc.shape[0] * sc.shape[1]} k={k} chunks={chunks} rearm={rearm}"
        assert tol.one_launch_grid(sc.shape[0] * sc.shape[1], sc.shape[-1], 132, chunks) is not None, where
        got, want = tol.radix_topk_one_launch(sc, L, k, chunks=chunks, rearm=rearm), topk_select_ref(sc, L, k)
        assert torch.equal(got, want), f"{where}: {(got != want).sum()} entries differ"
        assert torch.equal(got, radix_topk(sc, L, k, chunks=chunks)), where
        if rearm:
            assert not kept_workspace(sc.shape[0] * sc.shape[1], "cpu").any(), f"workspace not re-armed: {where}"
    # the histograms from the scores kernel's epilogue (indexer radix_fused), kept and fresh workspaces
    q8, qs = act_quant(torch.randn(2, 3, 16, 128, generator=g))
    k8, ks = act_quant(torch.randn(2, 1500, 128, generator=g))
    L = torch.tensor([1000, 1497], dtype=torch.int32)
    w = torch.randn(2, 3, 16, generator=g)
    for impl in ("radix", "radix_fused"):
        for rearm in (False, True):
            idx, sc = indexer_topk(q8, qs[..., 0], w, k8, ks[..., 0], L, 200, impl=impl, rearm=rearm, one_launch=True)
            assert torch.equal(idx, topk_select_ref(sc, L, 200)), f"indexer_topk {impl} rearm={rearm} one launch"
            assert not rearm or not kept_workspace(6, "cpu").any(), f"{impl}: workspace not re-armed"
    # the launch counter (`mtp.plan.launches`) books the phased launches as the GPU's one launch
    from mtp.plan.launches import counting

    holder = torch.nn.Module()  # what `counting` hooks: a model's layers, final norm and head (none here)
    holder.model, holder.lm_head = torch.nn.Module(), torch.nn.Identity()
    holder.model.layers, holder.model.norm = torch.nn.ModuleList(), torch.nn.Identity()
    sc, L = tie_scores(1, 2, 1500, g), torch.tensor([1498])
    for one, names in ((True, {"_topk_one_launch_kernel": 1}),
                       (False, {"_topk_hist_kernel": 1, "_topk_split_kernel": 1, "_topk_write_kernel": 1})):
        with counting(holder) as n:
            (tol.radix_topk_one_launch if one else radix_topk)(sc, L, 40, rearm=True)
        assert n.names("glue") == names, (one, n.names("glue"))
    try:  # the one launch's barriers would never open here: refused, not a hang
        tol.radix_topk_one_launch(sc, L, 40, split_phases=False)
        raise AssertionError("split_phases=False was not refused under the interpreter")
    except ValueError as e:
        assert "split_phases=False" in str(e), e
    # a grid past the SMs (5 rows x 63 chunks > 132) never launches the one-launch kernel
    kernel = tol._topk_one_launch_kernel

    class Refuse:
        def __getitem__(self, grid):
            raise AssertionError(f"the one-launch kernel was launched on grid {grid}")

    sc, L = tie_scores(1, 5, 4000, g), torch.tensor([3995])
    tol._topk_one_launch_kernel = Refuse()
    try:
        assert tol.one_launch_grid(5, 4000, 132, 64) is None
        assert torch.equal(tol.radix_topk_one_launch(sc, L, 90, chunks=64, rearm=True), topk_select_ref(sc, L, 90))
    finally:
        tol._topk_one_launch_kernel = kernel


def _split_v2_checks(g: torch.Generator) -> None:
    """Switch topk_split_v2: the kernels' V2 and V1 give the reference's index sets bit for bit: odd S, 1..4 rows,
    chunk counts, ties at the boundary (pairwise <= 128 candidates; radix above, its position passes and V2's walk over
    the scores, the threshold early and late in the row), fewer candidates than k, every score equal; three launches,
    one launch, and the histograms from the scores kernel's epilogue."""
    from mtp.kernels.indexer import indexer_topk
    from mtp.kernels.topk import kept_workspace, radix_topk
    from mtp.kernels.topk_one_launch import radix_topk_one_launch
    from mtp.model.fp8 import act_quant

    few = torch.randn(1, 1, 4000, generator=g).clamp(max=0.9)
    few[..., :300] = 1.0 + torch.randint(0, 4, (1, 1, 300), generator=g).float() * 1e-7  # 300 share P: byte passes
    late = -torch.rand(1, 1, 4000, generator=g)
    late[..., 2900:] = 1.0  # 1100 tied candidates: V2's walk, the threshold in the row's last block
    equal = torch.full((1, 3, 2001), 0.5)
    equal[..., 7] = float("-inf")
    cases = [  # (scores, lens, k, chunks)
        (torch.randn(1, 4, 3001, generator=g), [2997], 256, None),  # <= 128 candidates: V2's registers
        (tie_scores(2, 2, 3000, g), [2999, 100], 256, 5),  # hundreds tied at the boundary: the walk
        (few, [3999], 60, 5),  # ties among 300: position passes (their blocks fewer than the walk's)
        (few[..., :2500].clone(), [2499], 50, 3),  # the same 300 in a shorter row: the walk
        (late, [3999], 1050, None),
        (late, [3999], 1050, 1),
        (torch.zeros(1, 1, 3001), [3000], 2500, None),  # every score equal: the walk stops in the third block
        (torch.zeros(1, 1, 3001), [3000], 700, 3),
        (equal, [1999], 1500, 2),  # the rows' last candidates: one row short of k
        (1.0 + torch.randint(0, 3000, (1, 2, 4000), generator=g).float() * 1e-7, [3998], 512, 4),
        (torch.randn(2, 2, 1111, generator=g), [1109, 40], 64, None),  # a short row: fewer than k
        (torch.randn(1, 4, 300, generator=g), [0], 512, None),  # k > S
        (torch.full((1, 1, 500), float("-inf")), [499], 64, 2),
    ]
    for sc, lens, k, chunks in cases:
        L = torch.tensor(lens)
        where = f"S={sc.shape[-1]} rows={sc.shape[0] * sc.shape[1]} k={k} chunks={chunks}"
        want = topk_select_ref(sc, L, k)
        for v2 in (False, True):
            got = radix_topk(sc, L, k, chunks=chunks, split_v2=v2)
            assert torch.equal(got, want), f"{where} v2={v2}: {(got != want).sum()} entries differ"
            got = radix_topk_one_launch(sc, L, k, chunks=chunks, rearm=True, split_v2=v2)
            assert torch.equal(got, want), f"{where} v2={v2} one launch: {(got != want).sum()} entries differ"
            assert not kept_workspace(sc.shape[0] * sc.shape[1], "cpu").any(), f"workspace not re-armed: {where}"
    q8, qs = act_quant(torch.randn(1, 2, 16, 128, generator=g))
    k8, ks = act_quant(torch.randn(1, 3000, 128, generator=g))
    L = torch.tensor([2998], dtype=torch.int32)
    w = torch.randn(1, 2, 16, generator=g)
    for v2 in (False, True):
        idx, sc = indexer_topk(q8, qs[..., 0], w, k8, ks[..., 0], L, 300, impl="radix_fused", rearm=True, split_v2=v2)
        assert torch.equal(idx, topk_select_ref(sc, L, 300)), f"indexer_topk radix_fused v2={v2}"


def _interpreted_checks() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_interpreter_loop_bounds()
    from mtp.kernels.topk import radix_topk

    g = torch.Generator().manual_seed(1)
    few = torch.randn(1, 1, 4000, generator=g)
    few[..., :100] = 1.0 + torch.randint(0, 4, (1, 1, 100), generator=g).float() * 1e-7  # one prefix bin, ties
    few[..., 100:] = few[..., 100:].clamp(max=0.9)
    cases = [  # (scores, lens, k, chunks): ties across chunks, the candidate list over several blocks, k > S,
        (few, [3999], 60, 5),  # <= 128 candidates with ties at the boundary (the pairwise-rank path)
        (tie_scores(2, 2, 3000, g), [2999, 100], 256, 5),
        (1.0 + torch.randint(0, 3000, (1, 2, 4000), generator=g).float() * 1e-7, [3998], 512, 4),
        (torch.randn(1, 3, 2001, generator=g), [1500], 300, None),
        (torch.randn(1, 4, 300, generator=g), [0], 512, None),
        (torch.full((1, 1, 500), float("-inf")), [499], 64, 2),
    ]
    for sc, lens, k, chunks in cases:
        L = torch.tensor(lens)
        got, want = radix_topk(sc, L, k, chunks=chunks), topk_select_ref(sc, L, k)
        assert torch.equal(got, want), f"S={sc.shape[-1]} k={k} chunks={chunks}: {(got != want).sum()} entries differ"
    # the histogram pass in the indexer scores kernel's epilogue instead of its own launch
    from mtp.model.fp8 import act_quant
    from mtp.kernels.indexer import indexer_topk

    q8, qs = act_quant(torch.randn(2, 3, 16, 128, generator=g))
    k8, ks = act_quant(torch.randn(2, 300, 128, generator=g))
    L = torch.tensor([100, 297], dtype=torch.int32)
    w = torch.randn(2, 3, 16, generator=g)
    idx, sc = indexer_topk(q8, qs[..., 0], w, k8, ks[..., 0], L, 64, impl="radix_fused")
    assert torch.equal(idx, topk_select_ref(sc, L, 64)), "radix_fused"
    _one_launch_checks(g)
    _split_v2_checks(g)
    print("interpreted checks ok")


if __name__ == "__main__":
    _interpreted_checks()
