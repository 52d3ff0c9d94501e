"""One run per folder: a second run into a busy folder is refused, a refused run leaves the folder as it was,
a refused resume names the settings that differ, and interrupted or failed writes end in one line."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from eval.rundir import RunDirError, locked, settings_diff
from eval.store import SampleStore, StoreError

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(PYTHONPATH=str(ROOT), HYDRA_FULL_ERROR="0")
    return env


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_busy_folder_is_refused(tmp_path):
    with locked(tmp_path) as claim:
        claim()
        with pytest.raises(RunDirError, match=f"another mtp-eval run \\(pid {os.getpid()}, .*\\) is writing to"):
            with locked(tmp_path):
                pass
    with locked(tmp_path):  # released at the end of the first run
        pass


def test_a_refused_lock_leaves_no_file_behind(tmp_path):
    class Refused(Exception):
        pass

    with pytest.raises(Refused):
        with locked(tmp_path):
            raise Refused
    assert list(tmp_path.iterdir()) == []


def test_settings_diff_names_what_changed():
    old = {"draft": {"name": "eagle", "k": 2}, "max_new_tokens": 32, "dataset": {"limit": None}}
    new = {"draft": {"name": "eagle", "k": 3}, "max_new_tokens": 32, "dataset": {"limit": 4}, "seed": 1}
    assert settings_diff(old, new) == ["dataset.limit: None -> 4", "draft.k: 2 -> 3", "seed: (absent) -> 1"]


def test_refused_resume_names_the_settings_that_differ(tmp_path):
    (tmp_path / "settings.json").write_text(json.dumps({"draft": {"k": 2}, "verify": {"name": "strict"}}))
    SampleStore(tmp_path / "samples.jsonl", "h1", resume=False).append([{"id": "a", "batch": "b0"}])
    with pytest.raises(StoreError, match=r"settings that differ: draft\.k: 2 -> 3"):
        SampleStore(tmp_path / "samples.jsonl", "h2", resume=True,
                    settings={"draft": {"k": 3}, "verify": {"name": "strict"}})


def test_a_failed_append_leaves_no_torn_line(tmp_path, monkeypatch):
    path = tmp_path / "samples.jsonl"
    store = SampleStore(path, "h", resume=False)
    store.append([{"id": "a", "batch": "b0"}])
    before = path.read_bytes()

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        store.append([{"id": "b", "batch": "b1"}, {"id": "c", "batch": "b1"}])
    assert path.read_bytes() == before and store.ids == {"a"}


def test_a_refused_run_leaves_the_folder_untouched(tmp_path):
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("draft:\n  k: 2\n")
    (run / "samples.jsonl").write_text('{"id": "x"}\n')
    (run / "run.log").write_text("old log\n")
    (run / ".mtp-eval.lock").write_text("12345")
    before = _snapshot(run)
    time.sleep(0.01)
    r = subprocess.run([sys.executable, "-m", "eval.run", f"hydra.run.dir={run}", "draft.k=3"], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "pass resume=true" in r.stderr, r.stderr[-2000:]
    assert r.stderr.count("already exists") == 1 and "Traceback" not in r.stderr
    assert _snapshot(run) == before


def test_a_refused_run_removes_the_folder_it_created_and_no_other(tmp_path):
    """A bad value into a fresh hydra.run.dir: exit 2, one line, no folder left (Hydra had opened run.log in it); into
    a folder with a previous run's metrics.json: that folder and file stay as they were."""
    fresh, old = tmp_path / "fresh", tmp_path / "old"
    old.mkdir()
    (old / "metrics.json").write_text('{"accept/mean_len": 2.5}\n')
    before = _snapshot(old)
    time.sleep(0.01)
    for run in (fresh, old):
        r = subprocess.run([sys.executable, "-m", "eval.run", f"hydra.run.dir={run}", "draft.k=-1"], cwd=ROOT,
                           env=_env(), capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [
            "mtp-eval: error: draft.k = -1 is invalid: expected an integer in [1, 16] (draft='none' drafts nothing)"], \
            r.stderr[-2000:]
    assert not fresh.exists() and tmp_path.is_dir()
    assert _snapshot(old)["metrics.json"] == before["metrics.json"]


def _interactive_sigint() -> None:
    """The child takes Ctrl-C as an interactive mtp-eval does. A process started in the background of a
    non-interactive shell (a CI script's `cmd &`) inherits SIGINT ignored, Python then installs no
    KeyboardInterrupt handler, and the run would (rightly) go on: that, not the run, failed this test in such
    loops (py-spy / faulthandler showed the run still decoding 60 s after the signal)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_ends_with_one_line_and_whole_lines(tmp_path):
    run = tmp_path / "run"
    samples = run / "samples.jsonl"
    # Enough work (400 prompts x 64 tokens, minutes on a CPU) that the interrupt, sent once the first sample
    # is on disk, always lands mid-run: with 4 short prompts the run could finish before the signal did (CI).
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Count from {i} to {i + 50}."}) + "\n"
                               for i in range(400)))
    env = dict(_env(), PYTHONFAULTHANDLER="1")  # a stuck run dumps every thread's stack on SIGABRT (below)
    p = subprocess.Popen([sys.executable, "-m", "eval.run", f"hydra.run.dir={run}", "model.numerics=dequant",
                          "max_new_tokens=64", "runtime.warmup=false", "dataset=local", f"dataset.path={prompts}",
                          "baseline=false", "runtime.batch_size=1"], cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         preexec_fn=_interactive_sigint)
    chunks: list[str] = []  # stderr read while the run goes (a full pipe would block the run)
    reader = threading.Thread(target=lambda: chunks.extend(iter(p.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not (samples.exists() and samples.read_text().count("\n") >= 1):
            assert p.poll() is None, "".join(chunks)[-2000:]
            assert time.monotonic() < deadline, "no sample written in time"
            time.sleep(0.02)
        p.send_signal(signal.SIGINT)
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGABRT)  # faulthandler: the stacks of a run that ignored the interrupt
            p.wait(timeout=30)
            reader.join(timeout=10)
            raise AssertionError("the run did not end within 60 s of Ctrl-C; its stacks:\n" + "".join(chunks)[-6000:])
    finally:
        if p.poll() is None:
            p.kill()
    reader.join(timeout=10)
    err = "".join(chunks)
    assert p.returncode == 130, err[-2000:]
    assert "mtp-eval: interrupted" in err and "Traceback" not in err, err[-2000:]
    assert all(json.loads(line) for line in samples.read_text().splitlines())
    assert not (run / "metrics.json").exists()
