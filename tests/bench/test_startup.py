"""`python -m mtp.bench.startup`: the parent passes the CUDA-start switch to its children and reports their phases
(CPU, children faked at the subprocess boundary); on a GPU, a real child splits CUDA start from the load and
imports no torch._dynamo by the first token on the reference path."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import mtp.bench.startup as startup
from mtp.kernels import HAS_TRITON


def _child_row(cuda_init_s):
    return {"import_s": 1.0, "overlap_cuda_init": cuda_init_s is None, "cuda_init_s": cuda_init_s, "load_s": 0.2,
            "fast_path_s": 0.1, "dynamo_imported": False, "first_generate_s": 2.0, "first_token_s": 0.5,
            "first_tokens": 48, "second_generate_s": 0.3, "second_token_s": 0.01, "second_tokens": 48,
            "to_first_token_s": 1.8 + (cuda_init_s or 0)}


@pytest.mark.parametrize("overlap", [True, False])
def test_the_switch_reaches_the_child_and_the_report(tmp_path, monkeypatch, capsys, overlap):
    cmds = []

    def fake_run(cmd, env, capture_output, text, timeout):
        cmds.append(cmd)
        if cmd[1] == "-c":  # the throwaway import that warms the OS file cache first
            return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")
        row = _child_row(None if "--no-overlap-cuda-init" not in cmd else 0.7)
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(row) + "\n", stderr="")

    monkeypatch.setattr(startup.subprocess, "run", fake_run)
    argv = ["--configs", "reference", "--json", str(tmp_path / "s.json")]
    argv += [] if overlap else ["--no-overlap-cuda-init"]
    assert startup.main(argv) == 0
    assert cmds[0][1:3] == ["-c", "import torch, triton, mtp" if HAS_TRITON else "import torch, mtp"]
    cmds = cmds[1:]
    assert len(cmds) == 2 and all(("--no-overlap-cuda-init" in c) != overlap for c in cmds)  # cold and warm
    out = capsys.readouterr().out
    assert ("cuda init in load" if overlap else "cuda init  0.7") in out
    assert "torch._dynamo at the first token: not imported" in out
    res = json.loads((tmp_path / "s.json").read_text())
    assert res["overlap_cuda_init"] is overlap and [r["cache"] for r in res["rows"]] == ["cold", "warm"]
    assert res["file_cache_warmup_import_s"] >= 0
    for r in res["rows"]:  # the keys BENCHMARKS.md's start-up table reads
        assert {"import_s", "load_s", "first_token_s", "to_first_token_s", "cuda_init_s", "dynamo_imported",
                "triton_autotune_cached", "triton_kernels_cached"} <= set(r)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("overlap", [True, False])
def test_a_real_start_on_the_reference_path(overlap):
    cmd = [sys.executable, "-m", "mtp.bench.startup", "--child", "reference", "--mode", "eager", "--tokens", "4"]
    p = subprocess.run(cmd + ([] if overlap else ["--no-overlap-cuda-init"]), capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["dynamo_imported"] is False  # nothing on the load or reference path imports it
    assert (r["cuda_init_s"] is None) if overlap else r["cuda_init_s"] > 0
    assert r["load_s"] > 0 and 1 <= r["first_tokens"] <= 4
