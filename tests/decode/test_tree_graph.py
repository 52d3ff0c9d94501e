"""The tree step as `GraphRunner` captures it (static shapes, static position bound, metrics as device counters),
on the CPU: an engine with `static_bound` runs that very step eagerly here (a CPU refuses the graph modes, as for
chains) and must give eager mode's tokens and metrics; tests/decode/test_tree_gpu.py replays the captured graph on
a GPU against eager.

Shape legend: N tree nodes."""

from __future__ import annotations

import pytest
import torch

from mtp.decode.config import GenerationConfig
from mtp.decode.engine import Engine
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
    e = generate_tree(model, PROMPTS, shape, 12, draft=draft, reuse_modules=True, **kw)
    cfg = GenerationConfig.from_options(12, draft, None, tree=shape, reuse_modules=True, **kw)
    static = Engine(model, cfg, static_bound=True)  # the bound a captured step uses: the buffer's
    g = static.run(PROMPTS)
    (st,) = static.pool.states.values()
    assert static.bound(st, None) == st.max_len - shape.n_nodes  # the buffer less the N positions a step writes
    assert g.tokens == e.tokens and g.finish_reasons == e.finish_reasons
    assert g.tree.to_dict() == e.metrics.to_dict()
    assert g.tree.accepted_hist == e.metrics.accepted_hist and g.tree.accepted_rank == e.metrics.accepted_rank
    assert sum(e.metrics.accepted_hist[1:]) > 0, "pick prompts whose trees accept something"


def test_graph_mode_refuses_sampling_and_unknown_modes(model):
    tree = TreeShape.chain(2)
    with pytest.raises(ValueError, match="mode must be 'eager' with tree 'chain2' and verify='sample'"):
        generate_tree(model, PROMPTS, tree, 4, verify="sample", mode="graph")
    with pytest.raises(ValueError, match="mode must be one of eager, graph, overlap, got 'cuda'"):
        generate_tree(model, PROMPTS, tree, 4, mode="cuda")
    with pytest.raises(ValueError, match="mode='graph' captures CUDA graphs and needs the model on a CUDA device"):
        generate_tree(model, PROMPTS, tree, 4, mode="graph")  # off CUDA: refused, as for chains
