"""Calibration: the fit recovers known efficiencies from measurements the model itself produced (in the real
JSON formats), reads our recorded files, and names the bad file / field."""

import json

import pytest

from mtp.model.presets import tiny_config
from mtp.plan.calibrate import calibrate, fit_link, rows_from
from mtp.plan.cli import main
from mtp.plan.cost import Layout, Shape, forward_terms
from mtp.plan.hardware import GPUS
from mtp.plan.speed import Efficiency, time_terms

CFG = tiny_config(layers=3, dense_layers=1, index_topk=16)
TRUE = Efficiency(bw=(("weights", 0.8), ("head", 0.8), ("experts", 0.5), ("attention", 0.6)),
                  launch=tuple((k, 2.0) for k in ("weights", "head", "experts", "attention")) + (("indexer", 20.0),),
                  per_row_launch=0.25)


TOUCHED = {1: 1.0, 2: 3.0, 3: 1.5, 4: 2.5}  # experts read per MoE layer per width: not a line in w


def synth_ms(L, w, touched, only=(), tp=2):
    terms = forward_terms(CFG, Layout(tp, tp), Shape(1, w, L + w, touched=touched))
    terms = [t for t in terms if t.name in only] if only else terms
    return time_terms(terms, GPUS["h200"], Layout(tp, tp), TRUE, w).work_ms


def rank_json(tmp_path):
    ctx = {}
    for L in (8, 64, 512):
        ctx[str(L)] = {"widths": {str(w): {"graph_ms": synth_ms(L, w, TOUCHED[w]), "kernels_per_step": 70,
                                           "local_experts_touched": {"mean": TOUCHED[w]}} for w in (1, 2, 3, 4)},
                       "indexer": {str(w): {"ms_per_step": synth_ms(L, w, None, ("indexer",))} for w in (1, 2)
                                   if L + w > 16}}
    d = {"device": "NVIDIA H200", "tp": 2, "args": {"batch": 1}, "contexts": ctx,
         "config": {"num_hidden_layers": 3, "first_k_dense_replace": 1}}
    p = tmp_path / "rank.json"
    p.write_text(json.dumps(d))
    return p


def tp1_json(tmp_path):
    """mtp-bench's TP=1 format: a few layers at full width, experts touched per layer (the dense one 0)."""
    steps = {str(w): {"graph_ms": synth_ms(8, w, 2.0 * w, tp=1), "experts_touched": [0, 2 * w, 2 * w]}
             for w in (1, 2, 3, 4)}
    d = {"device": "NVIDIA H200", "ours": {"config": {"layers": 3, "dense_layers": 1, "prompt_len": 8, "batch": 1},
                                           "target_step": steps}}
    p = tmp_path / "tp1.json"
    p.write_text(json.dumps(d))
    return p


def test_fit_recovers_the_efficiencies_that_made_the_measurements(tmp_path):
    cal = calibrate(CFG, [str(rank_json(tmp_path)), str(tp1_json(tmp_path))])
    assert dict(cal.efficiency.bw)["weights"] == pytest.approx(0.8, rel=1e-4)
    assert dict(cal.efficiency.bw)["experts"] == pytest.approx(0.5, rel=1e-4)
    assert dict(cal.efficiency.bw)["attention"] == pytest.approx(0.6, rel=1e-4)
    assert dict(cal.efficiency.launch)["indexer"] == pytest.approx(20.0, rel=1e-4)
    assert cal.efficiency.per_row_launch == pytest.approx(0.25, rel=1e-4)
    assert all(r.calibrated_ms == pytest.approx(r.measured_ms, rel=1e-4) for r in cal.rows)
    assert all(r.roofline_ms < r.measured_ms for r in cal.rows)
    assert len(cal.rows) == 12 + 4 + 4  # steps; indexer alone where context > index_topk; TP=1


def test_link_fit_from_a_collectives_json():
    g = GPUS["h200"]
    ops = {"world": 8, "ops": {"all_reduce": [{"bytes": b, "us": 2 * 7 / 8 * b / 300e9 * 1e6 + 3 * 4.0}
                                              for b in (1024, 28672, 1 << 20)]}}
    link = fit_link(ops, g)
    assert link["link_latency_us"] == pytest.approx(4.0) and link["link_gbps"] == pytest.approx(300.0)


def test_our_recorded_measurements_fit_within_10_percent_at_batch_1():
    from mtp.model.config import ModelConfig
    cal = calibrate(ModelConfig(), ["eval/results/bench_tp8_h200_final_s4.json",
                                    "eval/results/bench_tp1_h200_db855bd_default.json"])
    steps = [r for r in cal.rows if r.label.startswith("TP8 rank")]
    assert len(steps) == 8
    assert all(abs(r.calibrated_ms / r.measured_ms - 1) < 0.10 for r in steps), \
        [(r.label, r.calibrated_ms, r.measured_ms) for r in steps]


@pytest.mark.parametrize("content, bad", [("not json", "cannot read"), ("[1]", "JSON object"),
                                          ('{"device": "NVIDIA H200"}', "no 'ours'"),
                                          ('{"device": "Tesla T4", "ours": {}}', "field 'device'")])
def test_bad_files_are_named(tmp_path, content, bad):
    p = tmp_path / "m.json"
    p.write_text(content)
    with pytest.raises(ValueError, match=bad) as e:
        rows_from(str(p), CFG)
    assert str(p) in str(e.value)


def test_cli_calibrate_missing_file_exits_2(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["--speed", "--calibrate", str(tmp_path / "nope.json")])
    assert e.value.code == 2 and "--calibrate" in capsys.readouterr().err
