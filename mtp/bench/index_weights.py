"""The indexer's head weights: the one-launch kernel (`kernels.index_weights`) against the cuBLAS path it replaced,
at DeepSeek-V3.2's shape (64 heads x 7168, bf16), rows 1..64 (decode / verify widths x batch). A section of
`mtp.bench.fused`:

    python -m mtp.bench.fused --only index_weights [--sweep]

Per row count: 'old' is what `mla_attend_fast` ran before, torch.mm(x, W^T, out_dtype=fp32) on a contiguous
W^T copy + mul_ (cuBLAS: split-K GEMM, its reduce kernel(s), the scale); 'off' the switch's off path now (the same
on a W.t() view: no copy); 'new' the kernel at its default plan. Each with its kernels per call (torch profiler).
--sweep also times the tiles around the default plan (BM, BH halved / doubled, 8 warps, 4 warps with the K walked in
chunks): the data to revise `index_weights_plan`. Timing as the section's module (`mtp.bench.kernels`): CUDA-graph
replays, W rotated over copies exceeding 3x the L2 (each layer's W comes from HBM in a step), median of 15.
"""

from __future__ import annotations

import torch

from mtp.bench import kernels as gk
from mtp.bench.timing import kernel_profile
from mtp.kernels.index_weights import index_weights, index_weights_plan, index_weights_ref

DEV = "cuda"
H, K = 64, 7168
SCALE = H ** -0.5 * 128 ** -0.5
ROWS = (1, 2, 4, 8, 16, 32, 64)


def _sweep_plans(N: int) -> list[tuple[int, int, int, int]]:
    """The default plan, BM and BH halved / doubled (accumulators <= 32 a lane), 8 warps, and 4 warps walking K in
    7 chunks (the shape ptxas issued 6 of 14 loads of before its first FMA)."""
    bm, bh, kv, nw = index_weights_plan(N, H, K, 8)
    plans = [(bm, bh, kv, nw)]
    for m in (bm // 2, bm, bm * 2):
        for h in (bh // 2, bh, bh * 2):
            if 1 <= m <= 8 and 1 <= h <= 8 and m * h <= 32 and (m, h) != (bm, bh):
                plans.append((m, h, kv, nw))
    return plans + [(bm, bh, 512, 8), (bm, bh, 128, 4)]


def index_weights_section(sweep: bool = False) -> dict:
    out = {}
    n_w = gk.n_sets(H * K * 2)
    ws = [(torch.randn(H, K, device=DEV) * 0.02).bfloat16() for _ in range(n_w)]
    wts = [w.t().contiguous() for w in ws]  # the old path's per-layer copy
    for N in ROWS:
        x = (torch.randn(N, K, device=DEV) * torch.logspace(-3, 1, K, device=DEV)).bfloat16()
        ref = index_weights_ref(x, ws[0], SCALE)
        got = index_weights(x, ws[0], SCALE)
        tol = 2.0 ** -18 * (x.double().abs() @ ws[0].double().abs().T) * SCALE  # tests/kernels/test_index_weights.py
        gk.check(f"index_weights N={N}", bool(((got.double() - ref.double()).abs() <= tol).all()),
                 f"max |diff| / bound {((got.double() - ref.double()).abs() / tol).max().item():.2f}")
        nbytes = H * K * 2 + N * K * 2 + N * H * 4
        calls = {"old": [lambda wt=wt: torch.mm(x, wt, out_dtype=torch.float32).mul_(SCALE) for wt in wts],
                 "off": [lambda w=w: torch.mm(x, w.t(), out_dtype=torch.float32).mul_(SCALE) for w in ws],
                 "new": [lambda w=w: index_weights(x, w, SCALE) for w in ws]}
        res = {}
        for name, fns in calls.items():
            res[name] = gk.graph_us(fns)
            prof = kernel_profile(fns[0], steps=3)
            res[f"{name} kernels"] = prof["kernels_per_step"]
            res[f"{name} names"] = [r["name"][:60] for r in prof["top"]]
            gk.row(f"index weights {name}", f"N={N} {H}x{K} bf16", res[name], nbytes,
                   kernels=prof["kernels_per_step"])
        if sweep:
            tiles = []
            for plan in _sweep_plans(N):
                us = gk.graph_us([lambda w=w, p=plan: index_weights(x, w, SCALE, plan=p) for w in ws])
                tiles.append(dict(plan=plan, us=round(us, 2)))
            tiles.sort(key=lambda r: r["us"])
            res["sweep"] = tiles
            gk.log(f"[sweep] index weights N={N}: default {index_weights_plan(N, H, K, 8)}; best {tiles[:3]}; "
                   f"worst {tiles[-1]}")
        out[f"N={N}"] = res
    gk.log("index weights, us per call (kernels per call): " + "; ".join(
        f"N={N} old {r['old']:.2f} ({r['old kernels']:.0f}) new {r['new']:.2f} ({r['new kernels']:.0f})"
        + (f" best tile {r['sweep'][0]['plan']} {r['sweep'][0]['us']:.2f}" if "sweep" in r else "")
        for N, r in ((int(k[2:]), v) for k, v in out.items())))
    return out
