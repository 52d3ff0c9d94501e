"""The verifiers by name: `verify=` maps to a `Verifier`, which names its chain rule, its tree rule and what it needs.

Torch-free: `GenerationConfig` checks a name and a verifier's needs (thinking ids, sampling options, graph capture of
its tree rule) without loading the verifiers; the rules themselves are imported when an engine is built
(`Verifier.chain_rule()` / `tree_rule()`), so a registered name whose rule does not exist fails there, at
construction, and an unregistered name fails when the config is built. Nothing falls back to another verifier.

A rule adapts one verifier to the engine's call, reading its options from the `GenerationConfig` `g`:

    chain(g, drafts_BK, q_BKV, logits_BKV, think_B, rng) -> Verdict        (mtp.verify.common)
    tree(g, tt, draft, logits_BNV, think_B, rng, live_BN) -> TreeVerdict    (mtp.verify.tree)

`q_BKV` / `draft.q_BNV`: the draft distributions (None for greedy drafts); `rng`: the step's `RowDraws` (chains) or
the tree engine's torch.Generator; `tt`: the tree's `TreeTensors`; `draft`: the `TreeDraft` (tokens_BN, q_BNV);
`live_BN`: nodes the adaptive length kept (None: all). The prefill's first token is the chain rule over no drafts.
A verifier whose verdict reads the logits only through their argmax (strict) also names its rules of the argmax:

    chain_argmax(g, drafts_BK, target_BK1) -> Verdict                     (target_BK1 = logits_BKV.argmax(-1))
    tree_argmax(g, tt, draft, target_BN, live_BN, opts) -> TreeVerdict

and the engine then takes that argmax with the health check of the logits in one scan (`mtp.decode.health.scan`:
one launch on the fast path, switch `FastPathOptions.logits_scan`), where another verifier's rule gets the logits.
`opts`: the model's `FastPathOptions` (None on the reference path), for a rule that has a kernel (strict's tree
verdict: one launch, switch tree_verdict).
Adding one: a file with the two functions, `register_verifier(Verifier(...))` here, and its test (mtp/DESIGN.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from ..spec.options import OptionError


@dataclass(frozen=True)
class Verifier:
    name: str  # the `verify=` option
    chain: str  # "module:function" of the chain rule
    tree: str | None = None  # "module:function" of the tree rule; None: chains only (a tree config is refused)
    options: tuple[str, ...] = ()  # the GenerationConfig fields its rules read, besides the tensors
    samples: bool = False  # reads SamplingParams (temperature, top_k, top_p): the config keeps them for it
    exact_with_sampled_drafts: bool = False  # stays exact when drafts are drawn from q (draft_sampling='sample')
    needs_think_ids: bool = False  # acts on thinking spans: a config without think_ids is refused
    tree_graphs: bool = True  # its tree rule can run inside a captured graph (False: it draws from a Generator)
    greedy_output: bool = False  # its output is plain greedy decoding's, token for token (strict): the applications
    # compare a verifier's outputs with strict greedy ones and flag rows at the acceptance ceiling only without it
    chain_argmax: str | None = None  # "module:function" of its chain rule of the target's argmax (None: it needs the
    # logits); the same verdict as `chain` on the logits' argmax
    tree_argmax: str | None = None  # likewise of its tree rule
    argmax_prefix: bool = False  # its chain verdict of the argmax is strict's (`strict.strict_verdict`: the drafts'
    # leading run equal to the argmax, the argmax after it, none relaxed): the fast path's commit kernel takes the
    # argmax and makes that verdict inside its launch (switch strict_commit, `mtp.kernels.step_commit`)

    def chain_rule(self) -> Callable:
        return _resolve(self.name, "chain", self.chain)

    def tree_rule(self) -> Callable:
        if self.tree is None:
            raise ValueError(f"verify={self.name!r} has no tree rule; tree decoding takes "
                             f"{', '.join(n for n, v in VERIFIER_REGISTRY.items() if v.tree)}")
        return _resolve(self.name, "tree", self.tree)

    def chain_argmax_rule(self) -> Callable | None:
        """Its chain rule of the target's argmax, None when it reads more of the logits."""
        return None if self.chain_argmax is None else _resolve(self.name, "chain argmax", self.chain_argmax)

    def tree_argmax_rule(self) -> Callable | None:
        """Its tree rule of the target's argmax at every node, None when it reads more of the logits."""
        return None if self.tree_argmax is None else _resolve(self.name, "tree argmax", self.tree_argmax)


def _resolve(name: str, kind: str, where: str) -> Callable:
    mod, _, fn = where.partition(":")
    try:
        rule = getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"verify={name!r} is registered with {kind} rule {where!r}, which does not load: {e}") from None
    if not callable(rule):
        raise ValueError(f"verify={name!r}: its {kind} rule {where!r} is not a function")
    return rule


VERIFIER_REGISTRY: dict[str, Verifier] = {}


def register_verifier(v: Verifier) -> Verifier:
    """Make `v` the verifier of `verify=v.name` (a name registered twice is refused)."""
    if not isinstance(v, Verifier):
        raise TypeError(f"register_verifier takes a Verifier, got {v!r}")
    if v.name in VERIFIER_REGISTRY and VERIFIER_REGISTRY[v.name] != v:
        raise ValueError(f"a verifier named {v.name!r} is already registered")
    named = (v.chain, v.tree, v.chain_argmax, v.tree_argmax)
    if any(r is not None and ":" not in r for r in named) or v.chain is None:
        raise ValueError(f"verifier {v.name!r}: rules are named 'module:function', got {', '.join(map(repr, named))}")
    if v.tree_argmax is not None and v.tree is None:
        raise ValueError(f"verifier {v.name!r}: a tree rule of the argmax ({v.tree_argmax!r}) needs its tree rule")
    VERIFIER_REGISTRY[v.name] = v
    return v


def verifier(name) -> Verifier:
    """The registered verifier of `name`, or the registered object itself."""
    if isinstance(name, Verifier):
        if VERIFIER_REGISTRY.get(name.name) != name:
            raise OptionError("verify", name, "a registered verifier (mtp.verify.registry.register_verifier) or its "
                              "name", f"registered: {', '.join(VERIFIER_REGISTRY)}")
        return name
    if isinstance(name, str) and name in VERIFIER_REGISTRY:
        return VERIFIER_REGISTRY[name]
    raise OptionError("verify", name, f"one of {', '.join(VERIFIER_REGISTRY)}")


register_verifier(Verifier("strict", "mtp.verify.strict:chain", "mtp.verify.tree:strict", greedy_output=True,
                           chain_argmax="mtp.verify.strict:chain_argmax", tree_argmax="mtp.verify.tree:strict_argmax",
                           argmax_prefix=True))
register_verifier(Verifier("relaxed", "mtp.verify.relaxed:chain", "mtp.verify.tree:relaxed",
                           options=("top_n", "delta", "think_ids", "span_rule"), needs_think_ids=True))
register_verifier(Verifier("sample", "mtp.verify.sampling:chain", "mtp.verify.tree:sampling", options=("sampling",),
                           samples=True, exact_with_sampled_drafts=True, tree_graphs=False))
register_verifier(Verifier("typical", "mtp.verify.typical:chain", "mtp.verify.tree:typical",
                           options=("sampling", "posterior_threshold", "posterior_alpha"), samples=True))
VERIFIERS = tuple(VERIFIER_REGISTRY)  # the built-in names, for the front ends' choices
