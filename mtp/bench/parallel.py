"""Tensor-parallel target-step benchmark on random FP8 weights built sharded on each rank (nothing on disk).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        torchrun --nproc-per-node 2 -m mtp.bench.parallel --out $OUT/tp2.json --compare-tp1
    torchrun --nproc-per-node 2 -m mtp.bench.parallel --out /tmp/tp2.json --compare-tp1    # CPU, gloo, tiny

Every rank builds its part of `mtp.checkpoint.synthetic.random_model` (`random_parallel_model`: default the real config
truncated to 3 trunk layers = 1 dense + 2 MoE, plus 1 MTP module; on CPU a tiny config that splits over the
world), enables the Triton fast path where it can run, prefills a random prompt and times one target forward
for verify widths 1..K+1 (`--k`), eager and CUDA-graph replayed (the helpers of `mtp.bench`), counting the
collectives one step issues. A greedy generation checks the engine end to end. With `--compare-tp1`, rank 0
then frees its part and, if the whole model fits in its free memory, builds the same model unsharded
(`random_model`, identical weights), times the same steps and compares logits and tokens with the TP=N run
(the other ranks wait). Rank 0 writes the JSON and prints a table. The step times are the slowest rank's.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from ..model.config import NUMERICS, ModelConfig, RuntimeOptions
from ..decode.engine import generate, release
from ..model.moe import MoE
from ..checkpoint.inventory import checkpoint_spec
from ..checkpoint.synthetic import random_model
from ..model.presets import gpu_test_config, real_config, tiny_parallel_config
from ..decode.graphs import capture_graph
from .rank_steps import B2B_REPLAYS
from .timing import timer
from ..parallel.comm import ALLREDUCE_IMPLS, CountingComm
from ..parallel.layout import MLP_SPLITS, ParallelPlan
from ..placement import LAYOUT_CHOICES
from ..parallel.load import param_bytes
from ..parallel.modules import ExpertParallelMoE
from ..parallel.memory import DTYPES, GIB
from ..parallel.synthetic import random_parallel_model

CONFIGS = ("real", "gpu-test", "tiny")


def bench_config(args, world: int, cuda: bool) -> tuple[str, ModelConfig]:
    name = args.config or ("real" if cuda else "tiny")
    if name == "real":
        cfg = real_config(layers=args.layers, dense_layers=args.dense_layers, mtp_modules=args.mtp_modules)
    elif name == "gpu-test":
        cfg = dataclasses.replace(gpu_test_config(layers=args.layers, mtp_modules=args.mtp_modules),
                                  first_k_dense_replace=args.dense_layers)
    else:
        cfg = tiny_parallel_config(world, args.layers, args.dense_layers, args.mtp_modules)
    cfg.validate(f"mtp.bench.parallel --config {name}")
    return name, cfg


def _fast_path(model, args, device) -> str | None:
    """Enable the Triton fast path when it can run; returns why not, or None when enabled."""
    if args.no_fast_path:
        return "disabled (--no-fast-path)"
    if device.type != "cuda":
        return "no CUDA device"
    from ..kernels import available

    if not available():
        return "triton kernels not available"
    if args.numerics != "fp8":
        return "numerics != fp8"
    from ..backends.fast_path import enable_fast_path

    enable_fast_path(model)
    return None


def moe_path(model) -> dict | None:
    """How the model's MoE layers compute the routed experts (the main cost difference TP=1 vs TP=N)."""
    from ..backends.fast_path import FastMoE

    for m in model.modules():
        backend = "triton" if isinstance(m, FastMoE) else "reference"
        if isinstance(m, ExpertParallelMoE):
            static = m.static or model.device.type == "cuda"
            if backend == "triton":
                reads = "the chosen local experts only (Triton, up to 64 tokens)"
            elif static:
                reads = "every local expert on every token (static, sync-free)"
            else:
                reads = "the local experts some token chose (host-synced loop)"
            return {"class": "ExpertParallelMoE", "backend": backend, "reads": reads}
        if isinstance(m, MoE):
            return {"class": "MoE", "backend": backend,
                    "reads": "the chosen experts only" if backend == "triton" else "reference path"}
    return None


@torch.no_grad()
def measure(model, args, device: torch.device, ids: torch.Tensor, comm: CountingComm | None) -> dict:
    """Prefill, then one target forward per verify width 1..K+1: eager and graph times, logits, collectives."""
    time_ms = timer(device.type == "cuda", args.iters, args.warmup)
    graph = "graph" in args.modes and device.type == "cuda"
    B, L = ids.shape[0], args.prompt_len
    res: dict = {"target_step": {}, "logits": {}}
    for w in range(1, args.k + 2):
        S = L + w + 8
        kv = model.new_cache(B, S)
        pre = model(ids[:, :L], kv, logits_at=torch.full((B, 1), L - 1, device=device))
        if w == 1:
            res["prefill_last_logits"] = pre.logits[:, -1].float().cpu()
        del pre
        base = kv.seq_lens.clone()
        blk = ids[:, L:L + w]
        out = {}

        def fwd():
            kv.truncate(base)
            out["o"] = model(blk, kv, kv_len=S)  # static bound: eager and graph run the same shapes

        if comm is not None:
            comm.reset()
        fwd()
        if comm is not None:
            res.setdefault("collectives_per_step", {})[w] = dict(comm.counts)
        res["logits"][w] = out.pop("o").logits.float().cpu()
        r = {"eager_ms": time_ms(fwd) if "eager" in args.modes else None, "graph_ms": None, "graph_ms_b2b": None}
        if graph:
            g = capture_graph(fwd)
            r["graph_ms"] = time_ms(g.replay)
            # B2B_REPLAYS back to back per event pair: no host launch latency between steps (as the simulated rank's
            # graph_ms_b2b, which the projection reads); every rank replays as many times, so NCCL pairs up
            r["graph_ms_b2b"] = time_ms(lambda: [g.replay() for _ in range(B2B_REPLAYS)]) / B2B_REPLAYS
            del g
        out.clear()
        res["target_step"][w] = r
    if args.gen_tokens > 0:
        mode = "graph" if device.type == "cuda" and "graph" in args.modes else "eager"
        t0 = time.perf_counter()
        g = generate(model, ids[:, :L].tolist(), args.gen_tokens, draft="none", mode=mode)
        res["generate"] = {"mode": mode, "tokens": g.tokens, "wall_s": time.perf_counter() - t0}
        release(model)
    return res


def compare(a: dict, b: dict) -> dict:
    """TP=N (a) against TP=1 (b): logits per width and of the prefill's last position, generated tokens."""
    def diff(x, y):
        d = (x - y).abs()
        return {"max_abs": d.max().item(), "rel_l2": ((x - y).norm() / y.norm()).item(),
                "max_abs_ref": y.abs().max().item(),
                "argmax_agree": (x.argmax(-1) == y.argmax(-1)).float().mean().item()}

    out = {"prefill_last": diff(a["prefill_last_logits"], b["prefill_last_logits"]),
           "target_step": {w: diff(a["logits"][w], b["logits"][w]) for w in a["logits"]}}
    if "generate" in a and "generate" in b:
        out["generate_tokens_equal"] = a["generate"]["tokens"] == b["generate"]["tokens"]
    return out


def tp1_fits(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> tuple[bool, dict]:
    """Whole-model weights + one full tensor drawn in fp32 (and its cast) + 4 GiB of workspace vs free memory."""
    from ..parallel.memory import rank_weight_bytes

    need = sum(rank_weight_bytes(cfg, ParallelPlan(1), 0, dtype).values())
    biggest = max(math.prod(ts.shape) for ts in checkpoint_spec(cfg).values()) * 6
    info = {"weights_gib": need / GIB, "margin_gib": (biggest + 4 * GIB) / GIB}
    if device.type != "cuda":
        return True, info
    free, total = torch.cuda.mem_get_info(device)
    info["free_gib"] = free / GIB
    return need + biggest + 4 * GIB < free, info


def _summary(res: dict, rank_ms: list[dict]) -> dict:
    """Per-width times as the slowest rank's (and every rank's) medians."""
    out = {}
    for w, r in res["target_step"].items():
        row = {}
        for key in ("eager_ms", "graph_ms", "graph_ms_b2b"):
            per = [m[w].get(key) for m in rank_ms]
            row[key] = None if any(v is None for v in per) else max(per)
            row[f"{key}_per_rank"] = per
        out[w] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mtp.bench.parallel", description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=CONFIGS, default=None, help="default: real on CUDA, tiny on CPU")
    ap.add_argument("--layers", type=int, default=3, help="trunk layers")
    ap.add_argument("--dense-layers", type=int, default=1)
    ap.add_argument("--mtp-modules", type=int, default=1)
    ap.add_argument("--k", type=int, default=3, help="verify widths 1..k+1")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=None, help="default: 1024 (real, gpu-test), 24 (tiny)")
    ap.add_argument("--gen-tokens", type=int, default=16, help="greedy tokens generated (0: skip)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--modes", default="eager,graph", help="comma list of eager, graph (graph: CUDA only)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--numerics", choices=NUMERICS, default="fp8")
    ap.add_argument("--mlp-split", choices=MLP_SPLITS, default="blocks")
    ap.add_argument("--expert-layout", choices=LAYOUT_CHOICES, default="auto",
                    help="which routed experts each rank holds (mtp/placement.py; 'auto' as the runtime default: "
                         "split where the width divides into whole 128-blocks per rank, else contiguous)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-fast-path", action="store_true")
    ap.add_argument("--allreduce", nargs="+", choices=ALLREDUCE_IMPLS, default=["nccl"],
                    help="the group's all-reduce; several: the same model timed once per choice, side by side")
    ap.add_argument("--compare-tp1", action="store_true",
                    help="rank 0 also runs the unsharded model (when it fits) and compares")
    ap.add_argument("--out", default=None, help="JSON result file (none is written unless given)")
    args = ap.parse_args(argv)
    args.modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not set(args.modes) <= {"eager", "graph"} or not args.modes:
        ap.error(f"--modes: comma list of eager, graph; got {args.modes}")

    in_group = dist.is_available() and dist.is_initialized()
    own_group = not in_group and "WORLD_SIZE" in os.environ  # under torchrun
    if own_group:
        os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")  # see DESIGN.md, CUDA graphs under NCCL
        from ..distributed.group import init_group

        group = init_group("cuda" if torch.cuda.is_available() else "cpu")
        device = group.device
    elif in_group:  # called inside an existing group (tests): its backend decides the device
        device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
                  else torch.device("cpu"))
    else:  # plain `python -m mtp.bench.parallel`: one process, the parallel modules at world 1
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    comm = CountingComm()
    try:
        run(args, comm, device)
    finally:
        if own_group:
            group.close()  # graphs freed, barrier, NCCL aborted (mtp.distributed.group)
        else:
            release()
    return 0


def run(args, comm: CountingComm, device: torch.device) -> dict | None:
    cuda = device.type == "cuda"
    name, cfg = bench_config(args, comm.world, cuda)
    if args.prompt_len is None:
        args.prompt_len = 24 if name == "tiny" else 1024
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    runtime = RuntimeOptions(numerics=args.numerics)
    # a gloo group for the waits around rank 0's TP=1 run: generous timeout, no GPU work while waiting
    wait_group = (dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=1))
                  if comm.world > 1 else None)
    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_len + args.k + 1), generator=g).to(device)

    res: dict = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "world": comm.world,
                 "backend": dist.get_backend() if dist.is_initialized() else None, "torch": torch.__version__,
                 "date": time.strftime("%Y-%m-%d %H:%M"),
                 "args": {k: v for k, v in vars(args).items()}, "dtype": str(dtype).replace("torch.", ""),
                 "config": {"name": name, **{f: getattr(cfg, f) for f in (
                     "num_hidden_layers", "first_k_dense_replace", "num_nextn_predict_layers", "hidden_size",
                     "vocab_size", "num_attention_heads", "n_routed_experts", "intermediate_size",
                     "moe_intermediate_size")}}}

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    plan = ParallelPlan(comm.world, args.mlp_split, args.expert_layout).resolved(cfg)
    res["expert_layout"] = plan.expert_layout
    model = random_parallel_model(cfg, comm, plan, device=device, dtype=dtype,
                                  seed=args.seed, runtime=runtime)
    build_s = time.perf_counter() - t0
    no_fast = _fast_path(model, args, device)
    by_impl: dict[str, dict] = {}  # --allreduce: one measurement per all-reduce, same model, same inputs
    for impl in dict.fromkeys(args.allreduce):
        comm.set_allreduce(impl, device)
        by_impl[impl] = measure(model, args, device, ids, comm)
    comm.set_allreduce("nccl")
    tpn = by_impl[args.allreduce[0]]
    mine = {"build_s": build_s, "param_bytes": param_bytes(model),
            "target_step": {impl: r["target_step"] for impl, r in by_impl.items()},
            "gpu_peak_gib": torch.cuda.max_memory_allocated(device) / GIB if cuda else None}
    every = [None] * comm.world
    if comm.world > 1:
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    first = args.allreduce[0]
    res["fast_path"] = no_fast is None
    if no_fast:
        res["fast_path_off_because"] = no_fast
    res["moe"] = moe_path(model)
    steps = tpn["collectives_per_step"]
    res["parallel"] = {
        "build_s": max(e["build_s"] for e in every), "build_s_per_rank": [e["build_s"] for e in every],
        "param_gib_per_rank": [e["param_bytes"] / GIB for e in every],
        "gpu_peak_gib_per_rank": [e["gpu_peak_gib"] for e in every],
        "collectives_per_step": steps[1], "collectives_same_every_width": all(
            {k: v for k, v in c.items() if "bytes" not in k} == {k: v for k, v in steps[1].items() if "bytes" not in k}
            for c in steps.values()),
        "collectives_bytes_per_width": {w: {k: v for k, v in c.items() if "bytes" in k} for w, c in steps.items()},
        "target_step": _summary(tpn, [e["target_step"][first] for e in every]),
        "generate": {k: v for k, v in tpn.get("generate", {}).items() if k != "tokens"} or None}
    res["allreduce"] = {
        impl: {"target_step": _summary(r, [e["target_step"][impl] for e in every]),
               "collectives_per_step": r["collectives_per_step"][1],
               # against the first choice: the summation order differs, so equal tokens are expected in
               # float64 / on well-separated logits, not promised on random bf16 weights
               f"generate_tokens_equal_{first}": (r.get("generate", {}).get("tokens")
                                                  == tpn.get("generate", {}).get("tokens")),
               f"logits_max_abs_diff_vs_{first}": {
                   w: (r["logits"][w] - tpn["logits"][w]).abs().max().item() for w in r["logits"]}}
        for impl, r in by_impl.items()}

    # free the sharded model before the TP=1 reference (rank 0 needs the room); keep its outputs
    release(model)
    del model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()

    if args.compare_tp1:
        if wait_group is not None:
            dist.barrier(group=wait_group)
        if comm.rank == 0:
            try:
                fits, info = tp1_fits(cfg, dtype, device)
                res["tp1_memory"] = info
                if not fits:
                    res["tp1"] = {"skipped": "does not fit in rank 0's free memory"}
                else:
                    t0 = time.perf_counter()
                    m1 = random_model(cfg, device=device, dtype=dtype, seed=args.seed, runtime=runtime)
                    b1 = time.perf_counter() - t0
                    _fast_path(m1, args, device)
                    tp1 = measure(m1, args, device, ids, None)
                    res["tp1"] = {"build_s": b1, "param_gib": param_bytes(m1) / GIB, "moe": moe_path(m1),
                                  "target_step": _summary(tp1, [tp1["target_step"]]),
                                  "generate": {k: v for k, v in tp1.get("generate", {}).items() if k != "tokens"}
                                  or None}
                    res["compare_tp1"] = compare(tpn, tp1)
                    res["speedup_vs_tp1"] = {}
                    for w, rn in res["parallel"]["target_step"].items():
                        r1 = res["tp1"]["target_step"][w]
                        res["speedup_vs_tp1"][w] = {
                            m: r1[f"{m}_ms"] / rn[f"{m}_ms"] if r1[f"{m}_ms"] and rn[f"{m}_ms"] else None
                            for m in ("eager", "graph")}
                    release(m1)
                    del m1
            except Exception as e:  # keep the TP=N numbers; the other ranks are waiting at the barrier
                res["tp1"] = {"error": repr(e)[:1000]}
        if wait_group is not None:
            dist.barrier(group=wait_group)
    else:
        res["tp1"] = {"skipped": "not requested (--compare-tp1)"}

    if comm.rank == 0:
        if "generate" in tpn:
            res["generated_tokens_rank0"] = tpn["generate"]["tokens"]
        from .rank import save

        save(res, args.out)
        print_table(res)
        return res
    return None


def print_table(res: dict) -> None:
    W = res["world"]
    c = res["config"]
    print(f"\nTP={W} ({res['backend'] or 'single process'}) on {res['device']}, torch {res['torch']}: "
          f"config {c['name']} ({c['num_hidden_layers']} layers, {c['first_k_dense_replace']} dense, {c['num_nextn_predict_layers']} MTP, "
          f"D={c['hidden_size']}), {res['dtype']}, fast path {'on' if res['fast_path'] else 'off'}, "
          f"MoE: {(res['moe'] or {}).get('reads')}")
    tn = res["parallel"]
    col = tn["collectives_per_step"]
    print(f"per target step: {col['all_reduce']} all-reduce ({col['all_reduce_bytes'] / 1024:.1f} KiB at w=1), "
          f"{col['all_gather']} all-gather; build {tn['build_s']:.1f} s, params/rank "
          f"{', '.join(f'{g:.2f}' for g in tn['param_gib_per_rank'])} GiB")
    tp1 = res.get("tp1", {})
    cmp = res.get("compare_tp1", {}).get("target_step", {})
    if "target_step" not in tp1:
        print(f"TP=1: {tp1.get('skipped') or tp1.get('error')}")
    f = lambda v: f"{v:9.3f}" if v is not None else f"{'-':>9s}"  # noqa: E731
    print(f"{'width':>5s} {f'TP{W} eager':>9s} {f'TP{W} graph':>9s} {'TP1 eager':>9s} {'TP1 graph':>9s} "
          f"{'x eager':>8s} {'x graph':>8s} {'max|dlog|':>10s} {'argmax=':>8s}")
    for w, r in tn["target_step"].items():
        r1 = tp1.get("target_step", {}).get(w, {})
        sp = res.get("speedup_vs_tp1", {}).get(w, {})
        d = cmp.get(w, {})
        g = lambda v, p: f"{v:{p}}" if v is not None else "-"  # noqa: E731
        print(f"{w:>5} {f(r['eager_ms'])} {f(r['graph_ms'])} {f(r1.get('eager_ms'))} {f(r1.get('graph_ms'))} "
              f"{g(sp.get('eager'), '8.2f'):>8s} {g(sp.get('graph'), '8.2f'):>8s} {g(d.get('max_abs'), '10.2e'):>10s} "
              f"{g(d.get('argmax_agree'), '8.2f'):>8s}")
    if "compare_tp1" in res and "generate_tokens_equal" in res["compare_tp1"]:
        print(f"greedy tokens TP={W} == TP=1: {res['compare_tp1']['generate_tokens_equal']}")
    impls = res.get("allreduce", {})
    if len(impls) > 1:  # --allreduce A B ...: the same steps per all-reduce, slowest rank's medians
        first = next(iter(impls))
        print(f"all-reduce side by side (graph ms, slowest rank; tokens and logits vs {first}):")
        for impl, r in impls.items():
            ts = r["target_step"]
            same = r[f"generate_tokens_equal_{first}"]
            dl = max(r[f"logits_max_abs_diff_vs_{first}"].values())
            print(f"  {impl:8s} " + " ".join(f"w={w}: {f(t['graph_ms'] or t['eager_ms'])}" for w, t in ts.items())
                  + f"   tokens equal: {same}, max|dlogit| {dl:.2e}")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
