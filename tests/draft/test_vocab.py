"""Draft vocabularies (`mtp.draft.vocab`): the file format, its checks, the counting CLI, and the option's
paths into `mtp.generate` and the experiment configs. Decoding with one is tested in tests/decode/test_engine.py."""

from __future__ import annotations

import json

import pytest
import torch
from hydra import compose, initialize_config_dir

import mtp
from eval.common import generate_kwargs
from eval.schema import SchemaError
from mtp.draft.vocab import check_ids, count_tokens, load_ids, main, top_ids
from mtp.checkpoint.tiny import default_checkpoint
from mtp.text.tokenizer import Tokenizer
from tests.eval.test_conf import CONF, FIXED


def test_load_ids_file_forms_and_errors(tmp_path):
    (tmp_path / "v.json").write_text(json.dumps({"ids": [5, 3, 9], "counts": [9, 4, 1]}))
    (tmp_path / "list.json").write_text("[1, 2]")
    assert load_ids(tmp_path / "v.json") == (5, 3, 9)
    assert load_ids(tmp_path / "v.json", 2) == (5, 3)
    assert load_ids(tmp_path / "list.json") == (1, 2)
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "strs.json").write_text('{"ids": ["a"]}')
    for name, size, msg in (("bad.json", None, "cannot read it as JSON"), ("strs.json", None, "list of token ids"),
                            ("v.json", 4, "holds 3 ids, 4 were asked"), ("v.json", 0, "size must be >= 1"),
                            ("missing.json", None, "cannot read")):
        with pytest.raises(ValueError, match=msg):
            load_ids(tmp_path / name, size)


def test_check_ids_names_the_problem():
    check_ids((0, 7, 3), 8)
    with pytest.raises(ValueError, match=r"outside the model's vocabulary \[0, 8\): \[8, -1\]"):
        check_ids((1, 8, -1), 8)
    with pytest.raises(ValueError, match="distinct"):
        check_ids((1, 1), 8)
    with pytest.raises(ValueError, match="empty"):
        check_ids((), 8)


def test_top_ids_specials_first_then_frequency_ties_to_lower_id():
    c = count_tokens(lambda t: [int(x) for x in t.split()], ["4 4 4 2 2 7 7 9", "1"])
    assert top_ids(c, 10) == [4, 2, 7, 1, 9]
    assert top_ids(c, 3, always=[11, 7]) == [11, 7, 4]


def test_generate_refuses_a_bad_vocabulary_before_decoding(tiny_model):
    V = tiny_model.cfg.vocab_size
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        mtp.generate(tiny_model, [[5, 6, 7]], 4, draft="eagle", k=1, draft_vocab=[0, V])
    # ignored when nothing is drafted
    assert mtp.generate(tiny_model, [[5, 6, 7]], 4, draft_vocab=[0, V]).tokens


def test_counting_cli_and_generate_with_the_file(tmp_path):
    ckpt = default_checkpoint()
    (tmp_path / "a.txt").write_text("import os\nimport sys\nfor i in range(10):\n    print(i)\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "def f(x):\n    return x + 1\n"}) + "\n")
    out = tmp_path / "vocab.json"
    assert main(["--checkpoint", str(ckpt), "--data", str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"),
                 "--size", "40", "--out", str(out)]) == 0
    raw = json.loads(out.read_text())
    tok = Tokenizer.from_dir(ckpt)
    specials = [tok.eos_id, tok.think_id, tok.end_think_id, tok.bos_id]  # always kept, first
    assert raw["ids"][:4] == specials and len(raw["ids"]) <= 40 and raw["tokens_counted"] > 20
    assert raw["counts"][4:] == sorted(raw["counts"][4:], reverse=True) and raw["counts"][4] > 1
    assert 0 < raw["coverage"] <= 1
    model = mtp.load_model(ckpt, dtype=torch.float32)
    ids = [tok.bos_id] + tok.encode("import os\n")
    base = mtp.generate(model, [ids], 8)
    spec = mtp.generate(model, [ids], 8, draft="eagle", k=2, draft_vocab=str(out))
    assert spec.tokens == base.tokens


def test_experiment_config_passes_the_vocabulary(tmp_path):
    (tmp_path / "v.json").write_text(json.dumps({"ids": list(range(100))}))
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("eval", overrides=[f"draft.vocab_file={tmp_path / 'v.json'}", "draft.vocab_size=10"] + FIXED)
        assert generate_kwargs(cfg)["draft_vocab"] == tuple(range(10))
        cfg = compose("eval", overrides=[f"draft.vocab_file={tmp_path / 'v.json'}", "draft.vocab_size=101"] + FIXED)
        with pytest.raises(SchemaError, match="draft.vocab_file: .* holds 100 ids, 101 were asked"):
            generate_kwargs(cfg)
        cfg = compose("eval", overrides=["draft=none"] + FIXED)
        assert "draft_vocab" not in generate_kwargs(cfg)


def test_proposers_share_one_sub_head(tiny_model):
    """An engine keeps a proposer per buffer bucket: they must not each copy the head's rows."""
    from mtp.draft import DraftConfig
    from mtp.draft.proposer import Proposer

    dcfg = DraftConfig("eagle", 2, vocab=(1, 5, 9))
    a, b = Proposer(tiny_model, dcfg, 1, 64), Proposer(tiny_model, dcfg, 3, 512)
    assert a.heads[0] is b.heads[0]
    other = Proposer(tiny_model, DraftConfig("eagle", 2, vocab=(1, 5)), 1, 64)
    assert other.heads[0] is not a.heads[0] and other.heads[0].weight.shape[0] == 2
