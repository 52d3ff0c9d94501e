"""The persistent experts' down projection as one flattened loop (`moe_experts(down_flat=True)`,
`mtp.kernels.moe_down_flat`) against the item loop it replaces, on the GPU (pytest -m gpu): bit for bit, eagerly
and in a CUDA graph's replay. Shapes: one TP=8 'split' rank's stack (256 routed slices + the shared one, I = 256,
D = 7168) at 1..4 tokens as the fast path calls it, and with other K slices, -1 slots, a contiguous rank's ids and
PDL; and a few experts of the full width (I = 2048: 16 K groups, 4 slices) as an expert-parallel range runs them.
Outputs are allocated from a NaN-poisoned pool (`poison`), so an element either kernel fails to write shows.
CPU twin (interpreter, small shapes; the sm_90 pipelining): tests/kernels/test_moe_down_flat.py.
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

from .test_kernels_gpu import poison, stacked  # noqa: E402


@pytest.fixture(scope="module")
def split_rank_stack():
    """One MoE layer's stack on a TP=8 'split' rank: 256 routed slices + the shared one (last), each 256 wide of
    DeepSeek-V3.2's 2048, D = 7168 (1.4 GB of FP8): [w_gate, s_gate, w_up, s_up, w_down, s_down]."""
    E, D, I = 257, 7168, 256
    return [t for N, K in ((I, D), (I, D), (D, I)) for t in stacked(E, N, K, std=0.02)]


def _same(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert not want.isnan().any(), f"{name}: the item loop left NaN (unwritten) outputs"
    assert torch.equal(got, want), f"{name}: {int((got != want).sum())} outputs differ, max " \
                                   f"{(got - want).abs().max().item():.3e}"


def _graph_equal(name: str, call) -> None:
    """call() captured in a CUDA graph and replayed equals the eager call (no host sync, static grid)."""
    if DEV != "cuda":
        return
    eager = call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    graph.replay()
    torch.cuda.synchronize()
    _same(f"{name} graph replay", out, eager)


@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_down_flat_split_rank(split_rank_stack, T):
    """A TP=8 split rank's experts (8 routed + the shared slot a token): the fast path's call (persistent,
    splits='waves': 1 down slice; PDL at one token), the default slices (4 / 2 down slices), -1 slots and no shared
    slot, a contiguous rank's ids (1-2 local experts, the other slots -1): down_flat gives the item loop's bits."""
    st = split_rank_stack
    S = st[0].shape[0] - 1
    g = torch.Generator(device=DEV).manual_seed(10 + T)
    x = torch.randn(T, 7168, device=DEV, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(S, device=DEV, generator=g)[:8] for _ in range(T)]).int()
    holes = ids.clone()
    holes[:, 1::3] = -1  # slots on other ranks
    few = torch.full_like(ids, -1)
    few[:, 0] = 3
    few[T - 1, 5] = 17  # a contiguous rank's view: two local experts
    w = torch.rand(T, 8, device=DEV, generator=g)
    kw = dict(out_dtype=torch.float32, layout="persistent")
    cases = [("waves shared", ids, dict(splits="waves", shared=True)),
             ("default shared", ids, dict(shared=True)),
             ("holes", holes, dict()),
             ("holes waves shared", holes, dict(splits="waves", shared=True)),
             ("contiguous shared", few, dict(shared=True))]
    if T == 1:
        cases.append(("waves shared pdl", ids, dict(splits="waves", shared=True, pdl=True)))
    for name, idx, opt in cases:
        poison()
        want = moe_experts(x, idx, w, *st, **opt, **kw)
        poison()
        got = moe_experts(x, idx, w, *st, down_flat=True, **opt, **kw)
        _same(f"T={T} {name}", got, want)
    _graph_equal(f"T={T}", lambda: moe_experts(x, ids, w, *st, splits="waves", shared=True, down_flat=True, **kw))


@pytest.mark.parametrize("T", [1, 4])
def test_down_flat_full_width(T):
    """8 experts of DeepSeek-V3.2's full width (I = 2048: 16 K groups a work item, 4 or 2 slices of 4 or 8 groups),
    as an expert-parallel range holds them, most slots -1: the same bits as the item loop, also with 3 slices (the
    last one 4 groups short) and in a graph's replay."""
    E, D, I = 8, 7168, 2048
    gw, sg = stacked(E, I, D)
    uw, su = stacked(E, I, D)
    dw, sd = stacked(E, D, I)
    st = (gw, sg, uw, su, dw, sd)
    g = torch.Generator(device=DEV).manual_seed(T)
    x = torch.randn(T, D, device=DEV, generator=g).bfloat16()
    idx = torch.full((T, 8), -1, dtype=torch.int32, device=DEV)
    idx[:, 2] = torch.randint(0, E, (T,), device=DEV, generator=g).int()
    idx[0, 6] = (idx[0, 2] + 1) % E
    w = torch.rand(T, 8, device=DEV, generator=g)
    kw = dict(out_dtype=torch.float32, layout="persistent")
    for splits in (None, (4, 3)):
        poison()
        want = moe_experts(x, idx, w, *st, splits=splits, **kw)
        poison()
        _same(f"T={T} splits={splits}", moe_experts(x, idx, w, *st, splits=splits, down_flat=True, **kw), want)
    _graph_equal(f"T={T} full width", lambda: moe_experts(x, idx, w, *st, down_flat=True, **kw))
