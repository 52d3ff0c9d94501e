"""DraftSampler: argmax drafts, or draws from exactly the filtered distribution the sampling verifier uses."""

from __future__ import annotations

import torch

from mtp.draft.policy import DraftSampler
from mtp.verify import SamplingParams, filter_probs


def test_greedy_is_the_argmax_without_a_distribution():
    logits = torch.tensor([[0.1, 3.0, -1.0], [2.0, 0.0, 1.0]])
    d, q = DraftSampler("greedy", SamplingParams(), None)(logits)
    assert d.tolist() == [1, 0] and q is None


def test_sampled_drafts_follow_the_filtered_law():
    sp = SamplingParams(temperature=0.7, top_k=2)
    logits = torch.tensor([[1.0, 0.5, -2.0, 0.9]]).expand(4000, -1)
    d, q = DraftSampler("sample", sp, torch.Generator().manual_seed(0))(logits)
    assert torch.equal(q, filter_probs(logits, sp))
    freq = torch.bincount(d, minlength=4).float() / len(d)
    assert freq[1] == 0 and freq[2] == 0  # outside the top 2: never drawn
    assert torch.allclose(freq, q[0], atol=0.03)
