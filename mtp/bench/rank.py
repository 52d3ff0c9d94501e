"""`mtp-bench --tp N`: one rank of a TP=N / EP=N group of the 671B model, timed on one device.

    python -m mtp.bench --tp 8 --layers 61 --prompt-len 1024 8192 32768 --profile --json tp8.json   # one H200
    python -m mtp.bench --tp 2 --layers 2 --prompt-len 24 40 --k 1                                  # CPU, tiny

Rank r (default: the rank holding the most weight bytes) is built at its real shapes (H/N heads, E/N experts,
V/N vocabulary rows; random FP8 weights drawn on the device, only this rank's slices: `random_parallel_model`)
inside `simulate.simulated_rank`, so every collective is a no-op; they are counted per step, not timed. For
each context length the target cache is filled with random valid FP8 entries (`fill_cache_random`: no prefill
is run) and one target forward per verify width 1..K+1 is CUDA-graph captured and timed, with
- the rank's byte floor: its non-expert trunk weights, the routed experts its slice was sent (distinct local
  experts the step's tokens chose, measured with the reference router; random weights route arbitrarily),
  its lm_head rows, and the cache it must read (the indexer keys of every position once the indexer runs,
  at least top-k latent entries), over the copy bandwidth measured in the same run; and the % of it reached;
- kernels per step (and per layer) from the profiler; with --profile the per-kernel table;
- the lightning indexer (scores + top-k) of one layer timed alone at that context, and per step;
- with `--trees chain3,2x2,...` (`TreeShape.parse` names): per tree shape the target verify forward over its N
  nodes with the tree mask, beside the causal verify of a chain of the same N tokens (graph ms, ms per node,
  bytes per node from the rank's byte floor; a few replays each on the same built rank); with `--tree-al
  2x2=2.9 ...` (acceptance lengths measured elsewhere, e.g. mtp-eval) the projection adds their tok/s per user.
Then whole speculative steps (`mtp.generate`, graph/overlap mode: plain, eagle and vanilla k = 1..K) at the
shortest context, which measures the draft cost at these shapes. `projection` adds the collectives back:
n x a latency that is measured (`--collective-json`, from `python -m mtp.bench.collectives` on N GPUs) or
assumed (`--allreduce-us`, printed as assumed), and divides by the acceptance length of `--accept`.
The JSON is rewritten (atomically) after every part, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from ..model.cache import KVCache
from ..model.config import ModelConfig
from ..checkpoint.inventory import checkpoint_spec
from ..decode.graphs import capture_graph
from .timing import copy_bandwidth, kernel_profile, timer
from ..parallel.layout import ParallelPlan
from ..parallel.memory import GIB
from ..plan.speed import accept_len

# Published batch-1 decode speeds to print beside ours (tok/s per user), as the issue cites them.
REFERENCES = (
    ("TensorRT-LLM, DeepSeek-R1 FP8, 8 x H200, MTP 3", 158.0),
    ("TensorRT-LLM, DeepSeek-R1 FP4, 8 x B200, MTP 3 (AL 2.82)", 253.0),
    ("TensorRT-LLM, DeepSeek-R1 FP4, 8 x B200, MTP 3, full min-latency tuning", 368.0),
)
# The deployments the tok/s lines are for: (GPU name fragment, TP)
TARGETS = (("H200", 8), ("H100", 16))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def default_rank(cfg: ModelConfig, world: int, dtype: torch.dtype) -> int:
    """The rank holding the most weight bytes (lowest on ties). Heads, experts and vocabulary split evenly;
    only the 128-block MLP split can make ranks differ (at TP 8 and 16 all ranks hold the same bytes, so rank
    0). Routed-expert work depends on the routing of each step and cannot be chosen up front."""
    from ..parallel.memory import weight_bytes_by_rank

    totals = [sum(b.values()) for b in weight_bytes_by_rank(cfg, ParallelPlan(world), dtype)]
    return max(range(world), key=lambda r: (totals[r], -r))


def rank_config(args, world: int, cuda: bool, layers: int) -> ModelConfig:
    """The real config on a GPU, a tiny one that splits over `world` on CPU; `layers` trunk layers."""
    from ..model.presets import real_config, tiny_parallel_config

    if cuda:
        return real_config(layers=layers, dense_layers=args.dense_layers, mtp_modules=1)
    return tiny_parallel_config(world, layers, args.dense_layers, 1)


def cache_bytes_per_position(cfg: ModelConfig, quantized: bool = True, dtype_bytes: int = 2) -> dict:
    """Bytes a step reads per cached position and layer, split as the floor needs them: the latent (+ its per-128
    scales when quantized) with the rotary key, and the indexer key (+ its scale). What the cache allocates is
    `KVCache.bytes_per_position` (which also counts the scales of an unquantized cache)."""
    C, R, Dk = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim
    lat = (C + 4 * max(C // 128, 1) if quantized else C * dtype_bytes) + R * dtype_bytes
    idx = (Dk + 4) if quantized else Dk * dtype_bytes + 4
    return {"latent": lat, "indexer": idx}


def memory_need(cfg: ModelConfig, world: int, rank: int, dtype: torch.dtype, max_len: int, batch: int) -> dict:
    """What the rank needs on the device: its weights (the planner's count), ~4% for the fast path's fused
    copies, one full tensor drawn in fp32 while building (+ its cast), its cache, and 4 GiB of workspace."""
    from ..parallel.memory import rank_weight_bytes

    weights = sum(rank_weight_bytes(cfg, ParallelPlan(world), rank, dtype).values())
    biggest = max(math.prod(ts.shape) for ts in checkpoint_spec(cfg).values()) * 6
    cache = KVCache.bytes_per_position(cfg, dtype, quantized=True) * max_len * batch * cfg.num_hidden_layers
    need = weights * 1.04 + biggest + cache + 4 * GIB
    return {"weights_gib": weights / GIB, "cache_gib": cache / GIB, "need_gib": need / GIB}


def rank_floor(model, touched: dict[int, int], S: int, B: int) -> dict:
    """Bytes one target forward of this rank must read at context S (positions incl. the new ones): trunk
    weights except routed experts, the `touched[layer]` local experts, lm_head rows, and per layer and row the
    cache: every indexer key when the indexer runs (S > top-k), and at least min(S, top-k) latent entries."""
    from ..parallel.modules import ExpertParallelMoE

    cfg = model.cfg
    dense, experts = 0, 0
    for li, layer in enumerate(model.model.layers):
        for name, p in layer.named_parameters():
            if ".experts." not in f".{name}":
                dense += p.numel() * p.element_size()
        if isinstance(layer.mlp, ExpertParallelMoE) and len(layer.mlp.experts):
            one = next(iter(layer.mlp.experts.values()))
            experts += sum(p.numel() * p.element_size() for p in one.parameters()) * touched.get(li, 0)
    head = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    per = cache_bytes_per_position(cfg, quantized=model.runtime.numerics == "fp8",
                                   dtype_bytes=torch.finfo(model.dtype).bits // 8)
    sparse = S > cfg.index_topk
    kv = (per["latent"] * min(S, cfg.index_topk) + (per["indexer"] * S if sparse else 0)) * B * cfg.num_hidden_layers
    return {"weights_non_expert": dense, "weights_routed_experts": experts, "lm_head": head, "cache": kv,
            "total": dense + experts + head + kv}


def count_local_experts(model) -> tuple[dict[int, set], list]:
    """Distinct local experts the tokens of one forward choose, per MoE layer: a pre-hook re-runs the replicated
    router (`gate`) on each MoE input and keeps the ids in this rank's range (eager forwards only)."""
    from ..parallel.modules import ExpertParallelMoE

    seen: dict[int, set] = {}
    hooks = []
    for li, layer in enumerate(model.model.layers):
        if isinstance(layer.mlp, ExpertParallelMoE):
            def hook(mod, inp, li=li):
                ids = mod.gate(inp[0].reshape(-1, inp[0].shape[-1]))[1].flatten().tolist()  # host read: eager
                seen.setdefault(li, set()).update(e for e in ids if mod.e0 <= e < mod.e1)
            hooks.append(layer.mlp.register_forward_pre_hook(hook))
    return seen, hooks


def expected_local_experts(cfg: ModelConfig, world: int, tokens: int) -> float:
    """Expected distinct local experts per MoE layer if each token picked its K experts uniformly at random."""
    p = cfg.num_experts_per_tok / cfg.n_routed_experts
    return cfg.n_routed_experts / world * (1 - (1 - p) ** tokens)


@torch.no_grad()
def indexer_alone(model, cache, L: int, w: int, time_fn, cuda: bool) -> dict:
    """One layer's lightning indexer at context L for w queries, alone: scores over the L + w keys, then
    top-k (the kernels the fast path runs; their references on CPU). Per layer, and x layers per step."""
    from ..model import fp8
    from ..kernels import indexer as ix

    cfg = model.cfg
    S = L + w
    if cfg.index_topk >= S:
        return {"skipped": f"S = {S} <= index_topk {cfg.index_topk}: every position is attended, no indexer"}
    B, dev = cache.batch, cache.kv.device
    g = torch.Generator(device=dev).manual_seed(7)
    q8, qs = fp8.act_quant(torch.randn(B, w, cfg.index_n_heads, cfg.index_head_dim, generator=g, device=dev))
    qs = qs.squeeze(-1)
    wt = torch.randn(B, w, cfg.index_n_heads, generator=g, device=dev)
    k8, ks = cache.idx_k[0, :, :S], cache.idx_k_scale[0, :, :S]
    lens = torch.full((B,), L, dtype=torch.long, device=dev)  # L keys before the w new ones
    score_fn = ix.indexer_scores if cuda else ix.indexer_scores_ref
    out = {}

    def scores():
        out["s"] = score_fn(q8, qs, wt, k8, ks, lens)

    impl = getattr(next((m for m in model.modules() if hasattr(m, "topk_impl")), None), "topk_impl", "torch")

    def topk():  # the top-k the fast path runs (`FastMLA.topk_impl`); torch.topk on the reference path
        if cuda and impl != "torch":
            from ..kernels.topk import radix_topk

            out["i"] = radix_topk(out["s"], lens, cfg.index_topk)
        else:
            out["i"] = ix.topk_from_scores(out["s"], cfg.index_topk)

    res = {}
    for name, fn in (("scores", scores), ("topk", topk)):
        fn()
        if cuda:
            graph = capture_graph(fn)
            res[f"{name}_us_per_layer"] = time_fn(graph.replay) * 1e3
            del graph
        else:
            res[f"{name}_us_per_layer"] = time_fn(fn) * 1e3
    res["topk_impl"] = impl if cuda else "torch"
    res["layers"] = cfg.num_hidden_layers
    res["ms_per_step"] = (res["scores_us_per_layer"] + res["topk_us_per_layer"]) * cfg.num_hidden_layers / 1e3
    return res


@torch.no_grad()
def target_steps(model, comm, args, L: int, cuda: bool, bw: float | None, time_fn, world: int) -> dict:
    """One context length: cache filled to L, then per width w = 1..K+1 the counted eager step, the graph
    time, floor, kernels, and the indexer alone."""
    from ..checkpoint.synthetic import fill_cache_random

    from ..spec.tree_shape import TreeShape

    cfg, B, K = model.cfg, args.batch, args.k
    shapes = [TreeShape.parse(t) for t in args.trees]
    cache = fill_cache_random(model.new_cache(B, L + max([K + 1] + [t.n_nodes for t in shapes])), L,
                              seed=args.seed + L)
    base = cache.seq_lens.clone()
    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, cfg.vocab_size, (B, K + 1), generator=g).to(model.device)
    widths, indexer = {}, {}
    for w in range(1, K + 2):
        blk = ids[:, :w]

        def fwd():
            cache.truncate(base)
            model(blk, cache, kv_len=L + w)

        comm.reset()
        seen, hooks = count_local_experts(model)
        try:
            fwd()  # the counted eager step (graph replays run no Python)
        finally:
            for h in hooks:
                h.remove()
        touched = {li: len(s) for li, s in seen.items()}
        r: dict = {"collectives": dict(comm.counts),
                   "local_experts_touched": {"per_moe_layer": [touched[li] for li in sorted(touched)],
                                             "mean": statistics.mean(touched.values()) if touched else 0.0,
                                             "expected_uniform_routing": expected_local_experts(cfg, world, B * w)}}
        if args.eager or not cuda:
            r["eager_ms"] = time_fn(fwd)
        if cuda:
            graph = capture_graph(fwd)
            r["graph_ms"] = time_fn(graph.replay)
            prof = kernel_profile(graph.replay, steps=3, top=40)
            del graph
            r["kernels_per_step"] = prof["kernels_per_step"]
            r["kernels_per_layer"] = prof["kernels_per_step"] / cfg.num_hidden_layers
            r["kernel_us_per_step"] = prof["kernel_us_per_step"]
            if args.profile:
                r["profile_top"] = prof["top"]
        step_ms = r.get("graph_ms", r.get("eager_ms"))
        by = rank_floor(model, touched, L + w, B)
        r["floor_bytes"] = by
        if bw:
            r["floor_ms"] = by["total"] / bw * 1e3
            r["pct_of_floor"] = 100 * r["floor_ms"] / step_ms
        widths[w] = r
        indexer[w] = indexer_alone(model, cache, L, w, time_fn, cuda)
        log(f"  L={L} w={w}: {'graph' if cuda else 'eager'} {step_ms:.3f} ms, "
            f"{r['collectives']['all_reduce']} all-reduce + {r['collectives']['all_gather']} all-gather, "
            f"floor {by['total'] / 1e9:.2f} GB" + (f" ({r['pct_of_floor']:.1f}% of it)" if bw else "")
            + (f", {r['kernels_per_step']:.0f} kernels" if cuda else ""))
    trees = {t.name: tree_verify(model, comm, cache, t, L, cuda, bw, args) for t in shapes}
    del cache
    out = {"cache": f"random valid FP8 entries at {L} positions (fill_cache_random; no prefill was run)",
           "widths": widths, "indexer": indexer}
    if trees:
        out["trees"] = trees
    return out


@torch.no_grad()
def tree_verify(model, comm, cache, shape, L: int, cuda: bool, bw: float | None, args) -> dict:
    """The target verify over a tree's N nodes at context L, and the causal verify of a chain of the same N
    tokens: graph ms (a few replays), ms and floor bytes per node (local experts counted on an eager call), the
    tree verify's collectives."""
    from .timing import tree_row, tree_verify_fns

    time_fn = timer(cuda, min(args.iters, 5), 2)
    N, ms, floor = shape.n_nodes, {}, {}
    for kind, fn in tree_verify_fns(model, cache, L, shape, args.seed).items():
        comm.reset()
        seen, hooks = count_local_experts(model)
        try:
            fn()
        finally:
            for h in hooks:
                h.remove()
        floor[kind] = rank_floor(model, {li: len(s) for li, s in seen.items()}, L + N, cache.batch)["total"]
        if kind == "tree":
            collectives = dict(comm.counts)
        if cuda:
            graph = capture_graph(fn)
            ms[kind] = time_fn(graph.replay)
            del graph
        else:
            ms[kind] = time_fn(fn)
    row = tree_row(shape, ms, floor, model.runtime.absorb_max_tokens)
    row["collectives"] = collectives
    if bw:
        row["floor_ms"] = floor["tree"] / bw * 1e3
        row["pct_of_floor"] = 100 * row["floor_ms"] / ms["tree"]
    log(f"  L={L} tree {shape.name} (N={N}): {ms['tree']:.3f} ms ({ms['tree'] / N:.3f} per node), chain of {N}: "
        f"{ms['chain']:.3f} ms; floor {floor['tree'] / N / 1e6:.1f} MB per node")
    return row


@torch.no_grad()
def spec_steps(model, args, L: int, cuda: bool) -> dict:
    """Whole speculative steps (draft K + verify K+1 + accept + commit) through `mtp.generate` at context L:
    plain, eagle and vanilla k = 1..K (vanilla past the checkpoint's MTP modules repeats the last one); and the
    eagle tree step of every --trees shape (`generate_tree`). As for the chains, the first call captures the step
    (kept per model and settings) and the second, timed, replays it."""
    from ..decode.engine import generate, release
    from ..decode.tree import generate_tree
    from ..spec.tree_shape import TreeShape

    g = torch.Generator().manual_seed(args.seed + 2)
    prompts = torch.randint(0, model.cfg.vocab_size, (args.batch, L), generator=g).tolist()
    modes = args.spec_modes if cuda else ("eager",)
    runs = [("none", 0)] + [(d, k) for d in ("eagle", "vanilla") for k in range(1, args.k + 1)]
    out = {}
    for draft, k in runs:
        opts = {"reuse_modules": True} if draft == "vanilla" and k > model.n_mtp else {}
        for mode in modes:
            t0 = time.perf_counter()
            if mode != "eager":  # the first call captures the step (kept by generate); the second is timed
                generate(model, prompts, 4, draft=draft, k=k or None, mode=mode, **opts)
            m = generate(model, prompts, args.new_tokens, draft=draft, k=k or None, mode=mode, **opts).metrics
            steps = max(m.target_forwards, 1)
            out[f"{draft}_k{k}_{mode}"] = {
                "draft": draft, "k": k, "mode": mode, "steps": m.target_forwards,
                "step_ms_wall": m.time_decode_s / steps * 1e3,
                "gpu_step_ms": m.gpu_busy_ms / m.graph_replays if m.graph_replays else None,
                "AL_random_weights": m.mean_accepted_len}
            log(f"  spec {draft} k={k} {mode}: {out[f'{draft}_k{k}_{mode}']['step_ms_wall']:.3f} ms/step wall "
                f"({time.perf_counter() - t0:.1f} s)")
        release(model)
    for name in args.trees:  # whole eagle tree steps (graph / overlap: the step captured per shape)
        shape = TreeShape.parse(name)
        for mode in modes:
            key = f"tree_{name}_{mode}"
            try:
                if mode != "eager":
                    generate_tree(model, prompts, shape, 4, draft="eagle", mode=mode)
                m = generate_tree(model, prompts, shape, args.new_tokens, draft="eagle", mode=mode).metrics
            except Exception as e:  # keep the chains' numbers; the error and its stack are in the JSON and printed
                out[key] = {"tree": name, "mode": mode, "error": repr(e)[:500],
                            "traceback": traceback.format_exc()[-4000:]}
                log(f"  spec tree {name} {mode} failed: {out[key]['error']}\n{out[key]['traceback']}")
                continue
            steps = max(m.target_forwards, 1)
            out[key] = {"draft": "eagle", "tree": name, "k": shape.max_depth, "nodes": shape.n_nodes, "mode": mode,
                        "steps": m.target_forwards, "graph_captures": m.graph_captures,
                        "step_ms_wall": m.time_decode_s / steps * 1e3,
                        "gpu_step_ms": m.gpu_busy_ms / m.graph_replays if m.graph_replays else None,
                        "AL_random_weights": m.mean_accepted_len}
            log(f"  spec tree {name} {mode}: " + (f"GPU {out[key]['gpu_step_ms']:.3f} ms/step" if m.graph_replays else
                                                  f"{out[key]['step_ms_wall']:.3f} ms/step wall"))
        release(model)  # a kept tree engine holds its buffers and graphs
    return {"prompt_len": L, "modes": tuple(modes), "runs": out,
            "note": "generate() / generate_tree() with a real prefill of a random prompt of this length"}


@torch.no_grad()
def draft_collectives(model, comm) -> dict:
    """Collectives of one MTP-module forward (one draft forward), counted on an eager call."""
    cache = model.new_cache(1, 8, n_layers=1)
    ids = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    h = torch.zeros(1, 1, model.cfg.hidden_size, dtype=model.dtype, device=model.device)
    comm.reset()
    model.mtp_forward(0, ids, h, cache, kv_len=1)
    return dict(comm.counts)


def collective_latency(args) -> dict:
    """us per all-reduce / all-gather: measured on N GPUs (`--collective-json`) or the assumption."""
    if args.collective_json:
        data = json.loads(Path(args.collective_json).read_text())
        world = data.get("world")
        other = f"; measured on {world} GPUs, not the {args.tp} of this TP" if world != args.tp else ""
        return {"source": f"measured ({args.collective_json}: {data.get('device')} x {world}{other})",
                "assumed": False, "world": world, "table": data["ops"]}
    return {"source": f"ASSUMED {args.allreduce_us} us per collective (no multi-GPU measurement given)",
            "assumed": True, "us": args.allreduce_us}


def latency_us(lat: dict, op: str, nbytes: int) -> float:
    """One collective's latency: the measured entry with the nearest message size at least as large."""
    if lat["assumed"]:
        return lat["us"]
    rows = sorted(lat["table"][op], key=lambda r: r["bytes"])
    for r in rows:
        if r["bytes"] >= nbytes:
            return r["us"]
    return rows[-1]["us"] * nbytes / rows[-1]["bytes"]


def comm_ms(lat: dict, counts: dict, times: int = 1) -> float:
    """Latency of the collectives in `counts` (per-call sizes: total bytes / number), `times` over."""
    ms = 0.0
    for op in ("all_reduce", "all_gather"):
        n = counts[op]
        if n:
            ms += n * latency_us(lat, op, counts[f"{op}_bytes"] // n) * 1e-3
    return ms * times


def project(res: dict, args) -> dict:
    """Per context: plain TPOT = step(w=1) + its collectives; MTP k: (step(w=k+1) + draft + collectives of the
    verify and the k draft forwards) / AL(k). draft = measured eagle-k spec step - the target step at w = k+1
    measured with it (same depth, spec context); at longer contexts plus k x (indexer per layer there - at the
    spec context). A tree of depth D with an AL given (--tree-al): (its verify + its draft + collectives) / AL,
    the draft taken from its measured tree step as the chains' (else the eagle-D chain's draft: a lower bound,
    a tree's draft forwards are wider)."""
    lat = collective_latency(args)
    spec = res.get("spec_step", {})
    L0 = spec.get("prompt_len")
    dc = res["draft_collectives_per_forward"]
    dev = res["device"]
    out = {"collective_latency": lat, "accept_per_position": args.accept, "note": " ".join(project.__doc__.split()),
           "contexts": {}}
    for L, ctx in res["contexts"].items():
        widths = ctx["widths"]
        key = "graph_ms" if "graph_ms" in widths[1] else "eager_ms"

        def ix_ms(ctx_, w):
            r = ctx_["indexer"].get(w, {})
            return (r.get("scores_us_per_layer", 0.0) + r.get("topk_us_per_layer", 0.0)) / 1e3

        plain = widths[1][key] + comm_ms(lat, widths[1]["collectives"])
        row = {"plain": {"tpot_ms": plain, "tok_s_per_user": 1e3 / plain,
                         "collectives_ms": comm_ms(lat, widths[1]["collectives"])}}

        def chain_draft_ms(k):
            """The eagle-k draft cost at this context (None where no speculative step of depth k was measured)."""
            run = spec.get("runs", {}).get(f"eagle_k{k}_{spec.get('modes', ('',))[0]}")
            t_step = run and (run["gpu_step_ms"] or run["step_ms_wall"])
            if not t_step or L0 not in res["contexts"]:
                return None
            ctx0 = res["contexts"][L0]
            return t_step - run["verify_ms"] + k * (ix_ms(ctx, k + 1) - ix_ms(ctx0, k + 1))

        for k in range(1, args.k + 1):
            draft = chain_draft_ms(k)
            if draft is None:
                continue
            cm = comm_ms(lat, widths[k + 1]["collectives"]) + comm_ms(lat, dc, times=k)
            step = widths[k + 1][key] + draft + cm
            al = args.al if (args.al and k == args.k) else accept_len(args.accept, k)
            # draft < 0: the target step timed alone (random verify tokens) routed to more local experts than the
            # verify inside the speculative step; the whole step is still measured, its split is not.
            row[f"eagle_k{k}"] = {"step_ms": step, "verify_ms": widths[k + 1][key],
                                  "draft_ms": draft if draft >= 0 else None,
                                  "collectives_ms": cm, "AL": al, "tpot_ms": step / al, "tok_s_per_user": 1e3 * al / step,
                                  "speedup_vs_plain": al * plain / step}
        def tree_draft_ms(name, D, N):
            """Draft (+ accept + compact) cost of the measured eagle tree step of `name` at this context: the step
            - its verify at the spec context, + D x the indexer's change per draft forward (None: not measured)."""
            run = spec.get("runs", {}).get(f"tree_{name}_{spec.get('modes', ('',))[0]}", {})
            t_step = run.get("gpu_step_ms") or run.get("step_ms_wall")
            if not t_step or "verify_ms" not in run or L0 not in res["contexts"]:
                return None
            w = min(N, args.k + 1)  # the indexer was timed alone for widths up to K + 1
            return t_step - run["verify_ms"] + D * (ix_ms(ctx, w) - ix_ms(res["contexts"][L0], w))

        for name, t in ctx.get("trees", {}).items():
            al, D = (getattr(args, "tree_al", None) or {}).get(name), t["depth"]
            draft, source = tree_draft_ms(name, D, t["nodes"]), "measured tree step"
            if draft is None:
                draft, source = chain_draft_ms(D), "eagle chain of the same depth (a lower bound)"
            if al is None or draft is None:
                continue
            cm = comm_ms(lat, t["collectives"]) + comm_ms(lat, dc, times=D)
            step = t["tree"]["ms"] + max(draft, 0.0) + cm
            row[f"tree_{name}"] = {"step_ms": step, "verify_ms": t["tree"]["ms"], "draft_ms": draft,
                                   "draft_source": source, "collectives_ms": cm, "AL": al, "nodes": t["nodes"],
                                   "tpot_ms": step / al, "tok_s_per_user": 1e3 * al / step,
                                   "speedup_vs_plain": al * plain / step}
        out["contexts"][L] = row
    here = [f"{n} x {g}" for g, n in TARGETS if g in dev and n == res["tp"]]
    out["deployment"] = (f"{res['tp']} x {dev}" + (f" (= {here[0]})" if here else "")
                         + ": one rank's measured compute; ranks assumed equal (the slowest rank sets the pace)"
                         + (f"; {res['extrapolated']}" if res.get("extrapolated") else ""))
    out["other_deployments"] = {f"{n} x {g}": ("this run" if here and here[0] == f"{n} x {g}"
                                               else f"not measured: run `mtp-bench --tp {n}` on an {g}")
                                for g, n in TARGETS}
    out["references_tok_s_per_user"] = dict(REFERENCES)
    return out


CPU_NOTICE = ("CPU RUN: these are CPU times of a small simulated rank, not GPU numbers; its tok/s projection says "
              "nothing about a GPU deployment (run on a CUDA GPU for that)")


def save(res: dict, path: str | None) -> None:
    """The result as JSON at `path` (--out); nothing when no file was asked for."""
    if path is None:
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(res, indent=1, default=float))
    os.replace(tmp, out)


def check_memory(cfg: ModelConfig, args, world: int, rank: int, dtype: torch.dtype) -> dict:
    """Say up front whether the rank fits this GPU at cfg's depth; if not, exit naming the depths that fit."""
    need = memory_need(cfg, world, rank, dtype, max(args.prompt_len) + args.k + 1,
                       max(getattr(args, "batches", [args.batch])))
    free, total = torch.cuda.mem_get_info()
    need.update(free_gib=free / GIB, total_gib=total / GIB)
    log(f"rank {rank} of TP={world}, {cfg.num_hidden_layers} layers: needs ~{need['need_gib']:.1f} GiB "
        f"(weights {need['weights_gib']:.1f}), {free / GIB:.1f} GiB free on {torch.cuda.get_device_name()}")
    if need["need_gib"] * GIB > free:
        per_layer = need["weights_gib"] / cfg.num_hidden_layers * 1.04
        fit = int((free / GIB - (need["need_gib"] - need["weights_gib"] * 1.04)) / per_layer)
        lo = cfg.first_k_dense_replace + 1
        hint = (f"measure two depths that fit and extrapolate per layer: --extrapolate {max(lo, fit // 2)} {fit}"
                if fit > lo else "no depth with a MoE layer fits")
        raise SystemExit(f"rank {rank} of TP={world} at {cfg.num_hidden_layers} layers does not fit this GPU: needs "
                         f"~{need['need_gib']:.1f} GiB, {free / GIB:.1f} GiB free. {hint} (the result is labelled "
                         f"extrapolated), or use a larger GPU (H200: 141 GB)")
    return need


def batch_axis(model, comm, args, cuda: bool, bw: float | None, time_fn, world: int, part: dict, saved) -> None:
    """--batch B1 B2 ...: part["batches"][B] = the target steps at every context, one entry per batch (B1's are
    part["contexts"], measured already; the others without trees). `saved()` after each context."""
    part["batches"] = {args.batch: {"contexts": part["contexts"]}}
    for B in args.batches[1:]:
        at_b = argparse.Namespace(**{**vars(args), "batch": B, "trees": []})
        part["batches"][B] = {"contexts": {}}
        for L in args.prompt_len:
            part["batches"][B]["contexts"][L] = target_steps(model, comm, at_b, L, cuda, bw, time_fn, world)
            saved()


def measure_depth(args, cfg: ModelConfig, world: int, rank: int, cuda: bool, bw: float | None, spec: bool,
                  part: dict, res: dict) -> None:
    """Rank `rank` at cfg's depth: build it in a simulated group, then per context the target steps and, when
    `spec`, the speculative steps. Fills `part` (a piece of `res`, which is saved after each part)."""
    from ..decode.engine import release
    from ..parallel.load import param_bytes
    from ..parallel.simulate import simulated_rank
    from ..parallel.synthetic import random_parallel_model

    dtype = torch.bfloat16 if cuda else torch.float32
    time_fn = timer(cuda, args.iters, 3)
    with simulated_rank(world, rank) as comm:
        log(f"building rank {rank} of TP={world} ({cfg.num_hidden_layers} layers, random FP8 weights on "
            f"{'cuda' if cuda else 'cpu'})")
        t0 = time.perf_counter()
        model = random_parallel_model(cfg, comm, device="cuda" if cuda else "cpu", dtype=dtype, seed=args.seed)
        part["build_s"] = time.perf_counter() - t0
        part["param_gib"] = param_bytes(model) / GIB
        if cuda:
            from ..backends.fast_path import enable_fast_path

            enable_fast_path(model)
            part["gpu_mem_gib_after_build"] = torch.cuda.memory_allocated() / GIB
        log(f"built in {part['build_s']:.1f} s: {part['param_gib']:.2f} GiB of parameters")
        part["draft_collectives_per_forward"] = draft_collectives(model, comm)
        part["contexts"] = {}
        try:
            for L in args.prompt_len:
                part["contexts"][L] = target_steps(model, comm, args, L, cuda, bw, time_fn, world)
                save(res, args.out)
            if len(getattr(args, "batches", ())) > 1:
                batch_axis(model, comm, args, cuda, bw, time_fn, world, part, lambda: save(res, args.out))
            if cuda and args.kernel_variants:
                part["variants"] = kernel_variants(model, comm, args, cuda, bw, time_fn, world, res)
            if spec:
                L0 = args.spec_prompt_len or min(args.prompt_len)
                if L0 not in part["contexts"]:
                    part["contexts"][L0] = target_steps(model, comm, args, L0, cuda, bw, time_fn, world)
                try:
                    sp = spec_steps(model, args, L0, cuda)
                    key = "graph_ms" if cuda else "eager_ms"
                    for r in sp["runs"].values():  # the verify forward of the same depth, to split off the draft
                        if "tree" in r and "error" not in r:
                            r["verify_ms"] = part["contexts"][L0]["trees"][r["tree"]]["tree"]["ms"]
                        elif "tree" not in r:
                            r["verify_ms"] = part["contexts"][L0]["widths"][r["k"] + 1][key]
                    part["spec_step"] = sp
                except Exception as e:  # keep the target-step numbers; the error is in the JSON and printed
                    part["spec_step_error"] = repr(e)[:1000]
                    log(f"speculative steps failed: {part['spec_step_error']}")
                save(res, args.out)
        finally:
            release(model)
            del model
            gc.collect()
            if cuda:
                part["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()


# Kernel variants of the fast path, timed on the same rank after the default run (side by side, same weights):
# 'old' is the fast path before this release's kernels (tensor-core GEMV, separate norm / quant / router / rotary /
# absorbed-projection launches, torch.topk, the pair grid for the experts).
KERNEL_VARIANTS = {
    "old": (dict(gemv=False, norm_quant=False, router=False, prologue=False, absorb=False, pdl=False),
            dict(indexer_topk="torch", moe_layout="pairs")),
    "new+pdl": (dict(pdl=True), dict()),
    # the split-K CUDA-core GEMV only up to 1 / 2 rows, the tensor-core GEMM above (its cost grows with the rows)
    "gemv1": (dict(gemv_rows=1), dict()),
    "gemv2": (dict(gemv_rows=2), dict()),
    "gemv1+pdl": (dict(gemv_rows=1, pdl=True), dict()),
}


def kernel_variants(model, comm, args, cuda: bool, bw, time_fn, world: int, res: dict) -> dict:
    """Each named variant's target steps at every context (no speculative steps); the switches are restored
    afterwards. A variant that fails is recorded and the others still run."""
    from ..backends.fast_path import set_kernel_options, set_kernels

    out: dict = {}
    for name in args.kernel_variants:
        if name not in KERNEL_VARIANTS:
            raise SystemExit(f"--kernel-variants: unknown variant {name!r}; known: {sorted(KERNEL_VARIANTS)}")
        flags, options = KERNEL_VARIANTS[name]
        topk0 = next((m.topk_impl for m in model.modules() if hasattr(m, "topk_impl")), None)
        old = set_kernels(model, **flags)
        if options:
            set_kernel_options(model, **options)
        log(f"kernel variant {name!r}: switches {flags}, options {options}")
        try:
            out[name] = {"switches": flags, "options": options, "contexts": {}}
            for L in args.prompt_len:
                out[name]["contexts"][L] = target_steps(model, comm, args, L, cuda, bw, time_fn, world)
                save(res, args.out)
        except Exception as e:  # keep the default run's numbers
            out[name]["error"] = repr(e)[:1000]
            log(f"kernel variant {name!r} failed: {out[name]['error']}")
        finally:
            set_kernels(model, **vars(old))
            set_kernel_options(model, indexer_topk=topk0, moe_layout=None if world > 1 else "pairs")
    return out


def extrapolate(a: dict, b: dict, da: int, db: int, full: int) -> dict:
    """Contexts at `full` layers from the same contexts measured at `da` < `db` layers (same dense layers):
    every per-step number is taken as linear in depth, slope = (b - a) / (db - da) per (MoE) layer."""
    def lin(x, y):
        return y + (full - db) * (y - x) / (db - da)

    out = {}
    for L, cb in b["contexts"].items():
        ca = a["contexts"][L]
        widths = {}
        for w, rb_ in cb["widths"].items():
            ra = ca["widths"][w]
            r: dict = {"extrapolated": f"from {da} and {db} layers to {full}",
                       "measured_ms": {da: ra.get("graph_ms", ra.get("eager_ms")),
                                       db: rb_.get("graph_ms", rb_.get("eager_ms"))}}
            for key in ("graph_ms", "eager_ms", "kernels_per_step", "kernel_us_per_step", "floor_ms"):
                if key in rb_:
                    r[key] = lin(ra[key], rb_[key])
            r["collectives"] = {k: round(lin(ra["collectives"][k], v)) for k, v in rb_["collectives"].items()}
            r["floor_bytes"] = {k: lin(ra["floor_bytes"][k], v) for k, v in rb_["floor_bytes"].items()}
            r["local_experts_touched"] = rb_["local_experts_touched"]
            if "kernels_per_step" in r:
                r["kernels_per_layer"] = r["kernels_per_step"] / full
            if "floor_ms" in r:
                r["pct_of_floor"] = 100 * r["floor_ms"] / r.get("graph_ms", r.get("eager_ms"))
            widths[w] = r
        indexer = {}
        for w, ix in cb["indexer"].items():
            ix = dict(ix)
            if "ms_per_step" in ix:
                ix["ms_per_step"] = ix["ms_per_step"] / ix["layers"] * full
                ix["layers"] = full
            indexer[w] = ix
        out[L] = {"cache": cb["cache"], "extrapolated": True, "widths": widths, "indexer": indexer}
        if "trees" in cb:
            out[L]["trees"] = {name: _extrapolate_tree(ca["trees"][name], t, lin) for name, t in cb["trees"].items()}
    return out


def _extrapolate_tree(a: dict, b: dict, lin) -> dict:
    """One `--trees` entry at full depth: each kind's ms and bytes linear in depth, per-node values recomputed."""
    r = dict(b)
    N = b["nodes"]
    for kind in ("tree", "chain"):
        ms, by = lin(a[kind]["ms"], b[kind]["ms"]), lin(a[kind]["bytes"], b[kind]["bytes"])
        r[kind] = {"ms": ms, "ms_per_node": ms / N, "bytes": by, "bytes_per_node": by / N}
    r["tree_over_chain"] = r["tree"]["ms"] / r["chain"]["ms"]
    r["collectives"] = {k: round(lin(a["collectives"][k], v)) for k, v in b["collectives"].items()}
    if "floor_ms" in b:
        r["floor_ms"] = lin(a["floor_ms"], b["floor_ms"])
        r["pct_of_floor"] = 100 * r["floor_ms"] / r["tree"]["ms"]
    r["extrapolated"] = True
    return r


def run(args) -> dict:
    """The whole --tp N run; returns the result dict (also written to args.out when given)."""
    cuda = torch.cuda.is_available()
    world = args.tp
    cfg = rank_config(args, world, cuda, args.layers)
    dtype = torch.bfloat16 if cuda else torch.float32
    rank = default_rank(cfg, world, dtype) if args.rank is None else args.rank
    if not 0 <= rank < world:
        raise SystemExit(f"--rank must be in [0, {world}), got {rank}")
    depths = tuple(args.extrapolate or ())
    res: dict = {"mode": f"simulated rank {rank} of TP={world} / EP={world} (torch fake process group: collectives "
                         "counted, not run)", "tp": world, "rank": rank,
                 "rank_choice": "given (--rank)" if args.rank is not None else "default: most weight bytes",
                 "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                 "date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args), "fast_path": cuda,
                 "config": {f: getattr(cfg, f) for f in (
                     "num_hidden_layers", "first_k_dense_replace", "hidden_size", "vocab_size", "num_attention_heads",
                     "n_routed_experts", "index_topk")}}
    if depths:
        res["extrapolated"] = (f"EXTRAPOLATED to {cfg.num_hidden_layers} layers from measurements at {depths[0]} and "
                               f"{depths[1]} layers (per-layer slope; speculative steps measured at {depths[1]})")
    bw = None
    if cuda:
        res["memory"] = check_memory(rank_config(args, world, cuda, depths[-1]) if depths else cfg, args, world,
                                     rank, dtype)
        bw = copy_bandwidth()
        res["copy_TBps"] = bw / 1e12
    if not depths:
        measure_depth(args, cfg, world, rank, cuda, bw, not args.no_spec, res, res)
    else:
        res["depths"] = {}
        for i, d in enumerate(depths):
            part = res["depths"].setdefault(d, {})
            measure_depth(args, rank_config(args, world, cuda, d), world, rank, cuda, bw,
                          i == 1 and not args.no_spec, part, res)
        a, b = res["depths"][depths[0]], res["depths"][depths[1]]
        res["contexts"] = extrapolate(a, b, depths[0], depths[1], cfg.num_hidden_layers)
        res["draft_collectives_per_forward"] = b["draft_collectives_per_forward"]
        res["build_s"] = a["build_s"] + b["build_s"]
        res["param_gib"] = b["param_gib"]
        res["param_gib_full_depth"] = memory_need(cfg, world, rank, dtype, 1, 1)["weights_gib"]
        for key in ("spec_step", "spec_step_error"):
            if key in b:
                res[key] = b[key]
    res["projection"] = project(res, args)
    save(res, args.out)
    print_table(res)
    return res


def print_table(res: dict) -> None:
    """Per-kernel profiles first (long), then the summary lines, so the end of the output is the summary."""
    if res["device"] == "cpu":
        print(f"*** {CPU_NOTICE} ***")
    for L, ctx in res["contexts"].items():
        ws = list(ctx["widths"])
        for w in (ws[0], ws[-1]):
            top = ctx["widths"][w].get("profile_top")
            if top:
                print(f"kernels of the target step, context {L}, w={w} (per step):")
                for k in top[:12]:
                    print(f"  {k['us_per_step']:9.1f} us  x{k['calls_per_step']:6.1f}  {k['name'][:90]}")
    cfgd = res["config"]
    if res.get("extrapolated"):
        print(f"\n*** {res['extrapolated']} ***")
    print(f"\n{res['mode']}\n{res['device']}, torch {res['torch']}, {cfgd['num_hidden_layers']} layers "
          f"({cfgd['first_k_dense_replace']} dense), params {res['param_gib']:.2f} GiB/rank, built in "
          f"{res['build_s']:.0f} s" + (f", copy {res['copy_TBps']:.2f} TB/s" if "copy_TBps" in res else ""))
    print(f"{'context':>8s} {'w':>2s} {'step ms':>8s} {'floor ms':>9s} {'% floor':>8s} {'kernels':>8s} "
          f"{'k/layer':>8s} {'AR+AG':>7s} {'experts':>8s} {'indexer ms/step':>16s}")
    for L, ctx in res["contexts"].items():
        for w, r in ctx["widths"].items():
            ix = ctx["indexer"][w]
            f = lambda key, fmt: format(r[key], fmt) if key in r else "-"  # noqa: E731
            c = r["collectives"]
            print(f"{L:>8} {w:>2} {format(r.get('graph_ms', r.get('eager_ms')), '8.3f'):>8s} {f('floor_ms', '9.3f'):>9s} "
                  f"{f('pct_of_floor', '8.1f'):>8s} {f('kernels_per_step', '8.0f'):>8s} {f('kernels_per_layer', '8.1f'):>8s} "
                  f"{c['all_reduce']:>3}+{c['all_gather']:<3} {r['local_experts_touched']['mean']:8.2f} "
                  f"{format(ix['ms_per_step'], '16.3f') if 'ms_per_step' in ix else 'no indexer':>16s}")
    for name, var in res.get("variants", {}).items():
        if "error" in var:
            print(f"kernel variant {name}: FAILED {var['error'][:300]}")
        for L, ctx in var.get("contexts", {}).items():
            for w, r in ctx["widths"].items():
                print(f"{L:>8} {w:>2} {r.get('graph_ms', float('nan')):8.3f} {r.get('floor_ms', float('nan')):9.3f} "
                      f"{r.get('pct_of_floor', float('nan')):8.1f} {r.get('kernels_per_step', 0):8.0f} "
                      f"{r.get('kernels_per_layer', 0):8.1f}  variant {name}")
    print_trees(res["contexts"])
    print("caches: random valid FP8 entries at each context (fill_cache_random), no prefill run; experts: distinct "
          "local experts the step's tokens chose (measured), mean per MoE layer; AR+AG: collectives per step (not run)")
    for L, ctx in res["contexts"].items():
        for w, ix in ctx["indexer"].items():
            if "ms_per_step" in ix:
                print(f"indexer alone, context {L}, w={w}: scores {ix['scores_us_per_layer']:.1f} us + top-k "
                      f"{ix['topk_us_per_layer']:.1f} us per layer = {ix['ms_per_step']:.3f} ms per step ({ix['layers']} layers)")
    spec = res.get("spec_step")
    if spec:
        print(f"speculative steps at context {spec['prompt_len']} (generate, real prefill):")
        for name, r in spec["runs"].items():
            if "error" in r:
                print(f"  {name:24s} FAILED {r['error'][:200]}")
                continue
            gpu = f", GPU {r['gpu_step_ms']:.3f} ms" if r["gpu_step_ms"] else ""
            print(f"  {name:24s} {r['step_ms_wall']:8.3f} ms/step wall{gpu}")
    if "spec_step_error" in res:
        print(f"speculative steps failed: {res['spec_step_error']}")
    pj = res.get("projection")
    if pj:
        print(f"projection ({pj['deployment']}); collectives: {pj['collective_latency']['source']}; "
              f"acceptance per position {pj['accept_per_position']}")
        for L, row in pj["contexts"].items():
            parts = [f"plain {row['plain']['tpot_ms']:.2f} ms ({row['plain']['tok_s_per_user']:.0f} tok/s)"]
            parts += [f"eagle k={n[len('eagle_k'):]} {r['tpot_ms']:.2f} ms ({r['tok_s_per_user']:.0f} tok/s, AL {r['AL']:.2f})"
                      for n, r in row.items() if n.startswith("eagle_k")]
            parts += [f"tree {n[len('tree_'):]} {r['tpot_ms']:.2f} ms ({r['tok_s_per_user']:.0f} tok/s, AL {r['AL']:.2f} "
                      f"given)" for n, r in row.items() if n.startswith("tree_")]
            print(f"  context {L}: " + "; ".join(parts))
        first = next(iter(pj["contexts"].values()), None)
        for name, v in pj["other_deployments"].items():
            if v == "this run" and first:
                best = max((r for n, r in first.items() if n.startswith("eagle_k")),
                           key=lambda r: r["tok_s_per_user"], default=None)
                v = (f"this run, context {next(iter(pj['contexts']))}: plain {first['plain']['tok_s_per_user']:.0f} "
                     f"tok/s per user" + (f", with MTP {best['tok_s_per_user']:.0f} (AL {best['AL']:.2f})" if best else ""))
            print(f"  {name}: {v}")
        for name, v in pj["references_tok_s_per_user"].items():
            if res["device"] != "cpu":  # published GPU numbers beside CPU times would read as a comparison
                print(f"  reference: {name}: {v:.0f} tok/s per user")
    if res["device"] == "cpu":
        print(f"*** {CPU_NOTICE} ***")
    sys.stdout.flush()


def print_trees(contexts: dict) -> None:
    """The `--trees` rows: each tree's verify beside the chain of the same node count (per context)."""
    rows = [(L, r) for L, ctx in contexts.items() for r in ctx.get("trees", {}).values()]
    if not rows:
        return
    print(f"{'context':>8s} {'tree':>10s} {'N':>3s} {'tree ms':>8s} {'ms/node':>8s} {'chain ms':>9s} "
          f"{'tree/chain':>10s} {'MB/node':>8s} {'% floor':>8s}")
    for L, r in rows:
        pct = format(r["pct_of_floor"], "8.1f") if "pct_of_floor" in r else "       -"
        print(f"{L:>8} {r['shape']:>10s} {r['nodes']:>3} {r['tree']['ms']:8.3f} {r['tree']['ms_per_node']:8.3f} "
              f"{r['chain']['ms']:9.3f} {r['tree_over_chain']:10.2f} {r['tree']['bytes_per_node'] / 1e6:8.1f} {pct}"
              + ("" if r.get("attention", "kernels") == "kernels" else f"  attention: {r['attention']}"))
    sys.stdout.flush()
