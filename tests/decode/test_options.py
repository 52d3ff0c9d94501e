"""One validation of the generation options: the same bad value fed to `mtp.generate`'s keyword form, to
`mtp-eval`'s schema and to `mtp-chat`'s settings is refused by the same rule (`GenerationConfig`, `DraftConfig`,
`SamplingParams`), each front end naming it its own way (option, config key, command); the rules run without
torch."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir

import eval.schema as schema
from mtp.chat.session import CommandError, Session, Settings
from mtp.decode.engine import generate
from mtp.spec.options import OptionError

ROOT = Path(__file__).resolve().parents[2]

# option, bad value, generate keywords, mtp-eval overrides, its config key, chat: a command line, or the
# settings' options when no command sets it (they come from the config), or None when chat cannot hold it
BAD = [
    ("draft", "medusa", dict(draft="medusa", k=1), ["draft.name=medusa"], "draft.name", "/draft medusa"),
    ("verify", "medusa", dict(verify="medusa"), ["verify.name=medusa"], "verify.name", "/verify medusa"),
    ("k", 17, dict(draft="eagle", k=17), ["draft=eagle", "draft.k=17"], "draft.k", "/k 17"),
    ("k", 0, dict(draft="eagle", k=0), ["draft=eagle", "draft.k=0"], "draft.k", "/k 0"),
    ("k", 2, dict(draft="none", k=2), ["draft=none", "draft.k=2"], "draft.k", None),
    ("max_new_tokens", 0, dict(max_new_tokens=0), ["max_new_tokens=0"], "max_new_tokens", "/max 0"),
    ("temperature", 0.0, dict(verify="sample", temperature=0.0), ["verify=sample", "verify.temperature=0"],
     "verify.temperature", "/temperature 0"),
    ("temperature", -2.5, dict(verify="sample", temperature=-2.5), ["verify=sample", "verify.temperature=-2.5"],
     "verify.temperature", "/temperature -2.5"),
    ("top_p", 1.5, dict(verify="sample", top_p=1.5), ["verify=sample", "verify.top_p=1.5"], "verify.top_p",
     {"verify": "sample", "top_p": 1.5}),
    ("top_k", -1, dict(verify="sample", top_k=-1), ["verify=sample", "verify.top_k=-1"], "verify.top_k",
     {"verify": "sample", "top_k": -1}),
    ("top_n", 0, dict(verify="relaxed", think_ids=(1, 2), top_n=0), ["verify=relaxed", "verify.top_n=0"],
     "verify.top_n", {"verify": "relaxed", "top_n": 0}),
    ("delta", 1.5, dict(verify="relaxed", think_ids=(1, 2), delta=1.5), ["verify=relaxed", "verify.delta=1.5"],
     "verify.delta", {"verify": "relaxed", "delta": 1.5}),
    ("posterior_threshold", 1.5, dict(verify="typical", posterior_threshold=1.5),
     ["verify=typical", "verify.posterior_threshold=1.5"], "verify.posterior_threshold",
     {"verify": "typical", "posterior_threshold": 1.5}),
    ("posterior_alpha", 0.0, dict(verify="typical", posterior_alpha=0.0), ["verify=typical", "verify.posterior_alpha=0"],
     "verify.posterior_alpha", {"verify": "typical", "posterior_alpha": 0.0}),
    ("prefill_chunk", 0, dict(prefill_chunk=0), ["runtime.prefill_chunk=0"], "runtime.prefill_chunk",
     {"prefill_chunk": 0}),
]


@pytest.fixture(scope="module")
def hydra_conf():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        yield


def chat_session(**settings) -> tuple[Session, list[str]]:
    """A session over a stand-in model and tokenizer: settings are checked without either doing any work."""
    model = SimpleNamespace(n_mtp=1, device=torch.device("cpu"),
                            cfg=SimpleNamespace(max_position_embeddings=4096, vocab_size=512))
    errors: list[str] = []
    view = SimpleNamespace(error=errors.append, notice=lambda text: None)
    s = Settings(**{"max_new_tokens": 32, "draft": "eagle", "k": 1, **settings})
    return Session(model, SimpleNamespace(think_id=1, end_think_id=2), s, view, generate=lambda *a, **k: None), errors


@pytest.mark.parametrize("name,value,kw,overrides,key,chat", BAD, ids=[f"{r[0]}={r[1]}" for r in BAD])
def test_one_rule_refuses_a_bad_value_in_every_entry_point(tiny_model, hydra_conf, name, value, kw, overrides,
                                                           key, chat):
    kw = dict(kw)
    with pytest.raises(OptionError) as ei:  # the keyword form of generate
        generate(tiny_model, [[1, 2, 3]], kw.pop("max_new_tokens", 4), **kw)
    rule = ei.value
    assert (rule.name, rule.value) == (name, value) and str(rule).startswith(f"{name} must be {rule.expected}")
    wanted = rule.expected + (f" ({rule.note})" if rule.note else "")

    with pytest.raises(schema.SchemaError) as es:  # mtp-eval's (and mtp-chat's) config
        schema.validate(compose("eval", overrides=overrides + ["output_dir=/tmp/mtp-options"]))
    assert str(es.value) == f"{key} = {value!r} is invalid: expected {wanted}"
    assert schema.CONFIG_KEYS[name] == key

    if isinstance(chat, str):  # a chat command: one line naming the command, the settings unchanged
        sess, errors = chat_session()
        before = Settings(**vars(sess.settings))
        assert sess.handle(chat) is True
        assert errors == [rule.say(chat.split()[0], "needs")] and sess.settings == before
    elif isinstance(chat, dict):  # a value from the config: the session does not start
        options = dict(chat)
        verify = options.pop("verify", "strict")
        with pytest.raises(CommandError) as ec:
            chat_session(verify=verify, options=options)
        assert str(ec.value) == str(rule)


def test_chat_checks_the_k_it_keeps_while_drafting_is_off():
    sess, errors = chat_session(draft="none")
    sess.handle("/k 17")
    assert errors == ["/k needs an integer in [1, 16], got 17"] and sess.settings.k == 1
    sess.handle("/k 3")
    assert sess.settings.k == 3 and sess.settings.effective_k == 0 and len(errors) == 1


def test_every_option_the_config_passes_has_a_config_key(hydra_conf):
    for overrides in (["draft=vanilla", "verify=relaxed", "runtime.prefill_chunk=8"],
                      ["verify=sample", "verify.draft_sampling=sample"], ["verify=typical"], ["draft=none"]):
        typed = schema.validate(compose("eval", overrides=overrides + ["output_dir=/tmp/mtp-options"]))
        assert set(schema.generation_options(typed)) <= set(schema.CONFIG_KEYS), overrides


def test_option_error_keeps_its_fields_through_pickle():
    e = pickle.loads(pickle.dumps(OptionError("top_p", 1.5, "a number in (0, 1]", "1 = off")))
    assert (e.name, e.value, e.expected, e.note) == ("top_p", 1.5, "a number in (0, 1]", "1 = off")
    assert str(e) == "top_p must be a number in (0, 1], got 1.5 (1 = off)"


def test_the_rules_and_the_schema_import_no_torch():
    code = ("import sys; import eval.schema; from mtp.decode.config import GenerationConfig; "
            "GenerationConfig.from_options(8, 'eagle', 2, 'sample', temperature=0.5, top_p=0.9); "
            "print(sorted(m for m in ('torch', 'mtp.model.deepseek', 'mtp.draft.proposer', 'mtp.verify.sampling') "
            "if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", f"validating generation options loaded {r.stdout.strip()}"
