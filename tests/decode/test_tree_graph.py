"""The tree step as `GraphRunner` captures it (static shapes, static position bound, metrics as device counters),
on the CPU: mode='graph' runs that very step eagerly here (no CUDA graphs on a CPU) and must give eager mode's
tokens and metrics; tests/decode/test_tree_gpu.py replays the captured graph on a GPU against eager.

Shape legend: N tree nodes."""

from __future__ import annotations

import pytest
import torch

from mtp.decode.tree import generate_tree
from mtp.spec.tree_shape import TreeShape


@pytest.fixture(scope="module")
def model(agreeing_model):  # tests/decode/conftest.py: one float64 tiny model whose MTP modules agree often
    return agreeing_model


_g = torch.Generator().manual_seed(1)
PROMPTS = [torch.randint(2, 500, (n,), generator=_g).tolist() for n in (5, 23)]  # index_topk 16: dense, sparse


@pytest.mark.parametrize("draft,shape,kw", [
    ("eagle", TreeShape.from_branching((2, 2, 1)), dict(min_draft_prob=0.05)),
    ("vanilla", TreeShape.from_paths([(0,), (1,), (0, 0), (0, 1)]), dict(verify="relaxed", think_ids=(510, 511))),
])
def test_graph_mode_step_equals_eager(model, draft, shape, kw):
    out = {mode: generate_tree(model, PROMPTS, shape, 12, draft=draft, mode=mode, reuse_modules=True, **kw)
           for mode in ("eager", "graph")}
    e, g = out["eager"], out["graph"]
    assert g.tokens == e.tokens and g.finish_reasons == e.finish_reasons
    assert g.metrics.to_dict() == e.metrics.to_dict()
    assert g.metrics.accepted_hist == e.metrics.accepted_hist and g.metrics.accepted_rank == e.metrics.accepted_rank
    assert sum(e.metrics.accepted_hist[1:]) > 0, "pick prompts whose trees accept something"


def test_graph_mode_refuses_sampling_and_unknown_modes(model):
    tree = TreeShape.chain(2)
    with pytest.raises(ValueError, match="mode must be 'eager' with tree 'chain2' and verify='sample'"):
        generate_tree(model, PROMPTS, tree, 4, verify="sample", mode="graph")
    with pytest.raises(ValueError, match="mode must be one of eager, graph, overlap, got 'cuda'"):
        generate_tree(model, PROMPTS, tree, 4, mode="cuda")
