"""GPU twin of tests/kernels/test_lookup.py's tree checks: a tree forward's cache slots, the angles of its nodes'
positions and its visibility in one launch (`kernels.lookup.tree_slots`, `fast_path.FastRotary.tree_slots`, switch
tree_fwd_glue) bit for bit against the reference (`Rotary.tree_slots`: the slots' add, the angles' torch ops,
`tree_visibility`) on a GPU, at the real model's rotary width and position range, eagerly, with PDL, and replayed in a
CUDA graph; and whole tree steps of the fast path with the switch on and off.

Shape legend: B rows, T nodes of the forward, U tree slots (T <= U), S key bound, N tree nodes.

- kernel: R/2 = 32 pairs and the table of every one of the 163840 positions (`FastRotary`'s), trees of 7 / 15 / 31
  nodes, B = 1 / 3 / 8 rows of different first slots up to the last positions, a verify (U = T = N) and a drafter's
  later depth (strided slices of the ancestor mask, as `TreeProposer.propose` passes them), S from 1 past the tree to
  thousands past it; PDL off / early / after the wait;
- graph: captured once after a torch op that writes the lengths (the kernel waits for it under PDL), replayed on new
  lengths (50 replays, each torch.equal to the reference's);
- engine: eagle trees 2x1x1 and 2x2 and a vanilla 3x1 (a cache per module) on the fast path of a small model, graph and
  overlap modes, tree_fwd_glue on vs off: the same tokens, acceptance, decode buffers and caches (every glue switch
  off: tests/backends/test_glue_gpu.py; strict tree decoding against greedy with the default switches:
  tests/decode/test_tree_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests.decode.tree_runs import tree_run  # noqa: E402

DEV = "cuda"


def _rotaries():
    """(reference Rotary, FastRotary with the default switches) of the real config, on the GPU."""
    from mtp.backends.fast_path import FastRotary
    from mtp.kernels.dispatch import FastPathOptions
    from mtp.model.layers import Rotary
    from mtp.model.presets import real_config

    cfg = real_config(layers=1)
    with torch.device(DEV):
        ref, fast = Rotary(cfg), Rotary(cfg)
    fast.__class__ = FastRotary
    fast.fast_options = FastPathOptions()
    return ref, fast


def _cases(g: torch.Generator, P: int):
    """(lens [B], T, depth, mask, S): a verify of every node and a drafter's last depth, rows anywhere in 0..P."""
    from mtp.spec.tree_shape import TreeShape

    for branching in ((2, 1, 1), (2, 2, 2), (4, 2, 1, 1)):
        tree = TreeShape.from_branching(branching)
        anc = tree.ancestor_mask(DEV)
        depth_N = anc.sum(1) - 1
        N = tree.n_nodes
        s = N - max(1, N // 4)  # the last nodes, after the earlier depths in the cache (a drafter's forward)
        for mask, depth in ((anc, depth_N), (anc[s:, 1:], depth_N[s:] - 1)):
            T, U = mask.shape
            for B, past in ((1, 1), (3, 37), (8, 5000)):
                top = P - U - past  # the tree's first slot at most: every slot and S stay inside the table
                lens = torch.randint(U - T, top + U - T, (B,), generator=g)
                lens[0] = top + U - T
                S = int(lens.max()) + T + past - 1
                yield lens.to(DEV), T, depth, mask, S


@pytest.mark.parametrize("pdl", [0, 1, 2])
def test_tree_slots_equal_the_reference_at_real_positions(pdl):
    from mtp.kernels.lookup import tree_slots

    ref, fast = _rotaries()
    table = fast.table(torch.device(DEV, torch.cuda.current_device()))
    g = torch.Generator().manual_seed(pdl)
    for lens, T, depth, mask, S in _cases(g, fast.max_positions):
        want = ref.tree_slots(lens, T, depth, mask, S)
        for got in (tree_slots(lens, T, depth, mask, S, *table, pdl=pdl), fast.tree_slots(lens, T, depth, mask, S)):
            bad = [i for i, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]
            assert not bad, (list(lens.shape), T, tuple(mask.shape), S, bad)


def test_tree_slots_in_a_cuda_graph_replay_new_lengths():
    from mtp.decode.graphs import capture_graph
    from mtp.kernels.lookup import tree_slots
    from mtp.spec.tree_shape import TreeShape

    ref, fast = _rotaries()
    table = fast.table(torch.device(DEV, torch.cuda.current_device()))
    tree = TreeShape.from_branching((2, 2, 1))
    mask = tree.ancestor_mask(DEV)
    depth = mask.sum(1) - 1
    B, T, S = 3, tree.n_nodes, 3000
    src = torch.zeros(B, dtype=torch.long, device=DEV)
    lens = torch.zeros(B, dtype=torch.long, device=DEV)
    box = {}

    def step():
        torch.add(src, 1, out=lens)  # an earlier launch writes the lengths, as a commit does
        box["out"] = tree_slots(lens, T, depth, mask, S, *table, pdl=2)

    graph = capture_graph(step, warmup=1)
    g = torch.Generator().manual_seed(5)
    for i in range(50):
        src.copy_(torch.randint(0, S - T, (B,), generator=g))
        graph.replay()
        torch.cuda.synchronize()
        want = ref.tree_slots(src + 1, T, depth, mask, S)
        bad = [j for j, (a, b) in enumerate(zip(box["out"], want)) if not torch.equal(a, b)]
        assert not bad, (i, bad)


def test_tree_steps_are_bitwise_with_the_switch_off():
    from mtp.backends.fast_path import enable_fast_path
    from mtp.checkpoint.synthetic import random_model
    from mtp.model.presets import gpu_test_config

    model = enable_fast_path(random_model(gpu_test_config(layers=3, mtp_modules=2), device=DEV,
                                          dtype=torch.bfloat16, seed=1))
    prompts = [list(range(3, 40)), list(range(50, 61)), list(range(100, 190))]  # 90 > index_topk 64: sparse rows
    for draft, tree in (("eagle", "2x1x1"), ("eagle", "2x2"), ("vanilla", "3x1")):
        for mode in ("graph", "overlap"):
            r0, b0 = tree_run(model, prompts, draft, tree, mode, {})
            r1, b1 = tree_run(model, prompts, draft, tree, mode, dict(tree_fwd_glue=False))
            assert r0.tokens == r1.tokens and r0.metrics.accepted_hist == r1.metrics.accepted_hist, (tree, mode)
            bad = [k for k in b0 if not torch.equal(b0[k], b1[k])]
            assert not bad, (draft, tree, mode, bad)
