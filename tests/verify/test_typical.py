"""Typical acceptance (Medusa / TensorRT-LLM posterior_threshold, posterior_alpha) against hand-computed cases,
and the verifier registries (an unknown name is an error, never sampling)."""

from __future__ import annotations

import pytest
import torch

from mtp.verify.registry import VERIFIER_REGISTRY, VERIFIERS
from mtp.spec.tree_shape import TreeShape
from mtp.verify import tree_typical_verify, typical_verify

# Position j's target distribution (V = 3). Entropies: H0 = 0.8018 (exp(-H0) = 0.4485), H1 = 0.8557 (0.4250).
P = torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.45, 0.05], [0.1, 0.1, 0.8]])


def test_chain_threshold_is_the_smaller_of_threshold_and_alpha_exp_minus_entropy():
    logits = P.log().unsqueeze(0)
    # alpha 0.3: thresholds min(0.09, 0.1346) = 0.09 and min(0.09, 0.1275) = 0.09. Draft 1 (p 0.2) passes,
    # draft 2 (p 0.05) does not: a = 1, then the target's argmax at position 1 (token 0).
    v = typical_verify(torch.tensor([[1, 2]]), logits, 1.0, 0.09, 0.3)
    assert (v.accept_len_B.item(), v.next_token_B.item(), v.relaxed_only_B.item()) == (1, 0, 1)
    # alpha 0.1: thresholds 0.0449 and 0.0425: draft 1 = token 2 (p 0.1) and draft 2 = token 2 (p 0.05) pass;
    # the token after both is the argmax at position 2 (token 2).
    v = typical_verify(torch.tensor([[2, 2]]), logits, 1.0, 0.09, 0.1)
    assert (v.accept_len_B.item(), v.next_token_B.item(), v.relaxed_only_B.item()) == (2, 2, 2)
    # batched rows are independent: row 0's token 2 passes at 0.1 > 0.09 then fails at 0.05; row 1 passes twice
    v = typical_verify(torch.tensor([[2, 2], [0, 0]]), logits.expand(2, -1, -1), 1.0, 0.09, 0.3)
    assert v.accept_len_B.tolist() == [1, 2] and v.next_token_B.tolist() == [0, 2]


def test_temperature_divides_the_logits_first():
    """Logits doubled at T = 2 are the T = 1 case; at T = 1 they are sharper and draft 1 (p 0.2 -> 0.075) fails."""
    logits2 = 2 * P.log().unsqueeze(0)
    v = typical_verify(torch.tensor([[1, 2]]), logits2, 2.0, 0.09, 0.3)
    assert v.accept_len_B.item() == 1
    v = typical_verify(torch.tensor([[1, 2]]), logits2, 1.0, 0.09, 0.3)
    assert (v.accept_len_B.item(), v.next_token_B.item()) == (0, 0)


def test_tree_takes_the_deepest_path_whose_nodes_all_pass():
    tree = TreeShape.from_paths([(0,), (1,), (0, 0)])  # nodes 1 = (0,), 2 = (1,), 3 = (0, 0)
    tt = tree.tensors()
    logits = torch.stack((P[0], P[1], P[2], P[2])).log().unsqueeze(0)  # node i's logits judge its children
    v = tree_typical_verify(tt, torch.tensor([[2, 0, 1, 2]]), logits, 1.0, 0.09, 0.3)
    # node 1 (token 0, p 0.7) and node 2 (token 1, p 0.2) pass at the root; node 3 (token 2, p 0.05 at node 1) fails
    assert (v.accept_len_B.item(), v.next_token_B.item(), v.path_BA[0, 1].item()) == (1, 0, 1)
    v = tree_typical_verify(tt, torch.tensor([[2, 0, 1, 1]]), logits, 1.0, 0.09, 0.3)
    assert (v.accept_len_B.item(), v.path_BA[0].tolist(), v.next_token_B.item()) == (2, [0, 1, 3], 2)
    live = torch.tensor([[True, True, True, False]])  # a pruned node is never accepted
    assert tree_typical_verify(tt, torch.tensor([[2, 0, 1, 1]]), logits, 1.0, 0.09, 0.3, live).accept_len_B.item() == 1


def test_every_built_in_verifier_has_a_chain_and_a_tree_rule():
    assert VERIFIERS == ("strict", "relaxed", "sample", "typical")
    for v in VERIFIER_REGISTRY.values():
        assert callable(v.chain_rule()) and callable(v.tree_rule())


def test_generate_runs_typical_on_chains_and_trees_and_refuses_unknown_names(tiny_model):
    import mtp
    from mtp.decode.config import GenerationConfig
    from mtp.decode.engine import Engine
    from mtp.spec.options import OptionError

    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    for tree in (None, "2x1"):
        out = mtp.generate(tiny_model, prompts, 6, draft="eagle", k=2, verify="typical", temperature=0.7,
                           posterior_threshold=0.3, posterior_alpha=0.3, tree=tree)
        assert [len(t) for t in out.tokens] == [6, 6]
    with pytest.raises(OptionError, match="one of strict, relaxed, sample, typical"):
        GenerationConfig.from_options(4, "eagle", 1, verify="medusa")
    with pytest.raises(OptionError, match="posterior_alpha"):
        GenerationConfig.from_options(4, "eagle", 1, verify="typical", posterior_alpha=0.0)
    g = GenerationConfig.from_options(4, "eagle", 1)
    object.__setattr__(g, "verify", "medusa")  # past the option check: the registry itself must refuse
    with pytest.raises(OptionError, match="verify must be one of strict, relaxed, sample, typical, got 'medusa'"):
        Engine(tiny_model, g)
