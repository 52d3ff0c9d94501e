"""Switch topk_split_v2 on the GPU (pytest -m gpu): the top-k kernels' V2 (`topk._topk_split_kernel`, `_finish_row`)
give V1's index sets bit for bit, and the reference's, on the TP=8 rank's decode rows (S = 32768 + w, 1..8 score
rows: N(0, 1), rounded scores with tens of ties near the k-th, the real scores kernel's scores, a tie over 7 values,
narrow rows whose keys all share P, every score equal), in three launches (with and without PDL, with the scores
kernel's histograms) and in one launch, and in a captured CUDA graph replayed with new scores.
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

from mtp.kernels.indexer import indexer_topk  # noqa: E402
from mtp.kernels.topk import kept_workspace, radix_topk, topk_select_ref  # noqa: E402
from mtp.kernels.topk_one_launch import radix_topk_one_launch  # noqa: E402

from .test_kernels_gpu import indexer_inputs, poison, topk_scores  # noqa: E402

K = 2048


def _scores(B: int, T: int, S: int, kind: str) -> torch.Tensor:
    if kind == "equal":  # every score 0.0: 32k candidates tie at the k-th key (V2: the walk over the scores)
        return torch.zeros(B, T, S, device=DEV)
    return topk_scores(B, T, S, kind)


@pytest.mark.parametrize("w", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["randn", "rounded", "ties", "narrow", "equal"])
def test_split_v2_equals_v1_and_reference(w, kind):
    """Decode rows of one query batch row: S = 32768 + w keys, w score rows; three launches with a fresh and the kept
    workspace, PDL, and one launch."""
    S = 32768 + w
    sc = _scores(1, w, S, kind)
    sc[..., 1] = float("-inf")
    L = torch.tensor([S - w], device=DEV, dtype=torch.int32)
    want = topk_select_ref(sc, L, K)
    for kw in (dict(), dict(rearm=True), dict(rearm=True, pdl=True), dict(chunks=3)):
        outs = {}
        for v2 in (False, True):
            poison()
            outs[v2] = radix_topk(sc, L, K, split_v2=v2, **kw)
        assert torch.equal(outs[True], outs[False]), f"{kind} w={w} {kw}: V2 differs from V1"
        assert torch.equal(outs[True], want), f"{kind} w={w} {kw}: differs from the reference"
    for v2 in (False, True):
        assert torch.equal(radix_topk_one_launch(sc, L, K, rearm=True, split_v2=v2), want), f"{kind} w={w} one launch"
    assert not kept_workspace(w, DEV).any()


@pytest.mark.parametrize("w", [1, 4])
@pytest.mark.parametrize("impl", ["radix", "radix_fused"])
def test_split_v2_on_indexer_scores(w, impl):
    """The real scores kernel's scores (and with radix_fused its histograms) at 32k: V2 == V1 == the reference."""
    S = 32768 + w
    args = indexer_inputs(1, w, S, [S - w])
    idx = {}
    for v2 in (False, True):
        idx[v2], sc = indexer_topk(*args, K, impl=impl, rearm=True, split_v2=v2, pdl=True)
        assert torch.equal(idx[v2], topk_select_ref(sc, args[-1], K)), f"{impl} w={w} v2={v2}"
    assert torch.equal(idx[True], idx[False])


def test_split_v2_graph_replays():
    """Both settings captured in one CUDA graph (kept workspace, PDL, three 'layers' each) and replayed with new
    scores: every replay equals the eager call of the other setting and the reference."""
    S, w = 32768 + 4, 4
    L = torch.tensor([S - w], device=DEV, dtype=torch.int32)
    layers = [_scores(1, w, S, kind) for kind in ("randn", "rounded", "equal")]
    for sc in layers:  # warm-up outside the capture: compiles, and the kept workspace exists
        for v2 in (False, True):
            radix_topk(sc, L, K, rearm=True, pdl=True, split_v2=v2)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [(radix_topk(sc, L, K, rearm=True, pdl=True, split_v2=False),
                 radix_topk(sc, L, K, rearm=True, pdl=True, split_v2=True)) for sc in layers]
    for rep in range(5):
        for i, sc in enumerate(layers):
            sc.copy_(_scores(1, w, S, ("randn", "rounded", "ties", "narrow", "equal")[(rep + i) % 5]))
        g.replay()
        torch.cuda.synchronize()
        for sc, (v1, v2) in zip(layers, outs):
            want = topk_select_ref(sc, L, K)
            assert torch.equal(v1, want) and torch.equal(v2, want), f"replay {rep}"
            assert torch.equal(v2, radix_topk(sc, L, K, split_v2=False)), f"replay {rep}: V2 vs eager V1"
        assert not kept_workspace(w, DEV).any()
