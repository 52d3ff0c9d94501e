"""Forced routes (`mtp.bench.forced_route`) on the fast path at DeepSeek's widths (D = 7168, I = 2048; 32 experts in
8 groups of 4, 8 per token; rank 0 of 2 holds 16, so a drawn busiest count can exceed K = 8): `FastMoE` under a
drawn table (T = 1 and 8: persistent / pairs expert kernels; 40: grouped) against the reference module under the
same table, captured in a CUDA graph that replays a table rewritten in place, bit for bit as an eager call; with
the table cleared, the router kernel's result is the same bits as before it was set.
Run: pytest -m gpu tests/bench/test_forced_route_gpu.py (the CPU twin: tests/bench/test_forced_route.py).
"""

from __future__ import annotations

import pytest
import torch

from mtp.kernels import available

pytestmark = pytest.mark.gpu
if not available():
    pytest.skip("needs triton and a CUDA device", allow_module_level=True)

from mtp.backends.fast_path import FastMoE, disable_fast_path, fast_module  # noqa: E402
from mtp.bench.experts import busiest_routes  # noqa: E402
from mtp.bench.forced_route import clear_routes, force_routes  # noqa: E402
from mtp.decode.graphs import capture_graph  # noqa: E402

from ..kernels.test_kernels_gpu import check_close  # noqa: E402
from ..kernels.test_moe_grouped_gpu import DEV, _real_moe  # noqa: E402
from ..parallel.test_moe_ep import ep_modules  # noqa: E402


@pytest.mark.parametrize("T", [1, 8, 40])
@torch.no_grad()
def test_fast_moe_forced_routes_graph_replays_a_rewritten_table(T):
    moe, cfg = _real_moe(seed=T)
    with torch.device(DEV):
        m = ep_modules(moe, cfg, 2)[0]
    del moe
    draws = busiest_routes(cfg, "contiguous", 2, T, 2, seed=T, local=m.local_ids())
    if T >= 8:
        assert max(d.count for d in draws) > cfg.num_experts_per_tok, [d.count for d in draws]
    x = torch.randn(T, cfg.hidden_size, device=DEV, generator=torch.Generator(device=DEV).manual_seed(1))
    disable_fast_path(m)
    wants = []
    for d in draws:
        force_routes(m, d.w_TK, d.ids_TK)
        wants.append(m(x))
    clear_routes(m)
    fast_module(m)
    assert isinstance(m, FastMoE)
    plain = m(x)
    force_routes(m, draws[0].w_TK, draws[0].ids_TK)
    out = torch.empty_like(plain)
    graph = capture_graph(lambda: out.copy_(m(x)))
    for i, (d, want) in enumerate(zip(draws, wants)):
        assert not force_routes(m, d.w_TK, d.ids_TK)  # in place: the captured graph reads it
        graph.replay()
        torch.cuda.synchronize()
        check_close(f"FastMoE T={T} table {i} (graph)", out, want, 2e-2)
        assert torch.equal(out, m(x)), f"T={T} table {i}: graph replay != eager call"
    del graph
    clear_routes(m)
    assert torch.equal(m(x), plain), f"T={T}: the cleared gate changed the router kernel's result"
