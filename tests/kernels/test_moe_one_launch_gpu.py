"""The persistent experts in one launch (`moe.moe_experts(one_launch=True)`, `kernels.moe_one_launch`) on the GPU
(pytest -m gpu), at one TP=8 'split' rank's shapes (256 routed experts + the shared one, each 256 wide, D = 7168):
bit for bit the three-launch persistent path, eagerly (1..4 tokens, with and without the shared slot, -1 slots, no
expert at all, `add`, 'waves' and default slices, the full grid and a 16-program one whose programs wait on many
others' items), CUDA-graph replays of two layers' calls (sharing the counter ring) with the routing rotated on each of
50 replays, and a PDL chain norm -> experts -> experts (bf16 between) against the same launches without PDL.
CPU twin (interpreter, one program): tests/kernels/test_moe_one_launch.py.
"""

from __future__ import annotations

import pytest
import torch

from mtp.kernels import available

pytestmark = pytest.mark.gpu
if not available():
    pytest.skip("needs triton and a CUDA device", allow_module_level=True)

from mtp.kernels.moe import moe_experts  # noqa: E402

from . import test_fused_kernels_gpu as fused  # noqa: E402
from .test_kernels_gpu import poison  # noqa: E402

split_rank_stack = fused.split_rank_stack  # the fixture: one TP=8 split rank's MoE stack, 1.4 GB of FP8

DEV = "cuda"


def _routing(T: int, S: int, g: torch.Generator, minus: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """8 distinct routed experts of the S a token (int32), routing weights; with `minus` token 0's slot 3 is -1."""
    ids = torch.stack([torch.randperm(S, device=DEV, generator=g)[:8] for _ in range(T)]).int()
    if minus:
        ids[0, 3] = -1
    return ids, torch.rand(T, 8, device=DEV, generator=g)


@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_one_launch_equals_three_launches(split_rank_stack, T):
    st = split_rank_stack
    S = st[0].shape[0] - 1
    g = torch.Generator(device=DEV).manual_seed(10 + T)
    x = torch.randn(T, 7168, device=DEV, generator=g).bfloat16()
    ids, w = _routing(T, S, g)
    add = torch.randn(T, 7168, device=DEV, generator=g)
    for shared in (True, False):
        for splits in ("waves", None):
            for a in (None, add):
                for programs in (None, (16, 32)):  # 'waves' sizes the slices on these grids: both paths alike
                    kw = dict(layout="persistent", shared=shared, splits=splits, add=a, out_dtype=torch.float32,
                              programs=programs)
                    poison()
                    want = moe_experts(x, ids, w, *st, **kw)
                    got = moe_experts(x, ids, w, *st, one_launch=True, **kw)
                    assert torch.equal(got, want), (T, shared, splits, a is not None, programs,
                                                    (got - want).abs().max().item())
    none = torch.full((T, 8), -1, dtype=torch.int32, device=DEV)  # no expert at all: nobody arrives, y = add
    got = moe_experts(x, none, w, *st, layout="persistent", add=add, one_launch=True, out_dtype=torch.float32)
    assert torch.equal(got, add)
    yb = moe_experts(x, ids, w, *st, layout="persistent", shared=True, one_launch=True)  # bf16, as x
    assert yb.dtype == torch.bfloat16 and torch.equal(yb, moe_experts(x, ids, w, *st, layout="persistent",
                                                                      shared=True))


@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_one_launch_graph_replays(split_rank_stack, T):
    """Two layers' calls in one graph (the same counter ring: each call leaves its counters at 0), replayed 50 times
    with a new routing each time: every replay equals the three-launch path's eager call on that routing."""
    st = split_rank_stack
    S = st[0].shape[0] - 1
    g = torch.Generator(device=DEV).manual_seed(100 + T)
    x = torch.randn(T, 7168, device=DEV, generator=g).bfloat16()
    ids, w = _routing(T, S, g)
    ids2, w2 = _routing(T, S, g, minus=False)
    kw = dict(layout="persistent", shared=True, splits="waves", out_dtype=torch.float32)

    def two_layers():
        y1 = moe_experts(x, ids, w, *st, one_launch=True, **kw)
        return y1, moe_experts(x, ids2, w2, *st, one_launch=True, add=y1, **kw)

    two_layers()  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y1, y2 = two_layers()
    for r in range(50):
        for dst, src in zip((ids, w, ids2, w2), (*_routing(T, S, g, r % 2 == 0), *_routing(T, S, g, r % 3 == 0))):
            dst.copy_(src)
        graph.replay()
        want1 = moe_experts(x, ids, w, *st, **kw)
        want2 = moe_experts(x, ids2, w2, *st, add=want1, **kw)
        torch.cuda.synchronize()
        assert torch.equal(y1, want1) and torch.equal(y2, want2), (T, r)


def test_one_launch_pdl_chain(split_rank_stack):
    """norm -> experts (bf16 out) -> experts, each launched with PDL (one token, as the decode step does), equals the
    plain launches' bits, eagerly and on 10 replays: the one-launch kernel triggers its successor first, so the
    next launch may start while its programs spin; it waits before touching their outputs."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs Hopper")
    from mtp.kernels.norm_quant import add_rms_norm_quant

    st = split_rank_stack
    S = st[0].shape[0] - 1
    g = torch.Generator(device=DEV).manual_seed(7)
    D = 7168
    h = torch.randn(1, D, device=DEV, generator=g)
    d = torch.randn(1, D, device=DEV, generator=g).bfloat16()
    wn = (torch.rand(D, device=DEV, generator=g) + 0.5).bfloat16()
    ids, w = _routing(1, S, g)
    ids2, w2 = _routing(1, S, g, minus=False)
    kw = dict(layout="persistent", shared=True, splits="waves", one_launch=True)

    def chain(pdl):
        hn, y, _, _ = add_rms_norm_quant(h, d, wn, 1e-6, pdl=pdl)
        a = moe_experts(y, ids, w, *st, pdl=pdl, **kw)
        return hn, a, moe_experts(a, ids2, w2, *st, pdl=pdl, out_dtype=torch.float32, **kw)

    want = chain(False)
    got = chain(True)
    assert all(torch.equal(u, v) for u, v in zip(want, got))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cap = chain(True)
    for _ in range(10):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(u, v) for u, v in zip(want, cap))
