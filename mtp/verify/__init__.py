"""Verifiers: pure functions over device tensors deciding how many drafted tokens the target accepts.

Shape legend: B batch, K drafted tokens, V vocabulary. Every verifier takes the drafts `draft_BK` and the
target logits at the K+1 verified positions `logits_BKV` (position j predicts the token after the j-th
verified input; position 0 checks draft 1) and returns a `Verdict`: accepted count a in [0, K] per row and
the one token the target adds after them (the correction at the first miss, or the bonus after all K).
Draft trees have their own verifiers (tree.py): the same rules over the paths of a static tree.
"""

from .common import Verdict
from .relaxed import SPAN_RULES, prompt_think_state, relaxed_verify, update_think_state
from .sampling import SamplingParams, filter_probs, sampling_verify
from .strict import strict_verify
from .tree import TreeVerdict, tree_relaxed_verify, tree_sampling_verify, tree_strict_verify

__all__ = ["Verdict", "strict_verify", "relaxed_verify", "update_think_state", "prompt_think_state", "SPAN_RULES",
           "SamplingParams", "filter_probs", "sampling_verify", "TreeVerdict", "tree_strict_verify",
           "tree_relaxed_verify", "tree_sampling_verify"]
