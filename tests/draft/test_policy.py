"""DraftSampler: argmax drafts, or draws from exactly the filtered distribution the sampling verifier uses."""

from __future__ import annotations

import torch

from mtp.draft.policy import DraftSampler
from mtp.verify import SamplingParams, filter_probs
from mtp.spec.draws import RowDraws, seed_tensor


def test_greedy_is_the_argmax_without_a_distribution():
    logits = torch.tensor([[0.1, 3.0, -1.0], [2.0, 0.0, 1.0]])
    draws = RowDraws(seed_tensor([0, 1], "cpu"), torch.zeros(2, dtype=torch.long))
    d, q = DraftSampler("greedy", SamplingParams()).bind(draws)(logits)
    assert d.tolist() == [1, 0] and q is None


def test_sampled_drafts_follow_the_filtered_law():
    sp = SamplingParams(temperature=0.7, top_k=2)
    logits = torch.tensor([[1.0, 0.5, -2.0, 0.9]]).expand(4000, -1)
    draws = RowDraws(seed_tensor(list(range(4000)), "cpu"), torch.zeros(4000, dtype=torch.long))
    draw = DraftSampler("sample", sp).bind(draws)
    d, q = draw(logits)
    assert torch.equal(q, filter_probs(logits, sp))
    freq = torch.bincount(d, minlength=4).float() / len(d)
    assert freq[1] == 0 and freq[2] == 0  # outside the top 2: never drawn
    assert torch.allclose(freq, q[0], atol=0.03)


def test_each_draft_of_a_step_draws_from_its_own_stream():
    """Draft j of one step uses stream DRAFT + j: two calls of the same bound sampler draw different tokens, and
    a fresh binding at the same (seed, position) repeats them."""
    logits = torch.zeros(64, 50)
    draws = RowDraws(seed_tensor(list(range(64)), "cpu"), torch.full((64,), 7))
    sampler = DraftSampler("sample", SamplingParams())
    draw = sampler.bind(draws)
    first, second = draw(logits)[0], draw(logits)[0]
    assert not torch.equal(first, second)
    again = sampler.bind(draws)
    assert torch.equal(again(logits)[0], first) and torch.equal(again(logits)[0], second)
