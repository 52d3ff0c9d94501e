"""One decode forward of a simulated TP=N rank (a few layers, real width, random FP8 weights) between
`cudaProfilerStart` and `cudaProfilerStop`, for Nsight Compute: each kernel of the step alone, with its hardware
counters (DRAM throughput, occupancy, stall reasons), where `mtp-bench --tp N --profile` gives the kernels' time in
the graph, overlapped by PDL. The same model, fast path and cache as `mtp-bench --tp N` (`mtp.bench.rank`).

    ncu --clock-control none --profile-from-start off --csv --page details --section SpeedOfLight ... \\
        python -m mtp.bench.ncu_step --tp 8 --layers 3 --width 1 --ctx 1024

ncu runs each kernel by itself (serialized, caches flushed between replays by default): a kernel's duration here is
its own critical path from a cold L2, without its launch overlapping the kernel before it.

    python -m mtp.bench.ncu_step --summarize FILE.csv   # one line per kernel: duration, DRAM / L2 %, grid, ...
"""

from __future__ import annotations

import argparse
import csv
import io

import torch

from ..backends.fast_path import enable_fast_path
from ..checkpoint.synthetic import fill_cache_random
from ..kernels.dispatch import FastPathOptions
from ..model.presets import real_config
from ..parallel.layout import ParallelPlan
from ..parallel.simulate import simulated_rank
from ..parallel.synthetic import random_parallel_model
from .cli import parse_switches
from .rank_steps import rank_token_ids


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=8, help="the simulated group's size (rank 0 is run)")
    ap.add_argument("--layers", type=int, default=3, help="trunk layers (the dense ones among them: --dense-layers)")
    ap.add_argument("--dense-layers", type=int, default=1)
    ap.add_argument("--width", type=int, default=1, help="tokens per step (the verify width)")
    ap.add_argument("--ctx", type=int, default=1024, help="context already in the cache")
    ap.add_argument("--warmup", type=int, default=3, help="forwards before the profiled one (JIT, counters)")
    ap.add_argument("--kernels", nargs="*", default=[], metavar="NAME=VALUE",
                    help="FastPathOptions switches on top of the rank's defaults (as mtp-bench --kernels)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--summarize", nargs="+", metavar="CSV",
                    help="instead of profiling: one line per kernel of these `ncu --csv --page details` files")
    return ap.parse_args(argv)


# ncu's metric names (sections SpeedOfLight, LaunchStats, Occupancy, WarpStateStats, SchedulerStats) -> columns
SUMMARY = {"Duration": "dur", "DRAM Throughput": "dram%", "L2 Cache Throughput": "l2%", "Grid Size": "grid",
           "Block Size": "block", "Registers Per Thread": "regs", "Achieved Occupancy": "occ%",
           "Warp Cycles Per Issued Instruction": "cpi", "One or More Eligible": "elig%"}
TO_US = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "nsecond": 1e-3}


def summarize(path: str) -> str:
    """One line per profiled kernel of an `ncu --csv --page details` file (launch order), and their summed time."""
    lines = open(path).read().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise SystemExit(f"{path}: no ncu CSV header (a line starting with \"ID\")")
    kernels: dict = {}
    for r in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        k = kernels.setdefault(int(r["ID"]), {"name": r["Kernel Name"]})
        if r["Metric Name"] in SUMMARY:
            k[SUMMARY[r["Metric Name"]]] = (r["Metric Value"].replace(",", ""), r["Metric Unit"])
    out, total = [], 0.0
    for i, k in sorted(kernels.items()):
        v, unit = k.get("dur", ("nan", "us"))
        us = float(v) * TO_US.get(unit, float("nan"))
        total += us
        cols = " ".join(f"{c} {k.get(c, ('-',))[0]:>6}" for c in ("dram%", "l2%", "grid", "block", "regs", "occ%",
                                                                    "cpi", "elig%"))
        out.append(f"{i:4d} {k['name'][:40]:40s} {us:8.2f} us  {cols}")
    out.append(f"{len(kernels)} kernels, {total:.1f} us in all")
    return "\n".join(out)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.summarize:
        for path in args.summarize:
            print(f"== {path}\n{summarize(path)}")
        return
    if not torch.cuda.is_available():
        raise SystemExit("mtp.bench.ncu_step: needs a CUDA device")
    cfg = real_config(layers=args.layers, dense_layers=args.dense_layers, mtp_modules=1)
    with simulated_rank(args.tp, 0) as comm, torch.no_grad():
        model = random_parallel_model(cfg, comm, ParallelPlan(args.tp, expert_layout="split"), device="cuda",
                                      dtype=torch.bfloat16, seed=args.seed)
        enable_fast_path(model, options=FastPathOptions.for_world(args.tp, **parse_switches(args.kernels)))
        cache = fill_cache_random(model.new_cache(1, args.ctx + args.width), args.ctx, seed=args.seed)
        base = cache.seq_lens.clone()
        ids = rank_token_ids(model, (1, args.width), torch.Generator().manual_seed(args.seed)).cuda()
        for _ in range(args.warmup):
            cache.truncate(base)
            model(ids, cache, kv_len=args.ctx + args.width)
        torch.cuda.synchronize()
        cache.truncate(base)
        torch.cuda.cudart().cudaProfilerStart()
        model(ids, cache, kv_len=args.ctx + args.width)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    print(f"mtp.bench.ncu_step: one forward of rank 0 of TP={args.tp}, {args.layers} layers, w = {args.width}, "
          f"context {args.ctx}, profiled")


if __name__ == "__main__":
    main()
