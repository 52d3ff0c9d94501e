"""`FastMoE` on CUDA for every expert layout (`mtp.placement`), on rank 3 of a simulated TP = 8 group
(`mtp.parallel.simulate`) at DeepSeek's widths (256 experts in 8 groups, 8 per token, D = 7168, I = 2048; one dense
and one MoE layer, random FP8 weights, bf16), as `mtp-bench --tp 8` builds a rank: the rank's MoE on the fast path
against the same module on the reference path (its static CUDA loop over the rank's experts), at 1, 2, 4 and 8
tokens (the persistent expert grid, or the pair grid under 'split'), 40 (the grouped GEMM) and 300 (the reference
router, whose ids the rank's table maps in torch); the router kernel's local ids equal the rank's table applied to
the ids `route_from_logits_ref` picks from the kernel's own logits, bit for bit; and a captured CUDA graph of the
MoE replays the eager call bit for bit (the table is a device tensor the graph reads).
Run: pytest -m gpu tests/parallel/test_layouts_fast_path_gpu.py (the CPU twins: test_layouts_fast_path.py,
test_moe_ep.py). ~1 minute on an H100 (most of it building the ranks).
"""

from __future__ import annotations

import pytest
import torch

from mtp.kernels import available

pytestmark = pytest.mark.gpu
if not available():
    pytest.skip("needs triton and a CUDA device", allow_module_level=True)

from mtp.backends.fast_path import FastMoE, disable_fast_path, fast_module  # noqa: E402
from mtp.decode.graphs import capture_graph  # noqa: E402
from mtp.kernels.dispatch import local_ids  # noqa: E402
from mtp.kernels.router import moe_route_fused, route_from_logits_ref  # noqa: E402
from mtp.model.presets import real_config  # noqa: E402
from mtp.parallel import ParallelPlan  # noqa: E402
from mtp.parallel.simulate import simulated_rank  # noqa: E402
from mtp.parallel.synthetic import random_parallel_model  # noqa: E402
from mtp.placement import EXPERT_LAYOUTS  # noqa: E402

from ..kernels.test_kernels_gpu import check_close  # noqa: E402

WORLD, RANK = 8, 3
TOKENS = (1, 2, 4, 8, 40, 300)


@pytest.mark.parametrize("layout", EXPERT_LAYOUTS)
@torch.no_grad()
def test_fast_moe_equals_the_reference_on_a_simulated_rank(layout):
    cfg = real_config(layers=2, dense_layers=1, mtp_modules=0)
    with simulated_rank(WORLD, RANK) as comm:
        model = random_parallel_model(cfg, comm, ParallelPlan(WORLD, expert_layout=layout), device="cuda",
                                      dtype=torch.bfloat16, seed=0)
        moe = model.model.layers[1].mlp
        held = list(moe.local_ids())
        assert len(held) == (256 if layout == "split" else 32)
        g = torch.Generator(device="cuda").manual_seed(1)
        xs = {T: torch.randn(T, cfg.hidden_size, device="cuda", generator=g).bfloat16() for T in TOKENS}
        want = {T: (moe(x), moe.routed(x)) for T, x in xs.items()}  # reference: the static loop on CUDA
        fast_module(moe)
        assert isinstance(moe, FastMoE)
        table, router = moe.id_map.table, moe.id_map.router
        assert (table is None) == (layout == "split")
        if table is not None:  # every held expert at its place in the stack, every other one -1
            want_table = torch.full((256,), -1, dtype=torch.int32)
            want_table[held] = torch.arange(len(held), dtype=torch.int32)
            assert torch.equal(table.cpu(), want_table)
            assert isinstance(router, tuple) == (layout == "contiguous")
        for T, x in xs.items():
            out, routed = moe(x), moe.routed(x)
            # 0.05 as tests/kernels/test_kernels_gpu.py's moe_experts vs its reference: the re-quantized h lands
            # on a neighbouring fp8 code near a rounding boundary (a 6-12% step on that element); fewer channels
            # per expert ('split': 256 of I) average fewer such flips (H200, session 10: 'split' T = 1 2.2e-2,
            # 'permuted' T = 2 2.6e-2); a wrong expert, slot or map is O(1)
            check_close(f"{layout} T={T} FastMoE forward", out.float(), want[T][0].float(), 0.05)
            check_close(f"{layout} T={T} routed sum", routed, want[T][1], 0.05)
            if T <= 16:
                gate = moe.gate
                w, ids, logits = moe_route_fused(x, gate.weight, gate.e_score_correction_bias, n_group=gate.n_groups,
                                                 topk_group=gate.topk_groups, topk=gate.topk,
                                                 route_scale=gate.route_scale, return_logits=True, local=router)
                wr, ir = route_from_logits_ref(logits, gate.e_score_correction_bias, gate.n_groups,
                                               gate.topk_groups, gate.topk, gate.route_scale)
                assert torch.equal(ids, local_ids(ir, table)), (layout, T, ids.tolist(), ir.tolist())
        x = xs[4]
        out = torch.empty_like(moe(x))
        graph = capture_graph(lambda: out.copy_(moe(x)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, moe(x)), f"{layout}: graph replay != eager call"
        del graph
        disable_fast_path(moe)
