"""Interpreted runs forked from one warm process: the imports paid once per test worker, not once per run.

Every interpreted kernel check runs in its own process started with TRITON_INTERPRET=1 (the interpreter is chosen
when a kernel is decorated, at import). Starting one costs ~2 s of CPU before the first check (torch, numpy,
triton, the project's kernel modules), and the CPU suite starts ~40 of them. Here one server process per test
worker imports those modules once, with TRITON_INTERPRET=1 set, and forks a child per run: each run still gets
its own process (its patches of the interpreter, its seeds and its globals die with it), started from the same
imported modules a fresh process would import, and runs its script or module as `__main__` with its own argv,
environment and working folder, its stdout and stderr to files. Nothing has run in the server when it forks
(no torch op, so no OpenMP pool; numpy's BLAS thread is re-made by its fork handler).

`run(argv, env, cwd, timeout)` -> (returncode, stdout, stderr), argv as after `python`: [script, *args] or
["-m", module, *args] (`tests.interp.interpreted` passes the repository root and its
PYTHONPATH). A run past its timeout is killed with its process group and raised as
subprocess.TimeoutExpired, as subprocess.run would. A server that died is started again at the next run.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

_SERVER = r"""
import io, json, os, runpy, sys, traceback
import numpy, torch, triton  # noqa: F401  what every interpreted run imports first: once, here
import triton.runtime.interpreter  # noqa: F401
import mtp.backends.fast_path  # noqa: F401  the kernel modules, decorated for the interpreter
import tests.interp  # noqa: F401

def child(req):
    os.setpgid(0, 0)  # the run and whatever it starts: one group, killed together on a timeout
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["stdout"], os.O_WRONLY),
                            (2, req["stderr"], os.O_WRONLY)):
        os.dup2(os.open(path, flags), fd)
    sys.stdin = open(0, closefd=False)
    sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), line_buffering=True)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    argv = req["argv"]
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            sys.path[0] = req["cwd"]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:
            child(req)
        finally:
            os._exit(70)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)
"""

_server: subprocess.Popen | None = None
_server_log = None


def _start(env: dict[str, str], cwd: str | Path) -> subprocess.Popen:
    """The live server, or a new one started with the first run's environment and folder (its imports need the
    run's TRITON_INTERPRET=1 and PYTHONPATH)."""
    global _server, _server_log
    if _server is not None and _server.poll() is None:
        return _server
    _server_log = tempfile.TemporaryFile()
    _server = subprocess.Popen([sys.executable, "-c", _SERVER], cwd=cwd, env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=_server_log, text=True, bufsize=1)
    return _server


def _stop() -> None:
    if _server is not None and _server.poll() is None:
        _server.stdin.close()
        try:
            _server.wait(10)
        except subprocess.TimeoutExpired:
            _server.kill()


atexit.register(_stop)


def _reply(server: subprocess.Popen, timeout: float | None) -> dict | None:
    """The server's next line as JSON, None past `timeout` seconds; a RuntimeError (with its log) if it died."""
    with selectors.DefaultSelector() as sel:
        sel.register(server.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            return None
    line = server.stdout.readline()
    if not line:
        _server_log.seek(0)
        raise RuntimeError(f"the interpreted-run server exited ({server.wait()}):\n"
                           f"{_server_log.read().decode(errors='replace')[-6000:]}")
    return json.loads(line)


def run(argv: list[str], env: dict[str, str], cwd: str | Path, timeout: float = 300) -> tuple[int, str, str]:
    """Run `python *argv` as a child of the server (see the module docstring) -> (returncode, stdout, stderr)."""
    env = dict(env, TRITON_INTERPRET="1")
    server = _start(env, cwd)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        out.touch()
        err.touch()
        req = {"argv": [str(a) for a in argv], "env": env, "cwd": str(cwd),
               "stdout": str(out), "stderr": str(err)}
        server.stdin.write(json.dumps(req) + "\n")
        server.stdin.flush()
        pid = _reply(server, 60)
        if pid is None:
            raise RuntimeError("the interpreted-run server did not fork within 60 s")
        done = _reply(server, timeout)
        if done is None:
            os.killpg(pid["pid"], signal.SIGKILL)
            _reply(server, 60)
            raise subprocess.TimeoutExpired(argv, timeout, out.read_text(errors="replace"),
                                            err.read_text(errors="replace"))
        return done["code"], out.read_text(errors="replace"), err.read_text(errors="replace")
