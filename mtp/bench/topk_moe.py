"""Time the indexer top-k and the routed-expert kernels, old vs new, side by side in one run on one GPU.

    python -m mtp.bench.topk_moe [--out DIR] [--only topk,moe] [--quick]

topk: torch.topk (`topk_from_scores`, sorted=False: the old fast path) vs `radix_topk`, the indexer scores
kernel alone, the whole `indexer_topk` per impl (torch / radix / radix_fused: histograms in the scores
kernel), at S = 8192 / 32768 / 131072 and T = 1..4 score rows (B = 1), plus a sweep of the radix select's
chunks per row. Each result is first checked against `topk_select_ref` (exact set; ties included).
Timing as in `mtp.bench.kernels`: CUDA-graph replays timed with CUDA events, median of 15. The scores a top-k
reads were just written by the scores kernel, so they sit in L2 here as in the decode step.
moe: `moe_experts` layout 'pairs' (old) vs 'persistent' (new) at one rank of TP=8 and at TP=1, T = 1..4, with
% of the HBM floor (see `moe_section`).
Prints a table last (sweep rows only in the JSON and the log) and writes everything as JSON to
DIR/gpu_topk_moe.json (DIR: $OUT, else eval/results).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from mtp.bench.kernels import graph_us, report
from mtp.model.fp8 import act_quant as act_quant_ref
from mtp.kernels.indexer import indexer_scores, indexer_topk, topk_from_scores
from mtp.kernels.topk import radix_topk, topk_select_ref

DEV = "cuda"
ROWS: list[dict] = []
CHECKS: list[dict] = []


def log(*a):
    print(*a, flush=True)


def check(name: str, ok: bool, detail: str = ""):
    CHECKS.append(dict(name=name, ok=bool(ok), detail=detail))
    log(f"[check] {'PASS' if ok else 'FAIL'} {name} {detail}")


def row(section: str, shape: str, variant: str, us: float, **extra):
    r = dict(section=section, shape=shape, variant=variant, us=round(us, 2), **extra)
    ROWS.append(r)
    log(f"[time] {section:<6} {shape:<28} {variant:<28} {us:9.2f} us {extra if extra else ''}")


def topk_section(quick: bool, sizes: tuple[int, ...] | None = None, H: int = 64, k: int = 2048):
    D = 128
    sizes = sizes or ((8192, 32768) if quick else (8192, 32768, 131072))
    for S in sizes:
        k8, ks = act_quant_ref(torch.randn(1, S, D, device=DEV))
        for T in (1, 2, 3, 4):
            shape = f"S={S} T={T}"
            q8, qs = act_quant_ref(torch.randn(1, T, H, D, device=DEV))
            w = torch.randn(1, T, H, device=DEV) * H ** -0.5 * D ** -0.5
            lens = torch.tensor([S - T], device=DEV, dtype=torch.int32)
            sc = indexer_scores(q8, qs[..., 0], w, k8, ks[..., 0], lens)
            want = topk_select_ref(sc, lens, k)
            got = radix_topk(sc, lens, k)
            check(f"radix_topk {shape}", torch.equal(got, want))
            ties = sc.clone()
            ties[..., : S // 2] = ties[..., S // 2: S // 2 * 2].round(decimals=1)  # many exact ties
            check(f"radix_topk ties {shape}", torch.equal(radix_topk(ties, lens, k), topk_select_ref(ties, lens, k)))
            t_scores = graph_us([lambda: indexer_scores(q8, qs[..., 0], w, k8, ks[..., 0], lens)])
            t_old = graph_us([lambda: topk_from_scores(sc, k)])
            t_new = graph_us([lambda: radix_topk(sc, lens, k)])
            row("topk", shape, "scores kernel", t_scores)
            row("topk", shape, "torch.topk (old)", t_old)
            row("topk", shape, "radix_topk (new)", t_new, speedup=round(t_old / t_new, 2))
            row("topk", shape, "scores + torch.topk", t_scores + t_old)
            row("topk", shape, "scores + radix_topk", t_scores + t_new)
            args = (q8, qs[..., 0], w, k8, ks[..., 0], lens, k)
            for impl in ("torch", "radix", "radix_fused"):  # the whole indexer_topk call, one graph
                try:
                    idx, sc2 = indexer_topk(*args, impl=impl)
                    if impl != "torch":
                        check(f"indexer_topk {impl} {shape}", torch.equal(idx, topk_select_ref(sc2, lens, k)))
                    row("topk", shape, f"indexer_topk impl={impl}", graph_us([lambda: indexer_topk(*args, impl=impl)]))
                except Exception as e:  # the fused epilogue may not compile: keep the other numbers
                    check(f"indexer_topk {impl} {shape}", False, f"{type(e).__name__}: {str(e)[:300]}")
            if not quick and T in (1, 4):
                for chunks in (16, 32, 64, 128, 256):
                    for blk in (512, 1024, 2048):
                        try:
                            ok = torch.equal(radix_topk(sc, lens, k, chunks=chunks, block=blk), want)
                            us = graph_us([lambda: radix_topk(sc, lens, k, chunks=chunks, block=blk)])
                        except Exception as e:  # a config that does not compile is skipped
                            log(f"[topk] chunks={chunks} block={blk} failed: {type(e).__name__}: {str(e)[:200]}")
                            continue
                        check(f"radix_topk {shape} chunks={chunks} block={blk}", ok)
                        row("topk", shape, f"radix chunks={chunks} blk={blk}", us)
        del k8, ks
        torch.cuda.empty_cache()


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB, read + write bytes per second (the ceiling the % columns use)."""
    from triton.testing import do_bench

    n = 1 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    del src, dst
    return 2 * n / ms * 1e3


def routing_sets(T: int, E: int, e_loc: int, n: int, g: torch.Generator) -> list[torch.Tensor]:
    """n routings [T, 8] (distinct random experts of E per token, as the router gives) mapped to this rank's
    experts [0, e_loc) (others -1); token 0 always has a local expert, so that every call computes one."""
    sets = []
    for _ in range(n):
        idx = torch.stack([torch.randperm(E, generator=g)[:8] for _ in range(T)])
        if not (idx[0] < e_loc).any():
            idx[0, 0] = torch.randint(0, e_loc, (1,), generator=g)
        sets.append(torch.where(idx < e_loc, idx, -1).int().to(DEV))
    return sets


def moe_section(quick: bool, D: int = 7168, I: int = 2048, E: int = 256, ranks=((32, "TP=8"), (256, "TP=1"))):
    """moe_experts at one rank of TP=8 (32 local experts of 256) and at TP=1 (256), T = 1..4: the pairs layout
    (old) vs the persistent one (new), and a sweep of the new one's K slices and grid. Bytes: the distinct
    experts' gate + up + down FP8 weights and scales, over the measured copy bandwidth (% of the HBM floor).
    Routings rotate over 8 sets per graph, so each call reads other experts' weights (from HBM)."""
    from mtp.model.fp8 import weight_quant
    from mtp.kernels.moe import default_splits, moe_experts, moe_experts_ref

    bw = copy_bandwidth()
    log(f"[bw] copy {bw / 1e9:.0f} GB/s")
    g = torch.Generator().manual_seed(0)
    expert_bytes = 3 * I * D + 3 * (I // 128) * (D // 128) * 4
    for e_loc, tag in ranks:
        if quick and e_loc == E:
            continue
        ws = []
        for N, K in ((I, D), (I, D), (D, I)):
            parts = [weight_quant(torch.randn(N, K, device=DEV) * 0.02) for _ in range(e_loc)]
            ws += [torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])]
            del parts
        for T in (1, 2, 3, 4):
            x = torch.randn(T, D, device=DEV).bfloat16()
            rw = torch.rand(T, 8, device=DEV)
            sets = routing_sets(T, E, e_loc, 8, g)
            active = sum(len(set(s[s >= 0].tolist())) for s in sets) / len(sets)
            floor_us = active * expert_bytes / bw * 1e6
            shape = f"{tag} T={T} ({active:.2f} experts)"
            ref = moe_experts_ref(x, sets[0], rw, *ws, out_dtype=torch.float32)
            res = {}
            variants = [("pairs (old)", dict(layout="pairs")), ("persistent (new)", dict(layout="persistent"))]
            if not quick:
                G, GI = D // 128, I // 128
                dflt = default_splits(T, G, GI)
                for sg in (4, 8, 14):
                    for sd in (1, 2, 4, 8):
                        if (sg, sd) != dflt:
                            variants.append((f"persistent splits=({sg},{sd})",
                                             dict(layout="persistent", splits=(sg, sd))))
                sm = torch.cuda.get_device_properties(0).multi_processor_count if DEV == "cuda" else 4
                variants += [("persistent 2/SM gu, 3 stages", dict(layout="persistent", programs=(2 * sm, 2 * sm),
                                                                   gate_up_stages=3)),
                             ("persistent 1/SM down", dict(layout="persistent", programs=(sm, sm)))]
            for name, kw in variants:
                try:
                    y = moe_experts(x, sets[0], rw, *ws, out_dtype=torch.float32, **kw)
                    err = ((y - ref).norm() / ref.norm()).item()
                    us = graph_us([lambda s=s: moe_experts(x, s, rw, *ws, out_dtype=torch.float32, **kw) for s in sets])
                except Exception as e:  # a config that does not compile is skipped
                    log(f"[moe] {shape} {name} failed: {type(e).__name__}: {str(e)[:200]}")
                    continue
                check(f"moe_experts {shape} {name}", err < 0.05, f"rel err {err:.2e}")
                res[name] = us
                row("moe", shape, name, us, pct_floor=round(100 * floor_us / us, 1), floor_us=round(floor_us, 2))
            if "pairs (old)" in res and "persistent (new)" in res:
                log(f"[moe] {shape}: speedup {res['pairs (old)'] / res['persistent (new)']:.2f}x")
        del ws
        torch.cuda.empty_cache()


def table() -> str:
    lines = [f"{'section':<6} {'shape':<28} {'variant':<28} {'us':>9}  extra"]
    for r in ROWS:
        if "chunks=" in r["variant"] or "splits=" in r["variant"] or "/SM" in r["variant"]:
            continue
        extra = {k: v for k, v in r.items() if k not in ("section", "shape", "variant", "us")}
        lines.append(f"{r['section']:<6} {r['shape']:<28} {r['variant']:<28} {r['us']:9.2f}  {extra if extra else ''}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "eval/results"))
    ap.add_argument("--only", default="topk,moe")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    out = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    import triton

    out["triton"] = triton.__version__
    sections = [("topk", topk_section), ("moe", moe_section)]
    for name, fn in sections:
        if name not in args.only.split(","):
            continue
        t = time.time()
        try:
            fn(args.quick)
        except Exception as e:  # keep the other section's numbers
            import traceback

            traceback.print_exc()
            check(f"section {name}", False, f"{type(e).__name__}: {str(e)[:300]}")
        log(f"[section] {name} took {time.time() - t:.1f} s")
        torch.cuda.empty_cache()
    report(out, ROWS, CHECKS, t0, os.path.join(args.out, "gpu_topk_moe.json"), table())


if __name__ == "__main__":
    main()
