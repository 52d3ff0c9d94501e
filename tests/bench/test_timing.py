"""`mtp.bench.timing.exposed_us`: the profile's attribution of a step's busy time to kernel names when kernels
overlap (programmatic dependent launch starts a kernel while its predecessor runs); `difference_profile`: a loop's
per-step profile from two runs that differ in their steps."""

from __future__ import annotations

import random

import pytest

from mtp.bench.timing import difference_profile, exposed_us, span_totals


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


def test_gpu_state_lines_parse_or_are_refused_by_name():
    import pytest

    from mtp.bench.timing import parse_gpu_state

    assert parse_gpu_state("1980, 3201, 45, 512.30, 0x0000000000000000\n") == {
        "sm_mhz": 1980.0, "mem_mhz": 3201.0, "temp_c": 45.0, "power_w": 512.3, "throttle_reasons": "0x0000000000000000"}
    got = parse_gpu_state("1755, 3201, [N/A], [Not Supported], 0x0000000000000004")
    assert got["temp_c"] is None and got["power_w"] is None and got["sm_mhz"] == 1755.0
    with pytest.raises(ValueError, match="expected 5 fields"):
        parse_gpu_state("1980, 3201, 45")
    with pytest.raises(ValueError, match="clocks.sm is not a number"):
        parse_gpu_state("fast, 3201, 45, 500, 0x0")
    with pytest.raises(ValueError):
        parse_gpu_state("1980, 3201, 45, 500, notahexmask")


def test_the_log_line_says_the_state_or_why_it_is_missing():
    from mtp.bench.rank_steps import _state_text

    st = {"sm_mhz": 1980.0, "mem_mhz": 3201.0, "temp_c": 45.0, "power_w": 512.3, "throttle_reasons": "0x4"}
    assert _state_text(st) == ", SM 1980 MHz, 45 C, 512 W, throttle 0x4"
    assert _state_text(dict(st, temp_c=None)) == ", SM 1980 MHz, ? C, 512 W, throttle 0x4"
    assert "nvidia-smi exit 6" in _state_text({"error": "nvidia-smi exit 6: no such field"})
    assert _state_text(None) == ""


def test_kernel_profile_busy_and_idle_from_spans(monkeypatch):
    """`kernel_profile`'s busy time (union of kernel spans) and idle time (the rest of the replays' span), on spans
    handed to it in place of the profiler's: two steps of a overlapping b, then a gap, then c."""
    import types

    from torch.autograd import DeviceType

    from mtp.bench import timing

    ev = lambda k, s, e: types.SimpleNamespace(key=k, time_range=types.SimpleNamespace(start=s, end=e),  # noqa: E731
                                                 device_type=DeviceType.CUDA)
    spans = [ev("a", 0, 10), ev("b", 5, 12), ev("c", 15, 20), ev("a", 20, 30), ev("b", 25, 32), ev("c", 40, 45)]

    class Prof:
        def __init__(self, activities):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def events(self):
            return spans

        def key_averages(self):
            rows = {}
            for e in spans:
                r = rows.setdefault(e.key, types.SimpleNamespace(key=e.key, device_time_total=0.0, count=0))
                r.device_time_total += e.time_range.end - e.time_range.start
                r.count += 1
            return list(rows.values())

    import torch.profiler

    monkeypatch.setattr(torch.profiler, "profile", Prof)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
    out = timing.kernel_profile(lambda: None, steps=2)
    assert out["busy_us_per_step"] == (12 + 5 + 12 + 5) / 2
    assert out["idle_us_per_step"] == (45 - 34) / 2  # span 45 over 2 steps, less the busy time
    assert out["kernel_us_per_step"] == (10 + 7 + 5 + 10 + 7 + 5) / 2


def _run(steps: int) -> list:
    """Spans of a loop run: a setup (prefill 'p' 0-50 then 'cap'), then `steps` steps of draft 'd' (4 us) and verify
    'v' (10 us, launched 1 us before d ends: PDL), 1 us apart."""
    spans, t = [("p", 0.0, 50.0), ("cap", 50.0, 53.0)], 60.0
    for _ in range(steps):
        spans += [("d", t, t + 4), ("v", t + 3, t + 13)]
        t += 14
    return spans


def test_difference_profile_cancels_the_setup_and_divides_by_the_steps():
    prof = difference_profile(span_totals(_run(3)), span_totals(_run(10)), 7)
    rows = {r["name"]: r for r in prof["top"]}
    assert set(rows) == {"d", "v", "p", "cap"}
    assert rows["d"]["calls_per_step"] == 1 and rows["v"]["calls_per_step"] == 1
    assert rows["d"]["us_per_step"] == pytest.approx(4) and rows["v"]["us_per_step"] == pytest.approx(10)
    assert rows["d"]["exposed_us_per_step"] == pytest.approx(4) and rows["v"]["exposed_us_per_step"] == pytest.approx(9)
    assert rows["p"]["us_per_step"] == 0 and rows["p"]["exposed_us_per_step"] == 0
    assert prof["busy_us_per_step"] == pytest.approx(13) and prof["kernels_per_step"] == pytest.approx(2)
    assert [r["name"] for r in prof["top"][:2]] == ["v", "d"]


def test_difference_profile_refuses_runs_without_more_steps():
    with pytest.raises(ValueError, match="more steps"):
        difference_profile(span_totals(_run(3)), span_totals(_run(3)), 0)


def test_spec_profile_profiles_a_short_and_a_long_run(monkeypatch):
    """`rank_steps.spec_profile` (CUPTI on a GPU only): the runs it profiles and the steps it divides by, with
    the profiler replaced by the loop's spans."""
    from types import SimpleNamespace

    from mtp.bench import rank_steps

    asked = []

    def run(n):
        asked.append(n)
        return SimpleNamespace(target_forwards=n - 1)

    monkeypatch.setattr(rank_steps, "profile_call", lambda fn: {**span_totals(_run(fn().target_forwards)),
                                                                "result": SimpleNamespace(target_forwards=asked[-1] - 1)})
    prof = rank_steps.spec_profile(run, 20)
    assert asked == [rank_steps.SPEC_PROFILE_SHORT, 20] and prof["steps"] == 20 - rank_steps.SPEC_PROFILE_SHORT
    assert {r["name"]: r["us_per_step"] for r in prof["top"]}["v"] == pytest.approx(10)
    with pytest.raises(ValueError, match="--new-tokens"):
        rank_steps.spec_profile(run, rank_steps.SPEC_PROFILE_SHORT)
