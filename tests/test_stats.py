"""mtp.stats: exact percentiles, Wilson intervals, the bootstrap over prompts."""

from __future__ import annotations

import numpy as np
import pytest

from mtp import stats


def test_percentile_matches_numpy_linear():
    rng = np.random.default_rng(1)
    for n in (1, 2, 7, 100):
        xs = list(rng.exponential(size=n))
        for q in (0, 50, 90, 99, 100):
            assert stats.percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    assert stats.percentile([], 50) is None
    with pytest.raises(ValueError, match="got 101"):
        stats.percentile([1.0], 101)


def test_latency_summary():
    d = stats.latency([0.1, 0.2, 0.3, 0.4])
    assert d["mean"] == pytest.approx(0.25) and d["p50"] == pytest.approx(0.25) and d["n"] == 4
    assert stats.latency([]) == {"mean": None, "p50": None, "p90": None, "p99": None, "n": 0}


def test_wilson_known_values():
    # Wilson 95% for 85/117 (acc@1 ~ 0.73 on 117 steps): (0.640, 0.799) by the score formula
    lo, hi = stats.wilson(85, 117)
    assert lo == pytest.approx(0.6397, abs=1e-3) and hi == pytest.approx(0.7991, abs=1e-3)
    assert stats.wilson(0, 10)[0] == 0.0 and stats.wilson(10, 10)[1] == pytest.approx(1.0)
    assert stats.wilson(0, 0) is None
    with pytest.raises(ValueError, match="got 11"):
        stats.wilson(11, 10)


def test_bootstrap_over_rows_covers_the_spread_of_prompts():
    """Rows of [successes, trials]: two kinds of prompts. The interval of the pooled rate lies around it and
    is wider than a binomial interval over all trials (the prompts differ, the trials of one are not
    independent); fewer than five rows have no interval."""
    rows = np.array([[9, 10]] * 5 + [[1, 10]] * 5)
    ci = stats.bootstrap_rows(rows, lambda s: (s[..., 0] / s[..., 1])[..., None])
    lo, hi = ci[0]
    w = stats.wilson(50, 100)
    assert lo < 0.5 < hi and hi - lo > w[1] - w[0]
    few = rows[[0, 5, 1, 6]]  # 4 prompts: too few for an honest percentile interval
    assert stats.bootstrap_rows(few, lambda s: s[..., :1]) is None
    assert stats.bootstrap_rows(rows[:5], lambda s: s[..., :1]) is not None
    again = stats.bootstrap_rows(rows, lambda s: (s[..., 0] / s[..., 1])[..., None])
    assert (again == ci).all()  # seeded: the same records give the same interval
