"""Small statistics for reported numbers: exact percentiles of per-request samples, Wilson intervals for
independent yes/no outcomes, and a bootstrap over prompts for figures built from many correlated steps.

Which interval where (95% throughout):
- Acceptance figures (AL, acceptance per position, acceptance rate) count verify steps, but the steps of one
  prompt are not independent: a prompt that the drafter predicts well gives a long run of accepts, a looping one
  gives all accepts. A binomial interval over steps (Wilson with n = steps) would treat 117 steps of 8 prompts
  as 117 independent trials and come out too narrow. The prompt is the independent unit, so these get a
  percentile bootstrap over prompts (resample prompts with replacement, recompute the ratio of sums). Below
  BOOTSTRAP_MIN_ROWS prompts the interval is None: resamples of 2 prompts take 3 distinct values, and the
  percentile interval comes out far narrower than the real uncertainty (it cannot see prompts it never got).
- Task accuracy is one independent yes/no per prompt: Wilson's score interval (good coverage at small n and at
  rates near 0 or 1, where the normal approximation fails).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

import numpy as np

Z95 = 1.959963984540054  # two-sided 95% normal quantile
BOOTSTRAP_RESAMPLES = 2000  # percentile-interval ends move by < 0.005 between seeds at this count (AL ~ 2)
BOOTSTRAP_SEED = 0  # fixed: the same records give the same interval
BOOTSTRAP_MIN_ROWS = 5


def percentile(xs: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) of the samples, interpolating linearly between order statistics (numpy's
    default, Hyndman-Fan type 7); None without samples."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def latency(xs: Sequence[float]) -> dict:
    """mean, p50, p90, p99 and n of per-request samples (None each without samples)."""
    return {"mean": sum(xs) / len(xs) if xs else None, "p50": percentile(xs, 50), "p90": percentile(xs, 90),
            "p99": percentile(xs, 99), "n": len(xs)}


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float] | None:
    """Wilson score interval of a binomial proportion; None for n = 0."""
    if not 0 <= successes <= n:
        raise ValueError(f"wilson: successes must be in [0, n={n}], got {successes}")
    if n == 0:
        return None
    p = successes / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def bootstrap_rows(rows: np.ndarray, figures: Callable[[np.ndarray], np.ndarray],
                   resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> np.ndarray | None:
    """Percentile bootstrap over the rows (prompts) of `rows` [R, C] (each row a prompt's counts): `figures`
    maps summed counts [..., C] to figures [..., F]. Returns [F, 2] (2.5%, 97.5%), or None for fewer than
    BOOTSTRAP_MIN_ROWS rows. Figures undefined in a resample (NaN: e.g. a ratio over zero steps) are left out of it."""
    rows = np.asarray(rows, dtype=np.float64)
    R = rows.shape[0]
    if R < BOOTSTRAP_MIN_ROWS:
        return None
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, R, size=(resamples, R))
    weights = np.zeros((resamples, R))
    np.add.at(weights, (np.arange(resamples)[:, None], pick), 1.0)
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a figure NaN in every resample: its interval is NaN
        vals = figures(weights @ rows)  # [resamples, F]
        return np.nanpercentile(vals, [2.5, 97.5], axis=0).T
