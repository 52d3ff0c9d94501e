"""impl one's routing split over its last programs to arrive (`router.moe_route_fused(impl="one", split_tail=True)`,
switch `FastPathOptions.router_one_split`) on the GPU (pytest -m gpu), bf16 at DeepSeek's shapes (E = 256, D = 7168,
8 groups, 4 kept, top 8), at T = 1, 3, 4, 8 only (a kernel per padded width and switch: this file compiles ~12 and
runs in well under two minutes on an H200, where test_router_one_gpu.py compiles one per width):
- logits, ids and weights torch.equal to the unsplit tail's (the same dots; each token's routing the same arithmetic,
  its weights' normalizing sum in the same layout: tests/kernels/test_router_one.py checks that on the sm_90 build),
  the logits `one_logits_ref`'s, the ids `route_from_logits_ref`'s on them; eight calls back to back without a sync
  (the counter's re-arm between launches);
- ties (x = 0, the bias in steps of 0.25); an expert-parallel rank's range and table;
- PDL (trigger at the start / after the wait) chained after a norm in a CUDA graph, 20 replays; a graph of eight
  calls (a step's layers) replayed 100 times with new inputs copied in, against eager calls.
CPU twin (the interpreter; sm_90 compile checks): tests/kernels/test_router_one.py.
MTP_TEST_DEVICE=cpu with TRITON_INTERPRET=1 dry-runs the kernel tests on the CPU (slow; no graphs).
"""

from __future__ import annotations

import os

import pytest
import torch

from mtp.kernels import available

pytestmark = pytest.mark.gpu
DEV = os.environ.get("MTP_TEST_DEVICE", "cuda")
if not (available() or (DEV == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")):
    pytest.skip("needs triton and a CUDA device", allow_module_level=True)
if DEV == "cpu":  # the dry run: the tail's loop over a runtime range of tokens needs the interpreter patched
    from tests.interp import patch_interpreter_loop_bounds

    patch_interpreter_loop_bounds()

from mtp.kernels.dispatch import expert_map, local_ids  # noqa: E402
from mtp.kernels.router import moe_route_fused, one_logits_ref, route_from_logits_ref  # noqa: E402

from .test_kernels_gpu import check_close, poison  # noqa: E402
from .test_router_one_gpu import _inputs, _needs_cuda  # noqa: E402

E, D = 256, 7168


def _same(a, b) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("T", [1, 3, 4, 8])
def test_split_equals_the_unsplit_tail(T):
    x, wg, bias = _inputs(T, 500 + T)
    one = moe_route_fused(x, wg, bias, return_logits=True, impl="one")
    poison()
    split = moe_route_fused(x, wg, bias, return_logits=True, impl="one", split_tail=True)
    for name, a, b in zip(("weights", "ids", "logits"), split, one):
        assert torch.equal(a, b), f"{name} differ from the unsplit tail's in tokens {torch.nonzero((a != b).any(1))}"
    assert torch.equal(split[2], one_logits_ref(x, wg))
    wr, ir = route_from_logits_ref(split[2], bias)
    assert torch.equal(split[1], ir)
    check_close("weights vs the reference on the same logits", split[0], wr, 1e-6)
    # back to back, no sync between: each launch finds the counter its predecessor re-armed
    outs = [moe_route_fused(x, wg, bias, return_logits=True, impl="one", split_tail=True) for _ in range(8)]
    assert all(_same(o, one) for o in outs)


def test_ties_and_local_ids():
    """Every logit 0 (x = 0) and the bias in steps of 0.25: equal experts and groups, the lower index first; a rank's
    range and table mapped in the same launch."""
    x = torch.zeros(8, D, device=DEV).bfloat16()
    wg = (torch.randn(E, D, device=DEV) * 0.02).bfloat16()
    bias = torch.randint(0, 3, (E,), device=DEV).float() * 0.25
    wr, ir = route_from_logits_ref(torch.zeros(8, E, device=DEV), bias)
    for T in (4, 8):
        w, idx = moe_route_fused(x[:T], wg, bias, impl="one", split_tail=True)
        assert torch.equal(idx, ir[:T]) and _same((w, idx), moe_route_fused(x[:T], wg, bias, impl="one")), T
        check_close(f"tied weights T={T}", w, wr[:T], 1e-6)
    x, wg, bias = _inputs(4, 600)
    w, idx = moe_route_fused(x, wg, bias, impl="one", split_tail=True)
    wl, il = moe_route_fused(x, wg, bias, local=(64, 96), impl="one", split_tail=True)
    assert torch.equal(wl, w) and torch.equal(il, torch.where((idx >= 64) & (idx < 96), idx - 64, -1))
    table = expert_map(sorted(set(range(1, E, 3)) | {0, E - 1}), E, DEV).router
    wt, it = moe_route_fused(x, wg, bias, local=table, impl="one", split_tail=True)
    assert torch.equal(wt, w) and torch.equal(it, local_ids(idx, table))


@pytest.mark.parametrize("mode", [1, 2])
def test_pdl_chained_in_a_graph(mode):
    """PDL (1: the trigger at the start; 2: after the wait), four tokens: the same bits as the unsplit tail without
    PDL, eagerly and chained after the norm that makes its input, on 20 graph replays."""
    _needs_cuda()
    from mtp.decode.graphs import capture_graph
    from mtp.kernels.norm_quant import add_rms_norm_quant

    x, wg, bias = _inputs(4, 700)
    want = moe_route_fused(x, wg, bias, return_logits=True, impl="one")
    assert _same(moe_route_fused(x, wg, bias, return_logits=True, impl="one", split_tail=True, pdl=mode), want)
    h = torch.randn(4, D, device=DEV)
    wn = (torch.rand(D, device=DEV) + 0.5).bfloat16()

    def chain(pdl, split):
        y = add_rms_norm_quant(h, None, wn, 1e-6, pdl=pdl)[1]
        return moe_route_fused(y, wg, bias, return_logits=True, impl="one", pdl=pdl, split_tail=split)

    plain = chain(False, False)
    box = {}
    graph = capture_graph(lambda: box.__setitem__("out", chain(mode, True)))
    for i in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert _same(box["out"], plain), f"replay {i}"


def test_graph_of_calls_replayed_with_new_inputs():
    """Eight calls of eight tokens in one graph (a step's MoE layers, each its own gate), replayed 100 times with new
    tokens copied in: every replay ends (no program left waiting) and each call equals an eager unsplit call."""
    _needs_cuda()
    gates = [_inputs(8, 800 + i)[1:] for i in range(8)]
    static = torch.zeros(8, D, device=DEV).bfloat16()
    for wg, bias in gates:  # compiled before the capture
        moe_route_fused(static, wg, bias, impl="one", split_tail=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [moe_route_fused(static, wg, bias, return_logits=True, impl="one", split_tail=True) for wg, bias in gates]
    for i in range(100):
        static.copy_(_inputs(8, 900 + i)[0])
        graph.replay()
        if i % 10 == 0 or i == 99:
            torch.cuda.synchronize()
            for j, (wg, bias) in enumerate(gates):
                assert _same(outs[j], moe_route_fused(static, wg, bias, return_logits=True, impl="one")), (i, j)
    torch.cuda.synchronize()
