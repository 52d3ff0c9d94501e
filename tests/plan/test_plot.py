"""--plot: the curves it draws and the measured points it overlays."""

import pytest

from mtp.model.config import ModelConfig
from mtp.plan.plot import curves, measured_points, plot_speed, rate_for
from mtp.plan.speed import accept_len

MEASURED = "eval/results/bench_tp8_h200_final_s4.json"


def test_rate_for_inverts_accept_len():
    for k, al in ((1, 1.5), (3, 2.8), (2, 1.0), (3, 4.0)):
        assert accept_len([rate_for(al, k)], k) == pytest.approx(al, abs=1e-9)


def test_curves_mtp_pays_at_batch_1_and_per_gpu_grows_with_batch():
    c = curves(ModelConfig(), "h200", 0.8, 1024, batches=(1, 16, 256))
    per_user = {k: [r[1] for r in rows] for k, rows in c.items()}
    per_gpu = {k: [r[2] for r in rows] for k, rows in c.items()}
    assert per_user[3][0] > per_user[0][0]  # memory-bound batch 1: drafts are almost free
    assert all(a > b for a, b in zip(per_user[0], per_user[0][1:]))
    assert all(a < b for a, b in zip(per_gpu[0], per_gpu[0][1:]))


def test_plot_writes_a_png_with_the_measured_points(tmp_path):
    out = tmp_path / "speed.png"
    d = plot_speed(ModelConfig(), str(out), 2.8, 3, [MEASURED], gpus=("h200",))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pts = [m for m in d["measured"] if m["context"] == 1024]
    assert sorted(m["w"] for m in pts) == [1, 2, 3, 4] and all(m["batch"] == 1 and m["tp"] == 8 for m in pts)
    assert measured_points(["eval/results/bench_tp1_h200_db855bd_default.json"]) == []  # TP=1 files: no rank steps


def test_plot_overlays_the_batch_axis_file_and_its_row_selection(tmp_path):
    batch = "eval/results/s9/h200/bench_tp8_batch.json"
    d = plot_speed(ModelConfig(), str(tmp_path / "b.png"), 2.8, 3, [batch], gpus=("h200",))
    assert sorted({m["batch"] for m in d["measured"]}) == [1, 8, 32, 64] and len(d["measured"]) == 16
    assert {m["batch"] for m in measured_points([batch + ":b=8,64"])} == {8, 64}
