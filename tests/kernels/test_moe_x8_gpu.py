"""Switch `FastPathOptions.moe_x8` on the GPU (pytest -m gpu): the experts' gate/up kernel on the block's quantized
input (`moe.moe_experts(xq=(x8, sx))`) gives the bits of x quantized in its K loop, torch.equal:
- at a TP=8 'split' rank's shapes (256 routed slices + the shared one, 256 wide, D = 7168; 8 routed + the shared slot
  per token) at 1..4 tokens, x and (x8, sx) from the post-attention add + norm + quant kernel as `FastBlock` hands
  them on (bf16 y, its residual add with the rounding of an fp32 sum): random routings, -1 slots, experts repeated
  across tokens; 'waves' and default K slices; item_regs on and off; without PDL and with it (the trigger at the
  start and after the wait); the pair grid too;
- in a CUDA graph of PDL launches (norm -> experts, twice, as two MoE layers), replayed with new residuals and
  routings copied in (12 replays), against eager launches with x quantized in the loop.
CPU twin (the interpreter, the sm_90 code's structure): tests/kernels/test_moe_x8.py.
MTP_TEST_DEVICE=cpu with TRITON_INTERPRET=1 dry-runs these on the CPU (slow).
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

from mtp.kernels.moe import moe_experts  # noqa: E402
from mtp.kernels.norm_quant import add_rms_norm_quant  # noqa: E402

from .test_fused_kernels_gpu import split_rank_weights  # noqa: E402
from .test_kernels_gpu import poison  # noqa: E402
from .test_moe_items_gpu import _routings  # noqa: E402


@pytest.fixture(scope="module")
def split_stack():
    return split_rank_weights()  # 1.4 GB of FP8, once for the file


def _normed(h: torch.Tensor, d: torch.Tensor, w: torch.Tensor, pdl: int = 0):
    """(x bf16, (x8, sx)): the post-attention residual add (d an fp32 all-reduced sum, rounded to bf16 first) + RMSNorm
    + quant, as `FastBlock` runs it before the MoE."""
    _, x, x8, sx = add_rms_norm_quant(h, d, w, 1e-6, torch.bfloat16, quant=True, pdl=pdl, round_dtype=torch.bfloat16)
    return x, (x8, sx)


@pytest.mark.parametrize("pdl", [0, 1, 2])
@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_x8_split_rank(split_stack, T, pdl):
    st = split_stack
    S, D = st[0].shape[0] - 1, st[0].shape[2]
    g = torch.Generator(device=DEV).manual_seed(20 * T + pdl)
    x, xq = _normed(torch.randn(T, D, device=DEV, generator=g), torch.randn(T, D, device=DEV, generator=g),
                    1 + 0.1 * torch.randn(D, device=DEV, generator=g))
    w = torch.rand(T, 8, device=DEV, generator=g)
    kw = dict(out_dtype=torch.float32, shared=True, pdl=pdl)
    for name, ids in _routings(T, S, 8, g).items():
        for splits in ("waves", None):
            for regs in (True, False):
                poison()
                off = moe_experts(x, ids, w, *st, layout="persistent", splits=splits, item_regs=regs, **kw)
                on = moe_experts(x, ids, w, *st, layout="persistent", splits=splits, item_regs=regs, xq=xq, **kw)
                assert torch.equal(on, off), (name, splits, regs, (on - off).abs().max().item())
        if name == "skip":
            off = moe_experts(x, ids, w, *st, layout="pairs", **kw)
            assert torch.equal(moe_experts(x, ids, w, *st, layout="pairs", xq=xq, **kw), off), (name, "pairs")


def test_x8_graph_replay(split_stack):
    """Two MoE layers (norm -> experts with xq, the second's residual delta the first's output) captured with PDL,
    replayed 12 times with new residuals and routings copied in: each replay equals eager launches with x quantized in
    the loop (the switch off)."""
    if DEV != "cuda":
        pytest.skip("CUDA graphs")
    st = split_stack
    S, D = st[0].shape[0] - 1, st[0].shape[2]
    g = torch.Generator(device=DEV).manual_seed(9)
    T = 4
    h, d = torch.randn(T, D, device=DEV, generator=g), torch.randn(T, D, device=DEV, generator=g)
    nw = 1 + 0.1 * torch.randn(D, device=DEV, generator=g)
    ids = torch.stack([torch.randperm(S, device=DEV, generator=g)[:8] for _ in range(T)]).int()
    w = torch.rand(T, 8, device=DEV, generator=g)
    kw = dict(out_dtype=torch.float32, layout="persistent", shared=True, splits="waves", item_regs=True, pdl=2)

    def two(x8: bool) -> torch.Tensor:
        y = d
        for _ in range(2):
            x, xq = _normed(h, y, nw, pdl=2)
            y = moe_experts(x, ids, w, *st, xq=xq if x8 else None, **kw)
        return y

    two(True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = two(True)
    for i in range(12):
        h.copy_(torch.randn(T, D, device=DEV, generator=g))
        ids.copy_(_routings(T, S, 8, g)[("random", "skip", "same")[i % 3]])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, two(False)), i
