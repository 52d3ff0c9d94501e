"""Verifiers as pure functions on crafted tensors: strict, relaxed (thinking spans), speculative sampling.

Shape legend: B batch (trials), K drafts, V vocabulary.

The sampling tests check the defining property of speculative rejection sampling: whatever the draft
distribution q, every emitted token follows the target distribution p. They run ~20k seeded trials as one
batch and use a chi-square goodness-of-fit test at alpha = 0.001 against a hard-coded critical value.
"""

from __future__ import annotations

import pytest
import torch

from mtp.verify import (SamplingParams, filter_probs, prompt_think_state, relaxed_verify, sampling_verify,
                        strict_verify, update_think_state)
from mtp.spec.draws import RowDraws, seed_tensor, splitmix64, splitmix64_ref
from mtp.verify.sampling import sample

# Chi-square critical values at alpha = 0.001 by degrees of freedom (statistical tables; cross-checked against
# torch.special.gammaincc in test_critical_values). A correct sampler fails one such test once in 1000 seeds;
# the seeds below are fixed, so the tests are deterministic.
CHI2_CRIT_001 = {2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}
TH, ETH = 6, 7  # <think>, </think> in the crafted vocabularies below


def chi2_stat(tokens: torch.Tensor, p_V: torch.Tensor) -> tuple[float, int]:
    """Goodness of fit of the observed tokens to p over p's support: (statistic, degrees of freedom)."""
    counts = torch.bincount(tokens, minlength=p_V.numel()).double()
    support = p_V > 0
    assert counts[~support].sum() == 0, f"tokens outside the support of p were emitted: {counts[~support]}"
    exp = counts.sum() * p_V.double()[support]
    return float(((counts[support] - exp) ** 2 / exp).sum()), int(support.sum()) - 1


def assert_follows(tokens: torch.Tensor, p_V: torch.Tensor, what: str) -> None:
    stat, dof = chi2_stat(tokens, p_V)
    min_expected = tokens.numel() * float(p_V[p_V > 0].min())
    assert min_expected >= 10, f"{what}: too few samples ({tokens.numel()}) for a chi-square test"
    assert stat < CHI2_CRIT_001[dof], (f"{what}: chi2 = {stat:.1f} >= {CHI2_CRIT_001[dof]} ({dof} dof, alpha 0.001) "
                                       f"over {tokens.numel()} samples; observed "
                                       f"{(torch.bincount(tokens, minlength=p_V.numel()) / tokens.numel()).tolist()}"
                                       f" vs p {p_V.tolist()}")


def logits_from(probs) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


def test_critical_values():
    for dof, crit in CHI2_CRIT_001.items():
        tail = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(crit / 2))
        assert abs(float(tail) - 1e-3) < 1e-6, (dof, float(tail))


# ---------------------------------------------------------------------------------------------- strict
def test_strict_accepts_the_argmax_prefix_and_adds_one_target_token():
    V = 5
    argmax_BK1 = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [4, 0, 0]])
    logits = torch.nn.functional.one_hot(argmax_BK1, V).float() * 3 + 0.1 * torch.randn(4, 3, V)
    drafts = torch.tensor([[1, 2], [1, 4], [0, 2], [4, 0]])
    v = strict_verify(drafts, logits)
    assert v.accept_len_B.tolist() == [2, 1, 0, 2]
    assert v.next_token_B.tolist() == [3, 2, 1, 0]  # bonus after all K, else the correction at the miss
    assert v.relaxed_only_B.tolist() == [0, 0, 0, 0]
    v0 = strict_verify(drafts[:, :0], logits[:, :1])  # K = 0: plain greedy decoding
    assert v0.accept_len_B.tolist() == [0] * 4 and v0.next_token_B.tolist() == [1, 1, 1, 4]


# ---------------------------------------------------------------------------------------------- relaxed
def test_update_think_state():
    s = torch.tensor([False, True, False, True])
    toks = torch.tensor([[1, TH, 2], [ETH, 3, 4], [TH, ETH, 5], [TH, 2, 3]])
    valid = torch.tensor([[True, True, True], [True, True, True], [True, False, True], [True, True, True]])
    out = update_think_state(s, toks, valid, TH, ETH)
    assert out.tolist() == [True, False, True, True]
    assert s.tolist() == [False, True, False, True]  # a new tensor: the input state is untouched


# One position's distribution over V = 8 (ids 6, 7 are <think>, </think>): top-1 is token 0, 2nd-best token 1 is
# within delta = 0.6 of it, token 2 is in the top 3 but 0.35 below top-1.
P_ROW = [0.40, 0.30, 0.05, 0.04, 0.03, 0.02, 0.08, 0.08]


def crafted(rows: list[list[list[float]]]) -> torch.Tensor:
    return torch.stack([torch.stack([logits_from(p) for p in r]) for r in rows])


def test_relaxed_outside_a_span_is_strict():
    logits = crafted([[P_ROW, P_ROW, P_ROW]] * 2)
    drafts = torch.tensor([[1, 0], [0, 1]])  # 2nd-best tokens, close to top-1 and inside top_n
    v = relaxed_verify(drafts, logits, torch.tensor([False, False]), top_n=10, delta=0.6, think_id=TH,
                       end_think_id=ETH)
    assert v.accept_len_B.tolist() == [0, 1]
    assert v.next_token_B.tolist() == [0, 0]
    assert v.relaxed_only_B.tolist() == [0, 0]


def test_relaxed_inside_a_span_accepts_close_candidates_only():
    logits = crafted([[P_ROW, P_ROW, P_ROW]] * 5)
    think = torch.ones(5, dtype=torch.bool)
    drafts = torch.tensor([[1, 1], [2, 0], [2, 0], [1, 4], [1, 0]])
    # row 0: both 2nd-best -> both accepted, bonus = argmax; row 1: token 2 is 0.35 below top-1 > delta 0.3 below;
    # row 2: with delta 0.4 it is accepted; row 3: token 4 (p 0.03) is outside top_n = 3; row 4: top_n = 1 keeps
    # only the argmax, so a close 2nd-best is still rejected.
    cases = [(0, 10, 0.6, 2, 2), (1, 10, 0.3, 0, 0), (2, 10, 0.4, 2, 1), (3, 3, 0.6, 1, 1), (4, 1, 0.6, 0, 0)]
    for row, top_n, delta, a, relaxed_only in cases:
        v = relaxed_verify(drafts[row: row + 1], logits[row: row + 1], think[row: row + 1], top_n, delta, TH, ETH)
        assert (v.accept_len_B.item(), v.relaxed_only_B.item()) == (a, relaxed_only), (row, top_n, delta)
        assert v.next_token_B.item() == 0  # the token after the accepted prefix is always the target argmax


def test_relaxed_span_opening_and_closing_inside_the_drafts():
    opens = [[0.1, 0.1, 0.05, 0.05, 0.05, 0.05, 0.55, 0.05], P_ROW, P_ROW, P_ROW]  # argmax at position 0: <think>
    closes = [P_ROW, [0.1, 0.1, 0.05, 0.05, 0.05, 0.05, 0.05, 0.55], P_ROW, P_ROW]  # argmax at 1: </think>
    logits = crafted([opens, closes, opens])
    drafts = torch.tensor([[TH, 1, 1], [1, ETH, 1], [5, 1, 1]])
    think = torch.tensor([False, True, False])
    v = relaxed_verify(drafts, logits, think, top_n=10, delta=0.6, think_id=TH, end_think_id=ETH)
    # row 0: <think> matches the argmax, then the span is open: two relaxed accepts, bonus = argmax.
    # row 1: in the span the 2nd-best is accepted, </think> is the argmax, after it the rule is strict again.
    # row 2: a wrong first draft outside the span: nothing accepted, the correction is the argmax (<think>).
    assert v.accept_len_B.tolist() == [3, 2, 0]
    assert v.relaxed_only_B.tolist() == [2, 1, 0]
    assert v.next_token_B.tolist() == [0, 0, TH]


def test_relaxed_with_zero_delta_equals_strict():
    g = torch.Generator().manual_seed(0)
    B, K, V = 4000, 3, 8
    logits = torch.randn(B, K + 1, V, generator=g) * 0.5
    target = logits.argmax(-1)
    # Drafts: the argmax with prob 0.6 per position, a random token otherwise; <think>/</think> sprinkled in.
    drafts = torch.where(torch.rand(B, K, generator=g) < 0.6, target[:, :K], torch.randint(0, V, (B, K), generator=g))
    think = torch.rand(B, generator=g) < 0.5
    s = strict_verify(drafts, logits)
    r = relaxed_verify(drafts, logits, think, top_n=10, delta=0.0, think_id=TH, end_think_id=ETH)
    assert torch.equal(r.accept_len_B, s.accept_len_B) and torch.equal(r.next_token_B, s.next_token_B)
    assert int(r.relaxed_only_B.sum()) == 0
    # And with delta > 0 outside every span (no span open, no <think> drafted): still strict.
    drafts_no_think = drafts.masked_fill(drafts == TH, 0)
    r = relaxed_verify(drafts_no_think, logits, torch.zeros(B, dtype=torch.bool), 10, 0.6, TH, ETH)
    s = strict_verify(drafts_no_think, logits)
    assert torch.equal(r.accept_len_B, s.accept_len_B) and torch.equal(r.next_token_B, s.next_token_B)


def test_relaxed_breaks_near_ties_like_strict():
    # Logits 1e-3 and 1e-3 + 1.2e-10 differ in fp32 but softmax rounds them to the same probability: an argmax of
    # the probabilities would pick token 0, strict (argmax of the logits) picks token 1.
    logits = torch.tensor([[[1e-3, 1e-3 + 1.2e-10, -5.0, -5.0]]])
    assert logits[0, 0, 0] != logits[0, 0, 1]
    empty = torch.zeros(1, 0, dtype=torch.long)
    s = strict_verify(empty, logits)
    r = relaxed_verify(empty, logits, torch.zeros(1, dtype=torch.bool), 10, 0.0, TH, ETH)
    assert r.next_token_B.tolist() == s.next_token_B.tolist() == [1]


# TensorRT-LLM's rule (span_rule='trtllm'), written from its statement: the span state at the start of the step
# holds for all K drafts, and after the prompt the span is on if the prompt holds any <think>.
def test_trtllm_rule_keeps_the_step_start_state_for_all_drafts():
    opens = [[0.1, 0.1, 0.05, 0.05, 0.05, 0.05, 0.55, 0.05], P_ROW, P_ROW, P_ROW]  # argmax at position 0: <think>
    closes = [[0.1, 0.1, 0.05, 0.05, 0.05, 0.05, 0.05, 0.55], P_ROW, P_ROW, P_ROW]  # argmax at 0: </think>
    logits = crafted([opens, closes])
    drafts = torch.tensor([[TH, 1, 1], [ETH, 1, 1]])  # the marker (exact), then 2nd-best tokens (relaxed only)
    think = torch.tensor([False, True])
    tracked = relaxed_verify(drafts, logits, think, 10, 0.6, TH, ETH, span_rule="tracked")
    trt = relaxed_verify(drafts, logits, think, 10, 0.6, TH, ETH, span_rule="trtllm")
    # row 0: a drafted <think> opens the span for the drafts after it (tracked) / does not (trtllm: still off).
    # row 1: a drafted </think> closes it (tracked) / does not (trtllm: still on, both 2nd-best drafts pass).
    assert tracked.accept_len_B.tolist() == [3, 1] and tracked.relaxed_only_B.tolist() == [2, 0]
    assert trt.accept_len_B.tolist() == [1, 3] and trt.relaxed_only_B.tolist() == [0, 2]
    assert trt.next_token_B.tolist() == [0, 0]


def test_trtllm_rule_with_zero_delta_equals_strict():
    g = torch.Generator().manual_seed(1)
    B, K, V = 2000, 3, 8
    logits = torch.randn(B, K + 1, V, generator=g) * 0.5
    drafts = torch.where(torch.rand(B, K, generator=g) < 0.6, logits.argmax(-1)[:, :K],
                         torch.randint(0, V, (B, K), generator=g))
    r = relaxed_verify(drafts, logits, torch.ones(B, dtype=torch.bool), 10, 0.0, TH, ETH, span_rule="trtllm")
    s = strict_verify(drafts, logits)
    assert torch.equal(r.accept_len_B, s.accept_len_B) and torch.equal(r.next_token_B, s.next_token_B)


def test_prompt_think_state_by_rule():
    prompts = torch.tensor([[1, TH, 2, ETH, 3], [ETH, 2, TH, 3, 4], [1, 2, 3, 4, 5], [1, 2, 3, ETH, TH]])
    valid = torch.ones_like(prompts, dtype=torch.bool)
    valid[3, 4] = False  # row 3's <think> is padding past the prompt
    assert prompt_think_state(prompts, valid, TH, ETH, "tracked").tolist() == [False, True, False, False]
    assert prompt_think_state(prompts, valid, TH, ETH, "trtllm").tolist() == [True, True, False, False]


def test_top_n_membership_is_by_value():
    # Tokens 1, 2, 3 tie at the 2nd-largest probability: with top_n = 2 each of them is "in the top 2".
    logits = crafted([[[0.40, 0.15, 0.15, 0.15, 0.05, 0.04, 0.03, 0.03]] * 2] * 3)
    drafts = torch.tensor([[1], [3], [4]])
    v = relaxed_verify(drafts, logits, torch.ones(3, dtype=torch.bool), top_n=2, delta=0.6, think_id=TH,
                       end_think_id=ETH)
    assert v.accept_len_B.tolist() == [1, 1, 0]


def test_unknown_span_rule_is_refused():
    logits = crafted([[P_ROW, P_ROW]])
    with pytest.raises(ValueError, match=r"span_rule must be one of \('tracked', 'trtllm'\), got 'vllm'"):
        relaxed_verify(torch.tensor([[1]]), logits, torch.ones(1, dtype=torch.bool), 10, 0.6, TH, ETH, "vllm")


# ---------------------------------------------------------------------------------------------- sampling
def test_filter_probs_top_k_top_p_temperature():
    p = torch.tensor([[0.05, 0.4, 0.1, 0.25, 0.2]])
    logits = p.log()
    out = filter_probs(logits, SamplingParams())
    torch.testing.assert_close(out, p)
    out = filter_probs(logits, SamplingParams(top_k=2))
    torch.testing.assert_close(out, torch.tensor([[0, 0.4, 0, 0.25, 0]]) / 0.65)
    # Nucleus: sorted 0.4, 0.25, 0.2, ...; 0.4 + 0.25 = 0.65 < 0.7, so the token crossing 0.7 (0.2) is kept.
    out = filter_probs(logits, SamplingParams(top_p=0.7))
    torch.testing.assert_close(out, torch.tensor([[0, 0.4, 0, 0.25, 0.2]]) / 0.85)
    out = filter_probs(logits, SamplingParams(top_p=0.65))  # reached exactly: the next token is dropped
    torch.testing.assert_close(out, torch.tensor([[0, 0.4, 0, 0.25, 0]]) / 0.65)
    out = filter_probs(logits, SamplingParams(top_p=0.3))  # the top token alone crosses
    torch.testing.assert_close(out, torch.tensor([[0.0, 1, 0, 0, 0]]))
    out = filter_probs(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(out, (p ** 2) / (p ** 2).sum())
    out = filter_probs(logits, SamplingParams(temperature=2.0, top_k=3, top_p=0.6))  # top-k, then nucleus
    t = p[0, [1, 3, 4]].sqrt() / p[0, [1, 3, 4]].sqrt().sum()  # 0.400, 0.317, 0.283: the 2nd crosses 0.6
    torch.testing.assert_close(out, torch.tensor([[0, t[0], 0, t[1], 0]]) / (t[0] + t[1]))
    batched = filter_probs(torch.randn(3, 4, 7), SamplingParams(top_k=3, top_p=0.9))
    torch.testing.assert_close(batched.sum(-1), torch.ones(3, 4))
    assert ((batched > 0).sum(-1) <= 3).all()


@pytest.mark.parametrize("bad", [dict(temperature=0.0), dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0),
                                 dict(top_p=1.5)])
def test_sampling_params_reject_bad_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_sample_follows_probs_and_skips_zero_mass():
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([0.0, 0.3, 0.0, 0.5, 0.2, 0.0])  # zeros first, in the middle and last
    toks = sample(p.expand(20000, -1), g)
    assert_follows(toks, p, "sample()")


P_TARGET = [[0.30, 0.25, 0.15, 0.12, 0.10, 0.08],  # position 0 (checks draft 1)
            [0.05, 0.10, 0.20, 0.30, 0.25, 0.10],  # position 1 (checks draft 2)
            [0.40, 0.05, 0.05, 0.10, 0.20, 0.20]]  # position 2 (the bonus after both)
Q_DRAFT = [[0.05, 0.10, 0.40, 0.20, 0.15, 0.10],
           [0.50, 0.20, 0.05, 0.05, 0.10, 0.10]]


def emitted_tokens(drafts_BK: torch.Tensor, a_B: torch.Tensor, next_B: torch.Tensor, j: int):
    """Token j (0-based) emitted by one verify, for the rows that emit it (those with a >= j)."""
    rows = a_B >= j
    tok = torch.where(a_B > j, drafts_BK[:, min(j, drafts_BK.shape[1] - 1)], next_B)
    return tok[rows]


def verify_rng(kind: str, seed: int, B: int):
    """The verifier's randomness: a torch.Generator, or the engine's per-row counter-based draws (row b seeded
    seed * B + b, all rows at the same position)."""
    if kind == "generator":
        return torch.Generator().manual_seed(seed)
    return RowDraws(seed_tensor(range(seed * B, seed * B + B), "cpu"), torch.full((B,), 17))


@pytest.mark.parametrize("rng", ["generator", "rows"])
@pytest.mark.parametrize("draws", ["greedy", "sampled"])
def test_speculative_sampling_keeps_the_target_distribution(draws, rng):
    """K = 2, V = 6, 20k trials: token 1 (draft 1 if accepted, else the residual sample) follows p_0; given
    draft 1 was accepted, token 2 follows p_1; given both were, the bonus follows p_2."""
    B, K = 20000, 2
    g = torch.Generator().manual_seed(7 if draws == "greedy" else 8)
    p = torch.tensor(P_TARGET)
    logits = p.log().expand(B, -1, -1)
    q = torch.tensor(Q_DRAFT).expand(B, -1, -1)
    drafts = sample(q, g)
    if draws == "greedy":
        # Point-mass drafts (q = one-hot at each row's draft). The drafts vary over rows with a skewed mix, not
        # uniformly: with uniform point masses, sampling p instead of the residual would also give p (symmetry).
        q = None
    v = sampling_verify(drafts, q, logits, SamplingParams(), verify_rng(rng, 7, B) if rng == "rows" else g)
    a = v.accept_len_B
    for j in range(K + 1):
        assert_follows(emitted_tokens(drafts, a, v.next_token_B, j), p[j], f"{draws} drafts, emitted token {j + 1}")
    # The test has power: the drafts themselves do not follow p, and a verifier that accepted every draft would fail.
    stat, dof = chi2_stat(drafts[:, 0], p[0])
    assert stat > 10 * CHI2_CRIT_001[dof]
    # relaxed_only counts accepted drafts that were not the argmax of p.
    assert torch.equal(v.relaxed_only_B, ((torch.arange(K) < a.unsqueeze(1)) & (drafts != p[:K].argmax(-1))).sum(1))


@pytest.mark.parametrize("rng", ["generator", "rows"])
def test_speculative_sampling_with_top_k_never_leaves_the_filtered_support(rng):
    B, K = 20000, 2
    g = torch.Generator().manual_seed(9)
    sp = SamplingParams(temperature=0.8, top_k=4)
    logits = torch.tensor(P_TARGET).log().expand(B, -1, -1)
    p = filter_probs(logits[0], sp)
    assert (p > 0).sum(-1).tolist() == [4, 5, 4]  # position 1 ties at the 4th value (0.10): both are kept
    q = filter_probs(torch.tensor(Q_DRAFT).log(), SamplingParams(top_k=3)).expand(B, -1, -1)  # a narrower draft
    drafts = sample(q, g)
    v = sampling_verify(drafts, q, logits, sp, verify_rng(rng, 9, B) if rng == "rows" else g)
    for j in range(K + 1):
        assert_follows(emitted_tokens(drafts, v.accept_len_B, v.next_token_B, j), p[j], f"top-k, token {j + 1}")


@pytest.mark.parametrize("rng", ["generator", "rows"])
def test_sampling_with_no_drafts_samples_the_target(rng):
    B = 20000
    g = verify_rng(rng, 10, B)
    p = torch.tensor(P_TARGET[0])
    v = sampling_verify(torch.zeros(B, 0, dtype=torch.long), None, p.log().expand(B, 1, -1), SamplingParams(), g)
    assert v.accept_len_B.eq(0).all()
    assert_follows(v.next_token_B, p, "K = 0")


def test_sampling_verify_is_reproducible_from_the_generator():
    B, K = 64, 2
    logits = torch.randn(B, K + 1, 6)
    drafts = torch.randint(0, 6, (B, K))
    runs = [sampling_verify(drafts, None, logits, SamplingParams(), torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(runs[0].accept_len_B, runs[1].accept_len_B)
    assert torch.equal(runs[0].next_token_B, runs[1].next_token_B)


def test_sampling_verify_refuses_draft_ids_outside_the_vocabulary():
    logits = torch.randn(2, 3, 6)
    for bad in (-1, 6):
        drafts = torch.tensor([[0, 1], [2, bad]])
        with pytest.raises(ValueError, match=rf"draft_BK holds ids outside the vocabulary \[0, 6\): \[{bad}\]"):
            sampling_verify(drafts, None, logits, SamplingParams(), torch.Generator().manual_seed(0))
    # check_ids=False leaves the check to the caller (the engine on CUDA); torch then fails on its own.
    with pytest.raises(RuntimeError):
        sampling_verify(torch.tensor([[0, 1], [2, 60]]), None, logits, SamplingParams(), None, check_ids=False)


# ---------------------------------------------------------------------------------------------- per-row draws
def test_splitmix64_on_tensors_equals_the_integer_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.cat((torch.randint(-2**63, 2**63 - 1, (5000,), generator=g), torch.tensor([0, 1, -1, -2**63])))
    got = [v & (2**64 - 1) for v in splitmix64(x).tolist()]
    assert got == [splitmix64_ref(v & (2**64 - 1)) for v in x.tolist()]


def test_row_draws_depend_only_on_the_rows_seed_position_and_stream():
    a = RowDraws(seed_tensor([5, 6, 7], "cpu"), torch.tensor([10, 11, 12])).uniform(3, 4)
    b = RowDraws(seed_tensor([7, 1, 5], "cpu"), torch.tensor([12, 99, 10])).uniform(3, 4)
    assert torch.equal(a[0], b[2]) and torch.equal(a[2], b[0])  # the same (seed, position): the same numbers
    assert torch.equal(a[:, 1:], RowDraws(seed_tensor([5, 6, 7], "cpu"), torch.tensor([10, 11, 12])).uniform(4, 3))
    moved = RowDraws(seed_tensor([5, 6, 7], "cpu"), torch.tensor([11, 12, 13])).uniform(3, 4)
    assert not torch.isclose(moved, a).any()
    assert torch.equal(seed_tensor([2**64 + 5, -1], "cpu"), seed_tensor([5, 2**64 - 1], "cpu"))  # modulo 2^64


def test_row_draws_are_uniform():
    """40k draws over seeds x positions x streams in 40 equal bins: chi-square at alpha 0.001 (39 dof: 72.05)."""
    seeds = seed_tensor([s // 100 for s in range(10000)], "cpu")
    u = RowDraws(seeds, torch.arange(10000) % 100).uniform(0, 4).flatten()
    assert 0 <= float(u.min()) and float(u.max()) < 1
    counts = torch.bincount((u * 40).long(), minlength=40).double()
    e = u.numel() / 40
    assert float(((counts - e) ** 2 / e).sum()) < 72.05
    # Neighbouring seeds, positions and streams are not correlated.
    cols = torch.stack((u[0::4], u[1::4], u[2::4]))
    assert torch.corrcoef(cols).sub(torch.eye(3)).abs().max() < 0.03


def test_sample_with_row_draws_follows_probs():
    p = torch.tensor([0.0, 0.3, 0.0, 0.5, 0.2, 0.0])
    B = 20000
    toks = sample(p.expand(B, -1), RowDraws(seed_tensor(range(B), "cpu"), torch.zeros(B, dtype=torch.long)))
    assert_follows(toks, p, "sample() with per-row draws")
