"""Small shared helpers."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any


class MissingExtraError(ImportError):
    """A feature needs a package of an optional extra (pyproject.toml) that is not installed."""


def require(module: str, extra: str, feature: str) -> ModuleType:
    """`import module`, or a MissingExtraError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or module.split(".")[0] != e.name.split(".")[0]:
            raise  # the module is there, one of its own imports is broken
        raise MissingExtraError(f"{feature} needs {module!r}, which is not installed: pip install 'mtp[{extra}]' "
                                f"(in the repository: pip install -e \".[{extra}]\")") from None


def write_atomic(path: str | os.PathLike, text: str, mode: int = 0o644) -> None:
    """Temp file in the same folder + fsync + os.replace: readers (or a crash) see the old file or the new one,
    never half of one. `mode`: mkstemp creates 0600; results are meant to be shared."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """JSON (indent 2, UTF-8, str() for anything else such as paths and enums) written atomically."""
    write_atomic(path, json.dumps(data, ensure_ascii=False, indent=2, default=str) + "\n")


def publish_dir(tmp: Path, out: Path, made: list[Path] | None = None) -> None:
    """Make a folder built in `tmp` (beside `out`) the new `out`: the files made there (default: all; pass the
    list when some are hard links to files elsewhere) readable by all (safetensors and mkstemp write 0600), then
    renamed into place, so readers never see a half-written folder. An old `out` is first renamed aside and
    deleted only once the new one is in place: if that rename fails the old folder is put back, and a crash in
    between leaves both folders on disk (old as `.old-<name>-<pid>`), so nothing is lost."""
    for f in made if made is not None else tmp.iterdir():
        if f.is_file():
            f.chmod(0o644)
    old = None
    if out.exists():
        old = out.with_name(f".old-{out.name}-{os.getpid()}")
        if old.exists():
            shutil.rmtree(old)
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        if old is not None:
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
