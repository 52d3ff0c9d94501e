"""Calibration: the bounded fit recovers known efficiencies from measurements the model itself produced (in the
real JSON formats, over batch and context), pins what lies outside the physical bounds, says what the rows cannot
separate, checks itself on held-out batch sizes, reads our recorded files, and names the bad file / field."""

import dataclasses
import json

import pytest
import torch

from mtp.model.config import ModelConfig
from mtp.model.presets import tiny_config
from mtp.plan.calibrate import PARAMS, StepModel, calibrate, fit_link, fit_rows, holdout, rows_from
from mtp.plan.cli import main
from mtp.plan.cost import Layout, Shape, forward_terms
from mtp.plan.kernels import StepShape, indexer_select
from mtp.plan.fit import Param, fit_bounded
from mtp.plan.hardware import GPUS
from mtp.plan.speed import Efficiency, time_terms

CFG = tiny_config(layers=3, dense_layers=1, index_topk=16)  # file-format tests
REAL = ModelConfig()  # the fit's tests: DeepSeek-V3.2's widths (bytes, FLOPs and launches all count), 4 layers
KINDS = ("weights", "head", "experts", "attention", "indexer")
TRUTH = {"bw_weights": 0.8, "bw_experts": 0.5, "bw_attention": 0.6, "flops_weights": 0.05,
         "flops_experts": 0.012, "flops_attention": 0.02, "launch": 2.0, "indexer_launch": 20.0}
# experts read per MoE layer per width on the 'split' rank the files name (every expert's 1/8 slice held: a token's
# 8 experts are 8 slices): not a line in w
TOUCHED = {1: 8.0, 2: 16.0, 3: 12.0, 4: 20.0}


def truth_eff(t=TRUTH):
    g = {"weights": "weights", "head": "weights", "experts": "experts", "attention": "attention",
         "indexer": "attention"}
    return Efficiency(bw=tuple((k, t[f"bw_{g[k]}"]) for k in KINDS),
                      compute=tuple((k, t[f"flops_{g[k]}"]) for k in KINDS),
                      launch=tuple((k, t["indexer_launch" if k == "indexer" else "launch"]) for k in KINDS))


def synth_ms(B, L, w, touched, eff, only=(), tp=8):
    cfg = dataclasses.replace(REAL, num_hidden_layers=4, first_k_dense_replace=1)
    terms = forward_terms(cfg, Layout(tp, tp), Shape(B, w, L + w, touched=touched))
    terms = [t for t in terms if t.name in only] if only else terms
    if only == ("indexer",):  # the bench times its scores and top-k alone: `kernels.indexer_select` launches
        terms = [dataclasses.replace(t, launches=indexer_select(StepShape(B, w, L + w, tp))) for t in terms]
    return time_terms(terms, GPUS["h200"], Layout(tp, tp), eff).work_ms


def rank_json(tmp_path, eff, batches=(1, 8, 32, 64), contexts=(1024, 8192, 32768)):
    """A 4-layer TP=8 rank of the real model in `mtp-bench --tp 8 --batch ...`'s format."""
    from mtp.kernels.dispatch import FastPathOptions

    # written by this code: its switches and the layout 'auto' gives the real model at TP=8 (synth_ms counts so)
    d = {"device": "NVIDIA H200", "tp": 8, "args": {"batch": 1}, "batches": {},
         "config": {"num_hidden_layers": 4, "first_k_dense_replace": 1},
         "fast_path_options": vars(FastPathOptions()), "expert_layout": "split"}
    for B in batches:
        ctx = {}
        for L in contexts:
            ctx[str(L)] = {"widths": {str(w): {"graph_ms": synth_ms(B, L, w, TOUCHED[w] if B == 1 else None, eff),
                                               "kernels_per_step": 70,
                                               **({"local_experts_touched": {"mean": TOUCHED[w]}} if B == 1 else {})}
                                      for w in (1, 2, 3, 4)},
                           "indexer": {str(w): {"ms_per_step": synth_ms(B, L, w, None, eff, ("indexer",))}
                                       for w in (1, 2) if L + w > 2048}}
        d["batches"][str(B)] = {"contexts": ctx}
    p = tmp_path / "rank.json"
    p.write_text(json.dumps(d))
    return p


def test_bounded_fit_recovers_the_parameters_that_made_the_measurements(tmp_path):
    cal = calibrate(REAL, [str(rank_json(tmp_path, truth_eff()))])
    f = cal.fit
    # the rows exercise every class's bytes and launches, and its FLOPs where batch x width makes them bind
    assert not f.bound and not f.unresolved, (f.bound, f.unresolved)
    for name, v in TRUTH.items():
        assert f.values[name] == pytest.approx(v, rel=1e-3), name
    steps = [r for r in cal.rows if not r.only]
    assert all(r.calibrated_ms == pytest.approx(r.measured_ms, rel=1e-4) for r in cal.rows)
    assert len(steps) == 4 * 3 * 4 and all(r.roofline_ms < r.measured_ms for r in steps)


def test_a_truth_outside_the_bounds_is_pinned_and_said_so(tmp_path):
    low = dict(TRUTH, bw_experts=0.1)  # a tenth of HBM: below the physical floor the fit allows
    cal = calibrate(REAL, [str(rank_json(tmp_path, truth_eff(low)))])
    assert cal.fit.bound.get("bw_experts") == "lower" and cal.fit.values["bw_experts"] == pytest.approx(0.3, rel=1e-2)
    assert "at its lower bound" in cal.fit.describe("bw_experts")
    assert any("bw_experts sits at its lower bound" in n for n in cal.notes)
    assert all(p.lo <= cal.fit.values[p.name] <= p.hi for p in PARAMS)


def test_physical_bounds():
    b = {p.name: (p.lo, p.hi) for p in PARAMS}
    assert all(b[f"bw_{g}"] == (0.3, 1.0) for g in ("weights", "experts", "attention"))
    assert all(0 < b[f"flops_{g}"][0] < 0.05 and b[f"flops_{g}"][1] == 1.0 for g in ("weights", "experts", "attention"))
    assert b["launch"][0] == 0.0 and b["indexer_launch"][0] == 0.0


def test_rows_that_do_not_exercise_a_parameter_say_so(tmp_path):
    """Context <= index_topk: no indexer in any row, so its launch cost is not a number the fit can give."""
    cal = calibrate(REAL, [str(rank_json(tmp_path, truth_eff(), contexts=(1024, 2000)))])
    assert "indexer_launch" in cal.fit.unresolved and "not separable" in cal.fit.describe("indexer_launch")


def test_step_model_is_the_arithmetic_time_terms_applies(tmp_path):
    _, rows, _ = rows_from(str(rank_json(tmp_path, truth_eff())), REAL)
    x = torch.tensor([TRUTH[p.name] for p in PARAMS], dtype=torch.float64)
    got = StepModel(rows, GPUS["h200"])(x, None) * 1e3
    assert got.tolist() == pytest.approx([r.measured_ms for r in rows], rel=1e-12)


def test_holdout_splits_the_batch_sizes_both_ways(tmp_path):
    """The experts' FLOPs bind only at batch 64: a fit on the low half reports them not separable; the high half
    misses what only the small batches pin, and the check says so (its error is the largest row's)."""
    _, rows, _ = rows_from(str(rank_json(tmp_path, truth_eff())), REAL)
    steps = [r for r in rows if not r.only]
    h = holdout(steps, GPUS["h200"])
    assert [(x["fit_on_batches"], x["predict_batches"]) for x in h] == [([1, 8], [32, 64]), ([32, 64], [1, 8])]
    assert all(x["fit_rows"] == len(x["rows"]) == 2 * 3 * 4 for x in h)
    assert "flops_experts" in fit_rows([r for r in steps if r.shape.rows <= 8], GPUS["h200"]).unresolved
    assert h[1]["max_abs_error"] > 0.05 and h[1]["max_abs_error"] == max(abs(e) for e in h[1]["rows"].values())


def test_row_selection(tmp_path):
    p = rank_json(tmp_path, truth_eff())
    _, rows, _ = rows_from(f"{p}:b=1,8:ctx=8192", REAL)
    assert {(r.shape.rows, r.shape.context - r.shape.width) for r in rows} == {(1, 8192), (8, 8192)}
    for sel, bad in ((":b=2", "keeps no row"), (":batch=1", "must be b=N"), (":b=x", "must be b=N")):
        with pytest.raises(ValueError, match=bad) as e:
            rows_from(f"{p}{sel}", REAL)
        assert str(p) in str(e.value)


def test_fit_bounded_rejects_bad_bounds_and_times():
    with pytest.raises(ValueError, match="bounds"):
        Param("x", "", 1.0, 0.5, "")
    with pytest.raises(ValueError, match="positive times"):
        fit_bounded(lambda x: x, torch.tensor([1.0, -1.0]), [Param("x", "", 0.1, 1.0, "")])


def test_link_fit_from_a_collectives_json():
    ops = {"world": 8, "ops": {"all_reduce": [{"bytes": b, "us": 2 * 7 / 8 * b / 300e9 * 1e6 + 3 * 4.0}
                                              for b in (1024, 28672, 1 << 20)]}}
    link = fit_link(ops, GPUS["h200"])
    assert link["link_latency_us"] == pytest.approx(4.0, rel=1e-3) and link["link_gbps"] == pytest.approx(300.0, rel=1e-3)


def test_our_batch_measurements_fit_within_10_percent_counted_as_their_code():
    """Session 9's TP=8 batch axis fits within 10% at every row; and its rows are counted by the launch structure of
    the code that wrote them (`measured_code`: test_a_file_is_counted_as_the_code_that_wrote_it_launched): the
    profiler's count is the structure's + 9 at every shape (BENCHMARKS.md, session 10). One fit for both (~6 s)."""
    from mtp.plan.calibrate import _kernels

    cal = calibrate(ModelConfig(), ["eval/results/s9/h200/bench_tp8_batch.json"])
    assert {r.shape.rows for r in cal.rows} == {1, 8, 32, 64} and len(cal.rows) == 16
    assert all(abs(r.residual) < 0.10 for r in cal.rows), [(r.label, r.residual) for r in cal.rows]
    assert all(p.lo <= cal.fit.values[p.name] <= p.hi for p in PARAMS)
    assert len(cal.holdout) == 2
    rows = [r for r in cal.rows if r.measured_kernels]
    assert len(rows) == 16 and all(r.measured_kernels - _kernels(r) == 9 for r in rows)


@pytest.mark.parametrize("content, bad", [("not json", "cannot read"), ("[1]", "JSON object"),
                                          ('{"device": "NVIDIA H200"}', "no 'ours'"),
                                          ('{"device": "Tesla T4", "ours": {}}', "field 'device'"),
                                          ('{"device": "NVIDIA H200", "tp": 8, "contexts": {}}', "field 'config'"),
                                          ('{"device": "NVIDIA H200", "tp": 8, "config": {"num_hidden_layers": 3, '
                                           '"first_k_dense_replace": 1}, "batches": {"1": {"contexts": {"8": '
                                           '{"widths": {"1": {"graph_ms": -1}}}}}}}',
                                           r"batches.1.contexts.8.widths.1.graph_ms = -1")])
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


def test_a_file_is_counted_as_the_code_that_wrote_it_launched():
    """A measurement of older code is counted by that code's launch structure (`measured_code`): session 9's file
    records no `fast_path_options`, so its rows are counted with session 11's fusions off on a 'contiguous' rank
    (its rows' counts against the profiler's: the test of our batch measurements' fit); counted as this code
    launches, each row would be hundreds of kernels short."""
    from mtp.plan.calibrate import BEFORE_SESSION_11, measured_code

    lim, lay = measured_code({})
    assert lay == "contiguous" and all(getattr(lim, k) == v for k, v in BEFORE_SESSION_11.items())
    now, lay_now = measured_code({"fast_path_options": {"shared_in_experts": True, "fuse_prologue": True},
                                  "expert_layout": "split"})
    assert now.shared_in_experts and now.fuse_prologue and lay_now == "split"
