"""GPU twin of tests/kernels/test_tree_commit.py: a tree step's compaction, hidden rows and counters in one launch
(`mtp.kernels.tree_commit`, switch tree_glue) bit for bit against the torch ops (`KVCache.compact` +
`tree_step.keep_path`) on a GPU, at the real model's widths, eagerly, with PDL, and replayed in a CUDA graph; and whole
tree steps of the fast path with the switch on and off.

Shape legend: L layers, B rows, A path nodes, N tree nodes, H hidden width.

- kernel: the real cache widths (latent 512 FP8 + 4 scales, rope 64 bf16, indexer key 128 FP8 + its scale) at 61
  layers and H = 7168 bf16 hidden rows, B = 1 / 3 / 8, paths of A = 3 / 4 / 6 nodes through trees of 7..31 nodes (rows
  keeping 1, A, and an inactive row; crossing sources and destinations), eager with PDL off / early / after the wait;
- graph: captured once, replayed on new random steps copied into its buffers (50 replays with PDL after the commit
  kernel, each checked): every buffer torch.equal to the torch ops';
- engine: eagle trees 2x1x1 and 2x2 on the fast path of a small model, graph and overlap modes, tree_glue on vs off:
  the same tokens, acceptance, decode buffers and caches (with every glue switch off too: tests/backends/
  test_glue_gpu.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests.kernels.test_tree_commit import kernel, random_step, reference, state  # noqa: E402
from tests.decode.tree_runs import tree_run  # noqa: E402

DEV = "cuda"


def _real_step(g, B: int, A: int, N: int, L: int = 61, S: int = 256):
    from mtp.model.presets import real_config

    return random_step(g, B, A, L, N, 7168, True, torch.bfloat16, S=S, device=DEV, cfg=real_config(layers=1))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _differs(a: dict, b: dict) -> list[str]:
    return [k for k in a if not torch.equal(_bits(a[k]), _bits(b[k]))]


@pytest.mark.parametrize("pdl", [0, 1, 2])
def test_tree_commit_equals_the_torch_ops_at_real_widths(pdl):
    g = torch.Generator().manual_seed(pdl)
    for B, A, N in ((1, 4, 7), (3, 3, 9), (8, 6, 31), (3, 4, 15)):
        st, *args = _real_step(g, B, A, N)
        want, got = copy.deepcopy(st), copy.deepcopy(st)
        reference(want, *args)
        kernel(got, *args, pdl=pdl)
        torch.cuda.synchronize()
        bad = _differs(state(want), state(got))
        assert not bad, (B, A, N, pdl, bad)


def test_tree_commit_in_a_cuda_graph_replays_new_steps():
    """Captured once after the commit kernel (PDL after its wait, as a step's launches chain), replayed on new random
    steps copied into the captured buffers: each replay's buffers equal the torch ops'."""
    from mtp.decode.accept import fused_commit
    from mtp.decode.graphs import capture_graph
    from tests.kernels.test_step_commit import _random_step

    g = torch.Generator().manual_seed(7)
    B, A, N = 3, 4, 15
    st, h, path, n0, active, accepted, rank_N, live = _real_step(g, B, A, N, L=8)
    # a commit kernel before it in the graph (its own small state): the tree kernel waits for it under PDL
    cst, drafts, verdict, stops = _random_step(g, B, A - 1)
    cst.cache.seq_lens = cst.cache.seq_lens.to(DEV)
    for k, v in vars(cst).items():
        if isinstance(v, torch.Tensor):
            setattr(cst, k, v.to(DEV))
    drafts, stops = drafts.to(DEV), stops.to(DEV)
    verdict = type(verdict)(*(t.to(DEV) for t in vars(verdict).values()))

    def step():
        fused_commit(cst, drafts, verdict, stops, None, pdl=2)
        kernel(st, h, path, n0, active, accepted, rank_N, live, pdl=2)

    graph = capture_graph(step, warmup=1)
    for i in range(50):
        new = _real_step(g, B, A, N, L=8)
        for dst, src in zip((st.cache.kv, st.cache.kv_scale, st.cache.pe, st.cache.idx_k, st.cache.idx_k_scale,
                             st.cache.seq_lens, st.hidden, st.n_B, st.keep_B, st.rank_DC, st.live_nodes, h, path, n0,
                             active, accepted, rank_N, live),
                            (new[0].cache.kv, new[0].cache.kv_scale, new[0].cache.pe, new[0].cache.idx_k,
                             new[0].cache.idx_k_scale, new[0].cache.seq_lens, new[0].hidden, new[0].n_B,
                             new[0].keep_B, new[0].rank_DC, new[0].live_nodes, *new[1:])):
            dst.copy_(src)
        want = copy.deepcopy(new[0])
        reference(want, *new[1:])
        graph.replay()
        torch.cuda.synchronize()
        bad = _differs(state(want), state(st))
        assert not bad, (i, bad)


def test_tree_steps_are_bitwise_with_the_switch_off():
    from mtp.backends.fast_path import enable_fast_path
    from mtp.checkpoint.synthetic import random_model
    from mtp.model.presets import gpu_test_config

    model = enable_fast_path(random_model(gpu_test_config(layers=3, mtp_modules=1), device=DEV,
                                          dtype=torch.bfloat16, seed=1))
    prompts = [list(range(3, 40)), list(range(50, 61)), list(range(100, 190))]  # 90 > index_topk 64: sparse rows
    for tree in ("2x1x1", "2x2"):
        for mode in ("graph", "overlap"):
            r0, b0 = tree_run(model, prompts, "eagle", tree, mode, {})
            r1, b1 = tree_run(model, prompts, "eagle", tree, mode, dict(tree_glue=False))
            assert r0.tokens == r1.tokens and r0.metrics.accepted_hist == r1.metrics.accepted_hist, (tree, mode)
            bad = _differs(b0, b1)
            assert not bad, (tree, mode, bad)
