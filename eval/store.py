"""Crash-safe outputs: samples.jsonl appended batch by batch (flush + fsync), whole files written atomically.

A killed run leaves complete lines for every finished batch plus at most one torn last line; `SampleStore`
drops the torn line and any batch with missing rows when it reopens the file (`resume=true`), so every
prompt ends up in the file exactly once. Lines carry the hash of the settings that shape the outputs, so a
resume with different settings is refused instead of mixing two experiments in one file.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from mtp.utils import write_atomic

from .rundir import read_settings, settings_diff


class StoreError(ValueError):
    """samples.jsonl cannot be continued (exists without resume, other settings, corrupt)."""


class SampleStore:
    """Records (one dict per prompt) with keys `id`, `batch` (batch name), `batch_size`, `config_hash`."""

    def __init__(self, path: Path, config_hash: str, resume: bool, settings: dict | None = None):
        """`settings`: what `config_hash` hashes; a refused resume names how they differ from the folder's
        settings.json (written by the run that started the file)."""
        self.path, self.config_hash, self.settings = path, config_hash, settings
        self.records: list[dict] = []
        if path.exists() and path.stat().st_size:
            if not resume:
                raise StoreError(f"{path} already exists: pass resume=true to continue that run, or choose "
                                 "another hydra.run.dir")
            self.records = self._load()

    def _load(self) -> list[dict]:
        lines = self.path.read_text(encoding="utf-8").split("\n")
        records, torn = [], False
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                if n < len(lines) - 1:  # only the last line can be cut by a kill
                    raise StoreError(f"{self.path}:{n}: corrupt line in the middle of the file") from None
                torn = True
                continue
            if rec.get("config_hash") != self.config_hash:
                old = read_settings(self.path.parent)
                diff = settings_diff(old, self.settings) if old is not None and self.settings is not None else []
                what = f"settings that differ: {'; '.join(diff)}" if diff else (
                    f"config hash {rec.get('config_hash')} != {self.config_hash}")
                raise StoreError(f"{self.path}:{n}: written with other settings ({what}); resume only with the "
                                 "same model / draft / verify / runtime / dataset / generation settings")
            records.append(rec)
        rows = Counter(r["batch"] for r in records)
        complete = [r for r in records if rows[r["batch"]] == r["batch_size"]]
        if torn or len(complete) != len(records):
            write_atomic(self.path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in complete))
        return complete

    @property
    def ids(self) -> set[str]:
        return {r["id"] for r in self.records}

    def has(self, ids: Sequence[str]) -> bool:
        """Whether this batch is finished; a batch half present means the prompt set changed since."""
        have = self.ids
        present = [i for i in ids if i in have]
        if present and len(present) != len(ids):
            raise StoreError(f"{self.path}: prompts {present} are stored but {sorted(set(ids) - set(present))} of "
                             "the same batch are not: the prompt set or batch_size changed since the first run")
        return bool(present)

    def append(self, records: list[dict]) -> None:
        """One write of whole lines, then fsync: after a kill the batch is either complete or dropped."""
        for r in records:
            r.update(config_hash=self.config_hash, batch_size=len(records))
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        data = memoryview(text.encode("utf-8"))
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            start = os.lseek(fd, 0, os.SEEK_END)
            try:
                while data:  # unbuffered: nothing is left to flush after a failure
                    data = data[os.write(fd, data):]
                os.fsync(fd)
            except BaseException:  # a full disk, Ctrl-C mid-write: cut the batch off rather than leave a torn line
                os.ftruncate(fd, start)
                raise
        finally:
            os.close(fd)
        self.records.extend(records)
