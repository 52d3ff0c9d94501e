"""SpecMetrics: per-request latency (never summed over requests), the acceptance rate, one set of formulas."""

from __future__ import annotations

import numpy as np
import pytest

import mtp
from mtp.decode.metrics import RowClock, SpecMetrics, acceptance


def test_merge_keeps_per_request_latency_samples_instead_of_summing():
    """8 requests of ~40 ms prefill each: TTFT is ~40 ms per request, not their 320 ms sum."""
    parts = [SpecMetrics(k=1, n_rows=2, ttft_s_rows=[0.04 + i / 1000] * 2, tpot_s_rows=[0.01 * (i + 1), 0.02])
             for i in range(4)]
    m = parts[0]
    for p in parts[1:]:
        m = m.merge(p)
    ttft = sorted(x for p in parts for x in p.ttft_s_rows)
    assert m.ttft_s_rows == [x for p in parts for x in p.ttft_s_rows]
    assert m.ttft["mean"] == pytest.approx(np.mean(ttft)) and m.ttft["n"] == 8
    for q in (50, 90, 99):
        assert m.ttft[f"p{q}"] == pytest.approx(np.percentile(ttft, q))
        assert m.tpot[f"p{q}"] == pytest.approx(np.percentile(m.tpot_s_rows, q))
    d = m.to_dict()
    assert "speed/ttft_s" not in d and d["speed/ttft_mean_s"] == pytest.approx(0.0415)
    assert d["speed/ttft_p99_s"] == pytest.approx(np.percentile(ttft, 99)) and d["count/requests"] == 8
    assert d["speed/tpot_p50_s"] == pytest.approx(np.percentile(m.tpot_s_rows, 50))


def test_old_records_with_a_summed_ttft_still_load():
    raw = SpecMetrics(k=1).raw()
    del raw["ttft_s_rows"]
    raw["ttft_s"] = 0.341
    m = SpecMetrics.from_raw(raw)
    assert m.ttft_s_rows == [] and m.ttft["mean"] is None


def test_acceptance_rate_and_one_set_of_formulas():
    m = SpecMetrics(k=3, accepted_hist=[2, 3, 1, 4], row_steps=10)
    assert m.accept_rate == pytest.approx((3 + 2 + 12) / 30) and m.to_dict()["accept/rate"] == m.accept_rate
    a = acceptance(np.array([[2, 3, 1, 4], [0, 0, 0, 0]]))
    assert a["mean_len"][0] == pytest.approx(m.mean_accepted_len) and np.isnan(a["mean_len"][1])
    assert a["pos"][0] == pytest.approx(m.accept_cum) and a["cond"][0] == pytest.approx(m.accept_cond)
    assert SpecMetrics(k=0, accepted_hist=[5], row_steps=5).accept_rate == 0.0


def test_row_clock_times_each_row_from_its_events():
    clock = RowClock(3)
    clock(None, [1, 1, 1], [0, 0, 0])
    clock(None, [2, 0, 3], [1, 0, 2])
    clock(None, [1, 0, 0], [0, 0, 0])
    clock.last = [clock.first + 0.3, clock.first, clock.first + 0.1]  # event times, fixed for the test
    m = SpecMetrics(k=2, n_rows=3)
    clock.fill(m, [4, 1, 4])
    assert m.ttft_s_rows == [clock.first - clock.t0] * 3
    assert m.tpot_s_rows == pytest.approx([0.1, 0.1 / 3])  # the one-token row has no TPOT


@pytest.mark.parametrize("tree", [None, "2x1"])
def test_generate_reports_one_latency_sample_per_request(tiny_model, tree):
    kw = {"tree": tree} if tree else {"k": 2}
    r = mtp.generate(tiny_model, [[5, 17, 33, 8], [7, 7, 300, 12, 9], [3, 4, 5]], max_new_tokens=6,
                     draft="eagle", **kw)
    m = r.metrics
    assert len(m.ttft_s_rows) == 3 and len(set(m.ttft_s_rows)) == 1 and m.ttft_s_rows[0] > 0
    assert len(m.tpot_s_rows) == sum(len(t) > 1 for t in r.tokens)
    assert all(0 < x < m.time_decode_s for x in m.tpot_s_rows)
