"""The verifier registry (mtp.verify.registry): a name maps to its chain and tree rules and its needs; an unknown
name, a registered one whose rule does not load, or a chains-only verifier asked for a tree is an error when the
config or the engine is built, never a fallback to another verifier; `generate` takes a registered verifier by
name or as the object; and adding one is a file, a registration and a test (the one below: `accept_none`)."""

from __future__ import annotations

import pytest
import torch

import mtp
from mtp.decode.config import GenerationConfig
from mtp.decode.engine import Engine
from mtp.spec.options import OptionError
from mtp.verify.common import Verdict
from mtp.verify.registry import VERIFIER_REGISTRY, Verifier, register_verifier, verifier
from mtp.verify.tree import TreeVerdict

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]


# ---- a verifier that accepts no draft: the target's argmax after x_{n-1} (so its output is greedy decoding's)
def chain(g, drafts_BK, q_BKV, logits_BKV, think_B, rng) -> Verdict:
    a_B = torch.zeros(drafts_BK.shape[0], dtype=torch.long, device=drafts_BK.device)
    return Verdict(a_B, logits_BKV[:, 0].argmax(-1), a_B)


def tree(g, tt, draft, logits_BNV, think_B, rng, live_BN) -> TreeVerdict:
    B, A = draft.tokens_BN.shape[0], tt.path_NA.shape[1]
    a_B = torch.zeros(B, dtype=torch.long, device=logits_BNV.device)
    return TreeVerdict(a_B, logits_BNV[:, 0].argmax(-1), torch.zeros(B, A, dtype=torch.long, device=a_B.device), a_B)


def test_a_new_verifier_is_one_registration_away(tiny_model, registered):
    v = registered(Verifier("accept_none", f"{__name__}:chain", f"{__name__}:tree"))
    greedy = mtp.generate(tiny_model, PROMPTS, 8, draft="none")
    for kw in (dict(k=2), dict(tree="2x1")):
        for name in ("accept_none", v):  # by name or as the registered object
            out = mtp.generate(tiny_model, PROMPTS, 8, draft="eagle", verify=name, **kw)
            assert out.tokens == greedy.tokens
            assert out.metrics.verify == "accept_none" and sum(out.metrics.accepted_hist[1:]) == 0
            assert out.metrics.accepted_hist[0] == out.metrics.row_steps > 0


def test_unknown_names_fail_when_the_config_is_built():
    with pytest.raises(OptionError, match="verify must be one of strict, relaxed, sample, typical, got 'medusa'"):
        GenerationConfig.from_options(4, "eagle", 1, verify="medusa")
    with pytest.raises(OptionError, match="verify must be one of"):
        GenerationConfig(verify="medusa")
    stray = Verifier("strict", "mtp.verify.strict:chain")  # equal name, not the registered object
    with pytest.raises(OptionError, match="a registered verifier"):
        verifier(stray)
    with pytest.raises(ValueError, match="already registered"):
        register_verifier(stray)


def test_a_registered_name_without_its_rule_fails_when_the_engine_is_built(tiny_model, registered):
    registered(Verifier("ghost", "mtp.verify.strict:no_such_rule"))
    g = GenerationConfig.from_options(4, "eagle", 1, verify="ghost")  # the name is registered: the config is fine
    with pytest.raises(ValueError, match="verify='ghost' is registered with chain rule 'mtp.verify.strict:no_such_rule'"):
        Engine(tiny_model, g)
    registered(Verifier("half", "mtp.verify.strict:chain", "mtp.verify.nowhere:tree"))
    g = GenerationConfig.from_options(4, "eagle", None, verify="half", tree="2x1")
    with pytest.raises(ValueError, match="verify='half' is registered with tree rule 'mtp.verify.nowhere:tree'"):
        Engine(tiny_model, g)


def test_a_chains_only_verifier_is_refused_for_a_tree(registered):
    registered(Verifier("chain_only", f"{__name__}:chain"))
    GenerationConfig.from_options(4, "eagle", 2, verify="chain_only")
    with pytest.raises(OptionError, match="verify must be a verifier with a tree rule with tree '2x1'"):
        GenerationConfig.from_options(4, "eagle", None, verify="chain_only", tree="2x1")


def test_needs_come_from_the_registration(registered):
    """What the config checks per verifier is read from its registration, not from its name."""
    registered(Verifier("spans", f"{__name__}:chain", needs_think_ids=True))
    with pytest.raises(OptionError, match="think_ids must be a \\(<think> id, </think> id\\) pair with verify='spans'"):
        GenerationConfig.from_options(4, "eagle", 1, verify="spans")
    registered(Verifier("draws", f"{__name__}:chain", samples=True))
    assert GenerationConfig.from_options(4, "eagle", 1, verify="draws", temperature=0.5).sampling.temperature == 0.5
    assert GenerationConfig.from_options(4, "eagle", 1, verify="strict", temperature=0.5).sampling.temperature == 1.0
    with pytest.raises(OptionError, match="draft_sampling"):
        GenerationConfig.from_options(4, "eagle", 1, verify="draws", draft_sampling="sample")
