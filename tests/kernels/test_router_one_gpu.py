"""The router with one arrival (`router.moe_route_fused(impl="one")`) on the GPU (pytest -m gpu), bf16 at DeepSeek's
shapes (E = 256, D = 7168, 8 groups, 4 kept, top 8):
- logits bit for bit `one_logits_ref` (bf16 products are exact in fp32, so the kernel's FMAs change nothing) at
  T = 1..16, at 4 and 8 warps, 2 and 4 experts per program and 1..4 tokens a pass, and the fp32 product at the other
  router tests' tolerance;
- the choice on them: ids torch.equal to `route_from_logits_ref` on the kernel's own logits, weights to fp32 rounding
  (its sigmoid and normalizing sum are the kernel's, not torch's); where the logits are equal (integer-valued inputs:
  every order sums them exactly) the grouped impl's logits and ids bit for bit and its weights to fp32 rounding (the
  normalizing sum's order is the compiler's per layout: grouped vs serial differed in the last bits too);
- ties (x = 0, the bias in steps of 0.25); an expert-parallel rank's range and table;
- PDL (trigger at the start / after the wait) eager and chained after a norm in a CUDA graph, and plain graph replays
  with new inputs copied in each time (the arrival counter re-armed by the last program), against eager.
CPU twin (the interpreter; sm_90 compile checks): tests/kernels/test_router_one.py.
MTP_TEST_DEVICE=cpu with TRITON_INTERPRET=1 dry-runs the kernel tests on the CPU (slow; no graphs).
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

from mtp.kernels.dispatch import expert_map, local_ids  # noqa: E402
from mtp.kernels.router import moe_route_fused, one_logits_ref, route_from_logits_ref  # noqa: E402

from .test_kernels_gpu import check_close, poison  # noqa: E402

E, D = 256, 7168


def _needs_cuda() -> None:
    if DEV != "cuda":
        pytest.skip("CUDA graphs and PDL")


def _inputs(T: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(T, D, device=DEV, generator=g).bfloat16()
    wg = (torch.randn(E, D, device=DEV, generator=g) * 0.02).bfloat16()
    return x, wg, torch.randn(E, device=DEV, generator=g) * 0.05


@pytest.mark.parametrize("T", range(1, 17))
def test_logits_and_choice(T):
    x, wg, bias = _inputs(T, T)
    ref = one_logits_ref(x, wg)
    poison()
    w, idx, lg = moe_route_fused(x, wg, bias, return_logits=True, impl="one")
    assert torch.equal(lg, ref), f"logits differ from one_logits_ref by {(lg - ref).abs().max().item():.3e}"
    check_close("logits vs the fp32 product", lg, x.float() @ wg.float().t(), 1e-5)
    for nw, be, tb in ((4, 2, 1), (8, 4, 2), (8, 2, 4), (4, 4, 1)):  # the same bits at any warps, tile, pass
        got = moe_route_fused(x, wg, bias, return_logits=True, impl="one", num_warps=nw, block_e=be, tokens_per_pass=tb)
        assert torch.equal(got[2], lg) and torch.equal(got[1], idx), (nw, be, tb)
        check_close(f"weights at {nw} warps", got[0], w, 1e-6)
    wr, ir = route_from_logits_ref(lg, bias)  # the same logits: the same choice exactly
    bad = torch.nonzero((idx != ir).any(1)).flatten().tolist()
    assert not bad, f"experts differ in tokens {bad}"
    check_close("weights", w, wr, 1e-6)


@pytest.mark.parametrize("T", [1, 2, 4, 8, 16])
def test_equal_logits_give_the_grouped_choice(T):
    """Integer-valued x and W (W in steps of 2^-6, bf16-exact): every product and partial sum is exact in fp32, so the
    split-K sums and the pair tree give the same logits, and the ids must be the grouped impl's."""
    g = torch.Generator(device=DEV).manual_seed(100 + T)
    x = torch.randint(-4, 5, (T, D), device=DEV, generator=g).bfloat16()
    wg = (torch.randint(-4, 5, (E, D), device=DEV, generator=g).float() / 64).bfloat16()
    bias = torch.randn(E, device=DEV, generator=g) * 0.05
    grouped = moe_route_fused(x, wg, bias, return_logits=True, impl="grouped")
    for nw in (4, 8):
        one = moe_route_fused(x, wg, bias, return_logits=True, impl="one", num_warps=nw)
        assert torch.equal(one[2], grouped[2]) and torch.equal(one[1], grouped[1]), nw
        check_close(f"weights vs grouped, {nw} warps", one[0], grouped[0], 1e-6)


def test_ties():
    """Every gate logit 0 (x = 0) and the bias in steps of 0.25: equal experts and equal groups everywhere; the lower
    index wins at every step, as the reference's stable sorts."""
    x = torch.zeros(16, D, device=DEV).bfloat16()
    wg = (torch.randn(E, D, device=DEV) * 0.02).bfloat16()
    bias = torch.randint(0, 3, (E,), device=DEV).float() * 0.25
    wr, ir = route_from_logits_ref(torch.zeros(16, E, device=DEV), bias)
    for T in (1, 5, 16):
        for nw in (4, 8):
            w, idx = moe_route_fused(x[:T], wg, bias, impl="one", num_warps=nw)
            assert torch.equal(idx, ir[:T]), (T, nw)
            check_close(f"tied weights T={T} {nw} warps", w, wr[:T], 1e-6)


@pytest.mark.parametrize("T", [1, 3, 8])
def test_local_ids(T):
    x, wg, bias = _inputs(T, 200 + T)
    w, idx = moe_route_fused(x, wg, bias, impl="one")
    wl, il = moe_route_fused(x, wg, bias, local=(64, 96), impl="one")  # an expert-parallel rank's range
    assert torch.equal(wl, w) and torch.equal(il, torch.where((idx >= 64) & (idx < 96), idx - 64, -1))
    table = expert_map(sorted(set(range(1, E, 3)) | {0, E - 1}), E, DEV).router  # scattered experts
    wt, it = moe_route_fused(x, wg, bias, local=table, impl="one")
    assert torch.equal(wt, w) and torch.equal(it, local_ids(idx, table))


@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("T", [1, 4])
def test_pdl_eager_and_chained_in_a_graph(T, mode):
    """PDL (mode 1: the trigger at the start; 2: after the wait): the same bits as without, eagerly and chained after
    the norm that makes its input, on 20 graph replays (the counter re-armed by each last program)."""
    _needs_cuda()
    from mtp.decode.graphs import capture_graph
    from mtp.kernels.norm_quant import add_rms_norm_quant

    x, wg, bias = _inputs(T, 300 + T)
    want = moe_route_fused(x, wg, bias, return_logits=True, impl="one")
    got = moe_route_fused(x, wg, bias, return_logits=True, impl="one", pdl=mode)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    h = torch.randn(T, D, device=DEV)
    wn = (torch.rand(D, device=DEV) + 0.5).bfloat16()

    def chain(pdl):
        y = add_rms_norm_quant(h, None, wn, 1e-6, pdl=pdl)[1]
        return moe_route_fused(y, wg, bias, return_logits=True, impl="one", pdl=pdl)

    plain = chain(False)
    box = {}
    graph = capture_graph(lambda: box.__setitem__("out", chain(mode)))
    for i in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(box["out"], plain)), f"replay {i}"


def test_graph_replays_with_new_inputs():
    """Captured once, replayed with new tokens copied into its input: each replay equals an eager call on them (the
    arrival counter re-armed by the last program, the logits buffer rewritten)."""
    _needs_cuda()
    x, wg, bias = _inputs(3, 400)
    static = x.clone()
    moe_route_fused(static, wg, bias, impl="one")  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_route_fused(static, wg, bias, return_logits=True, impl="one")
    for i in range(5):
        static.copy_(_inputs(3, 401 + i)[0])
        graph.replay()
        torch.cuda.synchronize()
        want = moe_route_fused(static, wg, bias, return_logits=True, impl="one")
        assert all(torch.equal(a, b) for a, b in zip(out, want)), f"replay {i}"
