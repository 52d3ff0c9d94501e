"""The safetensors header of a shard, parsed by hand, and the one check of a tensor's entry before a reader reads its
bytes itself. A leaf of `mtp.checkpoint`: `files` (validation, loading) and `reader` (explicit reads) both use it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

ST_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn, "BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16,
    "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool,
}


class CheckpointError(ValueError):
    """The checkpoint on disk is incomplete, corrupt or disagrees with its config."""


def shard_header(file: Path) -> tuple[int, dict]:
    """(offset of the data section, header dict) of a safetensors shard, parsed by hand: an 8-byte little-endian
    length, then that many bytes of JSON. CheckpointError for a file too short for either or a header that is not
    a JSON object. The entries are checked where they are used: every entry's end against the file's size
    (`files.validate`), one entry in full before a reader reads it (`tensor_extent`)."""
    size = file.stat().st_size
    with open(file, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file}: truncated: {size} bytes, shorter than the 8-byte safetensors header length")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise CheckpointError(f"{file}: corrupt or truncated safetensors header: its length field says {n} "
                                  f"bytes, the file has {size}")
        try:
            header = json.loads(fh.read(n))
        except ValueError as e:
            raise CheckpointError(f"{file}: corrupt safetensors header ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header: a JSON {type(header).__name__}, not an object")
    return 8 + n, header


def tensor_extent(file: Path, header: dict, start: int, size: int, name: str
                  ) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    """(dtype, shape, first byte, end byte) in the file of tensor `name` of a shard whose header `shard_header`
    parsed (`start`: its data offset, `size`: the file's size now), for a reader that reads the bytes itself
    (`mtp.checkpoint.reader`). Everything it will rely on is checked first: a dtype this loader knows, a shape of
    non-negative ints, offsets that hold exactly shape x itemsize bytes and end inside the file. CheckpointError
    naming the file and tensor otherwise."""
    entry = header.get(name)
    if not isinstance(entry, dict):
        raise CheckpointError(f"{file}: has no tensor {name!r} in its header")
    dt = ST_DTYPES.get(entry.get("dtype"))
    if dt is None:
        raise CheckpointError(f"{file}: tensor {name!r} has unsupported dtype {entry.get('dtype')!r} (known: "
                              f"{', '.join(ST_DTYPES)})")
    shape, offs = entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise CheckpointError(f"{file}: tensor {name!r} has shape {shape!r} in its header, not a list of ints >= 0")
    if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs) and 0 <= offs[0] <= offs[1]):
        raise CheckpointError(f"{file}: tensor {name!r} has data_offsets {offs!r}, not [begin, end] with "
                              "0 <= begin <= end")
    want = math.prod(shape) * dt.itemsize
    if offs[1] - offs[0] != want:
        raise CheckpointError(f"{file}: tensor {name!r} has data_offsets {offs} ({offs[1] - offs[0]} bytes), its "
                              f"shape {shape} of {entry['dtype']} needs {want}")
    if start + offs[1] > size:
        raise CheckpointError(f"{file}: truncated or corrupt: tensor {name!r} ends at byte {start + offs[1]}, the file "
                              f"has {size}")
    return dt, tuple(shape), start + offs[0], start + offs[1]


def in_file_order(header: dict, names) -> list[str]:
    """`names` sorted by where their bytes start in the shard (`header` as `shard_header` returns it): read in this
    order, a shard is read front to back. A bad entry sorts first, so its error comes before any other read."""
    def begin(n: str) -> int:
        try:
            return int(header[n]["data_offsets"][0])
        except (TypeError, KeyError, IndexError, ValueError):
            return -1
    return sorted(names, key=begin)
