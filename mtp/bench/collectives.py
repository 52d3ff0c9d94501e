"""Latency of the decode step's collectives on N GPUs: NCCL all-reduce and all-gather at the step's message sizes,
issued through `Comm` (the calls the model makes) and CUDA-graph captured, as in a captured step.

    NCCL_NVLS_ENABLE=0 TORCH_NCCL_AVOID_RECORD_STREAMS=1 \\
        torchrun --standalone --nproc-per-node 8 -m mtp.bench.collectives --json $OUT/coll.json
    mtp-bench --tp 8 --collective-json $OUT/coll.json ...      # the projection then uses these latencies

Sizes (batch 1, verify width w = 1..8, the real config): the fp32 partial sums [1, w, 7168] all-reduced after
o_proj and after the FFN, the bf16 embedding [1, w, 7168], the fp32 local logits [1, w, V/N] all-gathered
at the head, and an MTP module's bf16 eh_proj slice [1, w, 7168/N] all-gathered before its block (a draft
forward). Each measurement is one graph of `--inner` back-to-back collectives, replayed (CUDA events, median
of `--iters`), divided by `--inner`; the slowest rank's value. Bytes are the input bytes per rank, as
`CountingComm` counts them. With fewer than 2 GPUs it prints why and exits 0 (nothing to measure).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from ..model.config import ModelConfig
from ..decode.graphs import capture_graph
from .timing import time_ms
from ..parallel.comm import Comm


def message_shapes(cfg: ModelConfig, world: int, widths=range(1, 9)) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    out = []
    for w in widths:
        out.append(("all_reduce", (1, w, cfg.hidden_size), torch.float32))
        out.append(("all_reduce", (1, w, cfg.hidden_size), torch.bfloat16))
        out.append(("all_gather", (1, w, cfg.vocab_size // world), torch.float32))
        out.append(("all_gather", (1, w, cfg.hidden_size // world), torch.bfloat16))
    return out


def nccl_version() -> str:
    v = torch.cuda.nccl.version()  # an int in older torch, a (major, minor, patch) tuple in newer
    return str(v) if isinstance(v, int) else ".".join(map(str, v))


def time_collective(comm: Comm, op: str, t: torch.Tensor, inner: int, iters: int) -> float:
    """us per collective: a graph of `inner` of them, replayed."""
    fn = (lambda: comm.all_reduce(t)) if op == "all_reduce" else (lambda: comm.all_gather_last(t))
    graph = capture_graph(lambda: [fn() for _ in range(inner)], warmup=1)  # eager warm-up first: NCCL's lazy state
    dist.barrier()
    ms = time_ms(graph.replay, iters=iters, warmup=3)
    del graph
    return ms * 1e3 / inner


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mtp.bench.collectives", description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="collectives.json")
    ap.add_argument("--inner", type=int, default=50, help="collectives per captured graph")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) < 2 or torch.cuda.device_count() < 2:
        print("mtp.bench.collectives: skipped, needs 2+ GPUs under torchrun (one NCCL rank per GPU)", flush=True)
        return 0
    os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")  # see DESIGN.md, CUDA graphs under NCCL
    local = int(os.environ.get("LOCAL_RANK", 0))
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev, timeout=datetime.timedelta(minutes=5))
    try:
        comm = Comm()
        cfg = ModelConfig()
        ops: dict[str, list[dict]] = {"all_reduce": [], "all_gather": []}
        for op, shape, dtype in message_shapes(cfg, comm.world):
            t = torch.randn(shape, device=dev).to(dtype)
            us = torch.tensor([time_collective(comm, op, t, args.inner, args.iters)], device=dev)
            dist.all_reduce(us, op=dist.ReduceOp.MAX)  # the slowest rank
            ops[op].append({"bytes": t.numel() * t.element_size(), "shape": list(shape),
                            "dtype": str(dtype).replace("torch.", ""), "us": us.item()})
        if comm.rank == 0:
            res = {"device": torch.cuda.get_device_name(dev), "world": comm.world, "torch": torch.__version__,
                   "nccl": nccl_version(), "date": time.strftime("%Y-%m-%d %H:%M"),
                   "inner": args.inner, "ops": ops}
            tmp = args.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(res, f, indent=1)
            os.replace(tmp, args.json)
            print(f"{res['device']} x {comm.world}, NCCL {res['nccl']}: us per collective (graph-captured)")
            for op, rows in ops.items():
                for r in rows:
                    print(f"  {op:10s} {str(r['shape']):16s} {r['dtype']:8s} {r['bytes']:8d} B  {r['us']:7.2f} us")
            sys.stdout.flush()
    finally:
        torch.cuda.synchronize()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
