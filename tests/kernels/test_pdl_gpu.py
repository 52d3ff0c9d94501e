"""Programmatic dependent launch (switch `FastPathOptions.pdl`) on the device (pytest -m gpu; Hopper, else skipped).

- A whole decode forward of a simulated TP=8 'split' rank at DeepSeek-V3.2's widths (one dense and one MoE layer,
  one MTP module, random FP8 weights, bf16; as `mtp-bench --tp 8` builds a rank): trunk, head and the MTP module
  captured as one CUDA graph with the switch on give the switch off's logits, hidden and cache bytes, bit for bit,
  on each of 50 replays in a row (a kernel reading before its wait, or storing before it, shows up as a flaky
  difference), and eagerly; at 1k keys (dense attention) and 3k (the indexer's top-k), 1, 2 and 4 tokens
  (the split-K GEMV and the persistent experts; the few-row GEMM, act_quant; the experts' pair grid), radix and
  radix_fused top-k; and with pdl_prefetch_tokens 0 (the kernels' L2 prefetches of their weights compiled out) at
  1..4 tokens.
- Each PDL entry point at the rank's shapes, eagerly with pdl on and off (the same bits), and all of them as one
  chain of PDL launches captured in a graph, replayed 50 times against the plain launches' bits; with and without
  the L2 prefetches (`prefetch=`).
The CPU side (PTX order, the interpreter's PDL branches, every launch of a step asking for PDL):
tests/kernels/test_pdl.py. ~2-3 minutes on an H100 (measured before the no-prefetch cases), most of it compiling
both variants of every kernel.
"""

from __future__ import annotations

import pytest
import torch

from mtp.kernels import available

pytestmark = pytest.mark.gpu
if not available():
    pytest.skip("needs triton and a CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("PDL needs Hopper", allow_module_level=True)

from mtp.backends.fast_path import enable_fast_path, set_kernel_options, set_kernels  # noqa: E402
from mtp.checkpoint.synthetic import fill_cache_random  # noqa: E402
from mtp.decode.graphs import capture_graph  # noqa: E402
from mtp.model.presets import real_config  # noqa: E402
from mtp.parallel import ParallelPlan  # noqa: E402
from mtp.parallel.simulate import simulated_rank  # noqa: E402
from mtp.parallel.synthetic import random_parallel_model  # noqa: E402

from .test_kernels_gpu import rand_weight  # noqa: E402

WORLD, RANK, REPLAYS = 8, 3, 50
CACHE = ("kv", "kv_scale", "pe", "idx_k", "idx_k_scale")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b)


@pytest.fixture(scope="module")
def rank():
    """Rank 3 of a simulated TP=8 group, 'split' experts, on the fast path (the bench's rank, 2 layers)."""
    cfg = real_config(layers=2, dense_layers=1, mtp_modules=1)
    with simulated_rank(WORLD, RANK) as comm:
        with torch.no_grad():
            model = random_parallel_model(cfg, comm, ParallelPlan(WORLD, expert_layout="split"), device="cuda",
                                          dtype=torch.bfloat16, seed=0)
            enable_fast_path(model)
        yield model


@pytest.mark.slow
@pytest.mark.parametrize("L,w,topk,prefetch,early", [(1024, 1, "radix", True, 64), (3000, 1, "radix", True, 64),
                                                     (3000, 2, "radix", True, 64), (3000, 4, "radix", True, 64),
                                                     (3000, 1, "radix_fused", True, 64), (1024, 1, "radix", False, 64),
                                                     (3000, 2, "radix", False, 64), (3000, 3, "radix", False, 64),
                                                     (3000, 4, "radix", False, 64), (3000, 1, "radix_fused", True, 0),
                                                     (3000, 4, "radix", True, 0)])
@torch.no_grad()
def test_decode_step_graph_with_pdl_equals_plain(rank, L, w, topk, prefetch, early):
    """early: pdl_early_tokens (64: every kernel triggers its successor at its start; 0: after its own wait)."""
    model, cfg = rank, rank.cfg
    set_kernel_options(model, indexer_topk=topk)
    cache = fill_cache_random(model.new_cache(1, L + 8), L, seed=L)
    mcache = fill_cache_random(model.new_cache(1, L + 8, n_layers=1), L, seed=L + 1)
    base, mbase = cache.seq_lens.clone(), mcache.seq_lens.clone()
    g = torch.Generator().manual_seed(w)
    ids = torch.randint(0, cfg.vocab_size, (1, w), generator=g).cuda()
    box = {}

    def step():
        cache.truncate(base)
        mcache.truncate(mbase)
        res = model(ids, cache, kv_len=L + w)
        box["out"] = (res.logits, res.hidden, model.mtp_forward(0, ids, res.hidden, mcache, kv_len=L + w).logits)

    def snapshot():
        bufs = [getattr(c, n)[..., L:L + w, :].clone() if getattr(c, n).dim() == 4 else
                getattr(c, n)[..., L:L + w].clone() for c in (cache, mcache) for n in CACHE]
        return [t.clone() for t in box["out"]] + bufs

    graphs, want = {}, None
    try:
        for pdl in (False, True):
            # every width (the default chains 1-token calls only); prefetch False: the weights' L2 prefetches
            # compiled out (variant pdl_all_nopf)
            set_kernels(model, pdl=pdl, pdl_tokens=64, pdl_prefetch_tokens=64 if prefetch else 0, pdl_early_tokens=early)
            step()  # eager
            eager = snapshot()
            graphs[pdl] = capture_graph(step)
            if not pdl:
                graphs[pdl].replay()
                torch.cuda.synchronize()
                want = snapshot()
                assert all(_same(a, b) for a, b in zip(eager, want)), "the plain graph differs from its eager step"
            else:
                assert all(_same(a, b) for a, b in zip(eager, want)), "eager with PDL differs from without"
        assert all(torch.isfinite(t).all() for t in want[:3])
        bad = []
        for i in range(REPLAYS):
            graphs[True].replay()
            torch.cuda.synchronize()
            got = snapshot()
            bad += [(i, j) for j, (a, b) in enumerate(zip(got, want)) if not _same(a, b)]
        assert not bad, f"PDL replays differ (replay, output): {bad[:10]} of {REPLAYS} replays"
    finally:
        set_kernels(model, pdl=False, pdl_prefetch_tokens=64, pdl_early_tokens=64)
        set_kernel_options(model, indexer_topk="radix")
        graphs.clear()


@pytest.mark.parametrize("prefetch,mode", [(True, 1), (False, 1), (True, 2)])
@torch.no_grad()
def test_pdl_entry_points_chained_in_a_graph_equal_plain(prefetch, mode):
    """Every PDL entry point at the TP=8 rank's shapes (16 heads, the indexer's 64, a split rank's experts at
    1/8 width), chained as a decode block chains them, each reading the one before: eagerly and on 50 graph
    replays the PDL chain gives the plain chain's bits, with the weights' L2 prefetches and without (`prefetch`,
    pdl_prefetch_tokens 0), each kernel triggering its successor at its start (mode 1, `_triton.PDL_EARLY`) or
    after its wait (mode 2, PDL_AFTER_WAIT)."""
    from mtp.kernels.absorb import absorb_out, absorb_q
    from mtp.kernels.elementwise import silu_mul
    from mtp.kernels.fp8_gemm import fp8_linear
    from mtp.kernels.gemv_splitk import fp8_gemv
    from mtp.kernels.index_weights import index_weights
    from mtp.kernels.indexer import indexer_topk
    from mtp.kernels.mla_decode import mla_decode
    from mtp.kernels.moe import moe_experts
    from mtp.kernels.norm_quant import add_rms_norm_quant, add_rounded
    from mtp.kernels.router import moe_route_fused
    from mtp.model.fp8 import act_quant

    g = torch.Generator(device="cuda").manual_seed(0)

    def rn(*shape, s=1.0):
        return torch.randn(*shape, device="cuda", generator=g) * s

    D, H, S, L, E, inner = 7168, 16, 4096, 3000, 256, 256
    h, wn = rn(1, D), (torch.rand(D, device="cuda", generator=g) + 0.5).bfloat16()
    w_qa, s_qa = rand_weight(H * 128, D)  # q_nope's width (the q_b GEMV stands in)
    w_kb, w_vb = rn(H, 128, 512, s=0.05).bfloat16(), rn(H, 128, 512, s=0.05).bfloat16()
    w_o, s_o = rand_weight(D, H * 128)
    kv8, kvs = act_quant(rn(1, S, 512))
    pe = rn(1, S, 64).bfloat16()
    ik8, iks = act_quant(rn(1, S, 128))
    lens = torch.tensor([L], device="cuda")
    wi = rn(64, D, s=0.02).bfloat16()
    wg, bias = rn(E, D, s=0.02).bfloat16(), rn(E, s=0.05)
    stack = []  # gate, up, down of E routed experts and the shared one, [E + 1, N, K] + scales
    for n, k in ((inner, D), (inner, D), (D, inner)):
        w8, sw = rand_weight((E + 1) * n, k)
        stack += [w8.view(E + 1, n, k), sw.view(E + 1, n // 128, k // 128)]
    w_gu, s_gu = rand_weight(2 * 2304, D)
    w_dn, s_dn = rand_weight(D, 2304)

    pf = prefetch

    def chain(pdl):
        hn, y, x8, sx = add_rms_norm_quant(h, None, wn, 1e-6, pdl=pdl)
        q = fp8_gemv(None, w_qa, s_qa, xq=(x8, sx), out_dtype=torch.bfloat16, pdl=pdl).view(1, 1, H, 128)
        q_lat = absorb_q(q, w_kb, pdl=pdl, prefetch=pf)
        iq8, iqs = act_quant(q.repeat(1, 1, 4, 1).float())  # 64 indexer heads from q (a stand-in, in torch)
        wts = index_weights(y.view(1, 1, D), wi, 0.01, pdl=pdl)
        idx, _ = indexer_topk(iq8, iqs.squeeze(-1), wts, ik8, iks.squeeze(-1), lens, topk=2048, rearm=True, pdl=pdl)
        o_lat = mla_decode(q_lat, q_lat[..., :64].contiguous(), kv8, kvs, pe, lens, 0.07, topk_idx=idx,
                           out_dtype=torch.bfloat16, pdl=pdl)
        o = absorb_out(o_lat, w_vb, pdl=pdl, prefetch=pf)
        a = fp8_linear(o.view(1, H * 128).repeat(2, 1), w_o, s_o, out_dtype=torch.float32, pdl=pdl, prefetch=pf)[:1]
        h2, y2, x28, sx2 = add_rms_norm_quant(h, a, wn, 1e-6, round_dtype=torch.bfloat16, pdl=pdl)
        wr, ir = moe_route_fused(y2, wg, bias, pdl=pdl, prefetch=pf)
        m = moe_experts(y2, ir, wr, *stack, out_dtype=torch.float32, shared=True, pdl=pdl, prefetch=pf)
        h3 = add_rounded(h2, m, torch.bfloat16, pdl=pdl)
        gu = fp8_gemv(None, w_gu, s_gu, xq=(x28, sx2), out_dtype=torch.bfloat16, pdl=pdl)
        d = fp8_gemv(silu_mul(gu[:, :2304], gu[:, 2304:], torch.bfloat16, pdl=pdl), w_dn, s_dn,
                     out_dtype=torch.float32, pdl=pdl)
        return [hn, q_lat, wts, idx, o_lat, o, a, h2, wr, ir, m, h3, d]

    want = chain(False)
    assert all(_same(a, b) for a, b in zip(chain(mode), want)), "the eager PDL chain differs"
    box = {}
    graph = capture_graph(lambda: box.__setitem__("out", chain(mode)))
    bad = []
    for i in range(REPLAYS):
        graph.replay()
        torch.cuda.synchronize()
        bad += [(i, j) for j, (a, b) in enumerate(zip(box["out"], want)) if not _same(a, b)]
    assert not bad, f"PDL chain replays differ (replay, output): {bad[:10]}"
