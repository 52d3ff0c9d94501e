"""Switch `FastPathOptions.moe_tma` on the GPU (pytest -m gpu): the persistent experts' weight tiles copied by TMA
through host tensor descriptors (`moe.moe_experts(tma=True)`, `moe.weight_desc`) give the pointer tiles' bits
(cp.async), torch.equal:
- at a TP=8 'split' rank's shapes (256 routed slices + the shared one, 256 wide, D = 7168; 8 routed + the shared slot
  per token) at 1..4 tokens: random routings, -1 slots, experts repeated across tokens; 'waves' and default K slices;
  x8 on and off; item_regs on and off; without PDL and with it (the trigger at the start and after the wait);
- at a contiguous expert-parallel rank's full-width experts (32 of 256, I = 2048), default grids and fewer programs;
- in a CUDA graph of PDL launches (two chained calls, as two MoE layers, as the step launches them: x8, item_regs,
  'waves'), replayed with new inputs and routings copied in, at 1..4 tokens, against eager calls with the switch off;
- the hardware's fill of an overhanging block (why `weight_desc` wants N a multiple of 128: 0 past the [E * N, K]
  view, the next expert's rows inside it); the descriptor cache: one object per stack, holding no tensor.
CPU twin (the interpreter, the sm_90 code's structure): tests/kernels/test_moe_tma.py.
MTP_TEST_DEVICE=cpu with TRITON_INTERPRET=1 dry-runs these on the CPU (slow).
"""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch

from mtp.kernels import available

pytestmark = pytest.mark.gpu
DEV = os.environ.get("MTP_TEST_DEVICE", "cuda")
if not (available() or (DEV == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")):
    pytest.skip("needs triton and a CUDA device", allow_module_level=True)
if DEV == "cuda" and torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("TMA needs compute capability >= 9.0", allow_module_level=True)

from mtp.kernels.act_quant import act_quant  # noqa: E402
from mtp.kernels.moe import moe_experts, weight_desc  # noqa: E402

from .test_fused_kernels_gpu import split_rank_weights  # noqa: E402
from .test_kernels_gpu import local_ids, poison, stacked  # noqa: E402
from .test_moe_items_gpu import _routings  # noqa: E402
from .test_moe_tma import overhang_checks  # noqa: E402


@pytest.fixture(scope="module")
def split_stack():
    return split_rank_weights()  # 1.4 GB of FP8, once for the file


@pytest.mark.parametrize("pdl", [0, 1, 2])
@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_tma_split_rank(split_stack, T, pdl):
    st = split_stack
    S = st[0].shape[0] - 1
    g = torch.Generator(device=DEV).manual_seed(30 * T + pdl)
    x = torch.randn(T, st[0].shape[2], device=DEV, generator=g).bfloat16()
    xq = act_quant(x)
    w = torch.rand(T, 8, device=DEV, generator=g)
    kw = dict(out_dtype=torch.float32, layout="persistent", shared=True, pdl=pdl)
    for name, ids in _routings(T, S, 8, g).items():
        for splits in ("waves", None):
            for regs, x8 in ((True, True), (True, False), (False, True)):
                poison()
                k = dict(kw, splits=splits, item_regs=regs, xq=xq if x8 else None)
                off = moe_experts(x, ids, w, *st, **k)
                on = moe_experts(x, ids, w, *st, tma=True, **k)
                assert torch.equal(on, off), (name, splits, regs, x8, (on - off).abs().max().item())


@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_tma_full_width_rank(T):
    """A contiguous rank's 32 experts of 256 at full width (gate / up [32, 2048, 7168], down [32, 7168, 2048]): the
    default slices and grids, and 16 / 24 programs (several items per program)."""
    E_loc, D, I, J = 32, 7168, 2048, 8
    torch.manual_seed(100 + T)
    ws = [*stacked(E_loc, I, D), *stacked(E_loc, I, D), *stacked(E_loc, D, I)]
    x = torch.randn(T, D, device=DEV).bfloat16()
    ids = local_ids(torch.stack([torch.randperm(256, device=DEV)[:J] for _ in range(T)]).int(), 0, E_loc)
    if not (ids[0] >= 0).any():
        ids[0, 0] = 3
    w = torch.rand(T, J, device=DEV)
    for programs in (None, (16, 24)):
        kw = dict(out_dtype=torch.float32, layout="persistent", programs=programs, item_regs=True, xq=act_quant(x))
        off = moe_experts(x, ids, w, *ws, **kw)
        assert torch.equal(moe_experts(x, ids, w, *ws, tma=True, **kw), off), programs


@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_tma_graph_replay(split_stack, T):
    """Two chained calls captured with the switch on and PDL as the step sets it (the trigger at the start at one
    token, after the wait past it), replayed 12 times with new inputs and routings copied in: each replay equals the
    eager calls with it off. The descriptors are by-value kernel parameters: the graph holds them."""
    if DEV != "cuda":
        pytest.skip("CUDA graphs")
    st = split_stack
    S = st[0].shape[0] - 1
    g = torch.Generator(device=DEV).manual_seed(50 + T)
    x = torch.randn(T, st[0].shape[2], device=DEV, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(S, device=DEV, generator=g)[:8] for _ in range(T)]).int()
    w = torch.rand(T, 8, device=DEV, generator=g)
    kw = dict(out_dtype=torch.float32, layout="persistent", shared=True, splits="waves", item_regs=True,
              pdl=1 if T == 1 else 2)

    def two(tma: bool) -> torch.Tensor:
        y = moe_experts(x, ids, w, *st, xq=act_quant(x), tma=tma, **kw)
        y = y.bfloat16()
        return moe_experts(y, ids, w, *st, xq=act_quant(y), tma=tma, **kw)

    two(True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = two(True)
    for i in range(12):
        x.copy_(torch.randn(x.shape, device=DEV, generator=g))
        ids.copy_(_routings(T, S, 8, g)[("random", "skip", "same")[i % 3]])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, two(False)), i


def test_tma_overhang_and_cache():
    """The TMA unit's fill at an overhanging N-block (`test_moe_tma.overhang_checks`, there under the interpreter's
    emulation); `weight_desc` gives one descriptor object per stack, which keeps no stack alive."""
    overhang_checks(DEV)
    if DEV != "cuda":
        return
    w = torch.zeros(4, 256, 384, dtype=torch.float8_e4m3fn, device=DEV)
    d = weight_desc("w_gate", w)
    assert weight_desc("w_gate", w) is d and d.base.data_ptr() == w.data_ptr()
    ref = weakref.ref(w)
    del w
    gc.collect()
    assert ref() is None, "the descriptor cache holds the stack"
