"""Request bodies -> validated jobs (mtp/serve/protocol.py) on the bundled model: field mapping, defaults, limits."""

from __future__ import annotations

import pytest
import torch

import mtp
from mtp.checkpoint.tiny import default_checkpoint
from mtp.serve.protocol import Defaults, RequestError, parse_chat, parse_completion
from mtp.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def mt():
    path = default_checkpoint()
    return mtp.load_model(path, device="cpu", dtype=torch.float32), Tokenizer.from_dir(path)


D = Defaults(max_new_tokens=512, thinking=True, options={"draft": "eagle", "k": 2, "verify": "strict"},
             max_model_len=300)


def chat(text: str = "hi", **body):
    return {"messages": [{"role": "user", "content": text}], **body}


def test_sampling_fields_map_onto_the_generation_config(mt):
    model, tok = mt
    job = parse_chat(chat(temperature=0.7, top_p=0.9, seed=3, max_tokens=5), D, tok, model)
    g = job.config
    assert (g.verify, g.sampling.temperature, g.sampling.top_p, g.seed, g.max_new_tokens) == ("sample", 0.7, 0.9, 3, 5)
    assert (g.draft.mode, g.draft.k) == ("eagle", 2) and job.thinking
    g = parse_chat(chat(temperature=0, mtp={"draft": "vanilla", "k": 3}), D, tok, model).config
    assert (g.verify, g.draft.mode, g.draft.k) == ("strict", "vanilla", 3)
    assert parse_chat(chat(mtp={"draft": "none"}), D, tok, model).config.draft.k == 0
    assert not parse_chat(chat(thinking={"type": "disabled"}), D, tok, model).thinking
    assert not parse_chat(chat(chat_template_kwargs={"thinking": False}), D, tok, model).thinking


def test_max_tokens_defaults_to_the_room_left_and_a_given_one_is_checked(mt):
    model, tok = mt
    long = "word " * 100
    n = len(parse_chat(chat(long, max_tokens=1), D, tok, model).prompt_ids)
    assert 150 < n < 290
    assert parse_chat(chat(long), D, tok, model).config.max_new_tokens == 300 - n  # not 512: max_model_len 300
    roomy = Defaults(max_new_tokens=16, options=D.options)
    assert parse_chat(chat(long), roomy, tok, model).config.max_new_tokens == 16
    with pytest.raises(RequestError, match=f"the prompt is {n} tokens; \\+ max_tokens 200 exceeds max_model_len 300"):
        parse_chat(chat(long, max_tokens=200), D, tok, model)


def test_completion_prompt_forms(mt):
    model, tok = mt
    assert parse_completion({"prompt": "def f():"}, D, tok, model).prompt_ids[0] == tok.bos_id
    assert parse_completion({"prompt": [[5, 6, 7]]}, D, tok, model).prompt_ids == [5, 6, 7]
    for bad in ({"prompt": ""}, {"prompt": ["a", "b"]}, {"prompt": [1.5]}):
        with pytest.raises(RequestError) as e:
            parse_completion(bad, D, tok, model)
        assert e.value.field == "prompt"


def test_a_registered_drafter_is_taken_by_name_and_an_unknown_one_refused(mt, registered):
    from tests.draft.test_modes import FirstModule

    model, tok = mt
    registered(FirstModule())
    g = parse_chat(chat(mtp={"draft": "first_module", "k": 3}), D, tok, model).config
    assert (g.draft.mode, g.draft.k, g.draft.reuse_modules) == ("first_module", 3, False)
    assert parse_chat(chat(mtp={"draft": "first_module"}), D, tok, model).config.draft.k == 2  # the server's k
    defaults = Defaults(max_new_tokens=8, options={**D.options, "draft": "first_module"})
    assert parse_chat(chat(), defaults, tok, model).config.draft.mode == "first_module"  # the server's own
    with pytest.raises(RequestError, match="mtp.draft must be one of none, vanilla, eagle, first_module, "
                                           "got 'nope'") as e:
        parse_chat(chat(mtp={"draft": "nope"}), D, tok, model)
    assert e.value.field == "mtp.draft"


def test_a_registered_verifier_is_taken_by_name_and_an_unknown_one_refused(mt, registered):
    from mtp.verify.registry import Verifier

    model, tok = mt
    registered(Verifier("accept_none", "tests.verify.test_registry:chain", "tests.verify.test_registry:tree"))
    job = parse_chat(chat(mtp={"verify": "accept_none"}, temperature=0.5), D, tok, model)
    assert job.config.verify == "accept_none"  # the request's verifier wins over temperature's
    defaults = Defaults(max_new_tokens=8, options={**D.options, "verify": "accept_none"})
    assert parse_chat(chat(), defaults, tok, model).config.verify == "accept_none"  # the server's own
    with pytest.raises(RequestError, match="mtp.verify must be one of strict, relaxed, sample, typical, accept_none, "
                                           "got 'nope'") as e:
        parse_chat(chat(mtp={"verify": "nope"}), D, tok, model)
    assert e.value.field == "mtp.verify"



def test_a_registered_verifiers_options_are_per_request_settings(mt, registered):
    from mtp.verify.registry import Verifier

    model, tok = mt
    with pytest.raises(RequestError, match="mtp.posterior_alpha is an option of verify=typical, not of "
                                           "verify='relaxed'"):
        parse_chat(chat(mtp={"verify": "relaxed", "posterior_alpha": 0.5}), D, tok, model)
    registered(Verifier("alpha_only", "tests.verify.test_registry:chain", options=("posterior_alpha",)))
    g = parse_chat(chat(mtp={"verify": "alpha_only", "posterior_alpha": 0.5}), D, tok, model).config
    assert (g.verify, g.posterior_alpha) == ("alpha_only", 0.5)
    with pytest.raises(RequestError, match="mtp.posterior_alpha is an option of verify=typical / alpha_only, not of "
                                           "verify='strict'") as e:
        parse_chat(chat(mtp={"posterior_alpha": 0.5}), D, tok, model)
    assert e.value.field == "mtp.posterior_alpha"
    with pytest.raises(RequestError, match="mtp.think_ids is not a per-request setting") as e:
        parse_chat(chat(mtp={"verify": "relaxed", "think_ids": [1, 2]}), D, tok, model)
