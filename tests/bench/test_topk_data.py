"""`mtp.bench.topk_data.candidate_stats`: the counts the radix top-k's split kernel works from, against a plain
float reading of the same row (ties, -inf, -0.0)."""

import torch

from mtp.bench.topk_data import candidate_stats


def _prefix16(x: float) -> int:
    """The 16-bit key prefix of one fp32 score, from its bits (as `topk.score_keys` + `add_to_histograms`)."""
    b = int(torch.tensor([0.0 if x == 0 else x]).view(torch.int32))
    key = b if b >= 0 else b ^ 0x7FFFFFFF
    return (key >> 16) + 32768


def test_candidate_stats_counts_prefix_and_ties():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(600, generator=g)
    s[:40] = 3.0  # 40 equal scores at the boundary: the k-th key is tied 40 ways
    s[40:50] = float("-inf")  # never candidates
    s[50] = -0.0
    k = int((s > 3.0).sum()) + 25
    st = candidate_stats(s, k)
    assert st["n_valid"] == 590 and not st["all_kept"]
    vals = [float(v) for v in s if v != float("-inf")]
    kth = sorted(vals, reverse=True)[k - 1]
    assert kth == 3.0 and st["kth_score"] == 3.0
    assert st["n_tied_kth"] == 40
    P = _prefix16(kth)
    assert st["prefix"] == P
    assert st["n_prefix"] == sum(_prefix16(v) == P for v in vals)
    assert st["n_above_prefix"] == sum(_prefix16(v) > P for v in vals)
    assert st["path"] == ("pairwise" if st["n_prefix"] <= st["small"] else "radix")


def test_candidate_stats_all_kept_below_k():
    st = candidate_stats(torch.tensor([1.0, float("-inf"), 2.0]), 4)
    assert st == {"n_valid": 2, "k": 4, "small": st["small"], "all_kept": True}
