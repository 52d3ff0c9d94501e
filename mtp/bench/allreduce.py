"""The decode step's all-reduce + residual add + RMSNorm (+ FP8 quant) on N GPUs: NCCL against the one-shot
all-reduce over NVLink peer memory (`mtp.parallel.oneshot`), each variant CUDA-graph captured, us per call.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 TORCH_NCCL_AVOID_RECORD_STREAMS=1 \\
        torchrun --standalone --nproc-per-node 2 -m mtp.bench.allreduce --json $OUT/ar2.json

Variants (each on [1, w, 7168] partials, fp32 as the model reduces them and bf16; w = 1..8 by default):
  nccl            Comm.all_reduce over NCCL
  nccl+norm       that, then the fast path's add + RMSNorm + quant kernel (`kernels.norm_quant`): today's block
  torch_oneshot   torch.ops.symm_mem.one_shot_all_reduce_copy_out (torch's own one-shot kernel), unfused
  oneshot         Comm.all_reduce with allreduce='oneshot' (our kernel), unfused
  oneshot+norm    that, then the add + RMSNorm + quant kernel
  oneshot_fused   Comm.all_reduce_add_norm with allreduce='oneshot': one kernel
`--programs A:G:L ...` times the one-shot variants once per program setting (`OneShot.set_programs`: A elements per
program of the unfused all-reduce, G groups of 128 channels per program of a fused row, L the peer loads,
'volatile' or 'cg'; `default` = the module's defaults), each row labelled with its setting.
Each variant is checked on the same inputs against NCCL's (max |diff| of the reduced sum for the two plain
all-reduces, of the new residual for the others: `max_abs_diff`) and guarded:
a failure is recorded with its exception and the next variant runs. A hang ends the process after
`--variant-timeout` s (faulthandler prints where); the JSON is rewritten after every variant, so what was
measured before survives. Each measurement: a graph of `--inner` calls, replayed `--iters` times (CUDA
events, median), divided by `--inner`; the slowest rank's value.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from ..decode.graphs import capture_graph
from ..parallel.comm import Comm
from ..distributed.group import leave
from .collectives import nccl_version
from .timing import time_ms

VARIANTS = ("nccl", "nccl+norm", "torch_oneshot", "oneshot", "oneshot+norm", "oneshot_fused")
HIDDEN = 7168  # DeepSeek-V3.2's hidden size
EPS = 1e-6


class Case:
    """The static buffers of one message: this rank's partial, the residual, the norm weight."""

    def __init__(self, w: int, dtype: torch.dtype, dev: torch.device, rank: int):
        g = torch.Generator(device=dev).manual_seed(1000 + rank)
        self.shape = (1, w, HIDDEN)
        self.dtype = dtype
        self.src = torch.randn(self.shape, generator=g, device=dev).to(dtype)
        self.x = self.src.clone()  # reduced in place by the unfused variants: refilled from src by each call
        self.h = torch.randn(self.shape, generator=torch.Generator(device=dev).manual_seed(7), device=dev)
        self.weight = torch.rand(HIDDEN, generator=torch.Generator(device=dev).manual_seed(8), device=dev,
                                 dtype=torch.bfloat16) + 0.5


def variant_fn(name: str, case: Case, nccl: Comm, oneshot: Comm | None, group_name: str):
    """fn() -> the new residual, for one call of the variant (the refill copy of the unfused ones included:
    the model's partial comes from a GEMM, so that copy is their cost too, one small kernel)."""
    from ..kernels.norm_quant import add_rms_norm_quant

    def norm(s):
        return add_rms_norm_quant(case.h, s, case.weight, EPS, torch.bfloat16, quant=True)[0]

    def refill():
        case.x.copy_(case.src)
        return case.x

    if name == "nccl":
        return lambda: nccl.all_reduce(refill())
    if name == "nccl+norm":
        return lambda: norm(nccl.all_reduce(refill()))
    if name == "torch_oneshot":
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(case.shape, dtype=case.dtype, device=case.x.device)
        symm_mem.rendezvous(buf, group_name)
        out = torch.empty_like(case.x)
        op = torch.ops.symm_mem.one_shot_all_reduce_copy_out
        return lambda: norm(op(buf, case.src, "sum", group_name, out))
    if oneshot is None:
        raise RuntimeError("allreduce='oneshot' could not be set up (see the 'setup' entry)")
    if name == "oneshot":
        return lambda: oneshot.all_reduce(refill())
    if name == "oneshot+norm":
        return lambda: norm(oneshot.all_reduce(refill()))
    if name == "oneshot_fused":
        return lambda: oneshot.all_reduce_add_norm(case.src, case.h, case.weight, EPS, torch.bfloat16, quant=True)[1]
    raise ValueError(f"unknown variant {name!r}; one of {VARIANTS}")


def run_variant(name, case, nccl, oneshot, group_name, refs, inner, iters) -> dict:
    """Check the variant's output against NCCL's (refs: 'sum' from nccl, 'residual' from nccl+norm; the first of
    each kind sets it), then time it."""
    fn = variant_fn(name, case, nccl, oneshot, group_name)
    got = fn().clone()
    torch.cuda.synchronize()
    row = {}
    kind = "sum" if name in ("nccl", "oneshot") else "residual"
    if kind in refs:
        row["max_abs_diff"] = (got.float() - refs[kind].float()).abs().max().item()
    else:
        refs[kind] = got
    graph = capture_graph(lambda: [fn() for _ in range(inner)], warmup=1)
    dist.barrier()
    row["us"] = time_ms(graph.replay, iters=iters, warmup=3) * 1e3 / inner
    del graph
    return row


def parse_programs(spec: str) -> tuple[str, dict]:
    """'A:G:L' -> (label, OneShot.set_programs keywords); 'default' -> the module's defaults."""
    from ..parallel.oneshot import DEFAULT_PROGRAMS as d, PEER_LOADS

    if spec == "default":
        return f"{d['ar_chunk']}:{d['row_groups']}:{d['peer_load']}", dict(d)
    parts = spec.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in PEER_LOADS:
        raise SystemExit(f"--programs {spec!r}: expected A:G:L (e.g. 2048:64:volatile, 1024:8:cg) or 'default'")
    return spec, dict(ar_chunk=int(parts[0]), row_groups=int(parts[1]), peer_load=parts[2])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mtp.bench.allreduce", description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--widths", type=int, nargs="+", default=list(range(1, 9)))
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--inner", type=int, default=50, help="calls per captured graph")
    ap.add_argument("--iters", type=int, default=30, help="graph replays (median)")
    ap.add_argument("--variant-timeout", type=float, default=120.0, help="s: a hung variant ends the process")
    ap.add_argument("--programs", nargs="+", default=["default"],
                    help="one-shot program settings A:G:L (elements per unfused program : groups per fused program "
                         ": volatile|cg), or 'default'")
    args = ap.parse_args(argv)
    settings = [parse_programs(p) for p in args.programs]
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) < 2 or torch.cuda.device_count() < 2:
        print("mtp.bench.allreduce: skipped, needs 2+ GPUs under torchrun (one rank per GPU)", flush=True)
        return 0
    os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")
    local = int(os.environ.get("LOCAL_RANK", 0))
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev, timeout=datetime.timedelta(seconds=args.variant_timeout))
    ctl = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=args.variant_timeout))
    nccl = Comm()
    group_name = dist.group.WORLD.group_name
    res = {"device": torch.cuda.get_device_name(dev), "world": nccl.world, "torch": torch.__version__,
           "nccl": nccl_version(), "date": time.strftime("%Y-%m-%d %H:%M"), "inner": args.inner,
           "iters": args.iters, "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE",
                                                                        "TORCH_SYMM_MEM_DISABLE_MULTICAST")},
           "setup": "ok", "rows": []}

    def agree(ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=ctl)
        return bool(flag.item())

    def write():
        if nccl.rank == 0:
            tmp = args.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(res, f, indent=1)
            os.replace(tmp, args.json)

    oneshot = None
    try:
        faulthandler.dump_traceback_later(args.variant_timeout, exit=True)
        try:
            oneshot = Comm()
            oneshot.set_allreduce("oneshot", dev)
            ok, err = True, None
        except Exception as e:  # noqa: BLE001  (recorded; the NCCL variants still run)
            ok, err = False, f"{type(e).__name__}: {e}"
        if not agree(ok):
            res["setup"] = err or "another rank failed to set up allreduce='oneshot'"
            oneshot = None
        write()
        for dname in args.dtypes:
            dtype = getattr(torch, dname)
            for w in args.widths:
                case = Case(w, dtype, dev, nccl.rank)
                refs: dict[str, torch.Tensor] = {}
                runs = [(name, label, kw) for name in args.variants
                        for label, kw in (settings if name.startswith("oneshot") else [("", None)])]
                for name, label, kw in runs:
                    faulthandler.dump_traceback_later(args.variant_timeout, exit=True)
                    row = {"variant": name, "w": w, "dtype": dname, "bytes": case.src.numel() * case.src.element_size()}
                    if kw is not None:
                        row["programs"] = label
                        if oneshot is not None:
                            oneshot.oneshot.set_programs(**kw)
                    try:
                        r = run_variant(name, case, nccl, oneshot, group_name, refs, args.inner, args.iters)
                        ok, err = True, None
                    except Exception as e:  # noqa: BLE001  (one variant's failure must not hide the others)
                        ok, err, r = False, f"{type(e).__name__}: {e}", {}
                    ok_all = agree(ok)
                    if ok_all:
                        us = torch.tensor([r["us"]], device=dev)
                        dist.all_reduce(us, op=dist.ReduceOp.MAX)  # the slowest rank
                        row.update(r, us=us.item(), status="ok")
                    else:
                        row.update(status="error", error=err or "failed on another rank")
                    res["rows"].append(row)
                    write()
                    if nccl.rank == 0:
                        line = (f"{row['us']:8.2f} us" + (f"  |d| {row['max_abs_diff']:.3g}"
                                                          if "max_abs_diff" in row else "")
                                if ok_all else f"ERROR {row['error'][:300]}")
                        print(f"{dname:8s} w={w} {row['bytes']:7d} B  {name:14s} {label:18s} {line}", flush=True)
        faulthandler.cancel_dump_traceback_later()
    finally:
        leave(dev, ctl)  # captured graphs freed before the communicator goes (mtp.distributed.group)
    return 0


if __name__ == "__main__":
    sys.exit(main())
