"""GPU twin of tests/kernels/test_tree_verdict.py: the strict tree verdict in one launch (`mtp.kernels.tree_verdict`,
switch tree_verdict) integer for integer against its torch reference (`verify.tree.tree_strict_verdict`) on a GPU,
eagerly, with PDL, and replayed in a CUDA graph; and whole strict tree decodes of the fast path with the switch on
and off.

Shape legend: B rows, N tree nodes, A path nodes.

- kernel: the CPU test's trees (N = 7..15, ties among siblings, dead nodes and a dead root) and a 31-node 2x2x2x2 tree,
  B = 1 / 3 / 8, with and without a live mask, PDL off / early / after the wait;
- graph: captured once (PDL after the wait), replayed on 50 new random verifies copied into its inputs, each checked;
- engine: eagle trees 2x1x1, 2x2 and one with sibling-rank gaps on the fast path of a small model, graph and overlap
  modes (and 2x2x1 with min_draft_prob 0.05: dead nodes), tree_verdict on vs off: the same tokens, acceptance,
  decode buffers and caches (with every glue switch off too: tests/backends/test_glue_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests.decode.tree_runs import tree_run  # noqa: E402
from tests.kernels.test_tree_verdict import SHAPES, _fields, random_case  # noqa: E402

DEV = "cuda"


def _kernel(tt, tokens, target, live, pdl: int = 0):
    from mtp.kernels.tree_verdict import tree_verdict

    return tree_verdict(tokens, target, tt.parent_N, tt.depth_N, tt.path_NA, live, pdl)


@pytest.mark.parametrize("pdl", [0, 1, 2])
def test_tree_verdict_equals_the_torch_ops(pdl):
    from mtp.verify.tree import tree_strict_verdict

    g = torch.Generator().manual_seed(pdl)
    for shape in (*SHAPES, "2x2x2x2"):
        for B in (1, 3, 8):
            tt, tokens, target, live = random_case(g, shape, B, device=DEV)
            for lv in (None, live):
                want = _fields(tree_strict_verdict(tt, tokens, target, lv))
                got = _kernel(tt, tokens, target, lv, pdl)
                torch.cuda.synchronize()
                assert all(torch.equal(x, y) for x, y in zip(want, got)), (shape, B, pdl, lv is not None, want, got)


def test_tree_verdict_in_a_cuda_graph_replays_new_verifies():
    from mtp.decode.graphs import capture_graph
    from mtp.verify.tree import tree_strict_verdict

    g = torch.Generator().manual_seed(7)
    tt, tokens, target, live = random_case(g, "2x2x1", 3, device=DEV)
    out = []

    def step():
        out[:] = _kernel(tt, tokens, target, live, pdl=2)

    graph = capture_graph(step, warmup=1)
    for i in range(50):
        _, t, tg, lv = random_case(g, "2x2x1", 3, device=DEV)
        tokens.copy_(t), target.copy_(tg), live.copy_(lv)
        graph.replay()
        torch.cuda.synchronize()
        want = _fields(tree_strict_verdict(tt, t, tg, lv))
        assert all(torch.equal(x, y) for x, y in zip(want, out)), (i, want, out)


def test_strict_tree_decodes_are_the_same_with_the_switch_off():
    from mtp.backends.fast_path import enable_fast_path
    from mtp.checkpoint.synthetic import random_model
    from mtp.model.presets import gpu_test_config
    from tests.kernels.test_tree_commit_gpu import _differs

    model = enable_fast_path(random_model(gpu_test_config(layers=3, mtp_modules=1), device=DEV,
                                          dtype=torch.bfloat16, seed=1))
    prompts = [list(range(3, 40)), list(range(50, 61)), list(range(100, 190))]  # 90 > index_topk 64: sparse rows
    runs = [(tree, mode, {}) for tree in ("2x1x1", "2x2", "0/1/0.0/1.1") for mode in ("graph", "overlap")]
    for tree, mode, opts in runs + [("2x2x1", "graph", dict(min_draft_prob=0.05))]:
        r0, b0 = tree_run(model, prompts, "eagle", tree, mode, {}, **opts)
        r1, b1 = tree_run(model, prompts, "eagle", tree, mode, dict(tree_verdict=False), **opts)
        assert r0.tokens == r1.tokens and r0.metrics.accepted_hist == r1.metrics.accepted_hist, (tree, mode)
        bad = _differs(b0, b1)
        assert not bad, (tree, mode, bad)
