"""Switch `FastPathOptions.moe_item_regs` on the GPU (pytest -m gpu): the persistent experts' work items without a
dependent load before their tiles (`moe.moe_experts(item_regs=True)`, `mtp.kernels.moe_items`) give the switch off's
bits, torch.equal:
- at a TP=8 'split' rank's shapes (256 routed slices + the shared one, 256 wide, D = 7168; 8 routed + the shared
  slot per token) at 1..4 tokens: random routings, -1 slots, experts repeated across tokens; 'waves' and default K
  slices; without PDL and with it, the trigger at the start and after the wait; with and without the next item's L2
  prefetch (`prefetch.global.L2`, which only a GPU runs);
- at a contiguous expert-parallel rank's full-width experts (32 of 256, I = 2048: 16 K groups a down item, 8 gate/up
  slices at one token), on the default grids and on grids of fewer programs than items;
- in a CUDA graph of PDL launches, replayed with new routings copied in (12 replays), against eager calls with the
  switch off.
CPU twin (the interpreter, the sm_90 code's structure): tests/kernels/test_moe_items.py.
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

from .test_fused_kernels_gpu import split_rank_weights  # noqa: E402
from .test_kernels_gpu import poison, stacked  # noqa: E402


@pytest.fixture(scope="module")
def split_stack():
    return split_rank_weights()  # 1.4 GB of FP8, once for the file


def _routings(T: int, E: int, J: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Routings [T, J] over E experts: distinct random per token; with -1 slots (one token with none); token 1 routed
    as token 0 (each of its experts serves both rows)."""
    rand = torch.stack([torch.randperm(E, device=DEV, generator=g)[:J] for _ in range(T)]).int()
    skip = rand.clone()
    skip[0, 1] = skip[0, J - 1] = -1
    if T > 2:
        skip[2] = -1
    same = rand.clone()
    if T > 1:
        same[1] = same[0]
    return {"random": rand, "skip": skip, "same": same}


@pytest.mark.parametrize("pdl", [0, 1, 2])
@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_item_regs_split_rank(split_stack, T, pdl):
    st = split_stack
    S = st[0].shape[0] - 1
    g = torch.Generator(device=DEV).manual_seed(10 * T + pdl)
    x = torch.randn(T, st[0].shape[2], device=DEV, generator=g).bfloat16()
    w = torch.rand(T, 8, device=DEV, generator=g)
    kw = dict(out_dtype=torch.float32, layout="persistent", shared=True, pdl=pdl)
    for name, ids in _routings(T, S, 8, g).items():
        for splits in ("waves", None):
            poison()
            off = moe_experts(x, ids, w, *st, splits=splits, **kw)
            on = moe_experts(x, ids, w, *st, splits=splits, item_regs=True, item_prefetch=True, **kw)
            assert torch.equal(on, off), (name, splits, (on - off).abs().max().item())
            if name == "random":
                assert torch.equal(moe_experts(x, ids, w, *st, splits=splits, item_regs=True, item_prefetch=False,
                                               **kw), off), (name, splits, "item_prefetch=False")


@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_moe_knobs_split_rank(split_stack, T):
    """The benchmark knobs of `moe_experts` (`mtp.bench.topk_moe --only moe_knobs`) keep the bits: 8 warps in either
    kernel, other stages and grids (item_regs, PDL)."""
    st = split_stack
    S = st[0].shape[0] - 1
    g = torch.Generator(device=DEV).manual_seed(40 + T)
    x = torch.randn(T, st[0].shape[2], device=DEV, generator=g).bfloat16()
    w = torch.rand(T, 8, device=DEV, generator=g)
    kw = dict(out_dtype=torch.float32, layout="persistent", shared=True, pdl=2, item_regs=True, splits="waves")
    knobs = [dict(warps=(8, 4)), dict(warps=(4, 8)), dict(warps=(8, 8)), dict(gate_up_stages=6, down_stages=2),
             dict(programs=(132, 396), down_stages=3)]
    for name, ids in _routings(T, S, 8, g).items():
        poison()
        base = moe_experts(x, ids, w, *st, **kw)
        for k in knobs:
            assert torch.equal(moe_experts(x, ids, w, *st, **kw, **k), base), (name, k)


@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_item_regs_full_width_rank(T):
    """A contiguous rank's 32 experts of 256 at full width: 8 (one token) or 4 gate/up slices, 4 or 2 down slices of
    16 K groups; the default grids (more programs than gate/up items at one token) and 16 / 24 programs."""
    from .test_kernels_gpu import local_ids

    E_loc, D, I, J = 32, 7168, 2048, 8
    torch.manual_seed(T)
    ws = [*stacked(E_loc, I, D), *stacked(E_loc, I, D), *stacked(E_loc, D, I)]
    x = torch.randn(T, D, device=DEV).bfloat16()
    ids = local_ids(torch.stack([torch.randperm(256, device=DEV)[:J] for _ in range(T)]).int(), 0, E_loc)
    if not (ids[0] >= 0).any():
        ids[0, 0] = 3  # at least one local expert (ids stay distinct within the token: none of its others is local)
    w = torch.rand(T, J, device=DEV)
    for programs in (None, (16, 24)):
        kw = dict(out_dtype=torch.float32, layout="persistent", programs=programs)
        off = moe_experts(x, ids, w, *ws, **kw)
        assert torch.equal(moe_experts(x, ids, w, *ws, item_regs=True, **kw), off), programs


def test_item_regs_graph_replay(split_stack):
    """Two chained PDL calls (as consecutive MoE layers: the second's x is the first's output) captured with the switch
    on, replayed 12 times with new routings copied in: each replay equals the eager calls with it off."""
    if DEV != "cuda":
        pytest.skip("CUDA graphs")
    st = split_stack
    S = st[0].shape[0] - 1
    g = torch.Generator(device=DEV).manual_seed(7)
    T = 3
    x = torch.randn(T, st[0].shape[2], device=DEV, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(S, device=DEV, generator=g)[:8] for _ in range(T)]).int()
    w = torch.rand(T, 8, device=DEV, generator=g)
    kw = dict(out_dtype=torch.float32, layout="persistent", shared=True, splits="waves", pdl=2)

    def two(item_regs: bool) -> torch.Tensor:
        y = moe_experts(x, ids, w, *st, item_regs=item_regs, **kw)
        return moe_experts(y.bfloat16(), ids, w, *st, item_regs=item_regs, **kw)

    two(True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = two(True)
    for i in range(12):
        ids.copy_(_routings(T, S, 8, g)[("random", "skip", "same")[i % 3]])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, two(False)), i
