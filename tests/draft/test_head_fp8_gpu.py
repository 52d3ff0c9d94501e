"""The drafts' FP8 head (`mtp.draft.head_fp8`) on the GPU (pytest -m gpu):
- the fast path's head (`kernels.dispatch.linear` on the copy of a TP=8 rank's shard of DeepSeek-V3.2's head,
  [16160, 7168]) against the reference formula on the same copy (act_quant + `fp8_gemm_ref`, `Linear.matmul`) at 1..4
  rows, x in bf16 (the model dtype) and fp32, with the default switches (the split-K GEMV at one row, the
  weight-streaming GEMV at 2..4) and gemv_rows 4 (the GEMV at every width); the copy's bytes are the planner's;
- the head in a CUDA graph replayed with new inputs gives eager's bits;
- strict decoding with it on the fast path (eagle k = 3, a real-width 3-layer model): eager, graph and overlap give
  the same tokens, and the drafts read the copy.
CPU twin (the reference formula, the FP8 error bound, decoding, the interpreter): tests/draft/test_head_fp8.py.
Timing (not a test): `mtp-bench --tp 8 --draft-head-fp8 --profile` (the eagle k = 3 step with and without it).
"""

from __future__ import annotations

import pytest
import torch

from mtp.kernels import available

pytestmark = pytest.mark.gpu
if not available():
    pytest.skip("needs triton and a CUDA device", allow_module_level=True)

from mtp.draft import head_fp8 as hf  # noqa: E402
from mtp.kernels.dispatch import FastPathOptions  # noqa: E402
from mtp.model.config import RuntimeOptions  # noqa: E402

SHARD = (16160, 7168)  # a TP=8 rank's rows of the 129280-row head, the model's width


class Holder(torch.nn.Module):
    """What an Fp8Head reads of its model at call time (the fast path's switches, None: the reference; numerics)."""

    def __init__(self, fast_options=None):
        super().__init__()
        self.fast_options, self.runtime = fast_options, RuntimeOptions()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def shard_weight():
    g = torch.Generator(device="cuda").manual_seed(0)
    return (torch.randn(*SHARD, device="cuda", generator=g) * 0.02).bfloat16()


@pytest.mark.parametrize("gemv_rows", [1, 4])
def test_fast_head_is_the_reference_formula_at_the_tp8_shard(shard_weight, gemv_rows):
    from mtp.parallel.layout import ParallelPlan
    from mtp.parallel.memory import draft_head_fp8_bytes
    from mtp.model.presets import real_config

    holders = Holder(FastPathOptions.for_world(8, gemv_rows=gemv_rows)), Holder(None)  # kept: held weakly
    fast, ref = (hf.Fp8Head(h, shard_weight) for h in holders)
    assert fast.nbytes == draft_head_fp8_bytes(real_config(), ParallelPlan(8), "eagle", 3) == 115_863_328
    g = torch.Generator(device="cuda").manual_seed(1)
    for M in (1, 2, 3, 4):
        x = torch.randn(M, 1, SHARD[1], device="cuda", generator=g) * torch.logspace(-2, 1, SHARD[1], device="cuda")
        # fp32: 1e-4 where the split-K GEMV (CUDA cores, fp32 sums) runs; 1e-3 on the tensor-core path (2-4 rows with
        # gemv_rows 1), whose FP8 MMA accumulates with fewer mantissa bits than fp32 (measured 1.22e-4 at M = 2, H200,
        # session 20)
        f32 = 1e-4 if M <= gemv_rows else 1e-3
        for dtype, tol in ((torch.float32, f32), (torch.bfloat16, 1e-2)):
            y, want = fast(x.to(dtype)), ref(x.to(dtype))
            assert y.dtype == dtype and y.shape == (M, 1, SHARD[0]) and torch.isfinite(y).all()
            err = rel_err(y, want)
            agree = (y.float().argmax(-1) == want.float().argmax(-1)).float().mean().item()
            print(f"gemv_rows={gemv_rows} M={M} {dtype}: rel err {err:.2e}, argmax agreement {agree:.2f}")
            assert err < tol, (M, dtype, err)
            if dtype == torch.float32:
                assert agree == 1.0, (M, agree)


def test_fast_head_in_a_cuda_graph(shard_weight):
    holder = Holder(FastPathOptions.for_world(8))
    head = hf.Fp8Head(holder, shard_weight)
    x = torch.randn(1, 1, SHARD[1], device="cuda", dtype=torch.bfloat16)
    head(x)  # compiles the kernels before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = head(x)
    for seed in range(3):
        x.copy_(torch.randn(1, 1, SHARD[1], device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        assert torch.equal(y, head(x)), seed


def test_strict_with_the_fp8_head_on_the_fast_path_in_every_mode():
    from mtp.backends.fast_path import enable_fast_path
    from mtp.checkpoint.synthetic import random_model
    from mtp.decode.engine import generate, release
    from mtp.model.presets import gpu_test_config

    model = random_model(gpu_test_config(layers=3, mtp_modules=1), device="cuda", dtype=torch.bfloat16, seed=1)
    enable_fast_path(model)
    prompts = [list(range(3, 40)), list(range(50, 61))]
    outs = {mode: generate(model, prompts, 24, draft="eagle", k=3, mode=mode, draft_head_fp8=True)
            for mode in ("eager", "graph", "overlap")}
    assert outs["graph"].tokens == outs["eager"].tokens == outs["overlap"].tokens
    assert None in hf._FP8_HEADS[model.mtp[0].shared_head.head]  # the drafts read the copy
    plain = generate(model, prompts, 24, draft="eagle", k=3)
    same = sum(a == b for r, s in zip(plain.tokens, outs["eager"].tokens) for a, b in zip(r, s))
    print(f"tokens equal to the bf16 head's run: {same} of {sum(map(len, plain.tokens))} (bf16 verify widths may "
          f"round otherwise)")
    release(model)
