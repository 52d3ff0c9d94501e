"""Time the indexer top-k and the routed-expert kernels, old vs new, side by side in one run on one GPU.

    PYTHONPATH=. python eval/gpu_topk_moe.py [--out DIR] [--only topk,moe] [--quick]

topk: torch.topk (`topk_from_scores`, sorted=False: the old fast path) vs `radix_topk`, and the indexer scores
kernel alone, at S = 8192 / 32768 / 131072 and T = 1..4 score rows (B = 1), plus a sweep of the radix select's
chunks per row. Each result is first checked against `topk_select_ref` (exact set; ties included).
Timing as in eval/gpu_kernels.py: CUDA-graph replays timed with CUDA events, median of 15. The scores a top-k
reads were just written by the scores kernel, so they sit in L2 here as in the decode step.
Prints a table last and writes everything as JSON to DIR/gpu_topk_moe.json (DIR: $OUT, else eval/results).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from eval.gpu_kernels import graph_us
from mtp.fp8 import act_quant as act_quant_ref
from mtp.kernels.indexer import indexer_scores, topk_from_scores
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


def topk_section(quick: bool):
    H, D, k = 64, 128, 2048
    sizes = [8192, 32768] if quick else [8192, 32768, 131072]
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
            row("topk", shape, "scores + radix_topk", t_scores + t_new)
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


def table() -> str:
    lines = [f"{'section':<6} {'shape':<28} {'variant':<28} {'us':>9}  extra"]
    for r in ROWS:
        if "chunks=" in r["variant"]:
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
    sections = [("topk", topk_section)]
    if "moe_section" in globals():
        sections.append(("moe", globals()["moe_section"]))
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
    out["rows"], out["checks"] = ROWS, CHECKS
    out["wall_s"] = round(time.time() - t0, 1)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_topk_moe.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    n_fail = sum(not c["ok"] for c in CHECKS)
    log(f"\nchecks: {len(CHECKS) - n_fail} passed, {n_fail} failed; wall {out['wall_s']} s")
    for c in CHECKS:
        if not c["ok"]:
            log(f"  FAIL {c['name']}: {c['detail']}")
    log(table())


if __name__ == "__main__":
    main()
