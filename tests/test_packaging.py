"""A non-editable install (a wheel built from this tree, in a fresh virtualenv that sees the system's
dependencies on its path) runs `mtp-eval` and `mtp-chat` from another folder: the configs ship inside the package and no
top-level `eval` package lands in site-packages."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd, cwd, timeout=300, env=None):
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, f"{cmd} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return r.stdout


@pytest.mark.slow
def test_wheel_installs_and_runs_from_another_folder(tmp_path):
    pytest.importorskip("setuptools")  # the build runs offline (--no-build-isolation) with this environment's
    pytest.importorskip("wheel")  # setuptools < 70 builds wheels through it (the `test` extra installs it)
    src = tmp_path / "src"  # a copy of the tracked files: the build never writes into the checkout
    src.mkdir()
    files = _run(["git", "ls-files", "-co", "--exclude-standard"], ROOT).split()
    for f in files:
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            os.link(ROOT / f, src / f) if os.stat(ROOT / f).st_dev == os.stat(tmp_path).st_dev else \
                (src / f).write_bytes((ROOT / f).read_bytes())
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", dist, src],
         tmp_path)
    (whl,) = dist.glob("mtp-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path).strip())
    # the dependencies (torch, hydra, ...) of this interpreter, after the new site-packages and without
    # processing its .pth files (an editable `mtp` installed there stays out of sight)
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # pip of this interpreter installs into the new environment (--prefix); nothing is downloaded
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--no-compile", "--prefix", env_dir,
          "--ignore-installed", whl], tmp_path)
    assert (site / "mtp_eval" / "conf" / "eval.yaml").is_file() and (site / "mtp" / "model").is_dir()
    assert not (site / "eval").exists(), "the wheel installed a top-level package named `eval`"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    where = _run([py, "-c", "import mtp, mtp_eval; print(mtp.__file__, mtp_eval.__file__)"], elsewhere, env=env)
    assert where.count(str(site)) == 2, where  # the installed copies, not the checkout or another install
    # the console scripts pip wrote (their #! names the interpreter that ran pip: run them with the new one)
    assert "mtp-eval" in _run([py, env_dir / "bin" / "mtp-eval", "--help"], elsewhere, env=env)
    job = _run([py, env_dir / "bin" / "mtp-eval", "--cfg", "job", "draft=eagle"], elsewhere, env=env)
    assert "draft:" in job and "eagle" in job
    chat = _run([py, env_dir / "bin" / "mtp-chat", "--cfg", "job"], elsewhere, env=env)
    assert "max_new_tokens" in chat and "show_drafts" in chat
    assert "served_model_name" in _run([py, env_dir / "bin" / "mtp-serve", "--cfg", "job"], elsewhere, env=env)
    plan = _run([py, env_dir / "bin" / "mtp-plan", "deepseek-v3.2", "--gpus", "8", "--gpu-mem-gib", "141"], elsewhere,
                env=env)  # the bundled config by name, read from the installed package
    assert "FITS" in plan
