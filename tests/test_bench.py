"""mtp-bench's arithmetic on the host: the full-model projection and the table (the GPU parts run on the device)."""

from __future__ import annotations

import argparse

import pytest

from mtp import bench


def _result(device="NVIDIA H100 80GB HBM3"):
    def width(ms, dense, experts, head, kv):
        return {"graph_ms": ms, "eager_ms": 10 * ms, "graph_ms_unfused_glue": 1.5 * ms, "roofline_ms": 0.7 * ms,
                "pct_of_roofline_graph": 70.0, "experts_touched": [0, 8, 8],
                "bytes": {"weights_dense": dense, "weights_experts": experts, "lm_head": head, "kv": kv,
                          "total": dense + experts + head + kv}}

    G = 1e9
    return {"device": device, "copy_TBps": 2.9, "torch": "x",
            "ours": {"target_step": {1: width(1.8, 0.9 * G, 0.7 * G, 1.85 * G, 0.01 * G),
                                     2: width(2.1, 0.9 * G, 1.3 * G, 1.85 * G, 0.01 * G)},
                     "spec_step": {"eagle_k1_graph": {"gpu_step_ms": 3.0, "step_ms_wall": 3.2, "gpu_idle_frac": 0.01}}},
            "hf": {"decode_ms": 18.0, "layers": 3}, "speedup_vs_hf_w1": 10.0, "speedup_bound_vs_hf_w1": 14.3}


ARGS = argparse.Namespace(layers=3, dense_layers=1, k=1, accept=0.8, allreduce_us=10.0)


def test_projection_bytes_time_and_mtp_speedup():
    res = _result()
    bench._project(res, ARGS)
    pj = res["projection_full_61_layers"]
    G = 1e9
    want1 = 61 * 0.9 * G / 3 + 58 * 0.7 * G / 2 + 1.85 * G + 0.01 * G / 3 * 61
    assert pj["bytes_per_width"][1] == pytest.approx(want1)
    assert pj["draft_ms_measured"] == pytest.approx(3.0 - 2.1)  # spec step minus the target forward at K+1
    t = pj["table"]
    ms_per_byte1 = 1.8 / (3.46 * G)
    plain = want1 * ms_per_byte1
    assert t["H100_tp1"]["tpot_plain_ms"] == pytest.approx(plain)
    assert t["H100_tp1"]["AL"] == pytest.approx(1.8)  # 1 + 0.8
    step = pj["bytes_per_width"][2] * 2.1 / (4.06 * G) + 0.9
    assert t["H100_tp1"]["mtp_speedup"] == pytest.approx(1.8 * plain / step)
    # the other GPU: scaled by the spec-sheet bandwidth ratio; TP 8: an eighth of the bytes plus all-reduces
    assert t["H200_tp1"]["tpot_plain_ms"] == pytest.approx(plain * 3.35 / 4.8)
    assert t["H100_tp8"]["tpot_plain_ms"] == pytest.approx(plain / 8 + 124 * 10e-3)


def test_projection_on_an_unknown_gpu_is_nan_not_wrong():
    res = _result(device="Some Other GPU")
    bench._project(res, ARGS)
    v = res["projection_full_61_layers"]["table"]["H100_tp1"]["tpot_plain_ms"]
    assert v != v  # NaN: no bandwidth ratio to carry the measurement over


def test_table_prints_every_line(capsys):
    res = _result()
    bench._project(res, ARGS)
    bench._table(res)
    out = capsys.readouterr().out
    assert "target step w=2 graph" in out and "full 61 layers H200_tp8" in out
    assert "at the HBM roofline 14.3x" in out
