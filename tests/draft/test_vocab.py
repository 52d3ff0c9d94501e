"""Draft vocabularies (`mtp.draft.vocab`): the file format, its checks, the counting CLI, and the option's
paths into `mtp.generate` and the experiment configs. Decoding with one is tested in tests/decode/test_engine.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hydra import compose, initialize_config_dir

import mtp
from eval.common import generate_kwargs
from eval.schema import SchemaError
from mtp.draft.vocab import check_ids, count_tokens, load_ids, main, rows_per_rank, top_ids
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


def test_rows_per_rank_at_the_real_shapes():
    """The rows each TP=8 rank holds for ids 0..32767 of the 129280 (what `mtp-bench --draft-vocab 32768` scores):
    balanced ceil(N / W); by shard the largest shard's count, rank 0's whole 16160-row shard (as the full head)."""
    assert rows_per_rank(range(32768), 129280, 8) == 4096
    assert rows_per_rank(range(32768), 129280, 8, by_shard=True) == 16160
    assert rows_per_rank((7,), 24, 2) == 1 and rows_per_rank((5, 17, 2), 24, 2, by_shard=True) == 2


def test_all_gather_rows_on_one_rank_and_counted_apart(tiny_model):
    """World 1: the identity, no process group. CountingComm counts it apart from a step's all-gathers. A model whose
    heads are not vocabulary-parallel has one layout: the by-shard switch is refused, naming why."""
    from mtp.parallel.comm import Comm, CountingComm
    from mtp.parallel.modules import set_draft_vocab_by_shard

    t = torch.randn(3, 4)
    assert Comm().all_gather_rows(t) is t
    c = CountingComm()
    assert c.all_gather_rows(t) is t
    assert c.counts["all_gather_rows"] == 1 and c.counts["all_gather_rows_bytes"] == 48 and c.counts["all_gather"] == 0
    assert c.calls == [("all_gather_rows", (3, 4), "float32")]
    with pytest.raises(ValueError, match="not vocabulary-parallel"):
        set_draft_vocab_by_shard(tiny_model, True)


def _cli_case(tmp_path, name: str) -> tuple[list[str], str]:
    """(arguments, what the one-line error must name) for each bad input of `mtp-draft-vocab`."""
    ckpt, ok, out = default_checkpoint(), tmp_path / "ok.txt", tmp_path / "vocab.json"
    ok.write_text("import os\nprint(1)\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": \n')
    (tmp_path / "nofield.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    (tmp_path / "notstr.json").write_text('[{"text": "a"}, {"text": 3}]')
    (tmp_path / "folder").mkdir()
    (tmp_path / "existing.json").write_text("{}")
    small = tmp_path / "small_vocab"  # config.json's vocab_size below the tokenizer's 2048 ids
    shutil.copytree(ckpt, small)
    raw = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**raw, "vocab_size": 1024}))
    data, size, out_, ckpt_ = "--data", "--size", "--out", "--checkpoint"
    cases = {
        "missing data": ({data: [tmp_path / "missing.txt"]}, "missing.txt: no such file"),
        "data is a folder": ({data: [tmp_path / "folder"]}, "folder: not a file"),
        "empty data": ({data: [ok, tmp_path / "empty.txt"]}, "empty.txt: holds no text"),
        "blank jsonl": ({data: [tmp_path / "blank.jsonl"]}, "blank.jsonl: holds no text"),
        "not utf-8": ({data: [tmp_path / "latin1.txt"]}, "latin1.txt line 1: not UTF-8 text"),
        "malformed jsonl": ({data: [tmp_path / "bad.jsonl"]}, "bad.jsonl line 2: not JSON"),
        "row without the field": ({data: [tmp_path / "nofield.jsonl"]}, "nofield.jsonl line 2: no field 'text'"),
        "field not a string": ({data: [tmp_path / "notstr.json"]}, "notstr.json row 2: field 'text' = 3"),
        "size 0": ({size: [0]}, "--size = 0 must be >= 1"),
        "size negative": ({size: [-3]}, "--size = -3 must be >= 1"),
        "size above the vocabulary": ({size: [4096]}, "--size = 4096 exceeds the model's vocab_size 2048"),
        "out in a missing folder": ({out_: [tmp_path / "nodir" / "v.json"]}, "nodir: no such folder"),
        "out exists": ({out_: [tmp_path / "existing.json"]}, "existing.json exists; pass --force"),
        "out is a folder": ({out_: [tmp_path / "folder"]}, "folder is a folder"),
        "missing checkpoint": ({ckpt_: [tmp_path / "nockpt"]}, "nockpt"),
        "tokenizer ids outside the model": ({ckpt_: [small]}, "2048 ids, more than the model's vocab_size 1024"),
    }
    override, want = cases[name]
    opts = {ckpt_: [ckpt], data: [ok], out_: [out], **override}
    return [str(x) for k, v in opts.items() for x in (k, *v)], want


BAD_CLI = ["missing data", "data is a folder", "empty data", "blank jsonl", "not utf-8", "malformed jsonl",
           "row without the field", "field not a string", "size 0", "size negative", "size above the vocabulary",
           "out in a missing folder", "out exists", "out is a folder", "missing checkpoint",
           "tokenizer ids outside the model"]


@pytest.mark.parametrize("name", BAD_CLI)
def test_counting_cli_refuses_bad_input_in_one_line(tmp_path, capsys, name):
    """Each: exit 2, one line naming the file / option and value, nothing written (issue 27 item 10)."""
    argv, want = _cli_case(tmp_path, name)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    before_existing = (tmp_path / "existing.json").read_text()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mtp-draft-vocab: error: ") and "\n" not in err, err
    assert want in err, err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert (tmp_path / "existing.json").read_text() == before_existing


def test_counting_cli_replaces_a_file_with_force(tmp_path, capsys):
    (tmp_path / "ok.txt").write_text("import os\n")
    (tmp_path / "v.json").write_text("{}")
    argv = ["--checkpoint", str(default_checkpoint()), "--data", str(tmp_path / "ok.txt"), "--out",
            str(tmp_path / "v.json"), "--size", "8"]
    assert main(argv + ["--force"]) == 0
    assert len(json.loads((tmp_path / "v.json").read_text())["ids"]) <= 8
