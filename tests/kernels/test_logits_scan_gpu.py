"""The logits scan on the GPU (pytest -m gpu): `logits_scan.logits_scan` gives torch.argmax(dim=-1)'s indices and the
old health check's flag exactly (torch.equal), at DeepSeek-V3.2's vocabulary (129280):
- R = 1..8 rows, fp32 and bf16, random and adversarial rows (ties across chunk boundaries, NaN first / later, +-inf,
  -inf rows, all-equal rows, the extremes of fp32), strided rows and [B, T, V] logits, through `dispatch.scan_logits`
  with the switch on and off too;
- in a CUDA graph replayed 10 times with new logits copied in (the per-row counters re-armed by their last user; the
  flag or-ed, zeroed between replays by the test), against torch on each;
- strict speculative decoding on the fast path (graph / overlap) gives the same tokens with the switch as without.
CPU twin (the interpreter, small V; the engine with the switch): tests/kernels/test_logits_scan.py. Timing (not a
test): `python -m mtp.bench.small_kernels --only logits`.
MTP_TEST_DEVICE=cpu with TRITON_INTERPRET=1 dry-runs the kernel tests on the CPU (slow; no graphs, no engine).
"""

from __future__ import annotations

import os

import pytest
import torch

from mtp.kernels import available

pytestmark = pytest.mark.gpu
DEV = os.environ.get("MTP_TEST_DEVICE", "cuda")
if not (available() or (DEV == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")):
    pytest.skip("needs triton and a CUDA device", allow_module_level=True)

from mtp.decode.health import logits_nonfinite  # noqa: E402
from mtp.kernels.dispatch import FastPathOptions, scan_logits  # noqa: E402
from mtp.kernels.logits_scan import CHUNK, logits_scan  # noqa: E402

from .test_logits_scan import adversarial_rows  # noqa: E402

V = 129280


def _needs_cuda() -> None:
    if DEV != "cuda":
        pytest.skip("CUDA graphs and the fast path")


def _old(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    f = torch.zeros((), dtype=torch.bool, device=x.device)
    logits_nonfinite(f, x)
    return x.argmax(dim=-1), bool(f)


def _same(x: torch.Tensor, what: str) -> None:
    want, flag = _old(x)
    f = torch.zeros((), dtype=torch.bool, device=x.device)
    got = logits_scan(x, f)
    assert torch.equal(got, want), f"{what}: {got.tolist()} vs torch {want.tolist()}"
    assert bool(f) == flag, f"{what}: flag {bool(f)} vs the old check's {flag}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("R", range(1, 9))
def test_random_rows(R, dtype):
    g = torch.Generator(device=DEV).manual_seed(R)
    for _ in range(4):
        _same(torch.randn(R, V, device=DEV, generator=g).to(dtype), f"random R={R} {dtype}")
    x = (torch.randn(R, V, device=DEV, generator=g) * 0.01).round(decimals=1).to(dtype)  # many tied maxima
    _same(x, f"ties R={R} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_adversarial_rows(dtype):
    for chunk in (CHUNK, 64):  # the chunk the kernel takes at V, and boundaries it does not (a tie / NaN is a tie)
        for name, x in adversarial_rows(V, chunk):
            x = x.to(DEV, dtype)
            for rows in (x, x[:1], x[1:2], x[2:]):
                _same(rows, f"{name} (boundary {chunk}) {dtype}")


def test_strided_and_batched_logits_and_the_dispatch():
    g = torch.Generator(device=DEV).manual_seed(7)
    wide = torch.randn(6, V + 100, device=DEV, generator=g)
    wide[3, 17] = float("nan")
    _same(wide[:, 50:50 + V], "strided rows")
    x3 = torch.randn(2, 4, V, device=DEV, generator=g)
    x3[1, 2, [CHUNK - 1, CHUNK]] = 100.0
    _same(x3, "[B, T, V]")
    for opts in (FastPathOptions(), FastPathOptions(logits_scan=False), None):
        f = torch.zeros((), dtype=torch.bool, device=DEV)
        assert torch.equal(scan_logits(x3, opts, f), x3.argmax(-1)) and not bool(f)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("R", [1, 4, 8])
def test_in_a_cuda_graph_replayed(R, dtype):
    """One captured launch (argmax + flag) and one of the argmax alone, replayed 10 times with new logits: random,
    a NaN, a collapsed row, ties across chunks, +inf; each replay against torch on what was copied in."""
    _needs_cuda()
    g = torch.Generator(device=DEV).manual_seed(100 + R)
    x = torch.randn(R, V, device=DEV, generator=g).to(dtype)
    flag = torch.zeros((), dtype=torch.bool, device=DEV)
    logits_scan(x, flag)  # compiled and its counters allocated outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        idx = logits_scan(x, flag)
        idx_only = logits_scan(x)
    for i in range(10):
        new = torch.randn(R, V, device=DEV, generator=g)
        r = i % R
        if i % 5 == 1:
            new[r, 1000 + i] = float("nan")
        elif i % 5 == 2:
            new[r] = 0.5
        elif i % 5 == 3:
            new[r, [CHUNK - 1, CHUNK, 5 * CHUNK]] = 30.0
        elif i % 5 == 4:
            new[r, V - 1] = float("inf")
        x.copy_(new.to(dtype))
        flag.zero_()
        graph.replay()
        torch.cuda.synchronize()
        want, bad = _old(x)
        assert torch.equal(idx, want) and torch.equal(idx_only, want), f"replay {i}: {idx.tolist()} vs {want.tolist()}"
        assert bool(flag) == bad, f"replay {i}: flag {bool(flag)} vs {bad}"


@pytest.mark.parametrize("draft,k", [("none", 0), ("eagle", 3), ("vanilla", 1)])
def test_strict_decoding_is_the_same_with_the_switch(draft, k):
    from mtp.backends.fast_path import enable_fast_path, set_kernels
    from mtp.checkpoint.synthetic import random_model
    from mtp.decode.engine import generate, release
    from mtp.model.presets import gpu_test_config

    _needs_cuda()
    model = random_model(gpu_test_config(layers=3, mtp_modules=1), device=DEV, dtype=torch.bfloat16, seed=1)
    enable_fast_path(model)
    prompts = [list(range(3, 40)), list(range(50, 61)), list(range(100, 190))]
    outs = {}
    for on in (False, True):
        set_kernels(model, logits_scan=on)
        for mode in ("eager", "graph", "overlap"):
            outs[on, mode] = generate(model, prompts, 16, draft=draft, k=k, mode=mode, reuse_modules=True)
    release(model)
    want = outs[False, "eager"]
    for key, out in outs.items():
        assert out.tokens == want.tokens, key
        assert out.metrics.accepted_hist == want.metrics.accepted_hist, key
