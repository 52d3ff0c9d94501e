"""The indexer's head-weights kernel (`mtp.kernels.index_weights`) on a GPU (pytest -m gpu): against its torch
reference at the decode / verify row counts (1..64), DeepSeek-V3.2's shape (64 heads x 7168, bf16 and an fp32
model's fp32), bit for bit on integer inputs, deterministic, in a CUDA graph, and one kernel per call (the cuBLAS
path it replaces ran 2-3 by the row count). Tolerance: tests/kernels/test_index_weights.py's `bound`.
MTP_TEST_DEVICE=cpu with TRITON_INTERPRET=1 dry-runs the kernel tests on the CPU (slow).
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

from mtp.kernels.index_weights import index_weights, index_weights_ref  # noqa: E402

from .test_index_weights import H, K, SCALE, assert_within, bound  # noqa: E402
from .test_kernels_gpu import poison  # noqa: E402

ROWS = [1, 2, 4, 8, 12, 24, 32, 64]  # 8 and 32: where cuBLAS added a kernel; 12: a partial 4 x 2 tile; 24: 4 x 4


def _inputs(N: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = (torch.randn(H, K, device=DEV, generator=g) * 0.02).to(dtype)
    x = (torch.randn(N, K, device=DEV, generator=g) * torch.logspace(-3, 1, K, device=DEV)).to(dtype)
    return x, w


@pytest.fixture(autouse=True)
def _fp32_reference():
    """The reference's F.linear in true fp32 (no TF32 on the GPU)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N", ROWS)
def test_index_weights_matches_reference(N, dtype):
    x, w = _inputs(N, dtype, seed=N)
    poison()
    got = index_weights(x, w, SCALE)
    assert torch.isfinite(got).all(), "an output left unwritten (NaN from the poisoned pool)"
    assert_within(f"N={N} {dtype}", got, index_weights_ref(x, w, SCALE), bound(x, w, SCALE))
    exact = (x.double() @ w.double().T) * SCALE  # the kernel is as close to the exact sum as the bound says
    assert_within(f"N={N} {dtype} vs float64", got, exact.float(), bound(x, w, SCALE))


@pytest.mark.parametrize("N", ROWS)
def test_index_weights_exact_on_integers(N):
    """Integer inputs: every order sums exactly, so kernel and reference agree bit for bit (indexing, masks)."""
    g = torch.Generator(device=DEV).manual_seed(N)
    x = torch.randint(-4, 5, (N, K), device=DEV, generator=g).bfloat16()
    w = torch.randint(-4, 5, (H, K), device=DEV, generator=g).bfloat16()
    assert torch.equal(index_weights(x, w, SCALE), index_weights_ref(x, w, SCALE))


@pytest.mark.parametrize("N", ROWS)
def test_index_weights_deterministic_and_graph_safe(N):
    if DEV != "cuda":
        pytest.skip("CUDA graphs")
    x, w = _inputs(N, torch.bfloat16, seed=100 + N)
    a = index_weights(x, w, SCALE)
    for _ in range(2):
        assert torch.equal(index_weights(x, w, SCALE), a)
    static = x.clone()
    index_weights(static, w, SCALE)  # compiled before capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = index_weights(static, w, SCALE)
    x2, _ = _inputs(N, torch.bfloat16, seed=200 + N)
    for inp in (x, x2, x):
        static.copy_(inp)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, index_weights(inp, w, SCALE)), "graph replay differs from the eager call"


@pytest.mark.parametrize("N", [1, 8, 32])
def test_index_weights_one_kernel(N):
    """One kernel per call on the GPU (the launch structure `mtp.plan.kernels` books 1); the cuBLAS path it replaced
    is printed for the record (2-3 kernels + the scale on an H200, by the row count)."""
    if DEV != "cuda":
        pytest.skip("profiler on CUDA")
    from mtp.bench.timing import kernel_profile

    x, w = _inputs(N, torch.bfloat16)
    prof = kernel_profile(lambda: index_weights(x, w, SCALE), steps=3)
    try:  # (torch.mm's out_dtype: the fast path checks this build has it, `fast_path._mm_out_fp32`)
        old = kernel_profile(lambda: torch.mm(x, w.t(), out_dtype=torch.float32).mul_(SCALE), steps=3)
        print(f"N={N}: kernel {prof['kernels_per_step']:.0f} launch(es); cuBLAS mm + mul_ "
              f"{old['kernels_per_step']:.0f}: {[r['name'][:60] for r in old['top']]}")
    except (RuntimeError, TypeError) as e:
        print(f"N={N}: no bf16 -> fp32 mm on this build ({type(e).__name__})")
    assert prof["kernels_per_step"] == 1 and "index_weights" in prof["top"][0]["name"], prof["top"]
