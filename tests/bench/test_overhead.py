"""`python -m mtp.bench.overhead`: the real-vs-simulated ratio from the 4 x H200 runs of session 11 (committed raw
files), recomputed by hand for one width, and the refusal of two runs of different steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtp.bench.overhead import main
from mtp.bench.rank_model import collective_latency, comm_ms

RES = Path(__file__).resolve().parents[2] / "eval" / "results" / "s11"
REAL, SIM, AR = RES / "x4b" / "deep_tp4.json", RES / "x4b" / "deep_sim_tp4.json", RES / "x4a" / "allreduce_4gpu.json"


def test_ratio_is_real_over_sim_plus_priced_collectives(tmp_path, capsys):
    out = tmp_path / "o.json"
    assert main([str(REAL), str(SIM), "--collectives", str(AR), "--gather-us", "16.34", "--json", str(out)]) == 0
    got = json.loads(out.read_text())["overhead"]
    real, sim = json.loads(REAL.read_text()), json.loads(SIM.read_text())
    w1 = sim["contexts"]["1024"]["widths"]["1"]
    from types import SimpleNamespace
    lat = collective_latency(SimpleNamespace(collective_json=str(AR), tp=4, allreduce="nccl", collective_growth=1.0,
                                             allreduce_us=16.34))
    # 81 fp32 all-reduces + 1 all-gather at w = 1: NCCL's 28672 B row of the file, 14.00 us, and the gather given
    assert w1["collectives"]["all_reduce"] == 81 and w1["collectives"]["all_gather"] == 1
    assert comm_ms(lat, w1["collectives"]) == pytest.approx((81 * 14.00 + 16.34) * 1e-3, abs=2e-3)
    want = real["allreduce"]["nccl"]["target_step"]["1"]["graph_ms"] / (w1["graph_ms"] + comm_ms(lat, w1["collectives"]))
    assert got["nccl"]["1"]["ratio"] == pytest.approx(want)
    assert set(got) == {"nccl", "oneshot", "timing"} and set(got["oneshot"]) == {"1", "2", "3", "4"}
    assert got["timing"] == "graph_ms"  # session 11's files: no back-to-back timing on either side
    assert "nccl" in capsys.readouterr().out


def test_back_to_back_timing_where_both_have_it(tmp_path):
    """Runs that timed replays back to back on both sides (`graph_ms_b2b`, since session 15 in mtp.bench.parallel)
    are compared on those; one side without them: both on graph_ms."""
    real, sim = json.loads(REAL.read_text()), json.loads(SIM.read_text())
    for r in real["allreduce"].values():
        for step in r["target_step"].values():
            step["graph_ms_b2b"] = step["graph_ms"] - 0.25
    for row in sim["contexts"]["1024"]["widths"].values():
        row["graph_ms_b2b"] = row["graph_ms"] - 0.5
    paths = {n: tmp_path / f"{n}.json" for n in ("real", "sim", "out")}
    paths["real"].write_text(json.dumps(real))
    paths["sim"].write_text(json.dumps(sim))
    args = [str(paths["real"]), str(paths["sim"]), "--collectives", str(AR), "--gather-us", "16.34", "--json",
            str(paths["out"])]
    assert main(args) == 0
    got = json.loads(paths["out"].read_text())["overhead"]
    assert got["timing"] == "graph_ms_b2b"
    w1 = got["nccl"]["1"]
    assert w1["real_ms"] == pytest.approx(real["allreduce"]["nccl"]["target_step"]["1"]["graph_ms"] - 0.25)
    assert w1["sim_ms"] == pytest.approx(sim["contexts"]["1024"]["widths"]["1"]["graph_ms"] - 0.5)
    del sim["contexts"]["1024"]["widths"]["2"]["graph_ms_b2b"]
    paths["sim"].write_text(json.dumps(sim))
    assert main(args) == 0
    assert json.loads(paths["out"].read_text())["overhead"]["timing"] == "graph_ms"


def test_different_steps_refused(tmp_path):
    sim = json.loads(SIM.read_text())
    sim["config"]["num_hidden_layers"] = 12
    bad = tmp_path / "sim.json"
    bad.write_text(json.dumps(sim))
    with pytest.raises(SystemExit, match="num_hidden_layers differs: 40 .* 12"):
        main([str(REAL), str(bad), "--collectives", str(AR), "--gather-us", "16"])
