"""Every result says what produced it: the code (commit, dirty flag, versions, device) and the checkpoint
(path, name, fingerprint of its config, index and shard names / sizes; deep: shard contents too)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from mtp.provenance import checkpoint_identity, code_identity, defaulted_line, provenance
from mtp.checkpoint.tiny import default_checkpoint


def test_checkpoint_identity_names_the_bundled_model_and_is_stable():
    a = checkpoint_identity(default_checkpoint())
    assert a["name"] == "dsv32_stdlib_mini" and a["path"] == str(default_checkpoint().resolve())
    assert re.fullmatch(r"[0-9a-f]{16}", a["fingerprint"]) and a["deep"] is False
    assert checkpoint_identity(default_checkpoint()) == a


def test_fingerprint_follows_config_index_and_shards(tmp_path):
    ckpt = shutil.copytree(default_checkpoint(), tmp_path / "copy")
    base = checkpoint_identity(ckpt)
    deep = checkpoint_identity(ckpt, deep=True)
    assert deep["deep"] is True and deep["fingerprint"] != base["fingerprint"]

    raw = json.loads((ckpt / "config.json").read_text())
    raw["rope_theta"] = 20000.0
    (ckpt / "config.json").write_text(json.dumps(raw))
    edited = checkpoint_identity(ckpt)
    assert edited["fingerprint"] != base["fingerprint"]

    shard = sorted(ckpt.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes: only the deep fingerprint sees it
    deep_before = checkpoint_identity(ckpt, deep=True)
    shard.write_bytes(bytes(data))
    assert checkpoint_identity(ckpt)["fingerprint"] == edited["fingerprint"]
    assert checkpoint_identity(ckpt, deep=True)["fingerprint"] != deep_before["fingerprint"]
    shard.write_bytes(bytes(data) + b"\0")
    assert checkpoint_identity(ckpt)["fingerprint"] != edited["fingerprint"]


def test_code_identity_records_commit_versions_and_device():
    c = code_identity("cpu")
    assert c["torch"] == torch.__version__ and c["mtp"] == "0.1.0"
    assert c["transformers"] is None or re.match(r"\d+\.", c["transformers"])
    assert c["git_commit"] is None or re.fullmatch(r"[0-9a-f]{40}", c["git_commit"])
    assert c["git_dirty"] in (None, True, False) and c["device"].startswith("cpu")
    p = provenance(default_checkpoint(), "cpu")
    assert set(p) == {"code", "checkpoint"}


def test_checkpoint_identity_lists_the_defaulted_config_fields(tmp_path):
    """Fields absent from config.json take transformers' defaults: a result says which (metrics.json, W&B)."""
    ckpt = Path(shutil.copytree(default_checkpoint(), tmp_path / "ckpt"))
    assert checkpoint_identity(ckpt)["config_defaulted"] == []
    raw = json.loads((ckpt / "config.json").read_text())
    del raw["rms_norm_eps"], raw["rope_theta"]
    (ckpt / "config.json").write_text(json.dumps(raw))
    assert checkpoint_identity(ckpt)["config_defaulted"] == ["rms_norm_eps", "rope_theta"]
    assert checkpoint_identity(ckpt)["config_assumed"] == {"rms_norm_eps": "1e-06", "rope_theta": "10000.0"}


def test_the_defaulted_line_says_what_was_assumed_for_rope_scaling(tmp_path):
    """The run log's line (metrics.json keeps the same dict): without rope_scaling, plain RoPE was assumed."""
    ckpt = Path(shutil.copytree(default_checkpoint(), tmp_path / "ckpt"))
    assert defaulted_line(checkpoint_identity(ckpt)) is None
    raw = json.loads((ckpt / "config.json").read_text())
    del raw["rope_scaling"], raw["rope_theta"]
    (ckpt / "config.json").write_text(json.dumps(raw))
    line = defaulted_line(checkpoint_identity(ckpt))
    assert line.startswith("config.json lacks rope_theta, rope_scaling; assumed: rope_theta = 10000.0; "
                           "rope_scaling = none: plain RoPE"), line
