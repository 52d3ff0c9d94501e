"""Tree engines kept across calls (graph / overlap mode), on the CPU: the kept engine's buffers serve every call of
the same batch and length bucket and give eager's tokens and metrics, whatever ran before; engines are kept per
model and settings (bounded, least recently used dropped), dropped by `release(model)` and when the model's
version changes; a runner's graphs go with their buffers and on a version bump. CPUs capture no graphs (the graph
modes run the static-bound step eagerly here): tests/decode/test_tree_graph_reuse_gpu.py replays a kept graph on a
GPU."""

from __future__ import annotations

import pytest

from mtp.decode import keep
from mtp.decode.config import GenerationConfig
from mtp.decode.engine import generate, release
from mtp.decode.graphs import GraphRunner
from mtp.decode.tree import TreeEngine, TreeStatePool, generate_tree
from mtp.spec.tree_shape import TreeShape
from mtp.draft.tree_proposer import TreeProposer

from .prompts import random_prompts


@pytest.fixture(scope="module")
def model(agreeing_model):
    yield agreeing_model
    release(agreeing_model)


P1 = random_prompts(5, 23)  # index_topk 16: dense, sparse
P2 = random_prompts(31, 9, seed=2)
SHAPE = TreeShape.from_branching((2, 2, 1))


def kept_engines(model) -> list:
    return list(keep._ENGINES.get(model, {}).values())


def test_kept_tree_engine_reuses_its_buffers_and_gives_eager_tokens(model):
    release(model)
    kw = dict(draft="eagle", min_draft_prob=0.05)
    calls = [(P1, 12), (P2, 7), (P1, 12), (P2[:1] * 2, 10)]
    eager = [generate_tree(model, p, SHAPE, n, **kw) for p, n in calls]
    assert kept_engines(model) == []  # eager builds its engine per call, as mtp.generate's eager mode
    states, pointers = set(), set()
    for (p, n), e in zip(calls, eager):
        g = generate_tree(model, p, SHAPE, n, mode="graph", **kw)
        assert g.tokens == e.tokens and g.finish_reasons == e.finish_reasons
        assert g.metrics.to_dict() == e.metrics.to_dict() and g.row_accepted_hist == e.row_accepted_hist
        assert g.metrics.draft_forwards == e.metrics.draft_forwards
        (engine,) = kept_engines(model)
        assert isinstance(engine, TreeEngine)
        (st,) = engine.pool.states.values()
        states.add(id(st))
        pointers.add(st.tokens.data_ptr())
    assert len(states) == len(pointers) == 1  # one (batch 2, length bucket) buffer set served every call
    assert sum(eager[0].metrics.accepted_hist[1:]) > 0, "pick prompts whose trees accept something"


def test_engines_are_kept_per_settings_bounded_and_released(model):
    release(model)
    first = generate_tree(model, P1, SHAPE, 6, mode="graph")
    generate_tree(model, P1, SHAPE, 6, mode="overlap")
    generate_tree(model, P1, SHAPE, 6, mode="graph", min_draft_prob=0.05)
    assert len(kept_engines(model)) == 3  # mode and the adaptive length change the captured step
    generate_tree(model, P1, SHAPE, 9, mode="graph", seed=4)  # max_new_tokens and seed are per call
    assert len(kept_engines(model)) == 3
    for name in ("chain1", "2x1", "3x1"):
        generate_tree(model, P1, TreeShape.parse(name), 4, mode="graph")
    engines = kept_engines(model)
    assert len(engines) == keep.MAX_ENGINES
    assert [e.tree.name for e in engines][-3:] == ["chain1", "2x1", "3x1"]  # least recently used dropped first
    assert not any(e.tree == SHAPE and e.g.mode == "overlap" for e in engines)
    release(model)
    assert kept_engines(model) == []
    again = generate_tree(model, P1, SHAPE, 6, mode="graph")
    (engine,) = kept_engines(model)
    assert again.tokens == first.tokens
    generate_tree(model, P1, SHAPE, 6, mode="graph")
    assert kept_engines(model) == [engine]
    model.set_runtime(model.runtime)  # what a module swap does: a new version drops the engines built before
    assert generate_tree(model, P1, SHAPE, 6, mode="graph").tokens == first.tokens
    (fresh,) = kept_engines(model)
    assert fresh is not engine
    release()
    assert kept_engines(model) == []


def test_a_runner_drops_graphs_on_a_version_bump_and_with_their_buffers(model):
    """The mechanism a kept tree engine has on CUDA (GraphRunner + TreeStatePool, as the chain engine's), driven
    with stand-in graphs: a capture needs a GPU, the bookkeeping does not."""
    g = GenerationConfig.from_options(4, "eagle", None, tree="2x1", mode="graph")
    engine = TreeEngine(model, g)
    runner = GraphRunner(model, engine.step)
    pool = TreeStatePool(model, g, TreeProposer, on_drop=runner.drop)
    keys = []
    for b in range(1, pool.MAX_STATES + 2):
        st = pool.get(P1[:1] * b, 4, [0] * b)
        keys.append((st.B, st.max_len))
        runner.graphs[keys[-1]] = ("stand-in graph", 0.0, 0)
    assert keys[0] not in pool.states and keys[0] not in runner.graphs  # dropped with its buffers
    assert set(runner.graphs) == set(keys[1:]) == set(pool.states)
    runner.check_version()
    assert set(runner.graphs) == set(keys[1:])  # same version: kept
    model.set_runtime(model.runtime)  # what a module swap does: a new version
    runner.check_version()
    assert runner.graphs == {}


def test_generate_and_generate_tree_share_the_kept_engine(model):
    """The same settings through either entry point are one engine: a call of one replays the other's graph."""
    release(model)
    a = generate_tree(model, P1, SHAPE, 8, mode="graph", min_draft_prob=0.05)
    (engine,) = kept_engines(model)
    b = generate(model, P1, 8, draft="eagle", tree=SHAPE.name, mode="graph", min_draft_prob=0.05)
    assert kept_engines(model) == [engine] and b.tokens == a.tokens


def test_a_call_past_the_position_limit_is_refused_with_the_trees_room(model):
    """A tree's buffer holds prompt + max_new_tokens + N + 2 positions (`draft_room` of the tree)."""
    limit, N = model.cfg.max_position_embeddings, SHAPE.n_nodes
    too_many = limit - len(P1[1]) - N - 1
    with pytest.raises(ValueError, match=rf"\+ draft room \({N + 2}\) exceed max_position_embeddings \({limit}\)"):
        generate_tree(model, P1, SHAPE, too_many, mode="graph")
