"""The fused decode kernels vs their plain-PyTorch references on the GPU (pytest -m gpu):
`gemv_splitk.fp8_gemv`, `norm_quant.add_rms_norm_quant`, `router.moe_route_fused`, and the fast path with the
new kernels switched on vs off (`kernels.dispatch.FastPathOptions`). Shapes: the TP=8 per-rank weights of
DeepSeek-V3.2 and odd ones; rows 1..5 (verify widths 1..K+1 for K = 4) and 8.
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

from mtp.model.fp8 import act_quant as act_quant_ref  # noqa: E402
from mtp.model.fp8 import weight_quant  # noqa: E402
from mtp.kernels.dispatch import FastPathOptions, linear  # noqa: E402
from mtp.kernels.gemv_splitk import fp8_gemv, fp8_gemv_ref  # noqa: E402
from mtp.kernels.moe import moe_route  # noqa: E402
from mtp.kernels.norm_quant import add_rms_norm_quant, add_rms_norm_quant_ref  # noqa: E402
from mtp.kernels.router import moe_route_fused, route_from_logits_ref  # noqa: E402

from .test_kernels_gpu import check_close, poison, rand_weight  # noqa: E402

# (N, K): q_a | wk | kv_a, q_b | wq_b (16 heads), o_proj (16 heads), shared gate | up and down (2 blocks),
# dense gate | up and down (18 blocks), kv_a alone, and odd ones (ragged scale block, K of 3 / 5 groups)
RANK_SHAPES = [(2240, 7168), (11264, 1536), (7168, 2048), (512, 7168), (7168, 256), (4608, 7168), (7168, 2304),
               (576, 7168)]
ODD_SHAPES = [(200, 384), (1000, 640), (130, 7168)]
WIDTHS = [1, 2, 3, 4, 5, 8]


@pytest.mark.parametrize("M", WIDTHS)
@pytest.mark.parametrize("NK", RANK_SHAPES + ODD_SHAPES)
def test_fp8_gemv(M, NK):
    N, K = NK
    w8, sw = rand_weight(N, K)
    x = (torch.randn(M, K, device=DEV) * torch.logspace(-3, 1, K, device=DEV)).bfloat16()
    xq = act_quant_ref(x)
    poison()
    y = fp8_gemv(None, w8, sw, xq=xq)
    check_close(f"fp8_gemv M={M} N={N} K={K}", y, fp8_gemv_ref(None, w8, sw, xq=xq), 1e-4)
    # in-register quantization is bit-identical to act_quant, so the two inputs give the same bits
    assert torch.equal(fp8_gemv(x, w8, sw, out_dtype=torch.float32), y)
    yb = fp8_gemv(x, w8, sw)
    assert yb.dtype == torch.bfloat16
    check_close(f"fp8_gemv bf16 M={M} N={N} K={K}", yb.float(), fp8_gemv_ref(x, w8, sw).float(), 1e-2)


@pytest.mark.parametrize("M", WIDTHS)
@pytest.mark.parametrize("NK", [(7168, 2048), (200, 2048), (1000, 1024)])
def test_fp8_gemv_one_slice(M, NK):
    """`gemv_plan`'s one slice (FastPathOptions.gemv_one_slice: K / 128 a power of two above 8, no fix-up) against
    the reference, x pre-quantized and quantized in the kernel (the same bits), and against the split plan; K = 1024
    (8 groups) keeps the split plan's tile."""
    N, K = NK
    w8, sw = rand_weight(N, K)
    x = (torch.randn(M, K, device=DEV) * torch.logspace(-3, 1, K, device=DEV)).bfloat16()
    xq = act_quant_ref(x)
    poison()
    y = fp8_gemv(None, w8, sw, xq=xq, one_slice=16)
    check_close(f"fp8_gemv one slice M={M} N={N} K={K}", y, fp8_gemv_ref(None, w8, sw, xq=xq), 1e-4)
    assert torch.equal(fp8_gemv(x, w8, sw, out_dtype=torch.float32, one_slice=16), y)
    check_close(f"fp8_gemv one slice vs split M={M} N={N} K={K}", y, fp8_gemv(None, w8, sw, xq=xq), 1e-5)


# TP=1 full width: q_b | wq_b, o_proj, dense gate | up (stacked) and down, shared gate | up, an expert's down
TP1_SHAPES = [(32768, 1536), (7168, 16384), (36864, 7168), (7168, 18432), (4096, 7168), (7168, 2048)]


@pytest.mark.parametrize("M", list(range(1, 9)))
@pytest.mark.parametrize("NK", RANK_SHAPES + ODD_SHAPES)
def test_fp8_gemv_mma(M, NK):
    """The tensor-core variant (mma=True) against the reference, pre-quantized and quantized in the kernel
    (the same bits), fp32 and bf16 out; its fp32 MMA sums a group in its own order: the old tensor-core
    kernel's tolerance (tests/kernels/test_kernels_gpu.py: 1e-3)."""
    N, K = NK
    w8, sw = rand_weight(N, K)
    x = (torch.randn(M, K, device=DEV) * torch.logspace(-3, 1, K, device=DEV)).bfloat16()
    xq = act_quant_ref(x)
    poison()
    y = fp8_gemv(None, w8, sw, xq=xq, mma=True)
    check_close(f"fp8_gemv mma M={M} N={N} K={K}", y, fp8_gemv_ref(None, w8, sw, xq=xq), 1e-3)
    assert torch.equal(fp8_gemv(x, w8, sw, out_dtype=torch.float32, mma=True), y)
    yb = fp8_gemv(x, w8, sw, mma=True)
    assert yb.dtype == torch.bfloat16
    check_close(f"fp8_gemv mma bf16 M={M} N={N} K={K}", yb.float(), fp8_gemv_ref(x, w8, sw).float(), 1e-2)


@pytest.mark.parametrize("M", [1, 2, 4, 8])
@pytest.mark.parametrize("NK", TP1_SHAPES)
def test_fp8_gemv_full_width(M, NK):
    """Both variants on the TP=1 weights (the shapes where the CUDA-core one lost to the old kernel)."""
    N, K = NK
    w8, sw = rand_weight(N, K)
    xq = act_quant_ref(torch.randn(M, K, device=DEV).bfloat16())
    ref = fp8_gemv_ref(None, w8, sw, xq=xq)
    poison()
    for mma, tol in ((False, 1e-4), (True, 1e-3)):
        check_close(f"fp8_gemv mma={mma} M={M} N={N} K={K}", fp8_gemv(None, w8, sw, xq=xq, mma=mma), ref, tol)


FMA_TILES = [dict(bn=8, gps=1), dict(bn=64, gps=2), dict(bn=16, gps=8, num_warps=4), dict(bn=128, gps=8)]
MMA_TILES = [dict(bn=16, gps=8), dict(bn=32, gps=4), dict(bn=64, gps=2, num_warps=4), dict(bn=128, gps=1)]


@pytest.mark.parametrize("mma, tune", [(False, t) for t in FMA_TILES] + [(True, t) for t in MMA_TILES])
def test_fp8_gemv_tiles(mma, tune):
    M, N, K = 5 if mma else 3, 2240, 7168
    w8, sw = rand_weight(N, K)
    xq = act_quant_ref(torch.randn(M, K, device=DEV))
    poison()
    y = fp8_gemv(None, w8, sw, xq=xq, mma=mma, **tune)
    check_close(f"fp8_gemv mma={mma} {tune}", y, fp8_gemv_ref(None, w8, sw, xq=xq), 1e-3 if mma else 1e-4)


def _needs_cuda():
    if DEV != "cuda":
        pytest.skip("CUDA graphs")


@pytest.mark.parametrize("mma", [False, True])
def test_fp8_gemv_deterministic_and_graph_safe(mma):
    _needs_cuda()
    w8, sw = rand_weight(2240, 7168)
    x = torch.randn(4, 7168, device=DEV).bfloat16()
    a = fp8_gemv(x, w8, sw, out_dtype=torch.float32, mma=mma)
    for _ in range(3):  # the split-K counters re-arm themselves: repeated launches agree bit for bit
        assert torch.equal(a, fp8_gemv(x, w8, sw, out_dtype=torch.float32, mma=mma))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = fp8_gemv(x, w8, sw, out_dtype=torch.float32, mma=mma)
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(a, y)


@pytest.mark.parametrize("M", [1, 4, 9, 40])
def test_dispatch_linear_switch(M):
    """`linear` takes the new GEMV for 1..gemv_rows rows when switched on, the old kernels otherwise; both agree."""
    w8, sw = rand_weight(1000, 1536)
    x = torch.randn(M, 1536, device=DEV).bfloat16()
    xq = act_quant_ref(x)
    ref = fp8_gemv_ref(x, w8, sw, out_dtype=torch.float32)
    outs = []
    for on in (True, False):
        o = FastPathOptions(gemv=on)
        outs += [linear(x, w8, sw, o, out_dtype=torch.float32), linear(None, w8, sw, o, xq=xq),
                 linear(x, w8, sw, o, out_dtype=torch.float32, xq=xq)]
    for i, y in enumerate(outs):
        check_close(f"linear #{i} M={M}", y, ref, 1e-3)


# ----------------------------------------------------------------------------- add + RMSNorm + quant
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 33])
@pytest.mark.parametrize("D", [7168, 1536, 640])
def test_add_rms_norm_quant(M, D):
    h = torch.randn(M, D, device=DEV) * torch.logspace(-2, 2, D, device=DEV)
    d = torch.randn(M, D, device=DEV).bfloat16()
    w = (torch.rand(D, device=DEV) + 0.5).bfloat16()
    poison()
    hn, y, x8, sx = add_rms_norm_quant(h, d, w, 1e-6)
    rh, ry, _, _ = add_rms_norm_quant_ref(h, d, w, 1e-6)
    assert torch.equal(hn, rh), "the residual add must be bit-identical to the reference's"
    diff = (y.float() - ry.float()).abs()
    ulp = ry.float().abs() * 2 ** -7
    assert bool((diff <= ulp).all()), f"y off by more than a bf16 ulp: {diff.max().item():.3e}"
    assert (diff > 0).float().mean() < 0.01, "more than 1% of y differs from the reference's rounding"
    k8, ks = act_quant_ref(y)  # bit-exact quantization of what it stored
    assert torch.equal(sx, ks) and torch.equal(x8.view(torch.uint8), k8.view(torch.uint8))
    qa = (torch.randn(M, D, device=DEV) * 0.3).bfloat16()  # the q_a norm: bf16 in, only the quantized y out
    _, none, q8, qs = add_rms_norm_quant(qa, None, w, 1e-6, store_y=False)
    _, ry2, _, _ = add_rms_norm_quant_ref(qa, None, w, 1e-6)
    r8, rs = act_quant_ref(ry2)
    assert none is None
    assert (q8.view(torch.uint8) != r8.view(torch.uint8)).float().mean() < 0.01 and (qs == rs).float().mean() > 0.99


@pytest.mark.parametrize("warps", [None, 4, 8, 16, 32])
@pytest.mark.parametrize("D", [7168, 4096, 1536])
def test_add_rms_norm_quant_warps(D, warps):
    """The norm at each warp count `FastPathOptions.norm_warps` may give a model-width row (None: `row_tiles`', 32
    warps from 32 groups of 128, 4 below), on the launches of a decode step (a bf16 delta; an fp32 sum rounded to bf16
    in the kernel; no delta): the residual add bit-equal to the reference's, y within a bf16 ulp of it (the warps set
    the sum of squares' order), the quant bit-exact on what it stored; bit-equal to itself across calls, and row by row
    across widths 1 / 4 / 5 (one program a row: a verify's rows get a decode step's bits, as strict spec-vs-greedy
    decoding needs). None equals row_tiles' count given explicitly."""
    from mtp.kernels.norm_quant import row_tiles

    g = torch.Generator(device=DEV).manual_seed(D + (warps or 0))
    M = 5
    h = torch.randn(M, D, device=DEV, generator=g) * torch.logspace(-2, 2, D, device=DEV)
    w = (torch.rand(D, device=DEV, generator=g) + 0.5).bfloat16()
    d32 = torch.randn(M, D, device=DEV, generator=g) * 4
    for d, rnd in ((d32.bfloat16(), None), (d32, torch.bfloat16), (None, None)):
        poison()
        out = add_rms_norm_quant(h, d, w, 1e-6, round_dtype=rnd, num_warps=warps)
        rh, ry, _, _ = add_rms_norm_quant_ref(h, d, w, 1e-6, round_dtype=rnd)
        name = f"D={D} warps={warps} delta={None if d is None else d.dtype} round={rnd}"
        assert torch.equal(out[0], rh), f"{name}: the residual add must be the reference's"
        diff = (out[1].float() - ry.float()).abs()
        assert bool((diff <= ry.float().abs() * 2 ** -7).all()), f"{name}: y off by {diff.max().item():.3e}"
        k8, ks = act_quant_ref(out[1])
        assert torch.equal(out[3], ks) and torch.equal(out[2].view(torch.uint8), k8.view(torch.uint8)), name

        def call(rows=slice(None), nw=warps, d=d, rnd=rnd):
            return add_rms_norm_quant(h[rows], None if d is None else d[rows], w, 1e-6, round_dtype=rnd, num_warps=nw)

        calls = [(slice(None), call())] + [(slice(i, i + 1), call(slice(i, i + 1))) for i in range(M)]
        calls.append((slice(1, 5), call(slice(1, 5))))
        if warps is None:
            calls.append((slice(None), call(nw=row_tiles(D)[1])))
        for k, (rows, again) in enumerate(calls):
            for a, b, what in zip(out, again, ("h", "y", "x8", "sx")):
                a = a[rows]
                same = (torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1
                        else torch.equal(a, b))
                assert same, f"{name}: {what} of call {k} (rows {rows}) differs from the first call's"


def test_add_rms_norm_quant_graph_safe():
    _needs_cuda()
    h = torch.randn(3, 7168, device=DEV)
    d = torch.randn(3, 7168, device=DEV).bfloat16()
    w = torch.ones(7168, device=DEV).bfloat16()
    a = add_rms_norm_quant(h, d, w, 1e-6)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        b = add_rms_norm_quant(h, d, w, 1e-6)
    g.replay()
    torch.cuda.synchronize()
    for u, v in zip(a, b):
        assert torch.equal(u.view(torch.uint8) if u.dtype.itemsize == 1 else u,
                           v.view(torch.uint8) if v.dtype.itemsize == 1 else v)


@pytest.mark.parametrize("shape", [(1, 1, 7168), (1, 4, 7168), (3, 5, 1000)])
def test_add_rounded(shape):
    """The block's last residual add, h + y rounded to bf16 / fp16, bit-equal to the torch reference."""
    from mtp.kernels.norm_quant import add_rounded, add_rounded_ref

    h, y = torch.randn(*shape, device=DEV) * 3, torch.randn(*shape, device=DEV) * 1e3
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        assert torch.equal(add_rounded(h, y, dt), add_rounded_ref(h, y, dt)), dt


@pytest.mark.parametrize("T", [1, 3])
def test_moe_experts_add(T):
    """moe_experts(add=s): the shared expert's output added in the combine launch equals the routed sum + s."""
    from mtp.kernels.moe import moe_experts

    E, D, I = 8, 1024, 256
    w1, s1 = zip(*[rand_weight(I, D) for _ in range(E)])
    w3, s3 = zip(*[rand_weight(I, D) for _ in range(E)])
    w2, s2 = zip(*[rand_weight(D, I) for _ in range(E)])
    st = [torch.stack(t).contiguous() for t in (w1, s1, w3, s3, w2, s2)]
    x = torch.randn(T, D, device=DEV).bfloat16()
    ids = torch.stack([torch.randperm(E, device=DEV)[:4] for _ in range(T)]).int()
    ids[0, 1] = -1  # another rank's expert
    w = torch.rand(T, 4, device=DEV)
    add = torch.randn(T, D, device=DEV)
    for layout in ("pairs", "persistent"):
        base = moe_experts(x, ids, w, *st, out_dtype=torch.float32, layout=layout)
        got = moe_experts(x, ids, w, *st, out_dtype=torch.float32, layout=layout, add=add)
        assert torch.equal(got, base + add), layout


@pytest.fixture(scope="module")
def split_rank_stack():
    return split_rank_weights()


def split_rank_weights() -> list[torch.Tensor]:
    """The TP=8 'split' rank's stack of one MoE layer: 256 routed experts + the shared one (last), each 256 wide
    (2 blocks of DeepSeek-V3.2's 2048), D = 7168: 1.4 GB of FP8."""
    E, D, I = 257, 7168, 256
    g = torch.Generator(device=DEV).manual_seed(0)
    st = []
    for N, K in ((I, D), (I, D), (D, I)):
        w8 = torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device=DEV)
        s = torch.empty(E, N // 128, K // 128, dtype=torch.float32, device=DEV)
        for e in range(E):
            w8[e], s[e] = weight_quant(torch.randn(N, K, device=DEV, generator=g) * 0.02)
        st += [w8, s]
    return st


@pytest.mark.parametrize("T", [1, 2, 3, 4, 5])
def test_moe_experts_shared_slot(split_rank_stack, T):
    """moe_experts(shared=True) at the TP=8 'split' rank's shapes (8 of 256 routed + the shared expert, 256 wide):
    bit for bit the routed call + the shared expert alone as `add` (pair and persistent grids), the float64
    reference (the shared expert an explicit 9th slot) within the expert kernels' fp8-flip bound (also the
    persistent grid with splits='waves'), and a CUDA
    graph's replay equal to the eager call (no host sync, static grids)."""
    from mtp.kernels.moe import moe_experts

    from .test_kernels_gpu import moe_flip_bound

    st = split_rank_stack
    S = st[0].shape[0] - 1
    g = torch.Generator(device=DEV).manual_seed(T)
    x = torch.randn(T, 7168, device=DEV, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(S, device=DEV, generator=g)[:8] for _ in range(T)]).int()
    w = torch.rand(T, 8, device=DEV, generator=g)
    kw = dict(out_dtype=torch.float32)
    for layout in ("pairs", "persistent"):
        poison()
        alone = moe_experts(x, torch.full((T, 1), S, dtype=torch.int32, device=DEV), torch.ones(T, 1, device=DEV),
                            *st, layout=layout, **kw)
        want = moe_experts(x, ids, w, *st, layout=layout, add=alone, **kw)
        got = moe_experts(x, ids, w, *st, layout=layout, shared=True, **kw)
        assert torch.equal(got, want), (layout, (got - want).abs().max().item())
    # the reference with the shared expert as an explicit 9th slot, held as `test_moe_experts` holds the experts:
    # within what fp8 flips of h (the wgmma's reduced-precision accumulation) can explain, element by element
    y64, bound = moe_flip_bound(x, torch.cat([ids, torch.full((T, 1), S, dtype=torch.int32, device=DEV)], 1),
                                torch.cat([w, torch.ones(T, 1, device=DEV)], 1), *st)
    slack = bound + 2e-3 * y64.abs().max()
    # the persistent grid with its K slices sized for 9 distinct experts a token (splits='waves', switch
    # moe_wave_splits) held to the same bound
    waves = moe_experts(x, ids, w, *st, layout="persistent", shared=True, splits="waves", **kw)
    for name, y in (("default", got), ("waves", waves)):
        err = (y.double() - y64).abs()
        assert bool((err <= slack).all()), f"T={T} {name}: {int((err > slack).sum())} outputs beyond the fp8-flip bound"
    if DEV == "cuda":
        eager = moe_experts(x, ids, w, *st, shared=True, **kw)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe_experts(x, ids, w, *st, shared=True, **kw)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


# ----------------------------------------------------------------------------- router
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 33, 64])
def test_moe_route_fused(T):
    E, D = 256, 7168
    x = torch.randn(T, D, device=DEV).bfloat16()
    wg = (torch.randn(E, D, device=DEV) * 0.02).bfloat16()
    bias = torch.randn(E, device=DEV) * 0.05
    poison()
    w, idx, lg = moe_route_fused(x, wg, bias, return_logits=True)
    check_close("gate logits", lg, x.float() @ wg.float().t(), 1e-5)
    wr, ir = route_from_logits_ref(lg, bias)  # same logits: the choice must agree exactly
    assert torch.equal(idx, ir), f"experts differ in tokens {torch.nonzero((idx != ir).any(1)).flatten().tolist()}"
    check_close("route weights", w, wr, 1e-6)
    wl, il = moe_route_fused(x, wg, bias, local=(64, 96))  # an expert-parallel rank's view
    assert torch.equal(wl, w) and torch.equal(il, torch.where((idx >= 64) & (idx < 96), idx - 64, -1))
    w2, i2 = moe_route(x, wg, bias)  # the two-launch router (other summation order of the logits)
    assert (i2 == idx).float().mean() > 0.99
    check_close("vs moe_route", w, w2, 1e-3)


# DeepSeek's config at verify widths 1..8 and 16, and the tiny models' (E, n_group, topk_group, topk)
GROUPED_CASES = [(T, 256, 8, 4, 8) for T in (1, 2, 3, 4, 5, 6, 7, 8, 16)] + [
    (3, 64, 4, 2, 6), (5, 32, 1, 1, 3), (8, 16, 4, 2, 4), (2, 8, 2, 1, 2), (7, 8, 4, 2, 3)]


@pytest.mark.parametrize("case", GROUPED_CASES)
def test_moe_route_grouped(case):
    """impl="grouped" (the top-k split over the E-blocks' last slices) against the serial tail and the reference:
    logits and ids bit for bit, weights to fp32 rounding (on an H200 they differed from serial's in the last bits
    in 6 of 9 DeepSeek-shaped cases: the normalizing sum adds the same 8 terms in another order; bit-equal under
    the interpreter); with and without an expert-parallel rank's local ids."""
    T, E, ng, tg, k = case
    D = 7168 if E == 256 else 512
    kw = dict(n_group=ng, topk_group=tg, topk=k)
    x = torch.randn(T, D, device=DEV).bfloat16()
    wg = (torch.randn(E, D, device=DEV) * 0.02).bfloat16()
    bias = torch.randn(E, device=DEV) * 0.05
    poison()
    got = moe_route_fused(x, wg, bias, return_logits=True, impl="grouped", **kw)
    ser = moe_route_fused(x, wg, bias, return_logits=True, impl="serial", **kw)
    for name, a, b in zip(("ids", "logits"), got[1:], ser[1:]):
        assert torch.equal(a, b), f"grouped vs serial {name} differ"
    check_close("grouped vs serial weights", got[0], ser[0], 1e-6)
    wr, ir = route_from_logits_ref(got[2], bias, **kw)
    bad = torch.nonzero((got[1] != ir).any(1)).flatten().tolist()
    assert not bad, f"experts differ in tokens {bad}"
    check_close("grouped route weights", got[0], wr, 1e-6)
    e0, e1 = E // 4, E // 2
    wl, il = moe_route_fused(x, wg, bias, local=(e0, e1), impl="grouped", **kw)
    assert torch.equal(wl, got[0]) and torch.equal(il, torch.where((ir >= e0) & (ir < e1), ir - e0, -1))


def test_moe_route_grouped_ties():
    """Every gate logit 0 (x = 0) and the bias in steps of 0.25: equal experts and equal groups everywhere; the
    lower index wins at every step, as the reference's stable sorts."""
    x = torch.zeros(8, 7168, device=DEV).bfloat16()
    wg = (torch.randn(256, 7168, device=DEV) * 0.02).bfloat16()
    bias = torch.randint(0, 3, (256,), device=DEV).float() * 0.25
    wr, ir = route_from_logits_ref(torch.zeros(8, 256, device=DEV), bias)
    for impl, nw in (("serial", 4), ("grouped", 4), ("grouped", 8), ("grouped", 16)):
        w, idx = moe_route_fused(x, wg, bias, impl=impl, num_warps=nw)
        assert torch.equal(idx, ir), (impl, nw)
        check_close(f"{impl} {nw} warps tied weights", w, wr, 1e-6)


@pytest.mark.parametrize("impl", ["serial", "grouped"])
def test_moe_route_fused_graph_safe(impl):
    _needs_cuda()
    x = torch.randn(2, 7168, device=DEV).bfloat16()
    wg = (torch.randn(256, 7168, device=DEV) * 0.02).bfloat16()
    bias = torch.randn(256, device=DEV) * 0.05
    a = moe_route_fused(x, wg, bias, impl=impl)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        b = moe_route_fused(x, wg, bias, impl=impl)
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ----------------------------------------------------------------------------- MLA prologue
def _rank_mla(seed: int):
    """One TP=8 rank's MLA of the real config (16 heads), bf16, random norm parameters."""
    import dataclasses

    from mtp.model.attention import MLA
    from mtp.model.presets import real_config

    cfg = dataclasses.replace(real_config(layers=1, dense_layers=1, mtp_modules=0), num_attention_heads=16)
    g = torch.Generator(device=DEV).manual_seed(seed)
    with torch.device(DEV):
        mla = MLA(cfg, torch.bfloat16)
    mla.kv_a_layernorm.weight.data = (torch.rand(cfg.kv_lora_rank, device=DEV, generator=g) + 0.5).bfloat16()
    k = mla.indexer.k_norm
    k.weight.data = torch.rand(128, device=DEV, generator=g) + 0.5
    k.bias.data = torch.randn(128, device=DEV, generator=g) * 0.1
    return cfg, mla, g


@pytest.mark.parametrize("B,T", [(1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (3, 2)])
def test_mla_prologue(B, T):
    from mtp.model.cache import KVCache
    from mtp.kernels.mla_prologue import mla_kv_prologue, mla_kv_prologue_ref, mla_q_prologue, mla_q_prologue_ref
    from mtp.model.layers import Rotary

    cfg, mla, g = _rank_mla(B * 10 + T)
    ix = mla.indexer
    Q, C, R = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    a = (torch.randn(B, T, Q + 128 + C + R, device=DEV, generator=g) * 2).bfloat16()
    pos = torch.randint(0, 60, (B, 1), device=DEV, generator=g) + torch.arange(T, device=DEV)
    cos, sin = Rotary(cfg).to(DEV).angles(pos)
    caches = [KVCache(cfg, 1, B, 72, device=DEV, dtype=torch.bfloat16, quantized=True) for _ in range(2)]
    mla_kv_prologue_ref(mla, caches[0].layer(0), pos, a, cos, sin)
    mla_kv_prologue(mla, caches[1].layer(0), pos, a, cos, sin)
    b = torch.arange(B, device=DEV)[:, None].expand(B, T)
    for name in ("kv", "kv_scale", "pe", "idx_k", "idx_k_scale"):
        r, k = getattr(caches[0], name), getattr(caches[1], name)
        keep = torch.ones(r.shape[:3], dtype=torch.bool, device=DEV)  # [layers, B, S]: slots not written stay
        keep[0, b, pos] = False
        assert torch.equal(r[keep].view(torch.uint8) if r.element_size() == 1 else r[keep],
                           k[keep].view(torch.uint8) if k.element_size() == 1 else k[keep]), f"{name}: other slots"
        r, k = r[0, b, pos], k[0, b, pos]
        same = (r.view(torch.uint8) == k.view(torch.uint8)) if r.element_size() == 1 else (r == k)
        # a value on a bf16 / fp8 rounding boundary may land on the neighbour (fp32 order, FMA contraction)
        assert same.float().mean() > 0.99, f"{name}: {int((~same).sum())} of {same.numel()} written values differ"
    rk, kk = caches[0].pe[0, b, pos].float(), caches[1].pe[0, b, pos].float()
    assert bool(((rk - kk).abs() <= rk.abs() * 2 ** -7).all()), "rotary keys off by more than a bf16 ulp"
    H, P = mla.H, mla.P
    qq = torch.randn(B, T, H * (P + R) + ix.n_heads * 128, device=DEV, generator=g).bfloat16()
    q_pe, iq8, iqs = mla_q_prologue(mla, qq, cos, sin)
    rp, r8, rs = mla_q_prologue_ref(mla, qq, cos, sin)
    assert q_pe.is_contiguous() and q_pe.dtype == torch.bfloat16
    assert bool(((q_pe.float() - rp.float()).abs() <= rp.float().abs() * 2 ** -7).all())
    assert (iq8.view(torch.uint8) == r8.view(torch.uint8)).float().mean() > 0.99 and (iqs == rs).float().mean() > 0.99
    q_pe2, none8, _ = mla_q_prologue(mla, qq[..., :H * (P + R)], cos, sin, index=False)  # S <= top-k: no queries
    assert torch.equal(q_pe2, q_pe) and none8 is None


@pytest.mark.parametrize("B,T", [(1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (3, 3)])
def test_absorb(B, T):
    from mtp.kernels.absorb import absorb_out, absorb_out_ref, absorb_q, absorb_q_ref

    H = 16  # one TP=8 rank
    qq = torch.randn(B, T, H * 192 + 64 * 128, device=DEV).bfloat16()
    q_nope = qq[..., :H * 192].view(B, T, H, 192)[..., :128]  # strided, as mla_forward_fast hands it over
    wkb = (torch.randn(H, 128, 512, device=DEV) * 0.05).bfloat16()
    wvb = (torch.randn(H, 128, 512, device=DEV) * 0.05).bfloat16()
    poison()
    q_lat = absorb_q(q_nope, wkb)
    assert q_lat.is_contiguous() and q_lat.dtype == torch.bfloat16
    check_close(f"absorb_q B={B} T={T}", q_lat.float(), absorb_q_ref(q_nope, wkb).float(), 1e-2)
    o_lat = torch.randn(B, T, H, 512, device=DEV).bfloat16()
    check_close(f"absorb_out B={B} T={T}", absorb_out(o_lat, wvb).float(), absorb_out_ref(o_lat, wvb).float(), 1e-2)


@pytest.mark.parametrize("B,T,S,lens,J,tree", [(1, 1, 4100, [4099], 0, False), (1, 1, 9000, [8999], 2048, False),
                                               (1, 3, 700, [500], 0, False), (2, 2, 3000, [100, 2990], 2048, False),
                                               (1, 5, 9000, [8990], 2048, False), (3, 4, 1200, [7, 600, 1190], 0, True),
                                               (16, 4, 300, [290] * 16, 0, False)])
@pytest.mark.parametrize("block_v", [None, 32, 128])
def test_mla_stage2_absorb_bit_identical(B, T, S, lens, J, tree, block_v):
    """One TP=8 rank (16 heads, latent 512, V 128): mla_decode with W_vb (stage 2 + absorb_out in one launch,
    `mla_out.stage2_absorb`) equals mla_decode's o_lat then `absorb_out` bit for bit, dense / top-k / a tree's
    visibility, 1..5 tokens and 64, absorb_out's output block and others; and is near the fp32 einsum."""
    from mtp.kernels.absorb import absorb_out, absorb_out_ref
    from mtp.kernels.mla_decode import mla_decode

    from .test_kernels_gpu import mla_inputs

    H = 16
    q, qpe, kv8, kvs, pe, L = mla_inputs(B, T, H, S, lens)
    q, qpe = q.bfloat16(), qpe.bfloat16()
    kw = {}
    if J:
        idx = torch.full((B, T, J), -1, dtype=torch.int32, device=DEV)
        for b in range(B):
            for t in range(T):
                n = min(J, lens[b] + t + 1) - (t % 2)  # some rows keep -1 padding
                idx[b, t, :n] = torch.randperm(lens[b] + t + 1, device=DEV)[:n].int()
        kw["topk_idx"] = idx
    if tree:
        kw["visible"] = torch.rand(B, T, S, device=DEV) < 0.5
    wvb = (torch.randn(H, 128, 512, device=DEV) * 0.05).bfloat16()
    want = absorb_out(mla_decode(q, qpe, kv8, kvs, pe, L, 0.0723, out_dtype=torch.bfloat16, **kw), wvb)
    poison()
    got = mla_decode(q, qpe, kv8, kvs, pe, L, 0.0723, out_dtype=torch.bfloat16, w_vb=wvb, block_v=block_v, **kw)
    assert got.shape == (B, T, H, 128) and got.dtype == torch.bfloat16
    # other output blocks than absorb_out's: the same MMA instruction per element (m16n8k16 up to 16 tokens)
    assert torch.equal(got, want), f"block_v={block_v}: {int((got != want).sum())} of {got.numel()} differ"
    lat = mla_decode(q, qpe, kv8, kvs, pe, L, 0.0723, out_dtype=torch.bfloat16, **kw)
    check_close(f"stage2_absorb B={B} T={T}", got.float(), absorb_out_ref(lat.float(), wvb.float()), 1e-2)


# ----------------------------------------------------------------------------- the fused prologue launches
def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bit equality (fp8 as bytes)."""
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    return torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.element_size() == 1 else torch.equal(x, y)


def _fused_vs_unfused(mla, cfg, g, B: int, T: int, kv_split: bool = False):
    """Both fused launches (`mla_prologue_fused`) and the two launches each replaces on the same random inputs at
    one rank's shapes: [(name, fused output, unfused output)], the cache buffers included; kv_split: the kv launch
    with a token's latent and indexer key in two programs."""
    from mtp.kernels.absorb import absorb_q
    from mtp.kernels.mla_prologue import mla_kv_prologue, mla_q_prologue
    from mtp.kernels.mla_prologue_fused import mla_kv_prologue_norm, mla_q_prologue_absorb
    from mtp.model.cache import KVCache
    from mtp.model.layers import Rotary

    ix = mla.indexer
    H, P, R, C, Q = mla.H, mla.P, mla.R, mla.C, cfg.q_lora_rank
    a = (torch.randn(B, T, Q + 128 + C + R, device=DEV, generator=g) * 2).bfloat16()
    pos = torch.randint(0, 60, (B, 1), device=DEV, generator=g) + torch.arange(T, device=DEV)
    cos, sin = Rotary(cfg).to(DEV).angles(pos)
    caches = [KVCache(cfg, 1, B, 72, device=DEV, dtype=torch.bfloat16, quantized=True).layer(0) for _ in range(2)]
    n = mla.q_a_layernorm
    poison()
    mla_kv_prologue(mla, caches[0], pos, a, cos, sin)
    _, _, r8, rs = add_rms_norm_quant(a[..., :Q], None, n.weight, n.eps, torch.bfloat16, store_y=False)
    q8, qs = mla_kv_prologue_norm(mla, caches[1], pos, a, cos, sin, torch.bfloat16, kv_split=kv_split)
    out = [(name, getattr(caches[1], name), getattr(caches[0], name))
           for name in ("kv", "kv_scale", "pe", "idx_k", "idx_k_scale")]
    out += [("q8", q8, r8), ("qs", qs, rs)]
    qq = torch.randn(B, T, H * (P + R) + ix.n_heads * 128, device=DEV, generator=g).bfloat16()
    for index, x in ((True, qq), (False, qq[..., :H * (P + R)].contiguous())):  # S > top-k; S <= top-k
        want = (*mla_q_prologue(mla, x, cos, sin, index=index),
                absorb_q(x[..., :H * (P + R)].view(B, T, H, P + R)[..., :P], mla.w_kb))
        got = mla_q_prologue_absorb(mla, x, cos, sin, index=index)
        out += [(f"{name} index={index}", o, w) for name, o, w in zip(("q_pe", "iq8", "iqs", "q_lat"), got, want)
                if w is not None or o is not None]
    return out


def _rank_mla_absorbed(seed: int):
    cfg, mla, g = _rank_mla(seed)
    mla.q_a_layernorm.weight.data = (torch.rand(cfg.q_lora_rank, device=DEV, generator=g) + 0.5).bfloat16()
    mla.w_kb = (torch.randn(mla.H, mla.P, mla.C, device=DEV, generator=g) * 0.05).bfloat16()
    return cfg, mla, g


@pytest.mark.parametrize("kv_split", [False, True])
@pytest.mark.parametrize("B,T", [(1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (3, 2), (2, 5)])
def test_mla_prologue_fused(B, T, kv_split):
    """One TP=8 rank (16 heads, latent 512, rope 64, q_lora 1536, indexer 64 heads x 128): the kv prologue +
    q_a norm-quant launch (a token's latent and indexer key in one program, or in two: switch kv_split) and the q
    prologue + absorb q launch write the two launches' bits (torch.equal)."""
    cfg, mla, g = _rank_mla_absorbed(B * 10 + T)
    assert (mla.H, mla.C, mla.R, cfg.q_lora_rank, mla.indexer.n_heads) == (16, 512, 64, 1536, 64)
    for name, got, want in _fused_vs_unfused(mla, cfg, g, B, T, kv_split):
        assert _same(got, want), f"{name} B={B} T={T} kv_split={kv_split}: fused differs from the two launches"


def test_mla_prologue_fused_graph_and_pdl():
    """The fused launches replay from a CUDA graph with the eager bits, and with PDL (Hopper) as without."""
    _needs_cuda()
    from mtp.kernels.mla_prologue_fused import mla_kv_prologue_norm, mla_q_prologue_absorb
    from mtp.model.cache import KVCache
    from mtp.model.layers import Rotary

    cfg, mla, g = _rank_mla_absorbed(7)
    B, T = 2, 3
    H, P, R, C, Q = mla.H, mla.P, mla.R, mla.C, cfg.q_lora_rank
    a = (torch.randn(B, T, Q + 128 + C + R, device=DEV, generator=g) * 2).bfloat16()
    qq = torch.randn(B, T, H * (P + R) + mla.indexer.n_heads * 128, device=DEV, generator=g).bfloat16()
    pos = torch.randint(0, 60, (B, 1), device=DEV, generator=g) + torch.arange(T, device=DEV)
    cos, sin = Rotary(cfg).to(DEV).angles(pos)
    pdl = torch.cuda.get_device_capability()[0] >= 9
    caches = [KVCache(cfg, 1, B, 72, device=DEV, dtype=torch.bfloat16, quantized=True).layer(0) for _ in range(2)]

    def step(cache, use_pdl):
        return (*mla_kv_prologue_norm(mla, cache, pos, a, cos, sin, torch.bfloat16, pdl=use_pdl),
                *mla_q_prologue_absorb(mla, qq, cos, sin))

    eager = step(caches[0], False)
    step(caches[1], pdl)  # warm-up (compiles the PDL variant)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = step(caches[1], pdl)
    for buf in ("kv", "kv_scale", "pe", "idx_k", "idx_k_scale"):  # back to a fresh cache's state (scales are ones)
        t = getattr(caches[1], buf)
        t.fill_(1.0) if buf.endswith("scale") else t.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for i, (u, v) in enumerate(zip(eager, replayed)):
        assert _same(u, v), f"output {i} differs on replay"
    for buf in ("kv", "kv_scale", "pe", "idx_k", "idx_k_scale"):
        assert _same(getattr(caches[0], buf), getattr(caches[1], buf)), f"cache {buf} differs on replay"


# ----------------------------------------------------------------------------- the fast path, old vs new kernels
def test_fast_path_new_kernels_match_old():
    """A random gpu_test_config model on the fast path, new kernels (all switches on) vs old (all off), both held
    to an fp32 reference of the same weights at verify widths 1..5 after a 65-69 token prompt (past the indexer's
    top-k 64: its head-weights kernel vs cuBLAS's GEMM too; random FP8 models amplify rounding noise: an FP8
    re-rounding flip moves a value by up to 1/8, so the new kernels must be as close to it as the old ones, not
    bit-equal to them); greedy tokens in graph mode equal eager."""
    _needs_cuda()
    from mtp.decode.engine import generate
    from mtp.backends.fast_path import disable_fast_path, enable_fast_path, set_kernels
    from mtp.checkpoint.synthetic import random_model
    from mtp.model.presets import gpu_test_config

    from ..decode.test_engine_gpu import _as_float32, _verify_logits

    model = random_model(gpu_test_config(layers=3, mtp_modules=1), device=DEV, dtype=torch.bfloat16, seed=3)
    ids = torch.randint(0, 2048, (1, 70), device=DEV, generator=torch.Generator(device=DEV).manual_seed(0))
    m32 = _as_float32(model)
    ref32 = {w: _verify_logits(m32, ids, w) for w in range(1, 6)}
    del m32
    enable_fast_path(model)
    try:
        for w in range(1, 6):
            out = {}
            for on in (False, True):
                set_kernels(model, gemv=on, norm_quant=on, router=on, prologue=on, absorb=on, index_weights=on)
                out[on] = _verify_logits(model, ids, w)
            err = lambda x: ((x - ref32[w]).norm() / ref32[w].norm()).item()  # noqa: E731
            rel = ((out[True] - out[False]).norm() / out[False].norm()).item()
            print(f"w={w}: rel L2 vs fp32: old kernels {err(out[False]):.3f}, new {err(out[True]):.3f}; "
                  f"new vs old {rel:.2e}")
            assert err(out[True]) <= 1.5 * err(out[False]) + 0.02
        set_kernels(model, gemv=True, norm_quant=True, router=True, prologue=True, absorb=True, index_weights=True)
        prompts = [list(range(3, 40)), list(range(50, 61))]
        eager = generate(model, prompts, 12, mode="eager").tokens
        assert generate(model, prompts, 12, mode="graph").tokens == eager
    finally:
        disable_fast_path(model)


def test_fast_path_fused_absorb_out_bit_identical():
    """The fast path with mla_decode's stage 2 and absorb_out in one launch (switch fuse_absorb_out) gives the two
    launches' verify logits bit for bit at widths 1..5 past the indexer's top-k, and eager greedy tokens."""
    _needs_cuda()
    from mtp.decode.engine import generate
    from mtp.backends.fast_path import FastMLA, disable_fast_path, enable_fast_path, set_kernels
    from mtp.checkpoint.synthetic import random_model
    from mtp.model.presets import gpu_test_config

    from ..decode.test_engine_gpu import _verify_logits

    model = random_model(gpu_test_config(layers=3, mtp_modules=1), device=DEV, dtype=torch.bfloat16, seed=3)
    ids = torch.randint(0, 2048, (1, 70), device=DEV, generator=torch.Generator(device=DEV).manual_seed(0))
    enable_fast_path(model)
    try:
        assert any(isinstance(m, FastMLA) for m in model.modules()), "the MLA kernels must run in this model"
        prompts = [list(range(3, 40)), list(range(50, 61))]
        out, toks = {}, {}
        for on in (False, True):
            set_kernels(model, fuse_absorb_out=on)
            out[on] = [_verify_logits(model, ids, w) for w in range(1, 6)]
            toks[on] = generate(model, prompts, 12, mode="eager").tokens
        for w, (a, b) in enumerate(zip(out[False], out[True]), start=1):
            assert torch.equal(a, b), f"w={w}: max |diff| {(a - b).abs().max().item():.3g}"
        assert toks[True] == toks[False]
    finally:
        disable_fast_path(model)


def test_fast_path_fused_prologue_bitwise():
    """The fast path with fuse_prologue on and off gives the same logits bit for bit (the fused launches run the
    same code with the same tiles) at verify widths 1..5 after a 65-69 token prompt (past the indexer's top-k 64:
    its queries from the fused q launch) and at 1..5 tokens from an empty cache (the indexer's query side off)."""
    _needs_cuda()
    from mtp.backends.fast_path import disable_fast_path, enable_fast_path, set_kernels
    from mtp.checkpoint.synthetic import random_model
    from mtp.model.presets import gpu_test_config

    from ..decode.test_engine_gpu import _verify_logits

    model = random_model(gpu_test_config(layers=3, mtp_modules=1), device=DEV, dtype=torch.bfloat16, seed=4)
    ids = torch.randint(0, 2048, (1, 70), device=DEV, generator=torch.Generator(device=DEV).manual_seed(1))
    enable_fast_path(model)
    try:
        for w in range(1, 6):
            out = {}
            for fused in (False, True):
                set_kernels(model, fuse_prologue=fused)
                out[fused] = (_verify_logits(model, ids, w), model(ids[:, :w], model.new_cache(1, 16)).logits)
            assert torch.equal(out[True][0], out[False][0]), f"w={w}: fused prologue changed the verify logits"
            assert torch.equal(out[True][1], out[False][1]), f"w={w}: fused prologue changed the short forward"
    finally:
        disable_fast_path(model)


def test_pdl_chain_equals_plain():
    """Programmatic dependent launch (switch `pdl`): a captured chain norm -> GEMV -> GEMV -> router, each
    launched with PDL, gives the plain launches' bits (the kernels wait before touching the previous one's
    outputs), eagerly and on replay."""
    _needs_cuda()
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs Hopper")
    D = 7168
    h = torch.randn(2, D, device=DEV)
    d = torch.randn(2, D, device=DEV).bfloat16()
    wn = (torch.rand(D, device=DEV) + 0.5).bfloat16()
    w1, s1 = rand_weight(2240, D)
    w2, s2 = rand_weight(D, 2240 - 64)
    wg = (torch.randn(256, D, device=DEV) * 0.02).bfloat16()
    bias = torch.randn(256, device=DEV) * 0.05

    def chain(pdl):
        hn, y, x8, sx = add_rms_norm_quant(h, d, wn, 1e-6, pdl=pdl)
        a = fp8_gemv(None, w1, s1, xq=(x8, sx), out_dtype=torch.bfloat16, pdl=pdl)
        b = fp8_gemv(a[:, :2240 - 64], w2, s2, out_dtype=torch.float32, pdl=pdl)
        return (hn, b, *moe_route_fused(y, wg, bias, pdl=pdl))

    want = chain(False)
    got = chain(True)
    for u, v in zip(want, got):
        assert torch.equal(u, v)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cap = chain(True)
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        for u, v in zip(want, cap):
            assert torch.equal(u, v)
