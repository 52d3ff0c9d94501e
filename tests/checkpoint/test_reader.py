"""`mtp.checkpoint.reader.ShardReader`: the bytes safetensors gives, for whole tensors, row and column ranges, at
chunk sizes that cut rows and tensors anywhere; reads in file order go front to back; and every bad entry (a file cut
short, an offset past the end, a byte count that disagrees with the shape, a dtype it does not know) is a
CheckpointError naming the file and the tensor, raised before any byte of that tensor is read."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mtp.checkpoint import reader
from mtp.checkpoint.files import CheckpointError
from mtp.checkpoint.reader import ShardReader

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> Path:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w8": (torch.randn(37, 300, generator=g) * 30).to(FP8),  # odd rows, a row of 300 bytes
        "wb": torch.randn(24, 50, generator=g).bfloat16(),
        "s": torch.rand(3, 4, generator=g) + 0.5,
        "v": torch.randn(129, generator=g).bfloat16(),
        "empty": torch.zeros(0, 5),
    }
    path = tmp_path_factory.mktemp("reader") / "one.safetensors"
    save_file(tensors, str(path))
    return path


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                       b.contiguous().view(torch.uint8))


@pytest.fixture
def reads(monkeypatch) -> list[tuple[int, int]]:
    """Every (offset, length) the reader asks of the disk."""
    seen: list[tuple[int, int]] = []
    real = reader.read_at

    def watch(fd, buf, off):
        seen.append((off, len(buf)))
        return real(fd, buf, off)

    monkeypatch.setattr(reader, "read_at", watch)
    return seen


@pytest.mark.parametrize("chunk", [7, 300, 1000, 1 << 20])  # a part of a row, one row, rows and a bit, all
def test_same_bytes_as_safetensors(shard, chunk):
    with safe_open(str(shard), framework="pt") as f, ShardReader(shard, chunk=chunk) as r:
        for name in f.keys():
            assert same(r.get_tensor(name), f.get_tensor(name)), name
            assert same(r.get_slice(name)[:], f.get_tensor(name)), name
            n = f.get_slice(name).get_shape()[0]
            for a, b in ((0, n), (1, n - 1), (n // 3, n // 2), (2, 2)):
                assert same(r.get_slice(name)[a:b], f.get_slice(name)[a:b]), (name, a, b)
        for name in ("w8", "wb", "s"):
            k = f.get_slice(name).get_shape()[1]
            for a, b in ((0, k), (1, k - 1), (k // 3, k // 2), (3, 3)):
                assert same(r.get_slice(name)[:, a:b], f.get_slice(name)[:, a:b]), (name, a, b)


def test_reads_only_the_slice_and_in_file_order(shard, reads):
    with ShardReader(shard, chunk=1 << 20) as r:
        _, _, begin, _ = r.extent("w8")
        r.get_slice("w8")[5:9]
        assert reads == [(begin + 5 * 300, 4 * 300)]  # one read, exactly the rows
        reads.clear()
        names = r.in_file_order(["v", "w8", "s", "wb"])
        for n in names:
            r.get_tensor(n)
        assert [off for off, _ in reads] == sorted(off for off, _ in reads)
        assert [r.extent(n)[2] for n in names] == sorted(r.extent(n)[2] for n in names)


def test_reads_to_come_are_advised_ahead_and_only_they(shard, reads, monkeypatch):
    """`will_read`: the kernel is asked (POSIX_FADV_WILLNEED) for the planned ranges a bounded distance ahead of the
    read position, in pieces, never for the gaps between them (another rank's bytes)."""
    advised: list[tuple[int, int, int]] = []  # (offset, length, index of the read it was advised before)
    monkeypatch.setattr(reader, "AHEAD", 3000)
    monkeypatch.setattr(reader, "ADVICE", 256)
    monkeypatch.setattr(reader, "advise", lambda fd, off, n: advised.append((off, n, len(reads))))
    with ShardReader(shard, chunk=1 << 20) as r:
        parts = [("w8", 0, 2, 9), ("w8", 0, 20, 30), ("wb", 1, 3, 9), ("v", None, 0, 0)]  # rows, rows, columns, all
        spans = sorted(r.span(n, d, a, b) for n, d, a, b in parts)
        r.will_read(spans)
        for n, d, a, b in sorted(parts, key=lambda p: r.span(*p)):
            r.read(n, d, a, b)
    advised = [(off, n, reads[k][0]) for off, n, k in advised]  # (offset, length, the read position then)
    assert all(n <= 256 for _, n, _ in advised)
    merged: list[list[int]] = []  # adjacent ranges are one
    for b, e in spans:
        if merged and merged[-1][1] == b:
            merged[-1][1] = e
        else:
            merged.append([b, e])
    assert len(merged) >= 2  # there is a gap to skip
    inside = [any(b <= off and off + n <= e for b, e in merged) for off, n, _ in advised]
    assert all(inside), "advised bytes outside the planned reads"
    pieces = sorted((off, off + n) for off, n, _ in advised)
    assert all(a[1] <= b[0] for a, b in zip(pieces, pieces[1:]))  # each byte advised once at most
    second = merged[1][0]
    assert any(off == second and pos < second for off, _, pos in advised)  # the range after the gap: before its read

    def planned_between(lo: int, hi: int) -> int:
        return sum(max(0, min(e, hi) - max(b, lo)) for b, e in merged)

    # never far ahead of the reads: at most AHEAD (+ one piece) of planned bytes between the read and the advice
    assert all(planned_between(pos, off) <= 3000 + 256 for off, _, pos in advised)


def test_bad_index_and_slice_refused(shard):
    with ShardReader(shard) as r:
        with pytest.raises(TypeError, match="'w8'"):
            r.get_slice("w8")[::2]
        with pytest.raises(ValueError, match="'v'"):
            r.get_slice("v")[:, 1:3]  # columns of a 1-D tensor
        with pytest.raises(CheckpointError, match="no tensor 'nope'"):
            r.get_tensor("nope")


# ------------------------------------------------------------------------------------------ bad entries
def write_raw(path: Path, header: dict, data: bytes) -> Path:
    """A safetensors file written by hand: any header, any bytes (save_file would refuse the bad ones)."""
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def two_tensors(tmp_path: Path, **bad) -> Path:
    """'a' (good, 64 bytes of F32) then 'b' (16 bytes of BF16, with the entry changed by `bad`)."""
    header = {"a": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]},
              "b": {"dtype": "BF16", "shape": [8], "data_offsets": [64, 80]}}
    header["b"].update(bad)
    return write_raw(tmp_path / "bad.safetensors", header, bytes(range(80)))


def refused_before_reading(file: Path, name: str, reads, *must: str) -> None:
    with ShardReader(file) as r:
        _, _, begin_a, end_a = r.extent("a")
        assert r.get_tensor("a").numel() > 0  # the good tensor before it reads
        reads.clear()
        with pytest.raises(CheckpointError) as ei:
            r.get_slice(name)[:]
    msg = str(ei.value)
    assert str(file) in msg and repr(name) in msg, msg
    for s in must:
        assert s in msg, msg
    assert reads == [], f"bytes read before the error: {reads}"


def test_truncated_shard(shard, tmp_path, reads):
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(shard.read_bytes()[:-10])
    with ShardReader(cut) as r:
        names = r.in_file_order([n for n in r.header if n != "__metadata__"])
        *kept, victim = names  # the last tensor of the file lost its last 10 bytes
        for n in kept:
            r.get_tensor(n)  # every tensor still inside the file reads
        reads.clear()
        with pytest.raises(CheckpointError, match="truncated or corrupt") as ei:
            r.get_slice(victim)[:1]
    assert str(cut) in str(ei.value) and repr(victim) in str(ei.value)
    assert reads == []


def test_header_offset_past_the_end(tmp_path, reads):
    refused_before_reading(two_tensors(tmp_path, data_offsets=[72, 88], shape=[8]), "b", reads, "ends at byte")


def test_offsets_that_disagree_with_the_shape(tmp_path, reads):
    refused_before_reading(two_tensors(tmp_path, shape=[4]), "b", reads, "needs 8")


def test_dtype_the_reader_does_not_know(tmp_path, reads):
    refused_before_reading(two_tensors(tmp_path, dtype="F8_E5M2"), "b", reads, "unsupported dtype 'F8_E5M2'")


def test_file_shortened_while_reading_is_a_short_read(tmp_path):
    file = two_tensors(tmp_path)
    with ShardReader(file) as r:
        os.truncate(file, r.start + 70)  # after the header was read: 'b' now ends past the end
        assert same(r.get_tensor("a"), torch.frombuffer(bytearray(range(64)), dtype=torch.float32).view(4, 4))
        with pytest.raises(CheckpointError, match="'b'.*file ends at byte"):
            r.get_tensor("b")
