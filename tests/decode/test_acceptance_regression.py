"""Acceptance regression gate: the shipped model, fixed prompts, CPU float32, strict greedy verification.

Any change that moves acceptance -- numerics, the draft chain, the verifier, cache rollback, the prompt
handling of the engine -- changes the accepted-count histograms below and fails here with every old and new
value. The numbers are what the code produced when this test was written (at 9fed75a); if a change
moves them on purpose, say why in its commit and update EXPECTED from the failure message.

Determinism: float32 on the CPU with one thread (a reduction split over threads may round differently, and on
a shared 2-core box more threads are also much slower: measured 160 s with 2 threads vs 9 s with 1).
"""

from __future__ import annotations

import pytest
import torch

from mtp import generate
from mtp.checkpoint.files import load_model
from mtp.checkpoint.tiny import default_checkpoint

# Encoded with the bundled tokenizer (BOS first): "import os\nimport sys\n\n\ndef main(",
# "class Queue:\n    def __init__(self", "    for i in range(len(". Ids, so a tokenizer change cannot move them.
PROMPTS = [
    [0, 615, 556, 205, 615, 661, 596, 205, 539, 644, 270, 14],
    [0, 463, 227, 55, 345, 345, 32, 284, 316, 529, 755, 595, 272],
    [0, 265, 387, 292, 329, 932, 14, 560, 14],
]
MAX_NEW = 16

# (draft, k) -> accepted-count histogram over verify steps (index a: steps that accepted a drafts), all rows.
EXPECTED = {
    ("eagle", 1): [6, 20],
    ("eagle", 2): [6, 6, 10],
    ("eagle", 3): [5, 7, 5, 4],
    ("vanilla", 2): [7, 3, 12],
    ("vanilla", 3): [5, 5, 3, 6],
}
EXPECTED_AL = {  # 1 + mean accepted drafts per step, from the histograms above, to 4 places
    ("eagle", 1): 1.7692, ("eagle", 2): 2.1818, ("eagle", 3): 2.3810, ("vanilla", 2): 2.2273, ("vanilla", 3): 2.5263,
}


@pytest.fixture(scope="module")
def model():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield load_model(default_checkpoint(), dtype=torch.float32, numerics="fp8")
    finally:
        torch.set_num_threads(n)


def test_acceptance_of_the_shipped_model_is_unchanged(model):
    greedy = generate(model, PROMPTS, MAX_NEW)
    assert greedy.finish_reasons == ["length"] * len(PROMPTS)
    got, al, wrong_tokens = {}, {}, []
    for draft, k in EXPECTED:
        r = generate(model, PROMPTS, MAX_NEW, draft=draft, k=k, verify="strict")
        got[draft, k] = list(r.metrics.accepted_hist)
        al[draft, k] = round(r.metrics.mean_accepted_len, 4)
        if r.tokens != greedy.tokens:
            wrong_tokens.append(f"{draft} k={k}")
    assert not wrong_tokens, f"strict speculative output differs from plain greedy for {wrong_tokens}"
    moved = [f"  {d} k={k}: hist {EXPECTED[d, k]} -> {got[d, k]}, AL {EXPECTED_AL[d, k]:.4f} -> {al[d, k]:.4f}"
             for d, k in EXPECTED if got[d, k] != EXPECTED[d, k] or al[d, k] != EXPECTED_AL[d, k]]
    assert not moved, "acceptance of the shipped model moved (old -> new):\n" + "\n".join(moved) + \
        f"\nnew EXPECTED = {got}\nnew EXPECTED_AL = {al}"
    for key, hist in got.items():  # the AL is the histogram's, not a separate number that could drift alone
        steps = sum(hist)
        assert al[key] == round(1 + sum(a * c for a, c in enumerate(hist)) / steps, 4)
