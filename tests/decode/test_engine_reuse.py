"""An Engine kept across calls reuses its decode buffers (and, on the GPU, its captured step graph): every
call must give exactly what a fresh engine gives, whatever ran before it."""

import dataclasses

import pytest

from mtp.draft.proposer import DraftConfig
from mtp.decode.config import GenerationConfig
from mtp.decode.engine import Engine, generate
from mtp.decode.state import StatePool

P1 = [list(range(5, 25)), list(range(40, 47))]
P2 = [list(range(100, 111)), list(range(200, 230))]


@pytest.mark.parametrize("draft,k", [("none", 0), ("eagle", 2), ("vanilla", 3)])
def test_reused_engine_matches_fresh_runs(tiny_model, draft, k):
    g = GenerationConfig(max_new_tokens=14, draft=DraftConfig(mode=draft, k=k, reuse_modules=True))
    eng = Engine(tiny_model, g)
    calls = [(P1, 14), (P2, 9), (P1, 14), (P2[:1] * 2, 14)]
    states = set()
    fresh_runs = {}  # a fresh engine's result per call (the third call repeats the first: run once)
    for prompts, n in calls:
        got = eng.run(prompts, max_new_tokens=n)
        key = (tuple(map(tuple, prompts)), n)
        if key not in fresh_runs:
            fresh_runs[key] = Engine(tiny_model, dataclasses.replace(g, max_new_tokens=n)).run(prompts)
        fresh = fresh_runs[key]
        assert got.tokens == fresh.tokens
        assert got.finish_reasons == fresh.finish_reasons
        assert got.metrics.accepted_hist == fresh.metrics.accepted_hist
        assert got.metrics.draft_forwards == fresh.metrics.draft_forwards
        assert all(len(t) <= n for t in got.tokens)
        states.update(id(s) for s in eng.pool.states.values())
    assert len(eng.pool.states) == 1 and len(states) == 1  # one (batch 2, length bucket) buffer set served all calls


def test_state_pool_is_bounded_and_keyed_by_batch(tiny_model):
    eng = Engine(tiny_model, GenerationConfig(max_new_tokens=4))
    for b in range(1, StatePool.MAX_STATES + 3):
        eng.run([[5, 6, 7]] * b)
    assert len(eng.pool.states) == StatePool.MAX_STATES
    assert sorted(k[0] for k in eng.pool.states) == list(range(3, StatePool.MAX_STATES + 3))


def test_generate_eager_matches_engine_and_bad_max_new(tiny_model):
    eng = Engine(tiny_model, GenerationConfig(max_new_tokens=6, draft=DraftConfig(mode="eagle", k=1)))
    assert eng.run(P1).tokens == generate(tiny_model, P1, 6, draft="eagle", k=1).tokens
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.run(P1, max_new_tokens=0)


def test_reused_engine_sampling_reproduces_per_call(tiny_model):
    g = GenerationConfig(max_new_tokens=10, draft=DraftConfig(mode="eagle", k=2), verify="sample", seed=3)
    eng = Engine(tiny_model, g)
    first = eng.run(P1).tokens
    assert eng.run(P1).tokens == first == Engine(tiny_model, g).run(P1).tokens
