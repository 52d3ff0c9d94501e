"""Everything config.json and the tokenizer files can tell is checked before any weight is read: each test
runs on a checkpoint whose shards are unreadable garbage, so only an error found before loading can be the
right one. The CLIs print it as one line, without a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mtp.preflight import PreflightError, preflight
from mtp.checkpoint.tiny import default_checkpoint

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def garbage_ckpt(tmp_path) -> Path:
    """The bundled model's config.json, index and tokenizer; every shard replaced by garbage bytes."""
    src, out = default_checkpoint(), tmp_path / "ckpt"
    shutil.copytree(src, out)
    for shard in out.glob("*.safetensors"):
        shard.write_bytes(b"\x00garbage, not safetensors" * 40)
    return out


def _edit_config(path: Path, **changes) -> None:
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


def test_the_garbage_checkpoint_fails_in_the_loader(garbage_ckpt):
    """The fixture is what it claims: loading its weights fails (so the errors below were found before)."""
    from mtp.checkpoint.files import CheckpointError, load_model

    preflight(garbage_ckpt, draft="eagle", k=2)
    with pytest.raises(CheckpointError, match="safetensors"):
        load_model(garbage_ckpt)


@pytest.mark.parametrize("draft, k, reuse, n_mtp, message", [
    ("vanilla", 4, False, None, "vanilla k=4 needs 4 MTP modules, the checkpoint has 3"),
    ("vanilla", 2, False, 1, "vanilla k=2 needs 2 MTP modules, the checkpoint has 1"),
    ("eagle", 1, False, 4, "n_mtp=4: the checkpoint has 3 MTP layers"),
])
def test_draft_settings_the_checkpoint_cannot_serve(garbage_ckpt, draft, k, reuse, n_mtp, message):
    with pytest.raises((PreflightError, ValueError)) as ei:
        preflight(garbage_ckpt, draft=draft, k=k, reuse_modules=reuse, n_mtp=n_mtp)
    assert message in str(ei.value)
    assert str(garbage_ckpt) in str(ei.value)


def test_vanilla_k_above_the_modules_is_fine_when_reusing_them(garbage_ckpt):
    cfg, tok = preflight(garbage_ckpt, draft="vanilla", k=5, reuse_modules=True)
    assert cfg.num_nextn_predict_layers == 3 and tok.eos_id == 1


def test_draft_settings_bad_for_any_checkpoint_name_no_file(tmp_path):
    with pytest.raises(PreflightError) as ei:  # refused before config.json is read: none exists here
        preflight(tmp_path / "nowhere", draft="eagle", k=17)
    assert str(ei.value) == "k must be an integer in [1, 16], got 17"


def test_no_mtp_modules_with_a_draft(garbage_ckpt):
    _edit_config(garbage_ckpt, num_nextn_predict_layers=0)
    with pytest.raises(PreflightError, match="draft='eagle' needs MTP modules") as ei:
        preflight(garbage_ckpt, draft="eagle", k=1)
    assert "num_nextn_predict_layers = 0" in str(ei.value)
    preflight(garbage_ckpt, draft="none", k=0)  # plain decoding needs none


def test_missing_tokenizer(garbage_ckpt):
    (garbage_ckpt / "tokenizer.json").unlink()
    with pytest.raises(PreflightError, match="tokenizer.json not found") as ei:
        preflight(garbage_ckpt, draft="eagle", k=1)
    assert str(garbage_ckpt) in str(ei.value)


def test_corrupt_tokenizer(garbage_ckpt):
    (garbage_ckpt / "tokenizer.json").write_text('{"version": "1.0", "model": {')
    with pytest.raises(PreflightError, match="not a readable tokenizers tokenizer.json"):
        preflight(garbage_ckpt, draft="eagle", k=1)


def test_tokenizer_larger_than_the_vocabulary(garbage_ckpt):
    _edit_config(garbage_ckpt, vocab_size=1024, eos_token_id=1)
    with pytest.raises(PreflightError, match="2048 ids, more than the model's vocab_size 1024"):
        preflight(garbage_ckpt, draft="eagle", k=1)


def test_bad_config_value_before_any_weight(garbage_ckpt):
    from mtp.model.config import ConfigError

    _edit_config(garbage_ckpt, rms_norm_eps=-1)
    with pytest.raises(ConfigError, match="'rms_norm_eps' = -1"):
        preflight(garbage_ckpt, draft="eagle", k=1)


# ---------------------------------------------------------------------------------------------- CLIs
def _env(tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(PYTHONPATH=str(ROOT), HYDRA_FULL_ERROR="0", WANDB_MODE="disabled")
    return env


def test_mtp_eval_reports_a_late_check_as_one_line(garbage_ckpt, tmp_path):
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "eval.run", f"model.path={garbage_ckpt}", "draft=vanilla", "draft.k=4",
                        f"hydra.run.dir={run}"], cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "vanilla k=4 needs 4 MTP modules, the checkpoint has 3" in r.stderr and "Traceback" not in r.stderr
    assert not (run / "metrics.json").exists()


def test_eval_build_checks_the_tokenizer_before_the_weights(garbage_ckpt):
    from hydra import compose, initialize_config_dir

    from eval.common import build

    (garbage_ckpt / "tokenizer.json").unlink()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("chat", overrides=[f"model.path={garbage_ckpt}"])
    with pytest.raises(PreflightError, match="tokenizer.json not found"):
        build(cfg)


@pytest.mark.parametrize("args, message", [
    (["--draft", "vanilla", "--k", "4"], "vanilla k=4 needs 4 MTP modules, the checkpoint has 3"),
    (["--draft", "none"], "tokenizer.json not found"),
])
def test_parallel_launch_checks_before_the_process_group(garbage_ckpt, capsys, args, message):
    """mtp.distributed.launch runs the checks before init_distributed (no torchrun environment here: reaching it
    would fail differently) and ends with one line, exit status 2."""
    import torch.distributed as dist

    from mtp.distributed.launch import main

    if "none" in args:
        (garbage_ckpt / "tokenizer.json").unlink()
    assert main([str(garbage_ckpt), "--prompt", "hi", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and not dist.is_initialized()


# ------------------------------------------------------------------------------------------ split and memory
def test_a_split_is_checked_from_the_config_alone():
    """The bundled model (4 heads of 96 query rows, 64 value channels) splits over 1, 2 and 4 ranks in fp8
    numerics; 8 ranks get no head each and are refused with the degrees that work, before the tokenizer or any
    weight is read."""
    path = default_checkpoint()
    for tp in (2, 4):
        preflight(path, draft="eagle", k=2, tp=tp)
    with pytest.raises(PreflightError, match=r"runtime.tp = 8: .*config.json cannot be split over 8 ranks .*"
                                             r"num_attention_heads = 4 .*splits over \[1, 2, 4\]"):
        preflight(path, draft="eagle", k=2, tp=8)


GIB = 2**30


@pytest.mark.parametrize("tp,gib,fits", [(8, 141, True), (16, 80, True), (1, 141, False), (8, 80, False)])
def test_the_real_model_fits_where_the_planner_says(tp, gib, fits):
    """The README table's cases: 8 x H200 and 16 x H100 hold DeepSeek-V3.2 at 32k; one H200, or 8 H100s, do not,
    and the refusal names both numbers and the smallest TP that fits."""
    from mtp.model.config import ModelConfig
    from mtp.preflight import check_fits

    cfg = ModelConfig.from_json(Path(__file__).resolve().parents[1] / "mtp/data/deepseek_v32_671b_config.json")
    if fits:
        check_fits(cfg, tp, gib * GIB)
        return
    with pytest.raises(PreflightError) as e:
        check_fits(cfg, tp, gib * GIB)
    msg = str(e.value)
    assert f"runtime.tp = {tp}: the model needs" in msg and f"has {gib:.2f} GiB free" in msg
    assert f"the smallest TP that fits is {8 if gib == 141 else 16}" in msg


def test_tokenizer_smaller_than_the_vocabulary_warns_once(garbage_ckpt):
    """DeepSeek-V3.2's own tokenizer is smaller than its padded vocab_size: accepted, with one warning."""
    _edit_config(garbage_ckpt, vocab_size=2100)
    with pytest.warns(UserWarning, match="2048 ids, fewer than the model's vocab_size 2100") as seen:
        preflight(garbage_ckpt, draft="eagle", k=1)
    assert len(seen) == 1
