"""Verifiers: pure functions over device tensors deciding how many drafted tokens the target accepts.

Shape legend: B batch, K drafted tokens, V vocabulary. Every verifier takes the drafts `draft_BK` and the
target logits at the K+1 verified positions `logits_BKV` (position j predicts the token after the j-th
verified input; position 0 checks draft 1) and returns a `Verdict`: accepted count a in [0, K] per row and
the one token the target adds after them (the correction at the first miss, or the bonus after all K).
Draft trees have their own verifiers (tree.py): the same rules over the paths of a static tree.

The verifiers by name, with their chain and tree rules: `registry.py` (torch-free). The names below load on first use;
`SamplingParams`, `SPAN_RULES` and `filter_probs` live in the shared leaves (mtp/spec/: drafting uses them too)
and are named here as well, as the verifiers' options.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .common import Verdict
    from ..spec.options import SPAN_RULES, SamplingParams
    from .relaxed import prompt_think_state, relaxed_verify, update_think_state
    from ..spec.draws import filter_probs
    from .sampling import sampling_verify
    from .strict import strict_verify
    from .tree import TreeVerdict, tree_relaxed_verify, tree_sampling_verify, tree_strict_verify, tree_typical_verify
    from .typical import typical_verify

_EXPORTS = {
    "Verdict": "common", "SPAN_RULES": "..spec.options", "SamplingParams": "..spec.options",
    "prompt_think_state": "relaxed", "relaxed_verify": "relaxed", "update_think_state": "relaxed",
    "filter_probs": "..spec.draws", "sampling_verify": "sampling", "strict_verify": "strict",
    "TreeVerdict": "tree", "tree_relaxed_verify": "tree", "tree_sampling_verify": "tree",
    "tree_strict_verify": "tree", "tree_typical_verify": "tree", "typical_verify": "typical",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        mod = _EXPORTS[name]
        return getattr(importlib.import_module(mod if mod.startswith(".") else f".{mod}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
