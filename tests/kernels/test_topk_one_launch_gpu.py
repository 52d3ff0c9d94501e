"""The indexer's radix top-k in one cooperative launch (`mtp.kernels.topk_one_launch`), and the indexer's scores
with it in one (`mtp.kernels.indexer_one_launch`), on the GPU (pytest -m gpu): the exact index sets of
`topk_select_ref` and of the three-launch `radix_topk` at S = 1k..64k and 1..8 score rows (the TP=8 rank's decode
shapes, ties, -inf, short rows, a tree's visibility, every program of the grid on its own SM), the default scores
kernel's scores bit for bit, the phases as three launches of the same kernel, the kept workspace zero after every
call, CUDA-graph replays equal to the eager call 50 times in a row (a barrier race would show up as a flaky
replay), and the fast path with the switches `topk_one_launch` / `indexer_one_launch` on giving the same logits bit
for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

from mtp.kernels import available

pytestmark = pytest.mark.gpu
DEV = os.environ.get("MTP_TEST_DEVICE", "cuda")
if not available() or DEV != "cuda":
    pytest.skip("needs triton and a CUDA device (cooperative launches)", allow_module_level=True)

from mtp.kernels.indexer import indexer_scores, indexer_topk  # noqa: E402
from mtp.kernels.indexer_one_launch import indexer_grid, indexer_topk_one_launch  # noqa: E402
from mtp.kernels.topk import kept_workspace, radix_topk, sm_count, topk_select_ref  # noqa: E402
from mtp.kernels.topk_one_launch import one_launch_grid, radix_topk_one_launch  # noqa: E402

from .test_kernels_gpu import indexer_inputs, poison, topk_scores  # noqa: E402

SMS = sm_count(torch.device(DEV))
# (B, T): 1..8 score rows as decode makes them (one row, a verify of 2..8 tokens, two rows of 4)
ROWS = [(1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (2, 4), (1, 8)]


def _lens(B: int, T: int, S: int) -> torch.Tensor:
    """Row 0 sees every key; later rows shorter (one with fewer keys than k)."""
    lens = [S - T] + [max(0, S // (3 * b) - T) for b in range(1, B)]
    return torch.tensor(lens, device=DEV, dtype=torch.int32)


def _differ(got: torch.Tensor, want: torch.Tensor) -> str:
    bad = (got != want).any(-1)
    return f"rows {torch.nonzero(bad).tolist()[:4]} differ"


@pytest.mark.parametrize("S", [1024 + 7, 8192 + 3, 32768, 65536])
@pytest.mark.parametrize("BT", ROWS)
@pytest.mark.parametrize("kind", ["randn", "rounded", "ties", "narrow"])
def test_one_launch_equals_reference_and_three_launches(S, BT, kind):
    """The exact set and order (positions ascending, then -1) of the stable-sort reference and of `radix_topk`, in
    one launch (the grid fits the SMs at every decode shape here), with a fresh and with the kept workspace."""
    B, T = BT
    k = 2048
    assert one_launch_grid(B * T, S, SMS) is not None
    sc = topk_scores(B, T, S, kind)
    sc[..., 1] = float("-inf")
    L = _lens(B, T, S)
    want = topk_select_ref(sc, L, k)
    poison()
    got = radix_topk_one_launch(sc, L, k)
    assert torch.equal(got, want), _differ(got, want)
    assert torch.equal(got, radix_topk(sc, L, k))
    for _ in range(2):
        got = radix_topk_one_launch(sc, L, k, rearm=True)
        assert torch.equal(got, want), _differ(got, want)
        assert not kept_workspace(B * T, DEV).any(), "the kept workspace was not re-armed"


@pytest.mark.parametrize("chunks", [1, 3, 16, 64, 128, None])
def test_one_launch_chunkings_and_phases(chunks):
    """Any chunking gives the same result (those past the SMs or MAX_TILE through the three launches: 1, 3, 64,
    128 here); the phases as three launches of the same kernel (what the interpreter runs) too."""
    sc = topk_scores(1, 4, 32768, "ties")
    L = torch.tensor([32760], device=DEV)
    want = topk_select_ref(sc, L, 2048)
    assert (one_launch_grid(4, 32768, SMS, chunks) is None) == (chunks in (1, 3, 64, 128))
    assert torch.equal(radix_topk_one_launch(sc, L, 2048, chunks=chunks), want)
    assert torch.equal(radix_topk_one_launch(sc, L, 2048, chunks=chunks, split_phases=True), want)


def test_one_launch_every_sm_one_program():
    """One row of SMs x 256 positions in SMs chunks: a program on every SM, all waiting at the row's barriers."""
    S = SMS * 256
    sc = topk_scores(1, 1, S, "rounded")
    L = torch.tensor([S - 1], device=DEV)
    assert one_launch_grid(1, S, SMS, chunks=SMS) == (256, SMS)
    for _ in range(3):
        assert torch.equal(radix_topk_one_launch(sc, L, 2048, chunks=SMS, rearm=True), topk_select_ref(sc, L, 2048))


def _new_inputs(layers, T: int, S: int) -> None:
    """New random queries, scales, head weights and keys in place of each captured layer's (lengths kept)."""
    for a in layers:
        for t, new in zip(a[:4], indexer_inputs(1, T, S, [0])[:4]):
            t.copy_(new)


@pytest.mark.parametrize("impl", ["radix", "radix_fused"])
@pytest.mark.parametrize("T", [1, 4, 8])
def test_one_launch_graph_replays(impl, T):
    """`indexer_topk(one_launch=True)` with the kept workspace: three 'layers' in one captured graph, replayed 50
    times in a row with new inputs every 10th replay, each replay equal to the eager call (and the reference), and
    the workspace zero after each: a barrier that lets a program through early shows up here as a flaky replay."""
    S, k = 32768, 2048
    layers = [indexer_inputs(1, T, S, [S - T - 100 * i]) for i in range(3)]
    kw = dict(impl=impl, rearm=True, one_launch=True)
    for a in layers:  # warm-up outside the capture: compiles, and the kept workspace exists
        idx, sc = indexer_topk(*a, k, **kw)
        assert torch.equal(idx, topk_select_ref(sc, a[-1], k))
        assert torch.equal(idx, indexer_topk(*a, k, impl=impl)[0])
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [indexer_topk(*a, k, **kw) for a in layers]
    want = None
    for i in range(50):
        if i % 10 == 0:
            _new_inputs(layers, T, S)
            want = [indexer_topk(*a, k, impl=impl)[0].clone() for a in layers]  # eager, three launches
        for idx, _ in outs:
            idx.fill_(-7)
        g.replay()
        torch.cuda.synchronize()
        for j, ((idx, sc), a) in enumerate(zip(outs, layers)):
            assert torch.equal(idx, want[j]), f"replay {i} layer {j}: {_differ(idx, want[j])}"
            if i % 10 == 0:
                assert torch.equal(idx, topk_select_ref(sc, a[-1], k))
        assert not kept_workspace(T, DEV).any(), f"replay {i}: the kept workspace was not re-armed"


def test_one_launch_eager_loop_is_stable():
    """200 eager calls in a row at 8 rows of 64k (16 programs a row, 128 in all) give one answer."""
    sc = topk_scores(1, 8, 65536, "rounded")
    L = torch.tensor([65536 - 8], device=DEV)
    want = topk_select_ref(sc, L, 2048)
    outs = [radix_topk_one_launch(sc, L, 2048, rearm=True) for _ in range(200)]
    torch.cuda.synchronize()
    bad = [i for i, o in enumerate(outs) if not torch.equal(o, want)]
    assert not bad, f"calls {bad[:8]} differ"


@pytest.mark.parametrize("S", [2048 + 5, 8192 + 3, 32768, 65536])
@pytest.mark.parametrize("BT", ROWS + [(8, 1)])
def test_indexer_one_launch_equals_scores_and_topk(S, BT):
    """Scores and top-k in one launch: the default scores kernel's scores bit for bit and the three-launch top-k's
    index sets, causal and with a tree's visibility, kept workspace zero after each call."""
    from .test_kernels_gpu import indexer_inputs

    B, T = BT
    k = 2048
    L = _lens(B, T, S)
    args = indexer_inputs(B, T, S, L.tolist())
    fits = indexer_grid(B, T, S, SMS) is not None  # every shape here on 132 SMs (8 rows of 64k: 4096-key chunks)
    assert fits or SMS < 132
    vis = torch.arange(S, device=DEV).view(1, 1, S) < L.long().view(B, 1, 1)
    vis = vis | (torch.rand(B, T, S, device=DEV) < 0.3)
    for visible in (None, vis):
        want_sc = indexer_scores(*args, visible=visible)
        want_idx = indexer_topk(*args, k, impl="radix", visible=visible)[0]
        assert torch.equal(want_idx, topk_select_ref(want_sc, L, k))
        for rearm in (False, True):
            poison()
            idx, sc = indexer_topk_one_launch(*args, k, visible=visible, rearm=rearm)
            where = f"tree={visible is not None} rearm={rearm} one launch={fits}"
            assert torch.equal(sc, want_sc), f"{where}: {(sc != want_sc).sum()} scores differ"
            assert torch.equal(idx, want_idx), f"{where}: {_differ(idx, want_idx)}"
            assert not rearm or not kept_workspace(B * T, DEV).any(), f"{where}: the kept workspace was not re-armed"
    idx, sc = indexer_topk_one_launch(*args, k, visible=vis, split_phases=True)  # the interpreter's launches
    assert torch.equal(sc, want_sc) and torch.equal(idx, want_idx)


@pytest.mark.parametrize("T", [1, 4, 8])
def test_indexer_one_launch_graph_replays(T):
    """Scores + top-k in one launch, three 'layers' in one captured graph, 50 replays in a row (new inputs every 10th),
    each equal to the eager three-launch path's scores and index sets; the kept workspace zero after each."""
    from .test_kernels_gpu import indexer_inputs

    S, k = 32768, 2048
    layers = [indexer_inputs(1, T, S, [S - T - 100 * i]) for i in range(3)]
    for a in layers:  # warm-up outside the capture: compiles, and the kept workspace exists
        indexer_topk_one_launch(*a, k, rearm=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [indexer_topk_one_launch(*a, k, rearm=True) for a in layers]
    want = None
    for i in range(50):
        if i % 10 == 0:
            _new_inputs(layers, T, S)
            want = [tuple(x.clone() for x in indexer_topk(*a, k, impl="radix")) for a in layers]
        for idx, sc in outs:
            idx.fill_(-7)
            sc.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        for j, ((idx, sc), (w_idx, w_sc)) in enumerate(zip(outs, want)):
            assert torch.equal(sc, w_sc), f"replay {i} layer {j}: scores differ"
            assert torch.equal(idx, w_idx), f"replay {i} layer {j}: {_differ(idx, w_idx)}"
        assert not kept_workspace(T, DEV).any(), f"replay {i}: the kept workspace was not re-armed"


@pytest.mark.parametrize("switch", ["topk_one_launch", "indexer_one_launch"])
def test_fast_path_one_launch_bit_identical(switch):
    """The fast path with the switch on gives the three launches' verify logits bit for bit at widths 1..5 past the
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
            set_kernels(model, **{switch: on})
            out[on] = [_verify_logits(model, ids, w) for w in range(1, 6)]
            toks[on] = generate(model, prompts, 12, mode="eager").tokens
        for w, (a, b) in enumerate(zip(out[False], out[True]), start=1):
            assert torch.equal(a, b), f"w={w}: max |diff| {(a - b).abs().max().item():.3g}"
        assert toks[True] == toks[False]
        assert generate(model, prompts, 12, mode="graph").tokens == toks[True]
    finally:
        disable_fast_path(model)
