"""One run per folder: the lock a run holds on its folder, and the settings it records there.

Two runs writing one folder would duplicate every record of samples.jsonl and lose one run's metrics, so a run
holds an exclusive lock (`flock` on `.mtp-eval.lock`, released by the kernel when the process dies, so a
killed run never leaves a stale lock) from before it reads the folder to its end. `settings.json` holds the
settings that shape the outputs (those hashed into every sample line); a resume with other settings is refused
naming each one that differs.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

LOCK_NAME = ".mtp-eval.lock"
SETTINGS_NAME = "settings.json"
FAILED_NAME = "job_failed.json"  # a sweep job that was refused or failed: its one-line error (the sweep summary reads it)


class RunDirError(ValueError):
    """The run folder is in use by another run."""


@contextmanager
def locked(out: Path) -> Iterator[Callable[[], None]]:
    """Hold `out`'s run lock for the block; a second holder gets a RunDirError. The block gets `claim()`, to
    call once the run is accepted: it writes this pid into the lock file (named to a second run). A lock file
    this call created is removed again when the block raises, so a refused run leaves the folder as it was (a
    finished or killed run keeps it: it holds only the pid of its last run)."""
    lock = out / LOCK_NAME
    created = not lock.exists()
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise RunDirError(f"{out}: another mtp-eval run (pid {pid}, or one still starting) is writing to this folder; wait for it to end "
                         "or choose another hydra.run.dir") from None
    def claim() -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)

    try:
        yield claim
    except BaseException:
        if created:
            lock.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def drop_refused(out: Path) -> bool:
    """Remove the folder of a refused run when it holds nothing but the empty log files Hydra opened for it (the
    README promises a refused run writes nothing); a folder with anything else in it (a previous run's results, a
    log with lines) is left as it is. Returns whether the folder went."""
    import logging

    root = logging.getLogger()
    logs = [h for h in root.handlers if isinstance(h, logging.FileHandler) and Path(h.baseFilename).parent == out]
    names = {Path(h.baseFilename).name for h in logs}
    try:
        entries = list(out.iterdir())
    except OSError:
        return False
    if any(e.name not in names or not e.is_file() or e.stat().st_size for e in entries):
        return False
    for h in logs:  # nothing more goes to a log of a folder that is gone
        root.removeHandler(h)
        h.close()
    try:
        for e in entries:
            e.unlink()
        out.rmdir()
    except OSError:
        return False
    return True


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def settings_diff(old: dict, new: dict) -> list[str]:
    """'key: old -> new' for every dotted key whose value differs, sorted."""
    a, b = flatten(old), flatten(new)
    missing = "(absent)"
    return [f"{k}: {a.get(k, missing)!r} -> {b.get(k, missing)!r}".replace("'(absent)'", missing)
            for k in sorted(a.keys() | b.keys()) if a.get(k, missing) != b.get(k, missing)]


def read_settings(out: Path) -> dict | None:
    try:
        return json.loads((out / SETTINGS_NAME).read_text())
    except (OSError, ValueError):
        return None
