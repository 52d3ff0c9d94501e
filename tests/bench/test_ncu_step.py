"""`mtp.bench.ncu_step --summarize`: one line per kernel of an Nsight Compute CSV (`--csv --page details`), read from
session 17's recorded profile and from a small file in the same format with other time units."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from mtp.bench.ncu_step import summarize

RECORDED = Path(__file__).resolve().parents[2] / "eval/results/s17/h200a/ncu_w1_ctx1024.csv.gz"
HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def _row(i: int, name: str, metric: str, unit: str, value: str) -> str:
    return f'"{i}","1","python3","host","{name}","1","7","(128, 1, 1)","(4, 1, 1)","0","9.0","S","{metric}","{unit}","{value}"'


def test_summarize_recorded_profile(tmp_path):
    """The recorded w = 1, 1k profile: 61 kernels in launch order, ncu's preamble lines skipped, the o_proj GEMV's
    row as ncu gave it (11.14 us, 896 programs, 78 registers), the sum of every duration."""
    path = tmp_path / "ncu.csv"
    path.write_bytes(gzip.decompress(RECORDED.read_bytes()))
    lines = summarize(str(path)).splitlines()
    assert lines[-1] == "61 kernels, 464.5 us in all"
    row = next(line for line in lines if line.startswith("  23 "))
    assert "_gemv_fma_kernel" in row and "11.14 us" in row and "grid    896" in row and "regs     78" in row


def test_summarize_units_and_bad_file(tmp_path):
    """Durations in ns / us / ms all come out in us, kernels sorted by ID, a metric ncu did not give shows '-'; a file
    without ncu's header is refused by name."""
    rows = [HEADER, _row(1, "b_kernel", "Duration", "ms", "0.5"), _row(0, "a_kernel", "Duration", "ns", "2,500"),
            _row(0, "a_kernel", "Registers Per Thread", "register/thread", "40"),
            _row(2, "c_kernel", "Duration", "us", "3.25")]
    path = tmp_path / "small.csv"
    path.write_text("==PROF== Connected to process 1\n" + "\n".join(rows) + "\n")
    lines = summarize(str(path)).splitlines()
    assert [line.split()[1] for line in lines[:3]] == ["a_kernel", "b_kernel", "c_kernel"]
    assert "2.50 us" in lines[0] and "regs     40" in lines[0] and "500.00 us" in lines[1] and "regs      -" in lines[1]
    assert lines[-1] == "3 kernels, 505.8 us in all"
    bad = tmp_path / "bad.csv"
    bad.write_text("==PROF== nothing profiled\n")
    with pytest.raises(SystemExit, match="bad.csv: no ncu CSV header"):
        summarize(str(bad))
