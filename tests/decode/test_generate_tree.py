"""`mtp.generate` takes draft trees: its keyword form (`tree=`) and a GenerationConfig carrying the tree (its
DraftConfig) decode exactly as `generate_tree`, return the chain engine's result with the tree's metrics beside
SpecMetrics, stream the same step events, and bad tree options are refused by the one validation
(GenerationConfig) with the same words whichever the entry point."""

from __future__ import annotations

import re

import pytest
import torch

from mtp.decode.config import GenerationConfig
from mtp.decode.engine import generate
from mtp.spec.options import OptionError
from mtp.decode.tree import generate_tree
from mtp.draft.config import DraftConfig
from mtp.spec.tree_shape import TreeShape
from mtp.verify import SamplingParams

from .prompts import random_prompts


@pytest.fixture(scope="module")
def model(agreeing_model):
    return agreeing_model


PROMPTS = random_prompts(5, 23)


@pytest.mark.parametrize("draft,tree,kw", [
    ("eagle", "2x2x1", dict(min_draft_prob=0.05)),
    ("vanilla", "0/1/0.0/0.1", dict(verify="relaxed", think_ids=(510, 511), reuse_modules=True)),
    ("eagle", "2x1", dict(verify="sample", draft_sampling="sample", seed=5,
                          sampling=SamplingParams(temperature=0.8, top_p=0.9))),
])
def test_generate_with_a_tree_is_generate_tree(model, draft, tree, kw):
    ref = generate_tree(model, PROMPTS, TreeShape.parse(tree), 10, draft, **kw)
    opts = dict(kw)
    verify = opts.pop("verify", "strict")
    sp = opts.pop("sampling", None)
    if sp is not None:
        opts.update(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p)
    events = []
    by_kw = generate(model, PROMPTS, 10, draft=draft, verify=verify, tree=tree, on_step=events.append, **opts)
    cfg = GenerationConfig.from_options(10, draft, None, verify, tree=TreeShape.parse(tree), **opts)
    assert cfg.draft == DraftConfig(draft, TreeShape.parse(tree).max_depth, tree=tree,
                                    reuse_modules=opts.get("reuse_modules", False), sampling=cfg.draft.sampling,
                                    min_draft_prob=opts.get("min_draft_prob", 0.0))
    by_cfg = generate(model, PROMPTS, cfg)
    for out in (by_kw, by_cfg):
        assert out.tokens == ref.tokens and out.finish_reasons == ref.finish_reasons
        assert out.tree.to_dict() == ref.metrics.to_dict()
        m = out.metrics  # SpecMetrics, k = the tree's depth, as a chain's
        assert (m.k, m.draft, m.verify) == (ref.metrics.max_depth, draft, verify)
        assert m.accepted_hist == ref.metrics.accepted_hist and m.row_steps == ref.metrics.row_steps
        assert m.mean_accepted_len == pytest.approx(ref.metrics.mean_accepted_len)
        assert m.new_tokens == sum(map(len, ref.tokens)) and m.n_rows == len(PROMPTS)
    # the step events add up to the tokens, the prefill's token first
    assert [sum((ev.new_tokens[b] for ev in events), []) for b in range(len(PROMPTS))] == ref.tokens
    assert events[0].new_tokens == [[t[0]] for t in ref.tokens]
    # a step commits its accepted drafts and the target's token, cut at a stop token or max_new_tokens
    assert all(len(new) - a in (0, 1) for ev in events[1:] for new, a in zip(ev.new_tokens, ev.accepted) if new)
    assert sum(sum(ev.accepted) for ev in events) <= sum(a * c for a, c in enumerate(ref.metrics.accepted_hist))


@pytest.mark.parametrize("kw", [
    dict(min_draft_prob=1.0),
    dict(draft="none"),
    dict(min_draft_prob=0.2, verify="sample", draft_sampling="sample"),
    dict(verify="sample", mode="graph"),
    dict(verify="lenient"),
    dict(tree="2x0"),
    dict(verify="relaxed"),
])
def test_bad_tree_options_read_the_same_everywhere(model, kw):
    kw = {"draft": "eagle", **kw}
    tree = kw.pop("tree", "2x1")
    errors = []
    for call in (lambda: generate_tree(model, PROMPTS, tree, 4, **kw),
                 lambda: generate(model, PROMPTS, 4, tree=tree, **kw),
                 lambda: GenerationConfig.from_options(4, tree=tree, **kw)):
        with pytest.raises(OptionError) as e:
            call()
        errors.append(str(e.value))
    assert errors[0] == errors[1] == errors[2], errors


def test_generate_refuses_a_draft_tree_with_k_not_its_depth_and_per_prompt_seeds(model):
    with pytest.raises(OptionError, match="k must be the depth of tree '2x1', 2, got 3"):
        generate(model, PROMPTS, 4, draft="eagle", k=3, tree="2x1")
    with pytest.raises(ValueError, match="a draft tree takes one int seed"):
        generate(model, PROMPTS, 4, draft="eagle", tree="2x1", verify="sample", seed=[1, 2])
    one = generate(model, PROMPTS[:1], 4, draft="eagle", tree="2x1", verify="sample", seed=[7])
    assert one.tokens == generate(model, PROMPTS[:1], 4, draft="eagle", tree="2x1", verify="sample", seed=7).tokens


@pytest.mark.parametrize("prompts,match", [([], "prompts is empty"), ([[3, 4], []], r"prompts\[1\] is empty"),
                                           ([[3, 4], [5, 512]], r"prompts\[1\] has token ids outside \[0, 512\)")])
def test_tree_decoding_refuses_bad_prompts_as_the_chain_engine(model, prompts, match):
    """One prompt check (mtp.decode.state.check_prompts) for chains and trees: an id past the vocabulary is
    named before anything runs, not an index error inside the embedding."""
    with pytest.raises(ValueError, match=match):
        generate_tree(model, prompts, "2x1", 4)
    with pytest.raises(ValueError, match=match):
        generate(model, prompts, 4, draft="eagle", tree="2x1")
    with pytest.raises(ValueError, match=match):
        generate(model, prompts, 4, draft="eagle", k=2)


@pytest.mark.parametrize("prompt,says", [([5, 40.5], "holds 40.5 (float)"), (["5", 6], "holds '5' (str)"),
                                         ([5, True], "holds True (bool)"), ("hello", "is a str, not token ids")])
def test_non_integer_prompt_ids_are_refused_by_name(prompt, says):
    """generate used to truncate 40.5 to 40 and give an int() traceback for strings."""
    from mtp.decode.state import check_prompts

    with pytest.raises(ValueError, match=rf"prompts\[1\] {re.escape(says)}"):
        check_prompts([[1, 2], prompt], 512)
    assert check_prompts([[1, 2], torch.tensor([3, 4])], 512) == [[1, 2], [3, 4]]
