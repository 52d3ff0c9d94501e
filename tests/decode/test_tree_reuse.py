"""Tree engines kept across calls, on the CPU: the kept engine's buffers serve every call of the same batch and length
bucket and give a fresh eager run's tokens and metrics, whatever ran before; engines are kept per model and
settings (bounded, least recently used dropped), dropped by `release(model)` and when the model's version changes;
a runner's graphs go with their buffers and on a version bump. CPUs capture no graphs and refuse the graph modes
(as for chains), so the engines here are eager ones with the static position bound a captured step uses, kept
through the same `keep.kept` that `mtp.generate` uses in the graph modes; tests/decode/test_tree_graph_reuse_gpu.py
replays kept graphs on a GPU (and shares one engine between `generate` and `generate_tree`)."""

from __future__ import annotations

import pytest

from mtp.decode import keep
from mtp.decode.config import GenerationConfig
from mtp.decode.engine import Engine, release
from mtp.decode.graphs import GraphRunner
from mtp.decode.tree import generate_tree
from mtp.spec.tree_shape import TreeShape

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


def run_kept(model, prompts, tree, n, seed=0, **kw):
    """A call through the kept engine of these settings (built eager with the captured step's static bound)."""
    g = GenerationConfig.from_options(n, kw.pop("draft", "eagle"), None, tree=tree, seed=seed, **kw)
    engine = keep.kept(model, g, lambda: Engine(model, g, static_bound=True))
    return engine, engine.run(prompts, max_new_tokens=n, seeds=[seed] * len(prompts))


def test_kept_tree_engine_reuses_its_buffers_and_gives_eager_tokens(model):
    release(model)
    kw = dict(draft="eagle", min_draft_prob=0.05)
    calls = [(P1, 12), (P2, 7), (P1, 12), (P2[:1] * 2, 10)]
    eager = [generate_tree(model, p, SHAPE, n, **kw) for p, n in calls]
    assert kept_engines(model) == []  # eager builds its engine per call, as mtp.generate's eager mode
    states, pointers = set(), set()
    for (p, n), e in zip(calls, eager):
        engine, g = run_kept(model, p, SHAPE, n, **kw)
        assert g.tokens == e.tokens and g.finish_reasons == e.finish_reasons
        assert g.tree.to_dict() == e.metrics.to_dict() and g.row_accepted_hist == e.row_accepted_hist
        assert g.tree.draft_forwards == e.metrics.draft_forwards
        assert kept_engines(model) == [engine] and engine.g.draft.tree == SHAPE
        (st,) = engine.pool.states.values()
        states.add(id(st))
        pointers.add(st.tokens.data_ptr())
    assert len(states) == len(pointers) == 1  # one (batch 2, length bucket) buffer set served every call
    assert sum(eager[0].metrics.accepted_hist[1:]) > 0, "pick prompts whose trees accept something"


def test_engines_are_kept_per_settings_bounded_and_released(model):
    release(model)
    first = run_kept(model, P1, SHAPE, 6)[1]
    run_kept(model, P1, SHAPE, 6, verify="relaxed", think_ids=(510, 511))
    run_kept(model, P1, SHAPE, 6, min_draft_prob=0.05)
    assert len(kept_engines(model)) == 3  # the verifier and the adaptive length change the captured step
    run_kept(model, P1, SHAPE, 9, seed=4)  # max_new_tokens and seed are per call
    assert len(kept_engines(model)) == 3
    for name in ("chain1", "2x1", "3x1"):
        run_kept(model, P1, TreeShape.parse(name), 4)
    engines = kept_engines(model)
    assert len(engines) == keep.MAX_ENGINES
    assert [e.g.draft.tree.name for e in engines][-3:] == ["chain1", "2x1", "3x1"]  # least recently used first out
    assert not any(e.g.draft.tree == SHAPE and e.g.verify == "relaxed" for e in engines)
    release(model)
    assert kept_engines(model) == []
    engine, again = run_kept(model, P1, SHAPE, 6)
    assert again.tokens == first.tokens
    assert run_kept(model, P1, SHAPE, 6)[0] is engine and kept_engines(model) == [engine]
    model.set_runtime(model.runtime)  # what a module swap does: a new version drops the engines built before
    fresh, out = run_kept(model, P1, SHAPE, 6)
    assert out.tokens == first.tokens and fresh is not engine and kept_engines(model) == [fresh]
    release()
    assert kept_engines(model) == []


def test_graph_modes_are_refused_off_cuda_for_trees_as_for_chains(model):
    for tree in (SHAPE, None):
        with pytest.raises(ValueError, match="mode='graph' captures CUDA graphs and needs the model on a CUDA device"):
            Engine(model, GenerationConfig.from_options(4, "eagle", None, tree=tree, mode="graph"))
    with pytest.raises(ValueError, match="mode='overlap' captures CUDA graphs"):
        generate_tree(model, P1, SHAPE, 4, mode="overlap")


def test_a_runner_drops_graphs_on_a_version_bump_and_with_their_buffers(model):
    """The mechanism a kept tree engine has on CUDA (GraphRunner + the step's StatePool, as a chain's), driven
    with stand-in graphs: a capture needs a GPU, the bookkeeping does not."""
    g = GenerationConfig.from_options(4, "eagle", None, tree="2x1")
    engine = Engine(model, g)
    runner = GraphRunner(model, engine.step)
    pool = engine.step.pool(on_drop=runner.drop)
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


def test_a_call_past_the_position_limit_is_refused_with_the_trees_room(model):
    """A tree's buffer holds prompt + max_new_tokens + N + 2 positions (`draft_room` of the tree)."""
    limit, N = model.cfg.max_position_embeddings, SHAPE.n_nodes
    too_many = limit - len(P1[1]) - N - 1
    with pytest.raises(ValueError, match=rf"\+ draft room \({N + 2}\) exceed max_position_embeddings \({limit}\)"):
        generate_tree(model, P1, SHAPE, too_many)
