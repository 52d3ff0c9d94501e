"""`mtp-bench`: decode-step latency of DeepSeek-V3.2 at real width with random FP8 weights, in one run:
measured copy bandwidth (the roofline's ceiling), our target step for verify widths 1..K+1 (eager and graph),
whole speculative steps in eager / graph / overlap mode with GPU idle time, the same truncated model through
transformers' eager implementation, and an analytic byte count per step (weights touched, including the union
of routed experts the K+1 tokens pick, plus KV reads) giving the HBM roofline and our percentage of it.
`--trees chain3,2x2,...` adds, per tree shape (`TreeShape.parse`), the target verify over its N nodes with the
tree mask beside the causal verify of a chain of the same N tokens (graph ms, ms and bytes per node).
Prints a table; writes JSON. `--tp N` instead times one rank of a TP=N group at full depth on this one device
(`mtp.bench.rank`): the full model is measured per rank, not projected from these few layers.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch

from ..decode.graphs import capture_graph
from ..kernels.dispatch import ELEMENTWISE_IMPLS
from .rank_model import REAL_OVERHEAD
from ..plan.collectives import GROWTH as COLLECTIVE_GROWTH, IMPLS as COLLECTIVE_IMPLS, MeasuredComm
from ..plan.collectives import read as read_collectives
from .timing import copy_bandwidth, kernel_profile, spec_step_times, step_bytes, time_ms
from ..placement import LAYOUT_CHOICES


def _count_experts(model, ids) -> tuple[dict, list]:
    """Distinct routed experts per layer for the tokens of one forward: a pre-hook re-runs the (cheap)
    reference router on each MoE input, whichever path computes the experts."""
    from ..model.moe import MoE

    seen: dict[int, set] = {}
    hooks = []
    for li, layer in enumerate(model.model.layers):
        if isinstance(layer.mlp, MoE):
            def hook(mod, inp, li=li):
                x = inp[0].reshape(-1, inp[0].shape[-1])
                seen.setdefault(li, set()).update(mod.gate(x)[1].flatten().tolist())
            hooks.append(layer.mlp.register_forward_pre_hook(hook))
    return seen, hooks


def bench_ours(args, bw: float) -> dict:
    from ..decode.engine import generate, release
    from ..backends.fast_path import FastPathOptions, enable_fast_path, set_elementwise
    from ..checkpoint.synthetic import random_model
    from ..model.presets import real_config

    cfg = real_config(layers=args.layers, dense_layers=args.dense_layers, mtp_modules=1)
    t0 = time.perf_counter()
    model = random_model(cfg, device="cuda", dtype=torch.bfloat16)
    # --kernels: this model's switches; --elementwise: its ops between the GEMMs
    enable_fast_path(model, elementwise=args.elementwise,
                     options=FastPathOptions.for_world(1, **(args.kernels or {})))
    build_s = time.perf_counter() - t0
    res = {"config": {"layers": args.layers, "dense_layers": args.dense_layers, "mtp_modules": 1,
                      "prompt_len": args.prompt_len, "batch": args.batch}, "build_s": build_s,
           # the switches this run's fast path had (`mtp.plan.calibrate.measured_code` counts its launches by them)
           "fast_path_options": vars(FastPathOptions.for_world(1, **(args.kernels or {}))),
           "gpu_mem_gib": torch.cuda.memory_allocated() / 2**30}
    B, L = args.batch, args.prompt_len
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (B, L + args.k + 1), device="cuda", generator=g)
    widths = {}
    for w in range(1, args.k + 2):
        kv = model.new_cache(B, L + w + 8)
        with torch.no_grad():
            model(ids[:, :L], kv)  # prefill (reference naive attention, tiled FP8 GEMMs)
        base = kv.seq_lens.clone()
        blk = ids[:, L:L + w]
        S = L + w + 8

        def fwd():
            kv.truncate(base)
            model(blk, kv, kv_len=S)

        with torch.no_grad():
            eager_ms = time_ms(fwd)
            graph = capture_graph(fwd)
            graph_ms = time_ms(graph.replay)
            prof = kernel_profile(graph.replay) if args.profile and w in (1, args.k + 1) else None
            del graph
            set_elementwise(model, "eager")  # same step with the plain (unfused) ops, side by side
            graph_plain_ms = time_ms(capture_graph(fwd).replay)
            set_elementwise(model, args.elementwise)
            seen, hooks = _count_experts(model, blk)
            fwd()
            for h in hooks:
                h.remove()
        touched = [len(seen.get(li, ())) for li in range(cfg.num_hidden_layers)]
        by = step_bytes(model, touched, L + w, B)
        roof_ms = by["total"] / bw * 1e3
        widths[w] = {"eager_ms": eager_ms, "graph_ms": graph_ms, "graph_ms_unfused_glue": graph_plain_ms,
                     "experts_touched": touched, "bytes": by,
                     "roofline_ms": roof_ms, "pct_of_roofline_graph": 100 * roof_ms / graph_ms}
        if prof is not None:
            widths[w]["profile"] = prof
    res["target_step"] = widths
    if args.trees:
        res["trees"] = bench_trees(model, args, bw)
    # whole speculative steps (draft K + verify K+1 + accept + commit) in each mode
    spec = {}
    prompts = ids[:, :L].tolist()
    runs = [("none", 0, None, False), ("eagle", args.k, None, False)]
    if args.draft_vocab:  # the draft head over the first N ids only (cost; random weights accept nothing)
        runs.append(("eagle", args.k, args.draft_vocab, False))
    if args.draft_head_fp8:  # the drafts' logits from an FP8 copy of the head (mtp.draft.head_fp8)
        runs.append(("eagle", args.k, None, True))
    for draft, k, nv, fp8_head in runs:
        for mode in ("eager", "graph", "overlap") if nv is None and not fp8_head else ("graph", "overlap"):
            opts = ({"draft_vocab": range(nv)} if nv else {}) | ({"draft_head_fp8": True} if fp8_head else {})
            # the first call captures (kept by generate for the next call); the second is the one timed
            generate(model, prompts, 8, draft=draft, k=k, mode=mode, **opts)
            out = generate(model, prompts, args.new_tokens, draft=draft, k=k, mode=mode, **opts)
            m = out.metrics
            d = m.to_dict()
            spec[f"{draft}_k{k}{f'_vocab{nv}' if nv else ''}{'_head_fp8' if fp8_head else ''}_{mode}"] = {
                **spec_step_times(m), "decode_tok_s": m.decode_tok_s, "AL": m.mean_accepted_len,
                "gpu_idle_frac": d.get("graph/gpu_idle_frac"), "capture_s": d.get("graph/capture_s"),
                "graph_pool_bytes": d.get("graph/pool_bytes")}
    res["spec_step"] = spec
    release(model)  # generate's kept engines hold the model and their graphs' memory pools
    del model, out, kv, fwd
    gc.collect()
    torch.cuda.empty_cache()
    res["gpu_mem_gib_after_release"] = torch.cuda.memory_allocated() / 2**30
    return res


@torch.no_grad()
def bench_trees(model, args, bw: float) -> dict:
    """Per `--trees` shape: the tree verify and the chain verify of the same node count after a prefill of
    --prompt-len tokens (graph ms over a few replays, bytes from `step_bytes` with the experts the nodes chose)."""
    from ..spec.tree_shape import TreeShape
    from .timing import tree_row, tree_verify_fns

    shapes = [TreeShape.parse(t) for t in args.trees]
    B, L, cfg = args.batch, args.prompt_len, model.cfg
    kv = model.new_cache(B, L + max(t.n_nodes for t in shapes) + 8)
    g = torch.Generator(device="cuda").manual_seed(args.seed + 1)
    model(torch.randint(0, cfg.vocab_size, (B, L), device="cuda", generator=g), kv)  # prefill
    out = {}
    for shape in shapes:
        N, ms, total = shape.n_nodes, {}, {}
        for kind, fn in tree_verify_fns(model, kv, L, shape, args.seed).items():
            seen, hooks = _count_experts(model, None)
            fn()
            for h in hooks:
                h.remove()
            total[kind] = step_bytes(model, [len(seen.get(li, ())) for li in range(cfg.num_hidden_layers)],
                                     L + N, B)["total"]
            graph = capture_graph(fn)
            ms[kind] = time_ms(graph.replay, iters=5, warmup=2)
            del graph
        row = tree_row(shape, ms, total, model.runtime.absorb_max_tokens)
        row["roofline_ms"] = total["tree"] / bw * 1e3
        row["pct_of_roofline"] = 100 * row["roofline_ms"] / ms["tree"]
        out[shape.name] = row
    del kv
    return out


def bench_hf(args) -> dict:
    """transformers' DeepseekV32ForCausalLM, bf16, same truncated depth, random weights on the GPU."""
    import transformers
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    layers = min(args.layers, args.hf_layers)
    c = DeepseekV32Config(num_hidden_layers=layers, first_k_dense_replace=args.dense_layers,
                          rope_parameters={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                           "rope_theta": 10000.0})
    c._attn_implementation = "eager"
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = DeepseekV32ForCausalLM(c).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    B, L = args.batch, args.prompt_len
    ids = torch.randint(0, c.vocab_size, (B, L + 1), device="cuda")
    with torch.no_grad():
        out = model(ids[:, :L], use_cache=True)
        pkv = out.past_key_values
        nxt = ids[:, L:L + 1]
        ms = time_ms(lambda: model(nxt, past_key_values=pkv, use_cache=True), iters=5, warmup=1)
    res = {"layers": layers, "decode_ms": ms, "transformers": transformers.__version__}
    del model
    torch.cuda.empty_cache()
    return res


def parse_switches(items: list[str]) -> dict:
    """NAME=VALUE pairs of `FastPathOptions` switches: the INT_FIELDS integers, the others 0 / 1 / true /
    false."""
    from ..kernels.dispatch import INT_FIELDS, FastPathOptions

    names = set(FastPathOptions.__dataclass_fields__)
    out: dict = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in names:
            raise ValueError(f"expected NAME=VALUE with NAME one of {sorted(names)}, got {item!r}")
        if name in INT_FIELDS:
            if not value.isdigit():
                raise ValueError(f"{name} takes an integer, got {value!r}")
            out[name] = int(value)
            FastPathOptions(**{name: out[name]})  # its range, before anything is built
        elif value.lower() in ("1", "true", "on"):
            out[name] = True
        elif value.lower() in ("0", "false", "off"):
            out[name] = False
        else:
            raise ValueError(f"{name} takes 0 / 1 / true / false, got {value!r}")
    return out


def add_projection_args(ap: argparse.ArgumentParser, defaults: bool = True) -> None:
    """The --tp N projection's flags (`rank_model.project`'s assumptions), shared with `mtp.bench.reproject`, which
    prices a saved run again: there (defaults False) a flag not given is None and keeps the run's own value."""
    def d(value):
        return value if defaults else None

    ap.add_argument("--accept", type=float, nargs="+", default=d([0.85]),
                    help="--tp N projection: per-position draft acceptance p_1 [p_2 ...] (the last repeats); "
                         "AL(k) = 1 + p_1 + p_1 p_2 + ...")
    ap.add_argument("--al", type=float, default=None, help="--tp N projection: the acceptance length at k = --k")
    ap.add_argument("--allreduce-us", type=float, default=d(10.0),
                    help="--tp N projection: ASSUMED latency of one collective when no measurement is given")
    ap.add_argument("--collective-json", default=None,
                    help="--tp N projection: measured collective latencies (python -m mtp.bench.collectives, or "
                         "python -m mtp.bench.allreduce for NCCL vs the one-shot all-reduce)")
    ap.add_argument("--allreduce", choices=COLLECTIVE_IMPLS, default=d("nccl"),
                    help="--tp N projection with --collective-json: which measured rows price the all-reduces "
                         "(oneshot: the block boundaries at the fused one-shot + add + norm + quant, less the norm "
                         "kernel the step holds, the rest plain one-shot; all-gathers stay NCCL)")
    ap.add_argument("--tree-al", nargs="+", default=d([]), metavar="SHAPE=AL",
                    help="--tp N projection: the acceptance length of --trees shapes (e.g. 2x2=2.9, measured with "
                         "mtp-eval), for their projected tok/s per user")
    ap.add_argument("--headline-al", type=float, nargs="+", default=d([2.8, 2.96]),
                    help="--tp N projection: acceptance lengths at k = --k printed first (DeepSeek MTP on real "
                         "prompts: 2.82 TensorRT-LLM R1 k=3 to 2.96 SGLang V3.2)")
    ap.add_argument("--real-overhead", type=float, default=d(REAL_OVERHEAD),
                    help="--tp N projection: real / simulated step ratio, measured at TP=4 and ASSUMED for N "
                         "(rank_model.REAL_OVERHEAD_SOURCE; `python -m mtp.bench.overhead` measures it)")
    ap.add_argument("--collective-growth", type=float, default=d(COLLECTIVE_GROWTH),
                    help="--tp N projection: ASSUMED collective latency growth per doubling of GPUs past those "
                         "measured (issue 25: 12-13 us on 2 x H200, 17-20 us on 4)")


def check_projection_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`add_projection_args`' values checked (`ap.error` names the flag and the value); the collective file read now:
    a bad file must not end a long GPU run at its projection."""
    if min(args.headline_al) < 1 or args.real_overhead < 1 or args.collective_growth < 1:
        ap.error(f"--headline-al, --real-overhead and --collective-growth must be >= 1, got {args.headline_al}, "
                 f"{args.real_overhead}, {args.collective_growth}")
    if args.al is not None and args.al < 1:
        ap.error(f"--al must be >= 1, got {args.al}")
    if args.collective_json:
        try:
            MeasuredComm(read_collectives(args.collective_json), args.tp, args.allreduce, args.collective_growth)
        except ValueError as e:
            ap.error(f"--collective-json: {e}")
    elif args.allreduce != "nccl":
        ap.error(f"--allreduce {args.allreduce} needs --collective-json (a measured mtp.bench.allreduce file)")
    if any(not 0 <= p <= 1 for p in args.accept):
        ap.error(f"--accept rates must be in [0, 1], got {args.accept}")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1, metavar="N",
                    help="time one rank of a TP=N / EP=N group (simulated: collectives counted, not run; "
                         "mtp.bench.rank). 1: the single-GPU benchmark")
    ap.add_argument("--rank", type=int, default=None, help="with --tp N: the rank (default: most weight bytes)")
    ap.add_argument("--layers", type=int, default=None, help="trunk layers (default 3; with --tp N: 61, full depth)")
    ap.add_argument("--dense-layers", type=int, default=None,
                    help="dense layers among them (default 1; with --tp N: min(3, layers - 1), as the real model)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batch", type=int, nargs="+", default=[1],
                    help="sequences per step; with --tp N several (e.g. 1 8 32 64): each its own entry in the JSON")
    ap.add_argument("--prompt-len", type=int, nargs="+", default=None,
                    help="context length(s) (default 1024; with --tp N: 1024 8192 32768 on a GPU, 24 40 on CPU)")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--hf", action="store_true", help="also time transformers' eager implementation")
    ap.add_argument("--hf-layers", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                    help="also time the eagle step with a draft vocabulary of N ids (mtp.draft.vocab; --tp N: eagle "
                         "k = --k in both layouts, balanced and by shard, and with --draft-head-fp8 also that head's "
                         "FP8 copy of the N rows in both)")
    ap.add_argument("--draft-head-fp8", action="store_true",
                    help="also time the eagle k = --k step with the drafts' logits from an FP8 copy of the head "
                         "(draft_head_fp8, mtp.draft.head_fp8; --tp N: profiled with --profile, the copy's bytes in "
                         "the JSON)")
    ap.add_argument("--profile", action="store_true",
                    help="per-kernel time of the graph step (torch.profiler), in the JSON and table")
    ap.add_argument("--iters", type=int, default=20, help="--tp N: timed replays per measurement")
    ap.add_argument("--extrapolate", type=int, nargs=2, default=None, metavar=("A", "B"),
                    help="--tp N when the rank does not fit at --layers: measure A and B layers (A < B, both with "
                         "the dense layers) and extrapolate per layer to --layers, labelled as extrapolated")
    ap.add_argument("--eager", action="store_true", help="--tp N on a GPU: also time the eager step")
    ap.add_argument("--no-spec", action="store_true", help="--tp N: skip the whole speculative steps")
    ap.add_argument("--kernel-variants", nargs="*", default=[], metavar="NAME",
                    help="--tp N on a GPU: also time these fast-path kernel variants on the same rank, side by side "
                         "(old: the fast path before this release's kernels; new+pdl: with programmatic dependent launch)")
    ap.add_argument("--elementwise", choices=ELEMENTWISE_IMPLS, default="triton",
                    help="the fast path's elementwise ops between the GEMMs: triton (one Triton kernel each), compile "
                         "(torch.compile'd), eager (plain PyTorch); the TP=1 table also times the step with eager ones")
    ap.add_argument("--kernels", nargs="*", default=[], metavar="NAME=VALUE",
                    help="fast-path kernel switches for this run (mtp.kernels.dispatch.FastPathOptions), e.g. "
                         "gemv_rows=1 pdl=1 norm_quant=0; recorded in the JSON")
    ap.add_argument("--spec-prompt-len", type=int, default=None,
                    help="--tp N: context of the speculative steps (a real prefill runs; default: the shortest)")
    ap.add_argument("--spec-modes", default="overlap", help="--tp N: comma list of graph, overlap (GPU)")
    ap.add_argument("--trees", default=None, metavar="SHAPES",
                    help="comma list of draft-tree shapes ('chain3', '2x2', '4x1x1': mtp.spec.tree_shape.TreeShape.parse): "
                         "also time the target verify of each tree beside a chain of the same node count")
    ap.add_argument("--route", choices=("measured", "busiest"), default="measured",
                    help="--tp N: 'busiest' replaces each MoE layer's router output with a seeded per-token draw "
                         "of the uniform group-limited router, renamed so this rank is the step's busiest under "
                         "--layout (mtp.bench.experts, mtp.bench.forced_route): the rank timed is the slowest one")
    ap.add_argument("--layout", choices=LAYOUT_CHOICES, default="auto",
                    help="--tp N: the rank's expert layout (mtp/placement.py; 'auto' as the runtime: split where each "
                         "rank gets whole 128-blocks of every expert, DeepSeek-V3.2 at TP=2..16); interleaved / "
                         "permuted need --route busiest (drawn for that layout)")
    add_projection_args(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", "--json", dest="out", default=None,
                    help="JSON result file (none is written unless given)")
    args = ap.parse_args(argv)
    try:
        args.kernels = parse_switches(args.kernels)
    except ValueError as e:
        ap.error(f"--kernels: {e}")
    tp = args.tp > 1
    args.trees = _tree_names(ap, args.trees)
    args.tree_al = _tree_al(ap, args.tree_al, args.trees)
    if args.tp < 1:
        ap.error(f"--tp must be >= 1, got {args.tp}")
    if args.layers is None:
        args.layers = 61 if tp else 3
    if args.dense_layers is None:
        args.dense_layers = min(3, args.layers - 1) if tp else 1
    if not 0 <= args.dense_layers < args.layers:
        ap.error(f"--dense-layers must be in [0, --layers), got {args.dense_layers} with {args.layers} layers")
    if min(args.batch) < 1 or len(set(args.batch)) != len(args.batch):
        ap.error(f"--batch: distinct values >= 1, got {args.batch}")
    if len(args.batch) > 1 and (not tp or args.extrapolate is not None):
        ap.error(f"several --batch values ({args.batch}) need --tp N without --extrapolate")
    args.batches, args.batch = list(args.batch), args.batch[0]
    if not tp:
        if args.rank is not None or args.extrapolate is not None:
            ap.error("--rank and --extrapolate need --tp N with N > 1")
        if args.prompt_len is not None and len(args.prompt_len) > 1:
            ap.error("several --prompt-len values need --tp N (the single-GPU benchmark takes one)")
        args.prompt_len = (args.prompt_len or [1024])[0]
        return args
    if args.prompt_len is None:
        args.prompt_len = [1024, 8192, 32768] if torch.cuda.is_available() else [24, 40]
    if args.extrapolate is not None:
        a, b = args.extrapolate
        if not args.dense_layers < a < b < args.layers:
            ap.error(f"--extrapolate A B needs {args.dense_layers} (dense layers) < A < B < {args.layers} (--layers), "
                     f"got {a} {b}")
    args.spec_modes = tuple(m.strip() for m in args.spec_modes.split(",") if m.strip())
    if not args.spec_modes or not set(args.spec_modes) <= {"graph", "overlap"}:
        ap.error(f"--spec-modes: comma list of graph, overlap; got {args.spec_modes}")
    check_projection_args(ap, args)
    if args.route == "measured" and args.layout not in ("auto", "contiguous", "split"):
        ap.error(f"--layout {args.layout} needs --route busiest (the measured route is the built rank's own, and "
                 f"the rank is built contiguous or split)")
    return args


def _tree_names(ap: argparse.ArgumentParser, spec: str | None) -> list[str]:
    """--trees as canonical shape names (validated here, parsed again where timed: the JSON keeps the names)."""
    from ..spec.tree_shape import TreeShape

    if not spec:
        return []
    try:
        return [TreeShape.parse(t).name for t in spec.split(",") if t.strip()]
    except ValueError as e:
        ap.error(f"--trees: {e}")


def _tree_al(ap: argparse.ArgumentParser, items: list[str], trees: list[str]) -> dict[str, float]:
    """--tree-al SHAPE=AL ... as {canonical shape name: AL}; every shape must be one of --trees, AL >= 1."""
    out = {}
    for item in items:
        name, sep, al = item.partition("=")
        try:
            key, value = _tree_names(ap, name)[0], float(al)
        except (IndexError, ValueError):
            ap.error(f"--tree-al: expected SHAPE=AL (e.g. 2x2=2.9), got {item!r}")
        if not sep or key not in trees or value < 1:
            ap.error(f"--tree-al {item!r}: the shape must be one of --trees {trees} and AL >= 1")
        out[key] = value
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.hf:
        from ..utils import MissingExtraError, require

        try:
            require("transformers", "hf", "mtp-bench --hf")
        except MissingExtraError as e:
            raise SystemExit(f"mtp-bench: {e}") from None
    if args.tp > 1:
        from .rank import run

        run(args)
        return
    if not torch.cuda.is_available():
        raise SystemExit("mtp-bench needs a CUDA GPU (on CPU: --tp N runs a simulated rank of a tiny model)")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "args": vars(args)}
    bw = copy_bandwidth()
    res["copy_TBps"] = bw / 1e12
    res["ours"] = bench_ours(args, bw)
    if args.hf:
        try:
            res["hf"] = bench_hf(args)
            ours1 = res["ours"]["target_step"][1]["graph_ms"]
            res["speedup_vs_hf_w1"] = res["hf"]["decode_ms"] / ours1 * (args.layers / res["hf"]["layers"])
            # no implementation beats the byte floor: transformers' time over it bounds any speedup claim
            roof1 = res["ours"]["target_step"][1]["roofline_ms"]
            res["speedup_bound_vs_hf_w1"] = res["hf"]["decode_ms"] / roof1 * (args.layers / res["hf"]["layers"])
        except Exception as e:  # keep our numbers even if this transformers version differs
            res["hf_error"] = repr(e)[:500]
    if args.out is not None:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1, default=float)
        os.replace(tmp, args.out)
    _table(res)


def _table(res: dict) -> None:
    print(f"\n{res['device']}  copy {res['copy_TBps']:.2f} TB/s  torch {res['torch']}")
    print(f"{'what':34s} {'ms':>9s} {'roofline ms':>12s} {'% roof':>7s}")
    for w, r in res["ours"]["target_step"].items():
        print(f"{'target step w=' + str(w) + ' eager':34s} {r['eager_ms']:9.3f}")
        print(f"{'target step w=' + str(w) + ' graph':34s} {r['graph_ms']:9.3f} {r['roofline_ms']:12.3f} "
              f"{r['pct_of_roofline_graph']:7.1f}")
        print(f"{'  same, unfused glue':34s} {r['graph_ms_unfused_glue']:9.3f}")
        if "profile" in r:
            p = r["profile"]
            print(f"  kernels/step {p['kernels_per_step']:.0f}, kernel time {p['kernel_us_per_step'] / 1e3:.3f} ms of "
                  f"{r['graph_ms']:.3f} ms; top:")
            for k in p["top"][:12]:
                print(f"    {k['us_per_step']:8.1f} us  x{k['calls_per_step']:5.1f}  {k['name'][:70]}")
    for name, r in res["ours"].get("trees", {}).items():
        print(f"{'tree ' + name + ' N=' + str(r['nodes']) + ' graph':34s} {r['tree']['ms']:9.3f} {r['roofline_ms']:12.3f} "
              f"{r['pct_of_roofline']:7.1f}  {r['tree']['ms_per_node']:.3f} ms/node, "
              f"{r['tree']['bytes_per_node'] / 1e6:.0f} MB/node; chain of {r['nodes']}: {r['chain']['ms']:.3f} ms "
              f"(tree/chain {r['tree_over_chain']:.2f})")
    for name, r in res["ours"]["spec_step"].items():
        idle = r["gpu_idle_frac"]
        extra = f" idle {100 * idle:.1f}%" if idle is not None else ""
        dp = f", drafter's prompt pass {r['draft_prefill_ms']:.1f} ms once" if r.get("draft_prefill_ms") else ""
        print(f"{'spec ' + name:34s} {r['step_ms_wall']:9.3f}  (wall per step){extra}{dp}")
    if "hf_error" in res:
        print("transformers baseline failed:", res["hf_error"])
    print("full model at TP=8 / 16: measure one rank with `mtp-bench --tp 8` (no projection from these layers)")
    if "hf" in res:
        print(f"{'transformers eager decode':34s} {res['hf']['decode_ms']:9.3f}  ({res['hf']['layers']} layers)"
              f"  ours is {res['speedup_vs_hf_w1']:.1f}x faster (w=1 graph, per layer; at the HBM roofline "
              f"{res.get('speedup_bound_vs_hf_w1', float('nan')):.1f}x)")


if __name__ == "__main__":
    main()
