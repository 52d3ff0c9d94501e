"""Read back what an offline W&B run logged, from its `run-<id>.wandb` file.

Recent wandb (the Go core, >= 0.19) writes no files/wandb-summary.json for offline runs and no longer ships
the Python datastore reader, so this parses the file itself: a 7-byte header (b":W&B", 0xBEE1, version)
then LevelDB-log records (32 KiB blocks; each chunk = crc32 u32, length u16, type u8: 1 full, 2 first,
3 middle, 4 last) whose payloads are `wandb_internal_pb2.Record` protobufs.

    python -m mtp_eval.wandb_offline outputs/eval/runs/<date>/wandb/offline-run-*/run-*.wandb
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

_BLOCK = 32768
_CHUNK_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: str | Path) -> Iterator:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B run file (header {data[:4]!r}, expected b':W&B')")
    pos, buf = _CHUNK_HEADER, b""
    while pos + _CHUNK_HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK_HEADER:  # block trailer padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos: pos + _CHUNK_HEADER])
        pos += _CHUNK_HEADER
        if kind == 0 and length == 0:  # zero fill: end of the written part
            break
        buf += data[pos: pos + length]
        pos += length
        if kind in (_FULL, _LAST):
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def read_run(path: str | Path) -> dict:
    """{"run": {id, project, group, name, ...}, "config": {...}, "summary": {...}, "history": [{...}, ...]}
    with JSON-decoded values."""
    out: dict = {"run": {}, "config": {}, "summary": {}, "history": []}
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            out["run"] = {"id": r.run_id, "project": r.project, "group": r.run_group, "name": r.display_name,
                          "job_type": r.job_type, "tags": list(r.tags)}
            out["config"].update({_key(u): json.loads(u.value_json) for u in rec.run.config.update})
        elif kind == "config":
            out["config"].update({_key(u): json.loads(u.value_json) for u in rec.config.update})
        elif kind == "summary":
            out["summary"].update({_key(u): json.loads(u.value_json) for u in rec.summary.update})
            for r in rec.summary.remove:
                out["summary"].pop(_key(r), None)
        elif kind == "history":
            out["history"].append({_key(i): json.loads(i.value_json) for i in rec.history.item})
    return out


def find_run_file(root: str | Path) -> Path:
    """The single run-*.wandb file under `root` (a run dir or its wandb/ folder)."""
    files = sorted(Path(root).rglob("run-*.wandb"))
    if len(files) != 1:
        raise FileNotFoundError(f"{root}: expected one run-*.wandb file, found {[str(f) for f in files]}")
    return files[0]


if __name__ == "__main__":
    target = Path(sys.argv[1])
    run = read_run(target if target.is_file() else find_run_file(target))
    print(json.dumps(run["summary"], indent=2, sort_keys=True, default=str))
