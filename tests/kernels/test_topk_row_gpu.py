"""Switch topk_row on the GPU (pytest -m gpu): the indexer top-k after its histogram in one program per score row
(`mtp.kernels.topk_row`) gives `topk_select_ref`'s index sets (and today's `radix_topk`'s) bit for bit, torch.equal:
decode rows of 1k..64k keys (+ w), 1..8 score rows, N(0, 1), rounded scores (tens of ties near the k-th), 7 values
(ties across the row), narrow rows (every key in one 16-bit bin), every score equal, NaN / +-inf / -0.0 / denormals,
rows shorter than S and than k; each tile and warps setting; with the histogram launch and with the scores kernel's
(radix / radix_fused, a tree's visibility); kept workspace zero after every call; three 'layers' captured in one CUDA
graph with PDL and the kept workspace, replayed with new inputs; and the fast path with the switch on giving the
default's logits bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

from mtp.kernels import available

pytestmark = pytest.mark.gpu
DEV = os.environ.get("MTP_TEST_DEVICE", "cuda")
if not available() or DEV != "cuda":
    pytest.skip("needs triton and a CUDA device", allow_module_level=True)

from mtp.kernels.indexer import indexer_scores, indexer_topk  # noqa: E402
from mtp.kernels.topk import kept_workspace, radix_topk, topk_select_ref, topk_workspace  # noqa: E402
from mtp.kernels.topk_row import radix_topk_row  # noqa: E402

from .test_kernels_gpu import indexer_inputs, poison, topk_scores  # noqa: E402

K = 2048
# (B, T): score rows as decode makes them (one row, a verify of 2..8 tokens, two rows of 4)
ROWS = [(1, 1), (1, 2), (1, 3), (1, 4), (2, 4), (1, 8)]


def _scores(B: int, T: int, S: int, kind: str) -> torch.Tensor:
    if kind == "equal":  # every score 0.0: the whole row ties at the k-th key (the radix path's walk)
        return torch.zeros(B, T, S, device=DEV)
    if kind == "special":  # NaN, +-inf, -0.0 beside +0.0, denormals
        sc = torch.randn(B, T, S, device=DEV)
        sc[..., ::7] = -0.0
        sc[..., 3::11] = 0.0
        sc[..., 5::13] = float("nan")
        sc[..., 6::17] = float("inf")
        sc[..., 9::19] = float("-inf")
        sc[..., 100:3000] = 1e-42 * torch.randint(1, 4, (B, T, 2900), device=DEV)
        return sc
    return topk_scores(B, T, S, kind)


def _lens(B: int, T: int, S: int) -> torch.Tensor:
    """Row 0 sees every key; later rows shorter (one with fewer keys than k)."""
    return torch.tensor([S - T] + [max(0, S // (3 * b) - T) for b in range(1, B)], device=DEV, dtype=torch.int32)


def _differ(got: torch.Tensor, want: torch.Tensor) -> str:
    bad = (got != want).any(-1)
    return f"rows {torch.nonzero(bad).tolist()[:4]} differ"


@pytest.mark.parametrize("S", [1024 + 7, 8192 + 3, 32768 + 1, 32768 + 4, 65536])
@pytest.mark.parametrize("BT", ROWS)
@pytest.mark.parametrize("kind", ["randn", "rounded", "ties", "narrow", "equal", "special"])
def test_row_equals_reference_and_radix_topk(S, BT, kind):
    """The exact set and order (positions ascending, then -1) of the reference and of `radix_topk`: a fresh
    workspace, the kept one (zero after each call), PDL."""
    B, T = BT
    sc = _scores(B, T, S, kind)
    sc[..., 1] = float("-inf")
    L = _lens(B, T, S)
    want = topk_select_ref(sc, L, K)
    poison()
    got = radix_topk_row(sc, L, K)
    assert torch.equal(got, want), _differ(got, want)
    assert torch.equal(got, radix_topk(sc, L, K))
    for pdl in (False, True):
        got = radix_topk_row(sc, L, K, rearm=True, pdl=pdl)
        assert torch.equal(got, want), f"rearm pdl={pdl}: {_differ(got, want)}"
        assert not kept_workspace(B * T, DEV).any(), "the kept workspace was not re-armed"


@pytest.mark.parametrize("tile", [2048, 4096, 8192, 16384])
@pytest.mark.parametrize("num_warps", [4, 8, 16, 32])
def test_row_tiles_and_warps(tile, num_warps):
    """Every tile and warps setting (the pass's whole tiles and its rest, each thread's run of keys) gives one answer,
    at 32k + 4 keys and 4 rows, on rows with ties."""
    if tile < 64 * num_warps:
        pytest.skip("fewer than two keys a thread: refused by radix_topk_row")
    S, T = 32768 + 4, 4
    for kind in ("rounded", "ties"):
        sc = _scores(1, T, S, kind)
        L = _lens(1, T, S)
        want = topk_select_ref(sc, L, K)
        got = radix_topk_row(sc, L, K, rearm=True, pdl=True, tile=tile, num_warps=num_warps)
        assert torch.equal(got, want), f"{kind}: {_differ(got, want)}"
        assert not kept_workspace(T, DEV).any()


@pytest.mark.parametrize("BT", [(1, 1), (1, 4), (2, 4), (1, 8)])
@pytest.mark.parametrize("impl", ["radix", "radix_fused"])
def test_row_on_indexer_scores(BT, impl):
    """The real scores kernel's scores (with radix_fused its histograms, in its epilogue) at 32k, causal and with a
    tree's visibility, fresh and kept workspaces: the default top-k's index sets, the reference's."""
    B, T = BT
    S = 32768 + T
    L = _lens(B, T, S)
    args = indexer_inputs(B, T, S, L.tolist())
    vis = torch.arange(S, device=DEV).view(1, 1, S) < L.long().view(B, 1, 1)
    vis = vis | (torch.rand(B, T, S, device=DEV) < 0.3)
    for visible in (None, vis):
        want, sc = indexer_topk(*args, K, impl=impl, visible=visible, rearm=True, pdl=True)
        assert torch.equal(want, topk_select_ref(sc, L, K))
        for rearm in (False, True):
            poison()
            got, sc2 = indexer_topk(*args, K, impl=impl, visible=visible, rearm=rearm, pdl=True, row=True)
            where = f"tree={visible is not None} rearm={rearm}"
            assert torch.equal(sc2, sc), f"{where}: scores differ"
            assert torch.equal(got, want), f"{where}: {_differ(got, want)}"
            assert not rearm or not kept_workspace(B * T, DEV).any(), f"{where}: the kept workspace was not re-armed"


def test_row_on_filled_histograms_without_rearm():
    """Histograms filled once by the scores kernel and kept (rearm off: how the bench times the row kernel alone):
    every call gives the same answer, the histograms untouched, the candidate counter back at zero."""
    S, T = 32768 + 1, 1
    args = indexer_inputs(1, T, S, [S - T])
    ws = topk_workspace(T, DEV)
    sc = indexer_scores(*args, hist=ws)
    before = ws.clone()
    want = topk_select_ref(sc, args[-1], K)
    for _ in range(5):
        assert torch.equal(radix_topk_row(sc, args[-1], K, workspace=ws, pdl=True), want)
    assert torch.equal(ws, before)


def _new_inputs(layers, T: int, S: int) -> None:
    """New random queries, scales, head weights and keys in place of each captured layer's (lengths kept)."""
    for a in layers:
        for t, new in zip(a[:4], indexer_inputs(1, T, S, [0])[:4]):
            t.copy_(new)


@pytest.mark.parametrize("impl", ["radix", "radix_fused"])
@pytest.mark.parametrize("T", [1, 4])
def test_row_graph_replays(impl, T):
    """`indexer_topk(row=True)` with the kept workspace and PDL: three 'layers' (of other lengths) in one captured
    graph, replayed 30 times with new inputs every 10th replay, each replay equal to the eager default (three
    launches) and the reference, and the workspace zero after each."""
    S = 32768 + T
    layers = [indexer_inputs(1, T, S, [S - T - 100 * i]) for i in range(3)]
    kw = dict(impl=impl, rearm=True, pdl=True, row=True)
    for a in layers:  # warm-up outside the capture: compiles, and the kept workspace exists
        idx, sc = indexer_topk(*a, K, **kw)
        assert torch.equal(idx, topk_select_ref(sc, a[-1], K))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [indexer_topk(*a, K, **kw) for a in layers]
    want = None
    for i in range(30):
        if i % 10 == 0:
            _new_inputs(layers, T, S)
            want = [indexer_topk(*a, K, impl=impl, rearm=True, pdl=True)[0].clone() for a in layers]
        for idx, _ in outs:
            idx.fill_(-7)
        g.replay()
        torch.cuda.synchronize()
        for j, ((idx, sc), a) in enumerate(zip(outs, layers)):
            assert torch.equal(idx, want[j]), f"replay {i} layer {j}: {_differ(idx, want[j])}"
            if i % 10 == 0:
                assert torch.equal(idx, topk_select_ref(sc, a[-1], K))
        assert not kept_workspace(T, DEV).any(), f"replay {i}: the kept workspace was not re-armed"


def test_fast_path_topk_row_bit_identical():
    """The fast path with switch topk_row on gives the default's verify logits bit for bit at widths 1..5 past the
    indexer's top-k (the same scores and index sets, so the same attention), and graph greedy tokens = eager."""
    from mtp.backends.fast_path import disable_fast_path, enable_fast_path, set_kernels
    from mtp.checkpoint.synthetic import random_model
    from mtp.decode.engine import generate
    from mtp.model.presets import gpu_test_config

    from ..decode.test_engine_gpu import _verify_logits

    model = random_model(gpu_test_config(layers=3, mtp_modules=1), device=DEV, dtype=torch.bfloat16, seed=3)
    ids = torch.randint(0, 2048, (1, 70), device=DEV, generator=torch.Generator(device=DEV).manual_seed(0))
    enable_fast_path(model)
    try:
        prompts = [list(range(3, 90)), list(range(50, 140))]  # past the top-k 64: the indexer selects
        out, toks = {}, {}
        for on in (False, True):
            set_kernels(model, topk_row=on)
            out[on] = [_verify_logits(model, ids, w) for w in range(1, 6)]
            toks[on] = generate(model, prompts, 12, mode="eager").tokens
        for w, (a, b) in enumerate(zip(out[False], out[True]), start=1):
            assert torch.equal(a, b), f"w={w}: max |diff| {(a - b).abs().max().item():.3g}"
        assert toks[True] == toks[False]
        assert generate(model, prompts, 12, mode="graph").tokens == toks[True]
    finally:
        disable_fast_path(model)
