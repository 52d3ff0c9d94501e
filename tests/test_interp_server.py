"""`tests.interp.interpreted`: runs forked from the warm server behave as `python *argv` in a fresh process would
(exit code, stdout / stderr, argv, environment, working folder, `-m`), each in its own process (what one run
patches the next does not see), and a run past its timeout is killed without taking the server with it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.interp import ROOT, interpreted

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or os.environ.get("MTP_TEST_NO_FORK") == "1",
                                reason="the forking server needs os.fork")


def _script(tmp_path, body: str) -> str:
    p = tmp_path / "run.py"
    p.write_text(body)
    return str(p)


def test_a_run_sees_its_argv_env_and_folder_and_returns_its_code(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_INTERP_PROBE", "seen")
    s = _script(tmp_path, "import os, sys\n"
                          "print(sys.argv[1:], os.environ['MTP_INTERP_PROBE'], os.environ['TRITON_INTERPRET'])\n"
                          "print(os.getcwd())\n"
                          "print('to stderr', file=sys.stderr)\n"
                          "raise SystemExit(3)\n")
    r = interpreted([s, "a", "b c"], 60)
    assert r.returncode == 3
    assert r.stdout.splitlines() == ["['a', 'b c'] seen 1", str(ROOT)]
    assert r.stderr == "to stderr\n"


def test_an_exception_is_exit_1_with_its_traceback(tmp_path):
    r = interpreted([_script(tmp_path, "raise ValueError('bad tensor x')\n")], 60)
    assert r.returncode == 1 and "ValueError: bad tensor x" in r.stderr


def test_a_module_runs_as_main():
    r = interpreted(["-m", "json.tool", "--help"], 60)
    assert r.returncode == 0 and "json.tool" in r.stdout


def test_what_a_run_patches_the_next_run_does_not_see(tmp_path):
    s = _script(tmp_path, "import triton.runtime.interpreter as ti, sys\n"
                          "print(hasattr(ti, '_mtp_probe'))\n"
                          "ti._mtp_probe = 1\n")
    assert [interpreted([s], 60).stdout for _ in range(2)] == ["False\n", "False\n"]


def test_a_run_past_its_timeout_is_killed_and_the_next_run_works(tmp_path):
    s = _script(tmp_path, "import subprocess, sys, time\n"
                          "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                          "print(p.pid, flush=True)\n"
                          "time.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired) as e:
        interpreted([s], 3)
    pid = int(e.value.output)  # what the run started went with it (gone, or a zombie until init reaps it)
    state = open(f"/proc/{pid}/stat").read().split()[2] if os.path.exists(f"/proc/{pid}/stat") else "gone"
    assert state in ("gone", "Z", "X"), state
    r = interpreted([_script(tmp_path, "print('next')\n")], 60)
    assert (r.returncode, r.stdout) == (0, "next\n")


def test_plain_processes_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_TEST_NO_FORK", "1")
    r = interpreted([_script(tmp_path, "import sys; print(sys.executable)\n")], 60)
    assert (r.returncode, r.stdout) == (0, sys.executable + "\n")
