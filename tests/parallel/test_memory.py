"""The memory planner: byte counts against the spec, the cache and a real load; the CLI on the real config."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from mtp.model.cache import KVCache
from mtp.model.config import ModelConfig
from mtp.parallel import ParallelPlan, param_bytes
from mtp.parallel.memory import (Workload, kv_bytes_per_token_layer, main, make_plan, rank_weight_bytes,
                      weight_bytes_by_rank)
from mtp.checkpoint.inventory import checkpoint_spec
from mtp.model.presets import real_config, tiny_config

SPLIT = ("embedding + lm_head", "attention (head-split)", "routed experts", "shared experts", "dense MLP")
REPLICATED = ("attention (replicated)", "indexer (replicated)", "router", "norms")


@pytest.fixture(scope="module")
def real_config_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("real") / "config.json"
    path.write_text(json.dumps(ModelConfig().to_dict()))  # the defaults are the public 671B config.json
    return path


def test_world1_weights_equal_the_checkpoint_bytes():
    cfg = real_config(layers=4, dense_layers=3)
    spec = checkpoint_spec(cfg)
    size = {"fp8": 1, "scale": 4, "bf16": 2, "fp32": 4, "norm": 4}  # norm: the indexer LayerNorm is held in fp32
    want = sum(math.prod(t.shape) * size[t.kind] for t in spec.values())
    assert sum(rank_weight_bytes(cfg, ParallelPlan(1), 0, torch.bfloat16).values()) == want


@pytest.mark.parametrize("world", [8, 16])
def test_split_parts_sum_to_the_whole_and_replicated_parts_repeat(world):
    cfg = real_config(layers=4, dense_layers=3)
    one = rank_weight_bytes(cfg, ParallelPlan(1), 0)
    ranks = weight_bytes_by_rank(cfg, ParallelPlan(world))
    for c in SPLIT:
        assert sum(r[c] for r in ranks) == one[c], c
    for c in REPLICATED:
        assert all(r[c] == one[c] for r in ranks), c


@pytest.mark.parametrize("world", [1, 8, 16])
def test_mtp_extras_split_eh_proj_and_the_vocabulary_copies(world):
    """An MTP module's own tensors per rank: enorm, hnorm and the head's norm whole (bf16 [D] each); eh_proj
    [D, 2D] by output rows and the embedding / head copies [V, D] by vocabulary rows, 1 / world each."""
    cfg = real_config(layers=4, dense_layers=3)
    D, V = cfg.hidden_size, cfg.vocab_size
    want = 3 * D * 2 + (2 * D * D + 2 * V * D) * 2 // world
    assert all(r["MTP extras"] == want for r in weight_bytes_by_rank(cfg, ParallelPlan(world)))


@pytest.mark.parametrize("numerics,dtype", [("fp8", torch.bfloat16), ("fp8", torch.float32), ("dequant", torch.float32)])
def test_kv_bytes_equal_the_cache(numerics, dtype):
    cfg = tiny_config()
    cache = KVCache(cfg, 3, 2, 17, device="cpu", dtype=dtype, quantized=numerics == "fp8")
    assert kv_bytes_per_token_layer(cfg, dtype, numerics == "fp8") * 3 * 2 * 17 == cache.nbytes()
    if numerics == "fp8" and dtype == torch.bfloat16:
        assert kv_bytes_per_token_layer(ModelConfig(), dtype) == 512 + 16 + 128 + 128 + 4


def test_world1_prediction_equals_a_real_load(tiny_model):
    """(The 2-rank version of this check runs in tests/parallel/test_parallel.py on the sharded load.)"""
    want = sum(rank_weight_bytes(tiny_model.cfg, ParallelPlan(1), 0, torch.float32).values())
    assert param_bytes(tiny_model) == want


@pytest.mark.parametrize("argv,fits", [
    (["--gpus", "8", "--gpu-mem-gib", "141"], True),  # 8 x H200, one node
    (["--gpus", "8", "--nodes", "2", "--gpu-mem-gib", "80"], True),  # 16 x H100, two nodes
    (["--gpus", "4", "--gpu-mem-gib", "80"], False),
])
def test_cli_on_the_real_config(real_config_file, capsys, argv, fits):
    rc = main([str(real_config_file), *argv])
    out = capsys.readouterr().out
    print(out)
    assert rc == (0 if fits else 1)
    assert ("FITS" in out and "DOES NOT FIT" not in out) == fits
    assert "788 B/token/layer x 62 layers" in out


def test_plan_numbers_for_8xh200():
    p = make_plan(ModelConfig(), 8, 141, wl=Workload(batch=1, max_len=32768))
    assert p.world == 8 and p.kv_layers == 62
    assert p.kv_bytes == 788 * 62 * 32768
    assert 80 * 2**30 < p.weights_max < 90 * 2**30  # ~690 GB / 8 plus replicated attention, indexer, router
    assert p.collectives_per_step == 2 * 61 + 2 + 2 * 5  # target forward + 2 eagle draft forwards (eh_proj gather)


def test_fp8_draft_head_copy_at_tp8(real_config_file, capsys):
    """--draft-head-fp8: a rank's [16160, 7168] head rows in e4m3 + fp32 block scales, ~116 MB, per MTP module the
    drafts read (one for eagle, and for vanilla past the checkpoint's one module), resident beside the weights."""
    from mtp.parallel.memory import draft_head_fp8_bytes

    cfg = ModelConfig()
    one = 16160 * 7168 + math.ceil(16160 / 128) * 56 * 4
    assert one == 115_863_328
    assert draft_head_fp8_bytes(cfg, ParallelPlan(8), "eagle", 3) == one
    assert draft_head_fp8_bytes(cfg, ParallelPlan(8), "vanilla", 3) == one  # the one module, repeated
    assert draft_head_fp8_bytes(cfg, ParallelPlan(8), "none", 0) == 0
    base, fp8_head = (make_plan(cfg, 8, 141, wl=Workload(k=3, head_fp8=h)) for h in (False, True))
    assert fp8_head.draft_head_bytes == one and fp8_head.resident - base.resident == one
    assert main([str(real_config_file), "--gpus", "8", "--gpu-mem-gib", "141", "--k", "3", "--draft-head-fp8"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"draft head FP8 copy +110\.50 MiB", out)
    assert re.search(r"rotary angle table +40\.00 MiB", out)  # 163840 x 32 pairs x cos, sin fp32: every rank


def test_rotary_angle_table_is_planned_as_the_fast_path_allocates_it():
    """The fast path's rotary angle table (`FastRotary.table`: cos and sin of every position, one per device), made on
    the CPU for a small config: its tensors' bytes are the planner's line, in the resident total (the CLI's line at
    DeepSeek-V3.2's 163840 positions, 40 MiB: `test_fp8_draft_head_copy_at_tp8`)."""
    from dataclasses import replace

    from mtp.backends.fast_path import FastRotary
    from mtp.kernels.dispatch import FastPathOptions
    from mtp.model.layers import Rotary

    cfg = tiny_config()
    rot = Rotary(cfg)
    rot.__class__, rot.fast_options = FastRotary, FastPathOptions()
    cos, sin = rot.table(torch.device("cpu"))
    assert rot.table(torch.device("cpu"))[0] is cos and len(rot.rope_tables) == 1  # made once, never grown
    p = make_plan(cfg, 1, 80, wl=Workload(max_len=512, prompt_len=64))
    assert p.rope_table_bytes == cos.nbytes + sin.nbytes == 4096 * cfg.qk_rope_head_dim * 4
    assert p.resident - replace(p, rope_table_bytes=0).resident == p.rope_table_bytes


def test_cli_on_a_missing_path_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as ei:
        main([str(tmp_path / "nowhere"), "--gpus", "8", "--gpu-mem-gib", "80"])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("mtp-plan: error:") and "nowhere" in err and err.count("\n") == 1


def test_cli_suggests_what_would_fit(real_config_file, capsys):
    """4 x H100 cannot hold the 671B model; the output says which settings would, each checked by the planner."""
    rc = main([str(real_config_file), "--gpus", "4", "--gpu-mem-gib", "80"])
    out = capsys.readouterr().out
    assert rc == 1 and "DOES NOT FIT" in out
    m = re.search(r"would fit: --nodes (\d+) \(", out)
    assert m, out
    n = int(m.group(1))  # the fewest nodes of 4 x 80 GiB that hold it
    cfg = ModelConfig.from_json(real_config_file)
    assert make_plan(cfg, 4, 80, nodes=n).fits
    for fewer in range(1, n):  # each smaller node count either does not fit or cannot split the model
        try:
            assert not make_plan(cfg, 4, 80, nodes=fewer).fits, fewer
        except ValueError:
            pass


def test_cli_finds_the_bundled_config_by_name(real_config_file, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no file of that name here: the installed package's copy is read
    argv = ["--gpus", "8", "--gpu-mem-gib", "141", "--json"]
    assert main(["deepseek-v3.2", *argv]) == 0
    by_name = json.loads(capsys.readouterr().out)
    main([str(real_config_file), *argv])
    assert by_name == json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "1", "--gpu-mem-gib", "nan"], "--gpu-mem-gib must be a finite number > 0, got nan"),
    (["--gpus", "1", "--gpu-mem-gib", "inf"], "--gpu-mem-gib must be a finite number > 0, got inf"),
    (["--gpus", "0", "--gpu-mem-gib", "80"], "--gpus must be an integer >= 1, got 0"),
    (["--gpus", "3", "--gpu-mem-gib", "80"],
     "--gpus 3 x --nodes 1 = 3 ranks: num_attention_heads = 4 is not divisible by the parallel world size 3; "
     "this config splits over [1, 2, 4] ranks"),
])
def test_cli_bad_values_are_one_line(capsys, argv, message):
    """NaN / infinite memory and a world the model cannot split over: one line naming the option, exit 2 (they were
    tracebacks)."""
    from mtp.checkpoint.tiny import default_checkpoint

    with pytest.raises(SystemExit) as e:
        main([str(default_checkpoint()), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1] == f"mtp-plan: error: {message}", err
