"""What produced a result: the code (git commit and dirty flag, package and library versions, device) and the
checkpoint (path, name, fingerprint, and the config.json fields that were absent and took a default).

The fingerprint hashes config.json, the index and every shard's name and size: cheap (no weight is read) and
enough to tell two checkpoints apart unless one was edited in place to the same sizes; `deep=True` hashes
the shards' contents too (minutes for the 690 GB model). Results (metrics.json, the W&B run config, the sweep
summary, chat transcripts) carry `provenance(...)`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the installed metadata only
    tomllib = None

_READ = 1 << 24  # bytes per read when hashing shard contents


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _mtp_version() -> str | None:
    """The version of the source that runs: its pyproject.toml when run from a checkout (installed metadata may
    belong to another checkout, or be absent), else the installed package's."""
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if tomllib is None:
        return _version("mtp")
    try:
        meta = tomllib.loads(pyproject.read_text()).get("project", {})
        if meta.get("name") == "mtp":
            return meta.get("version")
    except (OSError, tomllib.TOMLDecodeError):
        pass
    return _version("mtp")


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), *args], capture_output=True,
                           text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def device_name(device: str) -> str:
    """'NVIDIA H200 (cuda:0)', or the CPU's name with its core count."""
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(torch.device(device))} ({device})"
    return f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def code_identity(device: str) -> dict:
    """Commit and dirty flag of the checkout `mtp` runs from (None outside a git checkout), versions, device."""
    import torch

    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain") if commit else None  # untracked files count: they can be imported
    return {"git_commit": commit, "git_dirty": None if status is None else bool(status), "mtp": _mtp_version(),
            "python": platform.python_version(), "torch": torch.__version__, "triton": _version("triton"),
            "transformers": _version("transformers"), "device": device_name(device)}


def checkpoint_identity(path: str | os.PathLike, deep: bool = False) -> dict:
    """path, name (the folder's), fingerprint (16 hex digits) and whether it covers the shard contents."""
    path = Path(path).resolve()
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        f = path / name
        h.update(name.encode() + b"\0" + (f.read_bytes() if f.is_file() else b"(absent)") + b"\0")
    for shard in sorted(path.glob("*.safetensors")):
        h.update(f"{shard.name}\0{shard.stat().st_size}\0".encode())
        if deep:
            with open(shard, "rb") as fh:
                while block := fh.read(_READ):
                    h.update(block)
    return {"path": str(path), "name": path.name, "fingerprint": h.hexdigest()[:16], "deep": deep,
            **_defaulted(path / "config.json")}


def _defaulted(config: Path) -> dict:
    """The config.json fields the loader filled with a default and the value it took for each (unreadable
    config: nothing to say here, the loader names it)."""
    from .model.config import defaulted_values

    try:
        raw = json.loads(config.read_text())
    except (OSError, ValueError):
        raw = None
    assumed = defaulted_values(raw) if isinstance(raw, dict) else {}
    return {"config_defaulted": list(assumed), "config_assumed": assumed}


def defaulted_line(checkpoint: dict) -> str | None:
    """One line for the run log naming the defaulted config fields and what was assumed; None when none was."""
    assumed = checkpoint["config_assumed"]
    if not assumed:
        return None
    return (f"config.json lacks {', '.join(assumed)}; assumed: "
            + "; ".join(f"{name} = {value}" for name, value in assumed.items()))


def provenance(checkpoint: str | os.PathLike, device: str, deep: bool = False) -> dict:
    return {"code": code_identity(device), "checkpoint": checkpoint_identity(checkpoint, deep)}
