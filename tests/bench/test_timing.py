"""`mtp.bench.timing.exposed_us`: the profile's attribution of a step's busy time to kernel names when kernels
overlap (programmatic dependent launch starts a kernel while its predecessor runs)."""

from __future__ import annotations

import random

from mtp.bench.timing import exposed_us


def _union(spans) -> float:
    """Length of the union of the spans, by sweeping sorted starts (the brute-force twin)."""
    total, cur_s, cur_e = 0.0, None, None
    for _, s, e in sorted(spans, key=lambda t: t[1]):
        if cur_e is None or s > cur_e:
            total += 0.0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (0.0 if cur_e is None else cur_e - cur_s)


def test_serial_kernels_are_their_durations_and_pdl_waits_are_not_counted():
    assert exposed_us([("a", 0, 10), ("b", 12, 15), ("a", 15, 16)]) == {"a": 11, "b": 3}
    # b launched early (PDL) waits from 2 until a ends at 10; c likewise inside b; d wholly inside c
    got = exposed_us([("c", 14, 20), ("a", 0, 10), ("b", 2, 15), ("d", 16, 18)])
    assert got == {"a": 10, "b": 5, "c": 5, "d": 0}
    assert sum(got.values()) == 20


def test_exposed_times_sum_to_the_union_of_the_spans():
    rng = random.Random(0)
    for _ in range(200):
        spans = []
        for i in range(rng.randint(1, 12)):
            s = rng.uniform(0, 50)
            spans.append((f"k{i % 4}", s, s + rng.uniform(0, 10)))
        got = exposed_us(spans)
        assert all(v >= 0 for v in got.values())
        assert abs(sum(got.values()) - _union(spans)) < 1e-9
        durations = {}
        for n, s, e in spans:
            durations[n] = durations.get(n, 0.0) + e - s
        assert all(got[n] <= durations[n] + 1e-9 for n in got)
