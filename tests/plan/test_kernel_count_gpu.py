"""The speed model's kernel count (`mtp.plan.kernels`) against the profiler on a GPU: `mtp-bench --tp 8` at 4 layers
(3 dense + 1 MoE), batch 1 / 8 / 32 x w = 1..4 (1 to 128 tokens: split-K GEMV, act_quant, grouped experts, several
router launches, the unquantized block above 64 tokens) at 1k and 4k (the indexer). Every row's profiled count
minus the model's must be one constant: the profiler's rows that are no launch of the step's code (BENCHMARKS.md
session 9, "Kernel counts from the launch structure": 10 memcpy rows less the seq_lens copy, +9 on an H200)."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def test_profiled_kernels_follow_the_launch_structure(tmp_path):
    from mtp.model.config import ModelConfig
    from mtp.plan.calibrate import _kernels, rows_from

    out = tmp_path / "tp8.json"
    cmd = [sys.executable, "-m", "mtp.bench", "--tp", "8", "--layers", "4", "--prompt-len", "1024", "4096", "--k", "3",
           "--batch", "1", "8", "32", "--iters", "3", "--no-spec", "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    _, rows, _ = rows_from(str(out), ModelConfig())
    diff = {r.label: r.measured_kernels - _kernels(r) for r in rows if not r.only and r.measured_kernels}
    assert len(diff) == 3 * 2 * 4, json.dumps(diff)
    assert len(set(diff.values())) == 1 and 0 <= next(iter(diff.values())) <= 10, json.dumps(diff, indent=1)
