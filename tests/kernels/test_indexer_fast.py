"""The indexer scores kernel's launch settings and the top-k's kept, re-armed workspace, under the Triton
interpreter (a subprocess started with TRITON_INTERPRET=1, this file as a script): every setting of
`indexer_scores` (block_s, programs: the looping kernel) gives today's scores and histograms bit for bit, and the
kept workspace (`topk.kept_workspace`, `rearm`) gives the fresh workspace's index sets over many calls, rows and
layers, is zero after each, and is dropped when a call stops between its launches; the scores and the top-k in one
launch (`indexer_one_launch`) give both bit for bit. tests/kernels/test_kernels_gpu.py and test_topk_one_launch_gpu.py
hold the same on a GPU at S = 32768."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`
from tests.interp import patch_interpreter_loop_bounds, run_interpreted  # noqa: E402


def test_indexer_settings_and_kept_workspace_interpreted():
    run_interpreted(__file__)


def test_indexer_grid_fits_the_sms_or_declines():
    """The scores + top-k launch: B x C never past the SMs, whole 64-key score tiles, at most MAX_TILE keys and
    MAX_T queries a program; else None (the fallback)."""
    from mtp.kernels.indexer_one_launch import MAX_T, MAX_TILE, indexer_grid

    assert indexer_grid(1, 1, 32768, 132) == (256, 128)
    assert indexer_grid(1, 8, 32768, 132) == (256, 128)
    assert indexer_grid(2, 4, 32768, 132) == (512, 64)
    assert indexer_grid(8, 1, 65536, 132) == (4096, 16)
    assert indexer_grid(8, 1, 65537, 132) is None and indexer_grid(1, MAX_T + 1, 4096, 132) is None
    assert indexer_grid(2, 1, 6400, 132, chunks=100) is None and indexer_grid(133, 1, 4096, 132) is None
    for B in range(1, 134, 4):
        for T in (1, 3, 8):
            for S in (1, 100, 2049, 32768 + 5, 131072):
                for chunks in (None, 1, 50, 200):
                    got = indexer_grid(B, T, S, 132, chunks)
                    if got is not None:
                        tile, C = got
                        assert B * C <= 132 and C == -(-S // tile) and tile & (tile - 1) == 0 and 64 <= tile <= MAX_TILE


def inputs(g: torch.Generator, B: int, T: int, S: int, H: int, D: int, lens=None):
    """FP8 queries and keys with positive scales, head weights of both signs, lens (default S - T)."""
    from mtp.model.fp8 import FP8_DTYPE

    q8 = (torch.randn(B, T, H, D, generator=g) * 4).to(FP8_DTYPE)
    k8 = (torch.randn(B, S, D, generator=g) * 4).to(FP8_DTYPE)
    qs = torch.rand(B, T, H, generator=g) + 0.01
    ks = torch.rand(B, S, generator=g) + 0.01
    w = torch.randn(B, T, H, generator=g)
    L = torch.tensor(lens if lens is not None else [S - T] * B, dtype=torch.int32)
    return q8, qs, w, k8, ks, L


def tree_visible(g: torch.Generator, B: int, T: int, S: int, L: torch.Tensor) -> torch.Tensor:
    """A tree verify's visibility: the committed keys, and a random subset of the block's own keys per node."""
    vis = torch.arange(S).view(1, 1, S) < L.long().view(B, 1, 1)
    own = torch.rand(B, T, S, generator=g) < 0.5
    inblock = (torch.arange(S).view(1, 1, S) >= L.long().view(B, 1, 1)) & \
              (torch.arange(S).view(1, 1, S) < L.long().view(B, 1, 1) + torch.arange(T).view(1, T, 1) + 1)
    return vis | (own & inblock)


def _scores_checks(g: torch.Generator) -> None:
    from mtp.kernels.indexer import indexer_scores
    from mtp.kernels.topk import topk_workspace

    H, D = 16, 32
    settings = [dict(block_s=128), dict(programs=1), dict(programs=3, num_stages=2, block_s=32),
                dict(programs=1000, block_s=16, num_warps=8)]
    cases = [(1, 1, 97, None, False), (2, 3, 301, [5, 290], True), (3, 2, 200, [197, 60, 0], False)]
    for B, T, S, lens, tree in cases:
        q8, qs, w, k8, ks, L = inputs(g, B, T, S, H, D, lens)
        for vis in (None, tree_visible(g, B, T, S, L)) if tree else (None,):
            want = indexer_scores(q8, qs, w, k8, ks, L, visible=vis)
            ws0 = topk_workspace(B * T, "cpu")
            indexer_scores(q8, qs, w, k8, ks, L, visible=vis, hist=ws0)
            for kw in settings:
                got = indexer_scores(q8, qs, w, k8, ks, L, visible=vis, **kw)
                where = f"B={B} T={T} S={S} tree={vis is not None} {kw}"
                assert torch.equal(got, want), f"scores differ at {where}: {(got != want).sum()} entries"
                if "programs" not in kw:
                    continue
                ws = topk_workspace(B * T, "cpu")
                indexer_scores(q8, qs, w, k8, ks, L, visible=vis, hist=ws, **kw)
                assert torch.equal(ws, ws0), f"histograms differ at {where}"


def _refusal_checks(g: torch.Generator) -> None:
    from mtp.kernels.indexer import indexer_scores

    q8, qs, w, k8, ks, L = inputs(g, 1, 2, 40, 16, 32)
    for kw, word in ((dict(block_s=48), "block_s"), (dict(programs=0), "programs")):
        try:
            indexer_scores(q8, qs, w, k8, ks, L, **kw)
            raise AssertionError(f"{kw} was not refused")
        except ValueError as e:
            assert word in str(e), e
    q8, qs, w, k8, ks, L = inputs(g, 1, 9, 40, 16, 32)  # the looping kernel unrolls T <= MAX_LOOP_T = 8
    try:
        indexer_scores(q8, qs, w, k8, ks, L, programs=4)
        raise AssertionError("T = 9 with programs was not refused")
    except ValueError as e:
        assert "T = 9" in str(e), e


def _kept_checks(g: torch.Generator) -> None:
    from mtp.kernels import topk as tk
    from mtp.kernels.indexer import indexer_topk
    from mtp.kernels.topk import kept_workspace, radix_topk, topk_select_ref

    H, D, k = 16, 32, 24
    # several layers of one step, then a step of other rows, then the first again: each call finds zeros
    seq = [(2, 1, 301, [150, 299]), (1, 3, 120, [117]), (2, 1, 301, [300, 31]), (1, 3, 120, [50])]
    for i, (B, T, S, lens) in enumerate(seq):
        q8, qs, w, k8, ks, L = inputs(g, B, T, S, H, D, lens)
        vis = tree_visible(g, B, T, S, L) if i == 1 else None
        want, sc0 = indexer_topk(q8, qs, w, k8, ks, L, k, impl="radix", visible=vis)
        for impl, scores in (("radix", None), ("radix_fused", None), ("radix_fused", dict(programs=2))):
            idx, sc = indexer_topk(q8, qs, w, k8, ks, L, k, impl=impl, visible=vis, rearm=True, scores=scores)
            where = f"call {i} {impl} scores={scores}"
            assert torch.equal(sc, sc0), where
            assert torch.equal(idx, want) and torch.equal(idx, topk_select_ref(sc, L, k)), where
            assert not kept_workspace(B * T, "cpu").any(), f"workspace not re-armed after {where}"
    # the radix top-k alone: chunks whose zeroing spans are not whole (C = 5, 7), ties, fewer candidates than k
    for chunks in (5, 7):
        sc = torch.randint(0, 6, (2, 2, 900), generator=g).float()
        sc[1, :, 400:] = float("-inf")
        L = torch.tensor([899, 600])
        for _ in range(2):
            assert torch.equal(radix_topk(sc, L, 40, chunks=chunks, rearm=True), topk_select_ref(sc, L, 40))
            assert not kept_workspace(4, "cpu").any(), f"chunks={chunks}"
    # a call stopped between its launches drops the kept workspace; the next call gets a fresh, zeroed one
    B, T, S = 1, 2, 150
    q8, qs, w, k8, ks, L = inputs(g, B, T, S, H, D)
    before = kept_workspace(B * T, "cpu")
    split = tk._topk_split_kernel

    class Stop:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                raise RuntimeError("stopped")
            return launch

    tk._topk_split_kernel = Stop()
    try:
        indexer_topk(q8, qs, w, k8, ks, L, k, impl="radix_fused", rearm=True)
        raise AssertionError("the stopped launch did not raise")
    except RuntimeError as e:
        assert str(e) == "stopped"
    finally:
        tk._topk_split_kernel = split
    assert before.any(), "the scores kernel should have counted into the workspace before the stop"
    after = kept_workspace(B * T, "cpu")
    assert after is not before and not after.any()
    idx, sc = indexer_topk(q8, qs, w, k8, ks, L, k, impl="radix_fused", rearm=True)
    assert torch.equal(idx, topk_select_ref(sc, L, k))


def _one_launch_checks(g: torch.Generator) -> None:
    """The scores and the top-k in one launch (`indexer_one_launch`; its phases as three launches here): the
    default scores kernel's scores and the three-launch top-k's index sets bit for bit, over 1..3 batch rows, 1..3
    queries, a tree's visibility, short rows, chunkings; the kept workspace zero after each call; shapes whose grid
    does not fit (past the SMs, more than MAX_T queries) take the fallback; the launch counter books one launch."""
    from mtp.kernels import indexer_one_launch as iol
    from mtp.kernels.indexer import indexer_topk
    from mtp.kernels.topk import kept_workspace, topk_select_ref
    from mtp.plan.launches import counting

    H, D, k = 16, 32, 24
    cases = [(1, 1, 301, None, False, None), (2, 3, 333, [5, 330], True, 3), (3, 2, 200, [197, 60, 0], False, 2),
             (1, 3, 700, [697], True, None)]
    for i, (B, T, S, lens, tree, chunks) in enumerate(cases):
        q8, qs, w, k8, ks, L = inputs(g, B, T, S, H, D, lens)
        vis = tree_visible(g, B, T, S, L) if tree else None
        assert iol.indexer_grid(B, T, S, 132, chunks) is not None
        want, sc0 = indexer_topk(q8, qs, w, k8, ks, L, k, impl="radix", visible=vis)
        for rearm in (False, True) if i == 0 else (True,):
            idx, sc = iol.indexer_topk_one_launch(q8, qs, w, k8, ks, L, k, visible=vis, rearm=rearm, chunks=chunks)
            where = f"B={B} T={T} S={S} tree={tree} chunks={chunks} rearm={rearm}"
            assert torch.equal(sc, sc0), f"scores differ at {where}: {(sc != sc0).sum()}"
            assert torch.equal(idx, want) and torch.equal(idx, topk_select_ref(sc, L, k)), where
            assert not rearm or not kept_workspace(B * T, "cpu").any(), f"workspace not re-armed after {where}"
    holder = torch.nn.Module()  # what `counting` hooks: a model's layers, final norm and head (none here)
    holder.model, holder.lm_head = torch.nn.Module(), torch.nn.Identity()
    holder.model.layers, holder.model.norm = torch.nn.ModuleList(), torch.nn.Identity()
    q8, qs, w, k8, ks, L = inputs(g, 1, 2, 150, H, D)
    with counting(holder) as n:
        iol.indexer_topk_one_launch(q8, qs, w, k8, ks, L, k, rearm=True)
    assert n.names("glue") == {"_indexer_topk_kernel": 1}, n.names("glue")
    # more queries than the unrolled loop takes: the fallback's launches (the grid's other limits: test_indexer_grid)
    q8, qs, w, k8, ks, L = inputs(g, 1, 9, 100, H, D)
    assert iol.indexer_grid(1, 9, 100, 132) is None
    want, sc0 = indexer_topk(q8, qs, w, k8, ks, L, k, impl="radix")
    with counting(holder) as n:
        idx, sc = iol.indexer_topk_one_launch(q8, qs, w, k8, ks, L, k, rearm=True)
    assert "_indexer_topk_kernel" not in n.names("glue") and torch.equal(idx, want) and torch.equal(sc, sc0)


def _interpreted_checks() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_interpreter_loop_bounds()
    g = torch.Generator().manual_seed(3)
    _refusal_checks(g)
    _scores_checks(g)
    _kept_checks(g)
    _one_launch_checks(g)
    print("interpreted checks ok")


if __name__ == "__main__":
    _interpreted_checks()
