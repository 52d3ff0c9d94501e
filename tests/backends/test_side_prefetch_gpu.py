"""The side-stream L2 prefetch (switch `FastPathOptions.l2_prefetch`, `mtp.backends.side_prefetch`) in a decode step on
the device (pytest -m gpu).

A simulated TP=8 'split' rank at DeepSeek-V3.2's widths (one dense and two MoE layers, one MTP module, random FP8
weights, bf16; as `mtp-bench --tp 8` builds a rank), trunk, head and MTP module:
- with the switch on (each variant: both points, the late tail, evict_last, bulk), eagerly and captured as one CUDA
  graph (the side stream forked and joined inside the capture; PDL on the one-token launches, the default) and
  replayed 20 times, the switch off's logits, hidden and cache bytes, bit for bit; at 1k keys (no indexer scores) and
  3k (the indexer's top-k), 1 and 2 tokens;
- the captured graph holds one prefetch kernel per point (3 tails, 2 heads) and, where the CUDA graph's DOT dump
  shows edge types, as many programmatic (PDL) edges as the graph without the switch: the fork does not cut the chain.
CPU side: tests/backends/test_side_prefetch.py; the kernel alone: tests/kernels/test_l2_prefetch_gpu.py.
"""

from __future__ import annotations

import re

import pytest
import torch

from mtp.kernels import available

pytestmark = pytest.mark.gpu
if not available():
    pytest.skip("needs triton and a CUDA device", allow_module_level=True)

from mtp.backends.fast_path import enable_fast_path, set_kernels  # noqa: E402
from mtp.checkpoint.synthetic import fill_cache_random  # noqa: E402
from mtp.decode.graphs import capture_graph  # noqa: E402
from mtp.model.presets import real_config  # noqa: E402
from mtp.parallel import ParallelPlan  # noqa: E402
from mtp.parallel.simulate import simulated_rank  # noqa: E402
from mtp.parallel.synthetic import random_parallel_model  # noqa: E402

WORLD, RANK, REPLAYS = 8, 3, 20
CACHE = ("kv", "kv_scale", "pe", "idx_k", "idx_k_scale")
VARIANTS = {
    "both": dict(l2_prefetch=True),
    "late": dict(l2_prefetch=True, l2_prefetch_tail_late=True),
    "evict_last": dict(l2_prefetch=True, l2_evict_last=True),
    "bulk": dict(l2_prefetch=True, l2_bulk=True),
}
OFF = dict(l2_prefetch=False, l2_prefetch_tail_late=False, l2_evict_last=False, l2_bulk=False)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b)


@pytest.fixture(scope="module")
def rank():
    """Rank 3 of a simulated TP=8 group, 'split' experts, on the fast path (the bench's rank, 3 layers)."""
    cfg = real_config(layers=3, dense_layers=1, mtp_modules=1)
    with simulated_rank(WORLD, RANK) as comm:
        with torch.no_grad():
            model = random_parallel_model(cfg, comm, ParallelPlan(WORLD, expert_layout="split"), device="cuda",
                                          dtype=torch.bfloat16, seed=0)
            enable_fast_path(model)
        yield model


def _step(model, L: int, w: int):
    """(step, snapshot): one decode forward of trunk, head and MTP module at L keys and w tokens, re-runnable (the
    caches truncated back first), and a copy of its outputs and the cache entries it wrote."""
    cfg = model.cfg
    cache = fill_cache_random(model.new_cache(1, L + 8), L, seed=L)
    mcache = fill_cache_random(model.new_cache(1, L + 8, n_layers=1), L, seed=L + 1)
    base, mbase = cache.seq_lens.clone(), mcache.seq_lens.clone()
    ids = torch.randint(0, cfg.vocab_size, (1, w), generator=torch.Generator().manual_seed(w)).cuda()
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

    return step, snapshot


_want: dict = {}


def _off(model, L: int, w: int) -> list[torch.Tensor]:
    """The switch off's outputs at (L, w), from its graph (checked equal to its eager step), once per shape."""
    if (L, w) not in _want:
        set_kernels(model, **OFF)
        step, snapshot = _step(model, L, w)
        step()
        eager = snapshot()
        graph = capture_graph(step)
        graph.replay()
        torch.cuda.synchronize()
        _want[L, w] = snapshot()
        del graph
        assert all(_same(a, b) for a, b in zip(eager, _want[L, w])), "the plain graph differs from its eager step"
        assert all(torch.isfinite(t).all() for t in _want[L, w][:3])
    return _want[L, w]


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("L,w", [(1024, 1), (3000, 1), (1024, 2)])
@torch.no_grad()
def test_decode_step_with_prefetch_equals_off(rank, L, w, variant):
    model = rank
    if VARIANTS[variant].get("l2_bulk") and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("cp.async.bulk.prefetch needs sm_90")
    want = _off(model, L, w)
    try:
        set_kernels(model, **{**OFF, **VARIANTS[variant]})
        step, snapshot = _step(model, L, w)
        step()
        torch.cuda.synchronize()
        assert all(_same(a, b) for a, b in zip(snapshot(), want)), f"{variant}: eager differs from the switch off"
        graph = capture_graph(step)
        bad = []
        for i in range(REPLAYS):
            graph.replay()
            torch.cuda.synchronize()
            bad += [(i, j) for j, (a, b) in enumerate(zip(snapshot(), want)) if not _same(a, b)]
        del graph
        assert not bad, f"{variant}: replays differ from the switch off (replay, output): {bad[:10]}"
    finally:
        set_kernels(model, **OFF)


def _dot(model, step, tmp_path, name: str) -> str:
    """The CUDA graph of `step` as the driver's DOT dump (warm-up on a side stream first, as `capture_graph`)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    graph.enable_debug_mode()
    with torch.cuda.graph(graph):
        step()
    path = tmp_path / f"{name}.dot"
    graph.debug_dump(str(path))
    return path.read_text()


@torch.no_grad()
def test_graph_holds_the_prefetches_and_keeps_pdl_edges(rank, tmp_path):
    model = rank
    dots = {}
    try:
        for name, flags in (("off", OFF), ("on", {**OFF, **VARIANTS["both"]})):
            set_kernels(model, **flags)
            step, _ = _step(model, 1024, 1)
            dots[name] = _dot(model, step, tmp_path, name)
    finally:
        set_kernels(model, **OFF)
    def lines(dot: str, name: str) -> int:  # the DOT dump declares a node per line
        return sum(name in line for line in dot.splitlines())

    assert lines(dots["off"], "_l2_prefetch_kernel") == 0
    assert lines(dots["off"], "_gemv_fma_kernel") == lines(dots["on"], "_gemv_fma_kernel"), "the GEMVs changed"
    n = lines(dots["on"], "_l2_prefetch_kernel")
    assert n >= 5, f"3 tails and 2 heads: 5 prefetch kernels in the graph, the DOT names {n}"
    prog = {k: len(re.findall(r"programmatic", d, flags=re.IGNORECASE)) for k, d in dots.items()}
    if prog["off"] == 0:
        pytest.skip(f"this driver's DOT dump shows no edge types (prefetch kernels: {n}); PDL edges unchecked")
    assert prog["on"] >= prog["off"], f"the fork cut PDL edges: {prog}"
