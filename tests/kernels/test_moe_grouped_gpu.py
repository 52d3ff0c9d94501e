"""The grouped routed-expert layout (`mtp.kernels.moe_grouped`, `moe_experts(layout='grouped')`) on the GPU at
DeepSeek-V3.2's widths (D = 7168, I = 2048): against the reference, element by element within what FP8
re-rounding flips of h can explain (`moe_flip_bound`: the FP8 MMA's reduced-precision accumulation moves h by
~1e-4 relative, which can land an h element on the neighbouring e4m3 code), run to run bit-identical, captured in a
CUDA graph, one rank's -1 slots equal to the full stack's masked result, and `FastMoE` at T = 40, 96 and 300
(grouped kernels; the router in 64-token chunks, or the reference router) against the reference module.
Run: pytest -m gpu tests/kernels/test_moe_grouped_gpu.py (the `slow` cases: T = 1024).
"""

from __future__ import annotations

import os

import pytest
import torch

from mtp.kernels import available

pytestmark = pytest.mark.gpu
DEV = os.environ.get("MTP_TEST_DEVICE", "cuda")
if not available():
    pytest.skip("needs triton and a CUDA device", allow_module_level=True)

from mtp.kernels.moe import moe_experts, moe_experts_ref  # noqa: E402
from mtp.kernels.moe_grouped import moe_align, moe_align_ref  # noqa: E402

from .test_kernels_gpu import check_close, distinct_topk, local_ids, moe_flip_bound, poison, stacked  # noqa: E402

E_ALL, D, I, J = 256, 7168, 2048, 8
_WEIGHTS: list[torch.Tensor] = []


def weights(E: int) -> list[torch.Tensor]:
    """The first E of 256 random FP8 experts (built once: 11 GB), contiguous slices of the stacks."""
    if not _WEIGHTS:
        torch.manual_seed(0)
        _WEIGHTS.extend([*stacked(E_ALL, I, D, 0.02), *stacked(E_ALL, I, D, 0.02), *stacked(E_ALL, D, I, 0.02)])
    return [w[:E] for w in _WEIGHTS]


def check_flip_bound(name: str, y: torch.Tensor, x, idx, rw, ws) -> None:
    y64, bound = moe_flip_bound(x, idx, rw, *ws)
    err = (y.double() - y64).abs()
    slack = bound + 2e-3 * y64.abs().max()
    assert bool((err <= slack).all()), (f"{name}: {int((err > slack).sum())} outputs beyond the fp8-flip bound; "
                                        f"worst excess {(err - slack).max().item():.3e}")


CASES = [pytest.param(T, E, marks=pytest.mark.slow) if T >= 1024 else (T, E)
         for T in (24, 64, 96, 256, 1024) for E in (32, 256)]


@pytest.mark.parametrize("T,E", CASES)
def test_grouped_vs_reference(T, E):
    """E = 256: one GPU holding every expert (TP=1); E = 32: one rank of TP=8, ~7/8 of the slots -1."""
    torch.manual_seed(T)
    ws = weights(E)
    x = torch.randn(T, D, device=DEV).bfloat16()
    idx = local_ids(distinct_topk(T, E_ALL, J, share=True), 0, E)
    rw = torch.rand(T, J, device=DEV)
    rows, blk_e, nblk = moe_align(idx, E, 16)
    assert (rows[:int(nblk) * 16].tolist(), blk_e[:int(nblk)].tolist()) == moe_align_ref(idx, E, 16)
    poison()
    y = moe_experts(x, idx, rw, *ws, out_dtype=torch.float32, layout="grouped")
    assert torch.equal(y, moe_experts(x, idx, rw, *ws, out_dtype=torch.float32, layout="grouped")), "not deterministic"
    check_flip_bound(f"grouped T={T} E={E}", y, x, idx, rw, ws)
    check_close(f"grouped T={T} E={E} (fp32 reference)", y, moe_experts_ref(x, idx, rw, *ws, out_dtype=torch.float32),
                0.05)
    if T <= 64:
        check_close(f"grouped T={T} E={E} vs pairs", y,
                    moe_experts(x, idx, rw, *ws, out_dtype=torch.float32, layout="pairs"), 2e-2)
    for bm in (32, 64, 128):  # every M-block: the same formulas (flip-level differences only)
        check_close(f"grouped T={T} E={E} block_m={bm}", y,
                    moe_experts(x, idx, rw, *ws, out_dtype=torch.float32, layout="grouped", block_m=bm), 2e-2)


@pytest.mark.parametrize("T", [24, 96])
def test_grouped_minus_one_slots_and_graph(T):
    """One rank of two (experts [0, 100) and [100, 256)): bit-equal to the full stack with the other rank's slots
    zeroed, a token with no local expert gets exactly 0, the ranks sum to the full result; a captured call replays
    to the eager bits, also after the routing changed in place (the sort runs on the device at every replay)."""
    ws = weights(E_ALL)
    torch.manual_seed(7)
    x = torch.randn(T, D, device=DEV).bfloat16()
    idx = distinct_topk(T, E_ALL, J, share=True)
    idx[3] = torch.randperm(E_ALL - 100, device=DEV)[:J].int() + 100  # no expert of rank 0
    rw = torch.rand(T, J, device=DEV)
    kw = dict(out_dtype=torch.float32, layout="grouped")
    full = moe_experts(x, idx, rw, *ws, **kw)
    parts = []
    for e0, e1 in ((0, 100), (100, 256)):
        loc = local_ids(idx, e0, e1)
        poison()
        y = moe_experts(x, loc, rw, *[w[e0:e1] for w in ws], **kw)
        assert torch.equal(y, moe_experts(x, idx, rw * (loc >= 0), *ws, **kw)), f"[{e0}, {e1}): not the masked stack"
        if e0 == 0:
            assert torch.equal(y[3], torch.zeros(D, device=DEV)), "a token without local experts must get exactly 0"
        parts.append(y)
    check_close(f"grouped T={T}: sum over ranks", parts[0] + parts[1], full, 1e-6)
    loc = local_ids(idx, 0, 32)
    a = moe_experts(x, loc, rw, *weights(32), **kw)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = moe_experts(x, loc, rw, *weights(32), **kw)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, a)
    for s in range(3):
        torch.manual_seed(100 + s)
        loc.copy_(local_ids(distinct_topk(T, E_ALL, J, share=False), 0, 32))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, moe_experts(x, loc, rw, *weights(32), **kw)), f"replay {s}"


def _real_moe(seed: int):
    """A float32 MoE at DeepSeek's widths with 32 routed experts (8 groups of 4, top-4 groups, 8 per token) and
    its shared expert, random FP8 weights, built on the GPU."""
    from mtp.model.fp8 import weight_quant
    from mtp.model.layers import Linear
    from mtp.model.moe import MoE
    from mtp.model.presets import real_config

    cfg = real_config(layers=2, n_routed_experts=32, n_group=8, topk_group=4, num_experts_per_tok=8)
    g = torch.Generator(device=DEV).manual_seed(seed)
    with torch.device(DEV):
        moe = MoE(cfg, torch.float32)
    for lin in moe.modules():
        if isinstance(lin, Linear):
            w8, s = weight_quant(torch.randn(lin.out_features, lin.in_features, device=DEV, generator=g)
                                 * lin.in_features ** -0.5)
            lin.weight = torch.nn.Parameter(w8, requires_grad=False)
            lin.weight_scale_inv = torch.nn.Parameter(s, requires_grad=False)
    moe.gate.weight.data = torch.randn(moe.gate.weight.shape, device=DEV, generator=g) * cfg.hidden_size ** -0.5
    moe.gate.e_score_correction_bias.data = torch.randn(cfg.n_routed_experts, device=DEV, generator=g) * 0.05
    return moe, cfg


@pytest.mark.parametrize("T", [40, 96, 300])
def test_fast_moe_grouped_vs_reference_module(T):
    """`FastMoE` (T = 40: one router launch; 96: two, the router kernels take <= 64 tokens; 300: the reference
    router, past `kernel_route_tokens`; all on the grouped experts) against the reference `MoE` on the same
    weights, one process and 2 expert-parallel ranks summed; chunked experts (max_tokens = 32 / 257) equal to one
    call, bit for bit."""
    from mtp.backends.fast_path import FastMoE, disable_fast_path, fast_module

    from ..parallel.test_moe_ep import ep_modules

    moe, cfg = _real_moe(seed=T)
    x = torch.randn(T, cfg.hidden_size, device=DEV, generator=torch.Generator(device=DEV).manual_seed(1))
    with torch.no_grad():
        for world in (1, 2):
            with torch.device(DEV):
                mods = [moe] if world == 1 else ep_modules(moe, cfg, world)
            for m in mods:
                disable_fast_path(m)
            want = sum(m(x) for m in mods)
            for m in mods:
                fast_module(m)
                assert isinstance(m, FastMoE) and T > m.grouped_above
            got = sum(m(x) for m in mods)
            check_close(f"FastMoE T={T} world={world}", got, want, 2e-2)
            for m in mods:
                m.max_tokens = 32 if T <= 256 else 257  # chunks whose M-block (`default_block_m`) is one call's
            chunked = sum(m(x) for m in mods)
            for m in mods:
                del m.max_tokens
            assert torch.equal(chunked, got), f"T={T} world={world}: chunks changed the bits"
        disable_fast_path(moe)
