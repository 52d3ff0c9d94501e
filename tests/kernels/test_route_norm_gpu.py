"""A MoE layer's post-attention add + norm + quant in its router's launch (`router.moe_route_norm`, switch
`FastPathOptions.route_norm`) on the device (pytest -m gpu), at the real TP=8 split rank's shapes (D = 7168, E = 256,
DeepSeek's 8 groups of 32, top-8): the same bits as the two launches it replaces (`norm_quant.add_rms_norm_quant`,
then `router.moe_route_fused` on its x: 'auto', the grouped tail on 4 warps where the one launch runs the norm's 8),
torch.equal on h_new, x, x8, sx, weights, ids and logits:
- alone, at 1, 3 and 4 tokens ('auto') and 2 (impl 'grouped' on both sides), the all-reduced fp32 sum rounded to
  bf16 inside or a bf16 delta, all experts, a rank's range and a table; again after a poisoned allocator (every output
  written) and twice (its counters re-armed);
- under PDL (both trigger modes, with and without the gate's L2 prefetch), chained between an fp32 GEMM that makes
  delta and the experts that read x and the routes, eagerly and on 50 CUDA-graph replays, against the plain chain of
  the two launches;
- in a simulated TP=8 'split' rank's decode step (one dense and one MoE layer, one MTP module, as `mtp-bench --tp 8`
  builds it) captured as a graph, 1..4 tokens at 1k keys: logits, hidden and the MTP module's logits with the switch
  on equal off, and the one launch ran where it should (1, 3 and 4 tokens: the trunk's and the MTP module's MoE).
The CPU side (the interpreter's bits, the compiled layouts that make the GPU's bits equal): tests/kernels/
test_route_norm.py.
"""

from __future__ import annotations

import pytest
import torch

from mtp.kernels import available

pytestmark = pytest.mark.gpu
if not available():
    pytest.skip("needs triton and a CUDA device", allow_module_level=True)

from mtp.kernels.dispatch import expert_map  # noqa: E402
from mtp.kernels.norm_quant import add_rms_norm_quant  # noqa: E402
from mtp.kernels.router import moe_route_fused, moe_route_norm  # noqa: E402

from .test_kernels_gpu import poison, rand_weight  # noqa: E402

D, E, REPLAYS = 7168, 256, 50
NAMES = ("h", "x", "x8", "sx", "weights", "ids", "logits")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b)


def _inputs(T: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(T, D, device="cuda", generator=g) * 3
    delta = torch.randn(T, D, device="cuda", generator=g) * 2
    nw = (torch.rand(D, device="cuda", generator=g) + 0.5).bfloat16()
    wg = (torch.randn(E, D, device="cuda", generator=g) * 0.02).bfloat16()
    bias = torch.randn(E, device="cuda", generator=g) * 0.05
    return h, delta, nw, wg, bias


def _two_launches(h, delta, nw, wg, bias, round_dtype, impl="auto", **kw):
    hn, x, x8, sx = add_rms_norm_quant(h, delta, nw, 1e-6, round_dtype=round_dtype, pdl=kw.get("pdl", False))
    return (hn, x, x8, sx, *moe_route_fused(x, wg, bias, impl=impl, **kw))


@pytest.mark.parametrize("T", [1, 2, 3, 4])
@pytest.mark.parametrize("delta_kind", ["fp32_sum", "bf16"])
@pytest.mark.parametrize("local", [None, "range", "table"])
@torch.no_grad()
def test_route_norm_equals_the_two_launches(T, delta_kind, local):
    h, delta, nw, wg, bias = _inputs(T, seed=10 * T + len(delta_kind))
    rd = torch.bfloat16 if delta_kind == "fp32_sum" else None
    if delta_kind == "bf16":
        delta = delta.bfloat16()
    if local == "range":
        local = (96, 128)
    elif local == "table":
        local = expert_map(sorted(torch.randperm(E)[:40].tolist()), E, "cuda").router
    impl = "grouped" if T == 2 else "auto"  # 'auto' runs the serial tail at 2 tokens, which the one launch has not
    kw = dict(local=local, return_logits=True)
    want = _two_launches(h, delta, nw, wg, bias, rd, impl=impl, **kw)
    poison()
    got = moe_route_norm(h, delta, nw, 1e-6, wg, bias, round_dtype=rd, impl=impl, **kw)
    bad = [n for n, a, b in zip(NAMES, got, want) if not _same(a, b)]
    assert not bad, f"T = {T}: {bad} differ from the two launches'"
    again = moe_route_norm(h, delta, nw, 1e-6, wg, bias, round_dtype=rd, impl=impl, **kw)
    assert all(_same(a, b) for a, b in zip(again, got)), "a second call differs (the counters' re-arm)"
    assert torch.isfinite(got[1].float()).all() and (got[5] >= -1).all()


@pytest.mark.parametrize("T", [1, 2, 3, 4])
@pytest.mark.parametrize("mode,prefetch", [(1, True), (2, True), (1, False)])
@torch.no_grad()
def test_route_norm_under_pdl_in_a_graph(T, mode, prefetch):
    """The chain o_proj-like fp32 GEMM -> add + norm + quant + router -> the experts (the split rank's stack of 256
    routed experts at 1/8 width and the shared one), with PDL (mode: `_triton.PDL_EARLY` 1 / PDL_AFTER_WAIT 2) on every
    launch, equals the plain chain of the two launches, eagerly and on every replay of its graph."""
    from mtp.decode.graphs import capture_graph
    from mtp.kernels.fp8_gemm import fp8_linear
    from mtp.kernels.moe import moe_experts

    h, _, nw, wg, bias = _inputs(T, seed=T)
    o = torch.randn(max(T, 2), 2048, device="cuda").bfloat16()  # 16 heads x 128: o_proj's input
    w_o, s_o = rand_weight(D, 2048)
    stack = []
    for n, k in ((256, D), (256, D), (D, 256)):
        w8, sw = rand_weight((E + 1) * n, k)
        stack += [w8.view(E + 1, n, k), sw.view(E + 1, n // 128, k // 128)]
    impl = "grouped" if T == 2 else "auto"

    def chain(pdl, fused):
        a = fp8_linear(o, w_o, s_o, out_dtype=torch.float32, pdl=pdl, prefetch=prefetch)[:T]
        if fused:
            hn, x, x8, sx, w, ids = moe_route_norm(h, a, nw, 1e-6, wg, bias, round_dtype=torch.bfloat16, impl=impl,
                                                   pdl=pdl, prefetch=prefetch)
        else:
            hn, x, x8, sx, w, ids = _two_launches(h, a, nw, wg, bias, torch.bfloat16, impl=impl, pdl=pdl,
                                                  prefetch=prefetch)
        m = moe_experts(x, ids, w, *stack, out_dtype=torch.float32, shared=True, pdl=pdl, prefetch=prefetch)
        return [a, hn, x, x8, sx, w, ids, m]

    want = chain(False, False)
    assert all(_same(a, b) for a, b in zip(chain(False, True), want)), "the fused chain differs without PDL"
    assert all(_same(a, b) for a, b in zip(chain(mode, True), want)), "the fused chain differs with PDL, eagerly"
    box = {}
    graph = capture_graph(lambda: box.__setitem__("out", chain(mode, True)))
    bad = []
    for i in range(REPLAYS):
        graph.replay()
        torch.cuda.synchronize()
        bad += [(i, j) for j, (a, b) in enumerate(zip(box["out"], want)) if not _same(a, b)]
    assert not bad, f"PDL graph replays differ (replay, output): {bad[:10]}"


@pytest.mark.slow
@torch.no_grad()
def test_rank_decode_step_with_route_norm_equals_off():
    """`mtp-bench --tp 8`'s rank (rank 3, 'split' experts, the simulated group: NCCL's path, the all-reduced fp32
    sum rounded in the add) at 1k keys, 1..4 tokens, each step a CUDA graph: the switch on (every width it takes)
    gives the switch off's logits, hidden and MTP logits bit for bit; the one launch ran at 1, 3 and 4 tokens, once
    per MoE block (the trunk's and the MTP module's), and not at 2."""
    import mtp.backends.fast_path as fp
    from mtp.checkpoint.synthetic import fill_cache_random
    from mtp.decode.graphs import capture_graph
    from mtp.model.presets import real_config
    from mtp.parallel import ParallelPlan
    from mtp.parallel.simulate import simulated_rank
    from mtp.parallel.synthetic import random_parallel_model

    cfg = real_config(layers=2, dense_layers=1, mtp_modules=1)
    calls = []
    fused = fp.moe_route_norm
    fp.moe_route_norm = lambda h, *a, **k: calls.append(h.shape[0]) or fused(h, *a, **k)
    try:
        with simulated_rank(8, 3) as comm:
            model = random_parallel_model(cfg, comm, ParallelPlan(8, expert_layout="split"), device="cuda",
                                          dtype=torch.bfloat16, seed=0)
            fp.enable_fast_path(model)
            L = 1024
            for w in (1, 2, 3, 4):
                cache = fill_cache_random(model.new_cache(1, L + 8), L, seed=w)
                mcache = fill_cache_random(model.new_cache(1, L + 8, n_layers=1), L, seed=w + 1)
                base, mbase = cache.seq_lens.clone(), mcache.seq_lens.clone()
                ids = torch.randint(0, cfg.vocab_size, (1, w), generator=torch.Generator().manual_seed(w)).cuda()
                box, out = {}, {}

                def step():
                    cache.truncate(base)
                    mcache.truncate(mbase)
                    res = model(ids, cache, kv_len=L + w)
                    mtp = model.mtp_forward(0, ids, res.hidden, mcache, kv_len=L + w).logits
                    box["out"] = (res.logits, res.hidden, mtp)

                for on in (False, True):
                    fp.set_kernels(model, route_norm=on, route_norm_tokens=16)
                    calls.clear()
                    graph = capture_graph(step)
                    assert calls == ([w, w] * 3 if on and w != 2 else []), (w, on, calls)  # warm-ups + capture
                    graph.replay()
                    torch.cuda.synchronize()
                    out[on] = [t.clone() for t in box["out"]]
                    del graph
                assert all(torch.equal(a, b) for a, b in zip(out[True], out[False])), f"w = {w}: switch on differs"
                assert all(torch.isfinite(t).all() for t in out[True])
    finally:
        fp.moe_route_norm = fused
