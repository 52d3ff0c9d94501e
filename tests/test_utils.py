"""`mtp.utils.publish_dir`: a folder built aside replaces the old one without ever losing either."""

from __future__ import annotations

import os

import pytest

from mtp import utils
from mtp.utils import publish_dir


def _folder(path, files):
    path.mkdir()
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def test_replaces_old_folder_and_leaves_nothing_behind(tmp_path):
    out = _folder(tmp_path / "ckpt", {"a.safetensors": "old", "stale.json": "old"})
    new = _folder(tmp_path / ".tmp-ckpt-1", {"a.safetensors": "new"})
    os.chmod(new / "a.safetensors", 0o600)
    publish_dir(new, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert sorted(p.name for p in out.iterdir()) == ["a.safetensors"]  # no stale file from the old folder
    assert (out / "a.safetensors").read_text() == "new"
    assert (out / "a.safetensors").stat().st_mode & 0o777 == 0o644


def test_failed_rename_puts_the_old_folder_back(tmp_path, monkeypatch):
    out = _folder(tmp_path / "ckpt", {"a.safetensors": "old"})
    new = _folder(tmp_path / ".tmp-ckpt-1", {"a.safetensors": "new"})
    real = os.replace
    calls = []

    def flaky(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # the old folder is already aside: fail the move of the new one into place
            raise OSError("disk went away")
        return real(src, dst)

    monkeypatch.setattr(utils.os, "replace", flaky)
    with pytest.raises(OSError, match="disk went away"):
        publish_dir(new, out)
    assert (out / "a.safetensors").read_text() == "old"
    assert (new / "a.safetensors").read_text() == "new"  # the new one is not lost either
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-ckpt-1", "ckpt"]


def test_require_names_the_extra_of_a_missing_module(monkeypatch):
    import sys

    from mtp.utils import MissingExtraError, require

    assert require("json", "x", "f").dumps([]) == "[]"
    monkeypatch.setitem(sys.modules, "fastapi", None)
    with pytest.raises(MissingExtraError, match=r"mtp-serve needs 'fastapi', which is not installed: "
                                                r"pip install 'mtp\[serve\]'"):
        require("fastapi", "serve", "mtp-serve")
