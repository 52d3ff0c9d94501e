"""`moe_experts(down_fused=True)` (`mtp.kernels.moe_down_fused`: the persistent layout's down projection and combine
in one pipelined launch) on the GPU at a TP=8 'split' rank's shapes: D = 7168, I = 256 (2048 / 8), 256 routed
experts + the shared one stacked last (every token's implicit slot), random FP8 weights, T = 1..4 tokens of 8
routed experts each. Bit for bit (torch.equal) the down + combine launches it replaces, with the K slices of
'waves' (what `FastMoE` runs on a split rank) and of `default_splits`, with `add`, with -1 slots, with 64-row
(default) and 128-row tiles, under PDL (both trigger places), eagerly and as 12 replays of a CUDA graph whose
routing changes between replays; within the expert kernels' tolerance of `moe_experts_ref`.
Run: pytest -m gpu tests/kernels/test_moe_down_fused_gpu.py
"""

from __future__ import annotations

import os

import pytest
import torch

from mtp.kernels import available

pytestmark = pytest.mark.gpu
DEV = os.environ.get("MTP_TEST_DEVICE", "cuda")
if not available():
    pytest.skip("needs triton and a CUDA device", allow_module_level=True)

import mtp.kernels.moe_down_fused as mdf  # noqa: E402
from mtp.kernels._triton import PDL_AFTER_WAIT, PDL_EARLY  # noqa: E402
from mtp.kernels.moe import moe_experts, moe_experts_ref  # noqa: E402

from .test_kernels_gpu import check_close, distinct_topk, stacked  # noqa: E402

E, D, I, J = 256, 7168, 256, 8  # routed experts; the shared one is stack entry E
_WEIGHTS: list[torch.Tensor] = []


def weights() -> list[torch.Tensor]:
    """257 random FP8 slices of a split rank (1.4 GB), built once."""
    if not _WEIGHTS:
        torch.manual_seed(0)
        _WEIGHTS.extend([*stacked(E + 1, I, D, 0.02), *stacked(E + 1, I, D, 0.02), *stacked(E + 1, D, I, 0.02)])
    return _WEIGHTS


def _call(x, idx, rw, fused: bool, **kw) -> torch.Tensor:
    return moe_experts(x, idx, rw, *weights(), out_dtype=torch.float32, layout="persistent", shared=True,
                       down_fused=fused, **kw)


@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_fused_equals_down_and_combine(T):
    torch.manual_seed(T)
    x = torch.randn(T, D, device=DEV).bfloat16()
    idx = distinct_topk(T, E, J, share=True)
    rw = torch.rand(T, J, device=DEV)
    add = torch.randn(T, D, device=DEV)
    minus = idx.clone()
    minus[0, 1] = -1  # a slot on another rank
    for name, ids, kw in (("waves", idx, dict(splits="waves")), ("default", idx, dict()),
                          ("waves + add", idx, dict(splits="waves", add=add)),
                          ("-1 slots", minus, dict(splits="waves")), ("2 down slices", idx, dict(splits=(2, 2))),
                          ("pdl early", idx, dict(splits="waves", pdl=PDL_EARLY)),
                          ("pdl after wait", idx, dict(splits="waves", pdl=PDL_AFTER_WAIT, add=add)),
                          ("pdl, no prefetch", idx, dict(splits="waves", pdl=PDL_EARLY, prefetch=False))):
        want = _call(x, ids, rw, False, **{k: v for k, v in kw.items() if k not in ("pdl", "prefetch")})
        got = _call(x, ids, rw, True, **kw)
        assert torch.equal(got, want), f"T={T} {name}: max |diff| {(got - want).abs().max().item():.3e}"
    bn = mdf.BN
    mdf.BN = 128
    try:
        got = _call(x, idx, rw, True, splits="waves")
    finally:
        mdf.BN = bn
    assert torch.equal(got, _call(x, idx, rw, False, splits="waves")), f"T={T}: 128-row tiles"
    shared = torch.full((T, 1), E, dtype=torch.int32, device=DEV)
    ref = moe_experts_ref(x, torch.cat([idx, shared], 1), torch.cat([rw, torch.ones(T, 1, device=DEV)], 1),
                          *weights(), out_dtype=torch.float32)
    check_close(f"T={T} fused vs reference", _call(x, idx, rw, True, splits="waves"), ref, 0.05)


@pytest.mark.parametrize("T", [1, 4])
def test_fused_in_a_cuda_graph_with_pdl(T):
    """A captured call (PDL on, a second layer's call after it so that PDL chains) replayed 12 times with a new
    routing copied in before each: every replay equals the eager call without the switch."""
    torch.manual_seed(10 + T)
    x = torch.randn(T, D, device=DEV).bfloat16()
    idx = distinct_topk(T, E, J, share=True)
    rw = torch.rand(T, J, device=DEV)
    kw = dict(splits="waves", pdl=PDL_EARLY if T == 1 else PDL_AFTER_WAIT)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # compile outside the capture
            y = _call(x, idx, rw, True, **kw)
            _call(y.bfloat16(), idx, rw, True, **kw)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y1 = _call(x, idx, rw, True, **kw)
        y2 = _call(y1.bfloat16(), idx, rw, True, **kw)
    for r in range(12):
        idx.copy_(distinct_topk(T, E, J, share=r % 2 == 0))
        rw.copy_(torch.rand(T, J, device=DEV))
        graph.replay()
        torch.cuda.synchronize()
        w1 = _call(x, idx, rw, False, splits="waves")
        w2 = _call(w1.bfloat16(), idx, rw, False, splits="waves")
        assert torch.equal(y1, w1) and torch.equal(y2, w2), f"T={T} replay {r}"
