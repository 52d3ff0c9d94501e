"""GPU twin of tests/kernels/test_draft_window.py's tree checks: a tree step's first window in one launch
(`mtp.kernels.draft_window.tree_window`, switch tree_window) integer for integer and row for row against its torch
reference (`tree_window_ref`, the tree proposer's ops) on a GPU, eagerly, with PDL, and replayed in a CUDA graph; and
whole strict tree decodes of the fast path with the switch on and off.

Shape legend: B rows, S buffer positions, W window, D width.

- kernel: B = 1 / 3 / 8, W = 2 / 4 / 5, D = 7168 (7 channel blocks) and an odd 1030, bf16 and fp32 rows of a hidden
  buffer with a row stride past S x D, rows of n = 1 and n = S, PDL off / early / after the wait; the cache lengths
  it writes too;
- graph: captured once (PDL after the wait), replayed on 50 new lengths and buffers copied into its inputs, each
  checked;
- engine: eagle trees 2x1x1 and 2x2, vanilla 2x1x1, graph and overlap modes, tree_window on vs off: the same tokens,
  acceptance, decode buffers and caches (every glue switch off too: tests/backends/test_glue_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests.decode.tree_runs import tree_run  # noqa: E402

DEV = "cuda"


def random_case(g: torch.Generator, B: int, S: int, D: int, dtype: torch.dtype):
    """(tokens [B, S], hidden [B, S, D] with a row stride past S x D, n [B] with rows of n = 1 and n = S)."""
    tokens = torch.randint(0, 1000, (B, S), generator=g)
    hidden = torch.randn(B, S + 1, D, generator=g).to(dtype)[:, 1:]
    n = torch.randint(1, S + 1, (B,), generator=g)
    n[0], n[-1] = 1, S
    return tokens.to(DEV), hidden.to(DEV), n.to(DEV)


def _same(want, got) -> bool:
    return all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(want, got))


@pytest.mark.parametrize("pdl", [0, 1, 2])
def test_tree_window_equals_the_torch_ops(pdl):
    from mtp.kernels.draft_window import tree_window, tree_window_ref

    g = torch.Generator().manual_seed(pdl)
    for B, W, D, dtype in ((1, 4, 7168, torch.bfloat16), (3, 2, 1030, torch.float32), (8, 5, 7168, torch.bfloat16),
                           (3, 4, 1030, torch.bfloat16)):
        tokens, hidden, n = random_case(g, B, 37, D, dtype)
        lens_want, lens_got = (torch.full((B,), 9, device=DEV) for _ in range(2))
        want = tree_window_ref(tokens, hidden, n, lens_want, W)
        got = tree_window(tokens, hidden, n, lens_got, W, pdl)
        torch.cuda.synchronize()
        assert _same(want, got) and torch.equal(lens_want, lens_got), (B, W, D, dtype, pdl)


def test_tree_window_in_a_cuda_graph_replays_new_windows():
    from mtp.decode.graphs import capture_graph
    from mtp.kernels.draft_window import tree_window, tree_window_ref

    g = torch.Generator().manual_seed(7)
    B, S, W, D = 3, 37, 4, 7168
    tokens, hidden, n = random_case(g, B, S, D, torch.bfloat16)
    lens = torch.zeros(B, dtype=torch.long, device=DEV)
    out = []

    def step():
        out[:] = tree_window(tokens, hidden, n, lens, W, pdl=2)

    graph = capture_graph(step, warmup=1)
    for i in range(50):
        t, h, nn = random_case(g, B, S, D, torch.bfloat16)
        tokens.copy_(t), hidden.copy_(h), n.copy_(nn)
        lens.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        lens_want = torch.full_like(lens, -1)
        want = tree_window_ref(t, h, nn, lens_want, W)
        assert _same(want, out) and torch.equal(lens, lens_want), (i, nn)


def test_strict_tree_decodes_are_the_same_with_the_switch_off():
    from mtp.backends.fast_path import enable_fast_path
    from mtp.checkpoint.synthetic import random_model
    from mtp.model.presets import gpu_test_config
    from tests.kernels.test_tree_commit_gpu import _differs

    model = enable_fast_path(random_model(gpu_test_config(layers=3, mtp_modules=2), device=DEV,
                                          dtype=torch.bfloat16, seed=1))
    prompts = [list(range(3, 40)), list(range(50, 61)), list(range(100, 190))]  # 90 > index_topk 64: sparse rows
    runs = [(d, tree, mode) for d, tree in (("eagle", "2x1x1"), ("eagle", "2x2"), ("vanilla", "2x1x1"))
            for mode in ("graph", "overlap")]
    for draft, tree, mode in runs:  # (vanilla: the last module repeated, as tree_run asks)
        r0, b0 = tree_run(model, prompts, draft, tree, mode, {})
        r1, b1 = tree_run(model, prompts, draft, tree, mode, dict(tree_window=False))
        assert r0.tokens == r1.tokens and r0.metrics.accepted_hist == r1.metrics.accepted_hist, (draft, tree, mode)
        bad = _differs(b0, b1)
        assert not bad, (draft, tree, mode, bad)
