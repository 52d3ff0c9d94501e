"""`mtp-bench --tp 8` end to end on one GPU at 4 layers (3 dense + 1 MoE, ~6 GiB): the simulated rank builds,
its target steps capture and replay at a dense (1024) and a sparse (4096 > top-k 2048) context, the floor, the
kernel counts and the indexer line are filled in, the speculative steps run in overlap mode, the projection
prints. A smoke test of the GPU code paths the full-depth run takes (the full run needs an H200)."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def test_bench_tp8_four_layers(tmp_path):
    out = tmp_path / "tp8.json"
    cmd = [sys.executable, "-m", "mtp.bench", "--tp", "8", "--layers", "4", "--prompt-len", "1024", "4096",
           "--k", "1", "--new-tokens", "8", "--iters", "3", "--profile", "--trees", "chain1,2x1", "--tree-al", "chain1=1.5",
           "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["tp"] == 8 and res["rank"] == 0 and res["fast_path"] and res["config"]["num_hidden_layers"] == 4
    for L in ("1024", "4096"):
        for w, r in res["contexts"][L]["widths"].items():
            assert r["graph_ms"] > 0 and 0 < r["pct_of_floor"] < 100 and r["kernels_per_step"] > 10
            assert r["collectives"]["all_reduce"] == 1 + 2 * 4 and r["collectives"]["all_gather"] == 1
            assert r["profile_top"]
    assert "skipped" in res["contexts"]["1024"]["indexer"]["1"]  # S <= 2048: no indexer
    assert res["contexts"]["4096"]["indexer"]["1"]["scores_us_per_layer"] > 0
    assert "spec_step" in res, res.get("spec_step_error")
    runs = res["spec_step"]["runs"]
    assert runs["eagle_k1_overlap"]["gpu_step_ms"] > 0 and runs["none_k0_overlap"]["gpu_step_ms"] > 0
    assert "tok/s" in p.stdout and "ASSUMED" in p.stdout
    for L in ("1024", "4096"):  # the tree verify (captured) beside the chain of as many nodes
        t = res["contexts"][L]["trees"]["2x1"]
        assert t["nodes"] == 5 and t["tree"]["ms"] > 0 and t["chain"]["ms"] > 0 and 0 < t["pct_of_floor"] < 100
    assert "tree 2x1" in p.stdout and runs["tree_2x1_overlap"]["gpu_step_ms"] > 0  # the captured tree step
    pj = res["projection"]["contexts"]["1024"]["tree_chain1"]
    assert pj["AL"] == 1.5 and pj["draft_source"] == "measured tree step"


def test_bench_tp8_batch_axis_four_layers(tmp_path):
    """--batch 1 8: each batch its own entry with graph-timed steps at every width; the speed model's
    calibration reads the file (k = 3: 2 batches x 4 widths = 8 whole-step rows, as many as it fits parameters)."""
    out = tmp_path / "tp8b.json"
    cmd = [sys.executable, "-m", "mtp.bench", "--tp", "8", "--layers", "4", "--prompt-len", "1024", "--k", "3",
           "--batch", "1", "8", "--iters", "3", "--no-spec", "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    res = json.loads(out.read_text())
    assert set(res["batches"]) == {"1", "8"}
    for B in ("1", "8"):
        for w, r in res["batches"][B]["contexts"]["1024"]["widths"].items():
            assert r["graph_ms"] > 0 and r["kernels_per_step"] > 10
    from mtp.model.config import ModelConfig
    from mtp.plan.calibrate import calibrate
    cal = calibrate(ModelConfig(), [str(out)])
    assert {r.shape.rows for r in cal.rows} == {1, 8}


def test_bench_tp8_busiest_route_realises_the_drawn_counts(tmp_path):
    """--route busiest --layout contiguous at --batch 1 8 on the real-width rank (fast path, graphs): every MoE
    layer computes exactly the drawn busiest count of local experts (above K = 8 at batch 8: no cap), the draws
    are `draw_busiest`'s, and the steps capture and replay."""
    from mtp.bench.experts import draw_busiest
    from mtp.model.presets import real_config

    out = tmp_path / "tp8busy.json"
    cmd = [sys.executable, "-m", "mtp.bench", "--tp", "8", "--layers", "4", "--prompt-len", "1024", "--k", "3",
           "--route", "busiest", "--layout", "contiguous", "--batch", "1", "8", "--iters", "3", "--no-spec",
           "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=500, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    res = json.loads(out.read_text())
    cfg = real_config(layers=4, dense_layers=3)
    above_k = 0
    for B in ("1", "8"):
        for w, r in res["batches"][B]["contexts"]["1024"]["widths"].items():
            b, T = r["busiest_rank"], int(B) * int(w)
            assert r["graph_ms"] > 0 and b["tokens"] == T
            assert b["drawn_per_moe_layer"] == draw_busiest(cfg, "contiguous", 8, T, 1, 1000 * T), (B, w, b)
            assert b["realised_per_moe_layer"] == b["drawn_per_moe_layer"], (B, w, b)
            above_k += sum(n > cfg.num_experts_per_tok for n in b["drawn_per_moe_layer"])
    assert above_k > 0, "no draw above K = 8 at batch 8"
    assert "busiest rank of layout 'contiguous'" in p.stdout
