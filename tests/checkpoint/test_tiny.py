"""The tiny-checkpoint CLI: flags become config fields, the result loads (model + tokenizer), bad flags exit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers
import torch

import mtp.checkpoint.tiny
from mtp.checkpoint.files import INDEX_NAME, load_model
from mtp.model.config import ModelConfig
from mtp.text.tokenizer import BOS, EOS, THINK

REPO = Path(__file__).resolve().parents[2]
ARGS = ["--layers", "2", "--dense-layers", "1", "--mtp-modules", "2", "--index-topk", "8", "--vocab", "400"]


@pytest.fixture(scope="module")
def cli_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "nested" / "tiny"  # parent folders do not exist yet
    mtp.checkpoint.tiny.main([str(out), *ARGS])
    return out


def test_cli_writes_checkpoint_matching_flags(cli_ckpt, capsys):
    cfg = ModelConfig.from_json(cli_ckpt / "config.json")
    assert (cfg.num_hidden_layers, cfg.first_k_dense_replace, cfg.num_nextn_predict_layers, cfg.index_topk,
            cfg.vocab_size) == (2, 1, 2, 8, 400)
    assert cfg.model_type == "deepseek_v32" and cfg.is_fp8 and cfg.rope_scaling.type == "yarn"
    shards = set(json.loads((cli_ckpt / INDEX_NAME).read_text())["weight_map"].values())
    assert len(shards) >= 2 and all((cli_ckpt / s).is_file() for s in shards)
    assert not [p.name for p in cli_ckpt.parent.iterdir() if p.name != "tiny"], "temp dir left behind"


def test_cli_checkpoint_loads_with_both_mtp_modules(cli_ckpt):
    model = load_model(cli_ckpt, dtype=torch.float32)
    assert model.n_mtp == 2 and len(model.model.layers) == 2
    assert model.model.layers[0].mlp.__class__.__name__ == "MLP"  # dense layer 0, MoE after
    assert model.model.layers[1].mlp.__class__.__name__ == "MoE"
    out = model(torch.tensor([[0, 17, 42, 99, 1]]))
    assert out.logits.shape == (1, 5, 400) and bool(torch.isfinite(out.logits).all())
    cache = model.new_cache(1, 8, n_layers=1)
    drafted = model.mtp_forward(1, torch.tensor([[5, 6]]), out.hidden[:, :2], cache)
    assert drafted.logits.shape == (1, 2, 400) and bool(torch.isfinite(drafted.logits).all())


def test_cli_tokenizer_files_load(cli_ckpt):
    assert (cli_ckpt / "tokenizer.json").is_file() and (cli_ckpt / "tokenizer_config.json").is_file()
    tok = tokenizers.Tokenizer.from_file(str(cli_ckpt / "tokenizer.json"))
    assert tok.get_vocab_size() == 400
    assert (tok.token_to_id(BOS), tok.token_to_id(EOS)) == (0, 1)
    text = f"def f(x):\n    return x + 1  # naïve ✓{THINK}"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert max(ids) < 400 and tok.decode(ids, skip_special_tokens=False) == text
    assert tok.token_to_id(THINK) in ids

    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(cli_ckpt))
    assert (hf.bos_token_id, hf.eos_token_id) == (0, 1)
    assert hf(text)["input_ids"] == ids  # add_bos_token false, as in the real tokenizer_config
    assert hf.decode(ids) == text


BAD_FLAGS = [
    ["--layers", "0"],
    ["--layers", "2", "--dense-layers", "3"],
    ["--dense-layers", "-1"],
    ["--mtp-modules", "-1"],
    ["--index-topk", "0"],
    ["--vocab", "100"],
    ["--shards", "0"],
    ["--layers", "two"],
    ["--no-such-flag"],
]


@pytest.mark.parametrize("flags", BAD_FLAGS, ids=[" ".join(f) for f in BAD_FLAGS])
def test_bad_flags_exit_with_usage_error(tmp_path, capsys, flags):
    out = tmp_path / "ckpt"
    with pytest.raises(SystemExit) as ei:
        mtp.checkpoint.tiny.main([str(out), *flags])
    assert ei.value.code not in (0, None)
    assert "usage:" in capsys.readouterr().err
    assert not out.exists()


def test_non_empty_folder_or_file_is_refused_unless_force(tmp_path, capsys):
    """mtp-tiny-checkpoint DIR used to delete a non-empty DIR's other files and rename a file argument away."""
    folder, keep = tmp_path / "mine", tmp_path / "mine" / "notes.txt"
    folder.mkdir()
    keep.write_text("precious")
    as_file = tmp_path / "file.txt"
    as_file.write_text("also precious")
    for out, says in ((folder, "is not empty (its files would be deleted); pass --force"), (as_file, "is a file")):
        with pytest.raises(SystemExit) as ei:
            mtp.checkpoint.tiny.main([str(out), *ARGS])
        err = capsys.readouterr().err
        assert ei.value.code == 2 and err.count("\n") == 1 and says in err and str(out) in err, err
    assert keep.read_text() == "precious" and sorted(folder.iterdir()) == [keep]
    assert as_file.read_text() == "also precious" and sorted(tmp_path.iterdir()) == [as_file, folder]
    mtp.checkpoint.tiny.main([str(folder), *ARGS, "--force"])
    assert (folder / "config.json").is_file() and not keep.exists()


def test_missing_out_dir_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as ei:
        mtp.checkpoint.tiny.main([])
    assert ei.value.code not in (0, None) and "out_dir" in capsys.readouterr().err


def test_module_entry_point(tmp_path):
    """`python -m mtp.checkpoint.tiny` runs main (the console script may not be installed)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-m", "mtp.checkpoint.tiny", str(tmp_path / "x"), "--layers", "0"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "usage:" in r.stderr, r.stderr[-2000:]


def test_default_checkpoint_keeps_a_racing_writers_copy(cli_ckpt, tmp_path, monkeypatch):
    """Another process finishes first: default_checkpoint must keep that copy (its readers may be loading it)."""
    monkeypatch.setenv("MTP_CACHE", str(tmp_path))
    monkeypatch.setattr(mtp.checkpoint.tiny, "SHIPPED_CHECKPOINT", tmp_path / "no-shipped-model")  # test the random fallback
    target = tmp_path / "tiny-random-v1"

    def other_process_wins(out_dir, **kwargs):
        shutil.copytree(cli_ckpt, target)
        (target / "marker").write_text("first writer")
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "config.json").write_text("{}")  # our own (unused) copy

    monkeypatch.setattr(mtp.checkpoint.tiny, "write_tiny_checkpoint", other_process_wins)
    assert mtp.checkpoint.tiny.default_checkpoint() == target
    assert (target / "marker").read_text() == "first writer"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-random-v1"]  # no temp dir left
    assert load_model(target).n_mtp == 2
