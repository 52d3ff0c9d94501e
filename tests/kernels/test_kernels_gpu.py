"""GPU kernels vs their plain-PyTorch references over odd shapes (run on the device: pytest -m gpu).

Every output is allocated from a caching-allocator pool first filled with NaN ("poisoned"), so an element a
kernel fails to write shows up as NaN. Inputs are fresh random draws per case.
"""

from __future__ import annotations

import os

import pytest
import torch

from mtp.kernels import available

pytestmark = pytest.mark.gpu
# MTP_TEST_DEVICE=cpu with TRITON_INTERPRET=1 dry-runs the kernels on the CPU (slow; for debugging only).
DEV = os.environ.get("MTP_TEST_DEVICE", "cuda")
if not (available() or (DEV == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")):
    pytest.skip("needs triton and a CUDA device", allow_module_level=True)

from mtp.model.fp8 import fp8_gemm_ref, weight_quant  # noqa: E402
from mtp.model.fp8 import act_quant as act_quant_ref  # noqa: E402
from mtp.kernels.act_quant import act_quant  # noqa: E402
from mtp.kernels.fp8_gemm import fp8_gemm, fp8_linear, fp8_linear_ref  # noqa: E402
from mtp.kernels.indexer import indexer_topk, indexer_topk_ref  # noqa: E402
from mtp.kernels.topk import radix_topk, topk_select_ref  # noqa: E402
from mtp.kernels.mla_decode import mla_decode, mla_decode_ref  # noqa: E402
from mtp.kernels.moe import gate_logits, moe_experts, moe_experts_ref, moe_route, moe_route_ref, route_from_logits_ref  # noqa: E402



def poison():
    """Fill the allocator's free pool with NaN so that unwritten outputs are visible."""
    if DEV != "cuda":
        return
    torch.cuda.synchronize()
    x = torch.full((64 << 20,), float("nan"), device=DEV)
    del x


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_close(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float):
    assert out.shape == ref.shape, f"{name}: shape {list(out.shape)} != {list(ref.shape)}"
    assert torch.isfinite(out).all(), f"{name}: non-finite at {torch.nonzero(~torch.isfinite(out))[:5].tolist()}"
    err = rel_err(out, ref)
    if not err < tol:
        d = (out.double() - ref.double()).abs()
        where = torch.nonzero(d == d.max())[:3].tolist()
        pytest.fail(f"{name}: rel err {err:.3e} >= {tol:.1e}; max |diff| {d.max().item():.3e} at {where}")


def rand_weight(N, K, std=0.02):
    return weight_quant(torch.randn(N, K, device=DEV) * std)


# ----------------------------------------------------------------------------- act_quant
@pytest.mark.parametrize("shape", [(1, 128), (3, 7168), (7, 1536), (33, 512), (2, 5, 640)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_act_quant_bit_exact(shape, dtype):
    x = torch.randn(shape, device=DEV) * torch.logspace(-6, 3, shape[-1], device=DEV)
    x[..., :128] *= 1e-3  # one group under the 1e-4 amax floor
    x = x.to(dtype)
    poison()
    y8, s = act_quant(x)
    r8, rs = act_quant_ref(x)
    assert torch.equal(s, rs), f"scales differ at {torch.nonzero(s != rs)[:5].tolist()}"
    bad = y8.view(torch.uint8) != r8.view(torch.uint8)
    assert not bad.any(), f"{bad.sum().item()} fp8 codes differ, first at {torch.nonzero(bad)[:5].tolist()}"


# ----------------------------------------------------------------------------- fp8 linear
SHAPES = [(576, 7168), (1536, 7168), (7168 + 128, 1536), (200, 256)]


@pytest.mark.parametrize("M", [1, 3, 7, 33, 64, 65, 130])
@pytest.mark.parametrize("NK", SHAPES)
def test_fp8_linear_fp32(M, NK):
    N, K = NK
    w8, sw = rand_weight(N, K)
    x = torch.randn(M, K, device=DEV)
    poison()
    y = fp8_linear(x, w8, sw)
    x8, sx = act_quant_ref(x)
    check_close(f"fp8_linear M={M} N={N} K={K}", y, fp8_gemm_ref(x8, sx, w8, sw), 1e-3)


@pytest.mark.parametrize("M", [1, 5, 40, 100])
def test_fp8_linear_bf16_batched(M):
    N, K = 576, 7168
    w8, sw = rand_weight(N, K)
    x = torch.randn(2, M, K, device=DEV).bfloat16()
    poison()
    y = fp8_linear(x, w8, sw)
    assert y.dtype == torch.bfloat16 and y.shape == (2, M, N)
    check_close("fp8_linear bf16", y.float(), fp8_linear_ref(x, w8, sw).float(), 1e-2)


@pytest.mark.parametrize("M", [2, 24, 64])
@pytest.mark.parametrize("tune", [dict(fuse_quant=False), dict(bn=256, num_stages=2), dict(bn=64, splits=3),
                                  dict(splits=7, num_stages=4),  # FastPathOptions.deep_tune's plans
                                  dict(splits=4, num_stages=4)])
def test_fp8_linear_variants(M, tune):
    N, K = 2048 + 64, 7168
    w8, sw = rand_weight(N, K)
    x = torch.randn(M, K, device=DEV).bfloat16()
    poison()
    y = fp8_linear(x, w8, sw, out_dtype=torch.float32, **tune)
    x8, sx = act_quant_ref(x)
    check_close(f"fp8_linear {tune} M={M}", y, fp8_gemm_ref(x8, sx, w8, sw), 1e-3)


@pytest.mark.parametrize("splits", [1, 3, 7])
def test_fp8_gemm_prequant_splits(splits):
    M, N, K = 6, 2048 + 64, 7168
    w8, sw = rand_weight(N, K)
    x8, sx = act_quant_ref(torch.randn(M, K, device=DEV))
    poison()
    y = fp8_gemm(x8, sx, w8, sw, splits=splits)
    check_close(f"fp8_gemm splits={splits}", y, fp8_gemm_ref(x8, sx, w8, sw), 1e-3)


def test_fp8_gemm_deterministic_and_graph_safe():
    w8, sw = rand_weight(7168, 2048)
    x = torch.randn(4, 2048, device=DEV)
    a = fp8_linear(x, w8, sw, splits=8)
    for _ in range(3):  # the split-K counters re-arm themselves: repeated launches agree bit for bit
        assert torch.equal(a, fp8_linear(x, w8, sw, splits=8))
    g = torch.cuda.CUDAGraph()
    fp8_linear(x, w8, sw, splits=8)
    with torch.cuda.graph(g):
        y = fp8_linear(x, w8, sw, splits=8)
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(a, y)


# ----------------------------------------------------------------------------- MoE routing
@pytest.mark.parametrize("T", [1, 3, 33])
def test_moe_route(T):
    E, D = 256, 7168
    x = torch.randn(T, D, device=DEV).bfloat16()
    wg = (torch.randn(E, D, device=DEV) * 0.02).bfloat16()
    bias = torch.randn(E, device=DEV) * 0.05
    poison()
    w, idx = moe_route(x, wg, bias)
    part = gate_logits(x, wg)
    logits = part[0].clone()
    for p in part[1:]:  # the kernel's fixed summation order
        logits += p
    check_close("gate logits", logits, x.float() @ wg.float().t(), 1e-5)
    wr, ir = route_from_logits_ref(logits, bias)  # same logits: selection must agree exactly
    assert torch.equal(idx, ir), f"experts differ in tokens {torch.nonzero((idx != ir).any(1)).flatten().tolist()}"
    check_close("route weights", w, wr, 1e-5)
    wr2, ir2 = moe_route_ref(x, wg, bias)
    assert (idx == ir2).float().mean() > 0.99


@pytest.mark.parametrize("router", ["moe_route", "moe_route_fused"])
def test_moe_route_ties_lower_index(router):
    from mtp.kernels.router import moe_route_fused

    E, D, T = 256, 256, 4
    x = torch.zeros(T, D, device=DEV)
    wg = torch.randn(E, D, device=DEV)
    bias = (torch.randint(0, 3, (E,), device=DEV) * 0.25).float()  # many exact ties
    w, idx = (moe_route if router == "moe_route" else moe_route_fused)(x, wg, bias)
    wr, ir = moe_route_ref(x, wg, bias)
    assert torch.equal(idx, ir), f"{idx.tolist()} != {ir.tolist()}"
    check_close("route weights ties", w, wr, 1e-6)


# ----------------------------------------------------------------------------- MoE experts
def stacked(E, N, K, std=0.05):
    ws, ss = zip(*[rand_weight(N, K, std) for _ in range(E)])
    return torch.stack(ws), torch.stack(ss)


def distinct_topk(T, E, J, share: bool):
    rows = [torch.randperm(E, device=DEV)[:J] for _ in range(T)]
    if share and T > 1:  # make tokens share experts, as consecutive verify tokens often do
        rows[1] = torch.cat([rows[0][: J // 2], rows[1][~torch.isin(rows[1], rows[0][: J // 2])][: J - J // 2]])
    return torch.stack(rows).int()


@pytest.mark.parametrize("T,E,D,I,J", [(1, 8, 384, 256, 4), (3, 8, 384, 256, 4), (7, 16, 640, 384, 8), (2, 12, 7168, 2048, 8),
                                       (9, 16, 640, 384, 8)])
@pytest.mark.parametrize("layout", ["pairs", "persistent"])
def test_moe_experts(T, E, D, I, J, layout):
    if layout == "persistent" and T * J > 64:
        pytest.skip("the persistent layout takes T * J <= 64")
    torch.manual_seed(T * 1000 + E)
    x = torch.randn(T, D, device=DEV).bfloat16()
    wgt, sg = stacked(E, I, D)
    wu, su = stacked(E, I, D)
    wd, sd = stacked(E, D, I)
    idx = distinct_topk(T, E, J, share=True)
    rw = torch.rand(T, J, device=DEV)
    poison()
    y = moe_experts(x, idx, rw, wgt, sg, wu, su, wd, sd, out_dtype=torch.float32, layout=layout)
    yr = moe_experts_ref(x, idx, rw, wgt, sg, wu, su, wd, sd, out_dtype=torch.float32)
    # h is re-quantized to fp8 per 128 channels; the FP8 wgmma accumulates gate/up with a reduced-precision
    # accumulator (DeepSeek-V3 report: ~14 mantissa bits within each 128-wide group), so an h element near an
    # fp8 rounding boundary can land on the neighbouring code (a 6-12% step on that element). Typical overall
    # error 5e-3; 2.1e-2 was seen once at T=1, D=384 (one flip of a large element). The check: the kernel
    # must be within what such flips can explain, element by element, of the float64 reference; a routing
    # weight 10% off, a wrong expert or slot is outside it (checked on CPU with the fp32 reference).
    y64, bound = moe_flip_bound(x, idx, rw, wgt, sg, wu, su, wd, sd)
    err = (y.double() - y64).abs()
    slack = bound + 2e-3 * y64.abs().max()
    assert bool((err <= slack).all()), (
        f"moe_experts T={T} E={E} D={D} I={I}: {int((err > slack).sum())} outputs beyond the fp8-flip bound; "
        f"worst excess {(err - slack).max().item():.3e}")
    check_close(f"moe_experts T={T} E={E} D={D} I={I} (fp32 reference)", y, yr, 0.05)


def moe_flip_bound(x, idx, rw, wg, sg, wu, su, wd, sd, delta: float = 2e-3):
    """(y float64 [T, D], bound [T, D]): the float64 reference and, per output, 4 standard deviations of the
    change that rounding h(1 +- delta) instead of h to fp8 (same ue8m0 scale) causes when the ambiguous
    elements flip independently: 4 * sqrt(sum_i (w_tj * dh_i * W_down[:, i])^2) (dequantized); dh_i is 0
    unless h_i lies within delta of a rounding boundary. Every element flipping the same way at once (the
    worst case, a linear sum) would make the bound too loose to catch a 10% error in one routing weight."""
    from mtp.model.fp8 import FP8_DTYPE, FP8_MAX, act_dequant, fp8_gemm_ref, weight_dequant
    from mtp.model.fp8 import act_quant as aq

    a = torch.float64
    T = x.shape[0]
    y = torch.zeros(T, wd.shape[1], dtype=a, device=x.device)
    bound = torch.zeros_like(y)
    for t in range(T):
        x8, sx = aq(x[t:t + 1].to(a))
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if e < 0:
                continue
            g = fp8_gemm_ref(x8, sx, wg[e], sg[e], acc=a)
            h = torch.nn.functional.silu(g) * fp8_gemm_ref(x8, sx, wu[e], su[e], acc=a)
            h8, sh = aq(h)
            s_full = sh.to(a).repeat_interleave(128, -1)
            q = lambda v: (v / s_full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(a) * s_full  # noqa: E731
            hq = act_dequant(h8, sh, a)
            dh = torch.maximum((q(h * (1 - delta)) - hq).abs(), (q(h * (1 + delta)) - hq).abs())
            y[t] += rw[t, j].to(a) * fp8_gemm_ref(h8, sh, wd[e], sd[e], acc=a)[0]
            bound[t] += rw[t, j].to(a) ** 2 * (weight_dequant(wd[e], sd[e], a) ** 2 @ dh[0] ** 2)
    return y, 4 * bound.sqrt()


def local_ids(idx_TJ, e0, e1):
    """Expert-parallel view of global ids: e - e0 for a local expert, -1 for one on another rank."""
    return torch.where((idx_TJ >= e0) & (idx_TJ < e1), idx_TJ - e0, -1).int()


@pytest.mark.parametrize("T,skip_row", [(1, None), (1, 0), (3, 1), (17, 16)])
@pytest.mark.parametrize("layout", [None, "pairs"])
def test_moe_experts_skips_minus_one(T, skip_row, layout):
    """Slots with id -1 (expert on another rank): equal to the reference, bit-equal to the full stack with those
    slots' weights zeroed, exactly 0 for a token with every slot -1; two 'ranks' sum to the full result.
    Poisoned buffers: a -1 slot's row of the per-slot buffer is never written, so reading it shows as NaN."""
    E, D, I, J = 16, 384, 256, 8
    ranks = [(0, 6), (6, 16)]  # uneven on purpose
    x = torch.randn(T, D, device=DEV).bfloat16()
    wgt, sg = stacked(E, I, D)
    wu, su = stacked(E, I, D)
    wd, sd = stacked(E, D, I)
    idx = distinct_topk(T, E, J, share=True)  # with 6 of 16 local on rank 0, most tokens get several -1 slots
    if skip_row is not None:
        idx[skip_row] = torch.randperm(E - 6, device=DEV)[:J].int() + 6  # no expert of rank 0
    rw = torch.rand(T, J, device=DEV)
    kw = dict(out_dtype=torch.float32, layout=layout)
    full = moe_experts(x, idx, rw, wgt, sg, wu, su, wd, sd, **kw)
    parts = []
    for r, (e0, e1) in enumerate(ranks):
        loc = local_ids(idx, e0, e1)
        ws = [t[e0:e1].contiguous() for t in (wgt, sg, wu, su, wd, sd)]
        poison()
        y = moe_experts(x, loc, rw, *ws, **kw)
        yr = moe_experts_ref(x, loc, rw, *ws, out_dtype=torch.float32)
        check_close(f"moe_experts -1 slots T={T} rank {r}", y, yr, 1e-2)
        masked = moe_experts(x, idx, rw * (loc >= 0), wgt, sg, wu, su, wd, sd, **kw)
        assert torch.equal(y, masked), f"rank {r}: not the full-stack result restricted to the local experts"
        if r == 0 and skip_row is not None:
            assert torch.equal(y[skip_row], torch.zeros(D, device=DEV)), "an all -1 token must get exactly 0"
        parts.append(y)
    check_close(f"moe_experts T={T}: sum over ranks", parts[0] + parts[1], full, 1e-6)


@pytest.mark.parametrize("layout", ["pairs", "persistent"])
def test_moe_experts_minus_one_graph_safe(layout):
    """-1 slots need no host sync: a captured call replays to the eager result, also after the routing
    changed in place (the persistent layout finds its experts on the device at every replay)."""
    if DEV != "cuda":
        pytest.skip("CUDA graphs")
    T, E, D, I, J = 4, 8, 384, 256, 8
    x = torch.randn(T, D, device=DEV).bfloat16()
    ws = [*stacked(E, I, D), *stacked(E, I, D), *stacked(E, D, I)]
    loc = local_ids(distinct_topk(T, 2 * E, J, share=True), 0, E)
    rw = torch.rand(T, J, device=DEV)
    a = moe_experts(x, loc, rw, *ws, out_dtype=torch.float32, layout=layout)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = moe_experts(x, loc, rw, *ws, out_dtype=torch.float32, layout=layout)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(a, y)
    for _ in range(3):  # new routings through the same graph
        loc.copy_(local_ids(distinct_topk(T, 2 * E, J, share=False), 0, E))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, moe_experts(x, loc, rw, *ws, out_dtype=torch.float32, layout=layout))


@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_moe_experts_tp8_rank_widths(T):
    """One rank of TP=8 at decode / verify widths 1..4: 32 local experts of 256 (DeepSeek's D and I), ~1-4 of
    them active; the persistent layout against the reference and against the pairs layout."""
    E_loc, E, D, I, J = 32, 256, 7168, 2048, 8
    torch.manual_seed(T)
    x = torch.randn(T, D, device=DEV).bfloat16()
    ws = [*stacked(E_loc, I, D), *stacked(E_loc, I, D), *stacked(E_loc, D, I)]
    idx = distinct_topk(T, E, J, share=True)
    if not (idx[0] < E_loc).any():
        idx[0, 0] = 5  # at least one local expert
    loc = local_ids(idx, 0, E_loc)
    rw = torch.rand(T, J, device=DEV)
    poison()
    y = moe_experts(x, loc, rw, *ws, out_dtype=torch.float32, layout="persistent")
    y64, bound = moe_flip_bound(x, loc, rw, *ws)
    err = (y.double() - y64).abs()
    slack = bound + 2e-3 * y64.abs().max()
    assert bool((err <= slack).all()), f"T={T}: {int((err > slack).sum())} outputs beyond the fp8-flip bound"
    check_close(f"moe_experts tp8 T={T} vs reference", y, moe_experts_ref(x, loc, rw, *ws, out_dtype=torch.float32),
                0.05)
    check_close(f"moe_experts tp8 T={T} vs pairs", y,
                moe_experts(x, loc, rw, *ws, out_dtype=torch.float32, layout="pairs"), 2e-2)


# ----------------------------------------------------------------------------- MLA decode
def mla_inputs(B, T, H, S, lens):
    kv8, kvs = act_quant_ref(torch.randn(B, S, 512, device=DEV))
    pe = torch.randn(B, S, 64, device=DEV).bfloat16()
    q = torch.randn(B, T, H, 512, device=DEV) * 0.05
    qpe = torch.randn(B, T, H, 64, device=DEV) * 0.05
    return q, qpe, kv8, kvs, pe, torch.tensor(lens, device=DEV, dtype=torch.int32)


@pytest.mark.parametrize("B,T,H,S,lens", [(1, 1, 16, 100, [99]), (3, 2, 128, 1000, [5, 700, 998]), (2, 4, 20, 3001, [2000, 2997])])
@pytest.mark.parametrize("splits", [None, 1, 5])
@pytest.mark.parametrize("variant,cfg", [("fused", {}), ("split4", dict(block_h=32, block_n=32)), ("fused", dict(block_n=32))])
def test_mla_decode_dense(B, T, H, S, lens, splits, variant, cfg):
    q, qpe, kv8, kvs, pe, L = mla_inputs(B, T, H, S, lens)
    poison()
    o = mla_decode(q, qpe, kv8, kvs, pe, L, 0.0723, splits=splits, variant=variant, **cfg)
    check_close(f"mla dense B={B} T={T} H={H}", o, mla_decode_ref(q, qpe, kv8, kvs, pe, L, 0.0723), 1e-2)


@pytest.mark.parametrize("B,T,H,S,lens,J", [(1, 1, 128, 5000, [4999], 2048), (3, 3, 16, 700, [100, 300, 690], 64)])
@pytest.mark.parametrize("variant", ["split4", "fused"])
def test_mla_decode_sparse(B, T, H, S, lens, J, variant):
    q, qpe, kv8, kvs, pe, L = mla_inputs(B, T, H, S, lens)
    idx = torch.full((B, T, J), -1, dtype=torch.int32, device=DEV)
    for b in range(B):
        for t in range(T):
            n = min(J, lens[b] + t + 1) - (t % 2)  # some rows keep -1 padding
            idx[b, t, :n] = torch.randperm(lens[b] + t + 1, device=DEV)[:n].int()
    poison()
    o = mla_decode(q, qpe, kv8, kvs, pe, L, 0.0723, topk_idx=idx, out_dtype=torch.bfloat16, variant=variant)
    ref = mla_decode_ref(q, qpe, kv8, kvs, pe, L, 0.0723, topk_idx=idx)
    check_close(f"mla sparse B={B} T={T}", o.float(), ref, 1.5e-2)


# ----------------------------------------------------------------------------- indexer
@pytest.mark.parametrize("B,T,S,lens", [(1, 1, 100, [99]), (3, 4, 3000, [10, 2500, 2996]), (2, 2, 5000, [4998, 3000])])
@pytest.mark.parametrize("impl", ["radix", "radix_fused", "torch"])
def test_indexer(B, T, S, lens, impl):
    H, D, topk = 64, 128, 2048
    q8, qs = act_quant_ref(torch.randn(B, T, H, D, device=DEV))
    k8, ks = act_quant_ref(torch.randn(B, S, D, device=DEV))
    w = torch.randn(B, T, H, device=DEV) * H ** -0.5 * D ** -0.5
    L = torch.tensor(lens, device=DEV, dtype=torch.int32)
    poison()
    idx, sc = indexer_topk(q8, qs[..., 0], w, k8, ks[..., 0], L, topk, impl=impl)
    if impl != "torch":  # exactly the reference's rule on the kernel's own scores
        assert torch.equal(idx, topk_select_ref(sc, L, topk))
    ridx, rsc = indexer_topk_ref(q8, qs[..., 0], w, k8, ks[..., 0], L, topk)
    assert torch.equal(torch.isinf(sc), torch.isinf(rsc)), "masks differ"
    fin = torch.isfinite(rsc)
    err = ((sc[fin] - rsc[fin]).abs().max() / rsc[fin].abs().max()).item()
    assert err < 1e-3, f"score max err {err:.2e}"
    for b in range(B):
        for t in range(T):
            a, r = idx[b, t], ridx[b, t]
            assert (a >= 0).sum() == (r >= 0).sum()
            got = a[a >= 0].long()
            if got.numel():  # a differing pick must be a near tie at the top-k boundary
                kth = rsc[b, t][r[r >= 0].long()].min()
                assert (rsc[b, t][got] >= kth - 1e-3 * rsc[b, t][fin[b, t]].abs().max()).all()


# ----------------------------------------------------------------------------- radix top-k
def topk_scores(B, T, S, kind):
    if kind == "randn":
        return torch.randn(B, T, S, device=DEV)
    if kind == "ties":  # 7 values, -0.0 beside +0.0: the k-th key ties across many chunks
        sc = torch.randint(0, 7, (B, T, S), device=DEV).float() * 0.25 - 0.5
        return torch.where((sc == 0) & (torch.arange(S, device=DEV) % 2 == 1), -0.0, sc)
    if kind == "rounded":  # tens of exact ties near the k-th score: the pairwise-rank path with ties
        return torch.randn(B, T, S, device=DEV).mul(100).round().div(100)
    if kind == "narrow":  # every score shares its 16-bit prefix: all are candidates of the last stage
        return 1.0 + torch.randint(0, 5000, (B, T, S), device=DEV).float() * 1e-7
    raise ValueError(kind)


@pytest.mark.parametrize("B,T,S,lens,k", [(1, 1, 32768, [32767], 2048), (1, 4, 8192 + 3, [8192 - 1], 2048),
                                          (2, 3, 131072, [131000, 4000], 2048), (3, 2, 3001, [2999, 50, 1500], 1000),
                                          (1, 2, 777, [775], 2048)])
@pytest.mark.parametrize("kind", ["randn", "rounded", "ties", "narrow"])
def test_radix_topk(B, T, S, lens, k, kind):
    """The exact set (and order: positions ascending, then -1) of the stable-sort reference, ties included."""
    sc = topk_scores(B, T, S, kind)
    sc[..., 1] = float("-inf")
    L = torch.tensor(lens, device=DEV, dtype=torch.int32)
    poison()
    got = radix_topk(sc, L, k)
    want = topk_select_ref(sc, L, k)
    bad = (got != want).any(-1)
    assert not bad.any(), f"rows {torch.nonzero(bad).tolist()[:4]} differ ({kind})"


@pytest.mark.parametrize("chunks", [1, 3, 128])
def test_radix_topk_chunks_graph(chunks):
    """Any chunk count gives the same result; a captured call replays to it (no host sync, fresh workspace)."""
    if DEV != "cuda":
        pytest.skip("CUDA graphs")
    sc = topk_scores(1, 4, 32768, "ties")
    L = torch.tensor([32760], device=DEV)
    want = topk_select_ref(sc, L, 2048)
    assert torch.equal(radix_topk(sc, L, 2048, chunks=chunks), want)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = radix_topk(sc, L, 2048, chunks=chunks)
    for _ in range(3):
        out.fill_(-7)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


# ----------------------------------------------------------------------------- indexer launch settings, kept workspace
SCORES_SETTINGS = [dict(block_s=32), dict(block_s=128), dict(block_s=128, num_warps=8), dict(programs=132),
                   dict(programs=264, num_stages=2), dict(programs=264, block_s=128, num_stages=4),
                   dict(programs=528, num_stages=3), dict(programs=264, block_s=128, num_warps=8)]


def indexer_inputs(B, T, S, lens, H=64, D=128):
    q8, qs = act_quant_ref(torch.randn(B, T, H, D, device=DEV))
    k8, ks = act_quant_ref(torch.randn(B, S, D, device=DEV))
    w = torch.randn(B, T, H, device=DEV) * H ** -0.5 * D ** -0.5
    return q8, qs[..., 0], w, k8, ks[..., 0], torch.tensor(lens, device=DEV, dtype=torch.int32)


@pytest.mark.parametrize("B,T,S,lens", [(1, 1, 32768, [32767]), (1, 4, 32768, [32764]), (2, 3, 32768 + 5, [32770, 900])])
def test_indexer_scores_settings_bit_identical(B, T, S, lens):
    """Every launch setting of the scores kernel (tile width, warps, the looping kernel's programs and stages) gives
    the default kernel's scores and radix_fused histograms bit for bit, at the TP=8 rank's S = 32768, a tree too."""
    from mtp.kernels.indexer import indexer_scores
    from mtp.kernels.topk import topk_workspace

    args = indexer_inputs(B, T, S, lens)
    L = args[-1]
    vis = torch.arange(S, device=DEV).view(1, 1, S) < L.long().view(B, 1, 1)
    vis = vis | (torch.rand(B, T, S, device=DEV) < 0.3)
    for visible in (None, vis):
        want = indexer_scores(*args, visible=visible)
        ws0 = topk_workspace(B * T, DEV)
        indexer_scores(*args, visible=visible, hist=ws0)
        for kw in SCORES_SETTINGS:
            poison()
            got = indexer_scores(*args, visible=visible, **kw)
            assert torch.equal(got, want), f"{kw} tree={visible is not None}: {(got != want).sum()} scores differ"
            ws = topk_workspace(B * T, DEV)
            indexer_scores(*args, visible=visible, hist=ws, **kw)
            assert torch.equal(ws, ws0), f"{kw}: histograms differ"


@pytest.mark.parametrize("impl", ["radix", "radix_fused"])
def test_indexer_topk_kept_workspace_graph(impl):
    """The kept top-k workspace (rearm): eager calls over rows 1 and 4, three 'layers' in one captured graph
    replayed with new inputs, each giving the fresh workspace's index set; zero after every call and replay."""
    from mtp.kernels.topk import kept_workspace

    if DEV != "cuda":
        pytest.skip("CUDA graphs")
    S, k = 32768, 2048
    for T in (1, 4, 1):
        args = indexer_inputs(1, T, S, [S - T])
        idx, sc = indexer_topk(*args, k, impl=impl, rearm=True)
        assert torch.equal(idx, topk_select_ref(sc, args[-1], k))
        assert torch.equal(idx, indexer_topk(*args, k, impl=impl)[0])
        assert not kept_workspace(T, DEV).any()
    layers = [indexer_inputs(1, 2, S, [S - 2 - 100 * i]) for i in range(3)]
    kw = dict(impl=impl, rearm=True, scores=dict(programs=264))
    for a in layers:  # warm-up outside the capture: compiles, and the kept workspace exists
        indexer_topk(*a, k, **kw)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [indexer_topk(*a, k, **kw) for a in layers]
    for _ in range(3):
        for a in layers:
            for t, new in zip(a[:4], indexer_inputs(1, 2, S, [0])[:4]):
                t.copy_(new)
        g.replay()
        torch.cuda.synchronize()
        for a, (idx, sc) in zip(layers, outs):
            assert torch.equal(idx, topk_select_ref(sc, a[-1], k))
            assert torch.equal(idx, indexer_topk(*a, k, impl=impl)[0])
        assert not kept_workspace(2, DEV).any()
