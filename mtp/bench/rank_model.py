"""The arithmetic of `mtp-bench --tp N` (no device work): the rank's byte floor and memory need, collective
latencies (measured or assumed), the tok/s projection from one rank's measured steps, and the per-layer
extrapolation to full depth. Measured by `rank_steps`, run by `rank`, printed by `rank_report`.
"""

from __future__ import annotations

import math

import torch

from ..model.cache import KVCache
from ..model.config import ModelConfig
from ..checkpoint.inventory import checkpoint_spec
from ..parallel.layout import ParallelPlan
from ..parallel.memory import GIB
from ..plan.collectives import MeasuredComm, read
from ..plan.speed import accept_len


# Published batch-1 decode speeds to print beside ours (tok/s per user), as the issue cites them.
REFERENCES = (
    ("TensorRT-LLM, DeepSeek-R1 FP8, 8 x H200, MTP 3", 158.0),
    ("TensorRT-LLM, DeepSeek-R1 FP4, 8 x B200, MTP 3 (AL 2.82)", 253.0),
    ("TensorRT-LLM, DeepSeek-R1 FP4, 8 x B200, MTP 3, full min-latency tuning", 368.0),
)


# The deployments the tok/s lines are for: (GPU name fragment, TP)
TARGETS = (("H200", 8), ("H100", 16))
# real / (simulated rank + its collectives priced from a measured file), `python -m mtp.bench.overhead`: the largest
# of the ratios measured, and the N it is carried to is an assumption (BENCHMARKS.md, sessions 11 and 14)
REAL_OVERHEAD = 1.08
REAL_OVERHEAD_SOURCE = ("measured at TP=4 (4 x H200, session 11, `python -m mtp.bench.overhead`): a real step of 12 "
                        "and of 40 layers over NCCL / oneshot against the simulated busiest rank of layout 'split' "
                        "+ collectives priced from mtp.bench.allreduce: 1.00-1.08 (1.08 at w = 1, nccl); session 14's "
                        "code, 40 layers: 0.99-1.07; session 15's, back-to-back replays on both sides (the timing the "
                        "projection reads), 40 layers: 0.99-1.07; ASSUMED "
                        "the same at this N (3 layers, 'contiguous', rank 0 as drawn gave 1.20-1.26: rank skew)")


def cache_bytes_per_position(cfg: ModelConfig, quantized: bool = True, dtype_bytes: int = 2) -> dict:
    """Bytes a step reads per cached position and layer, split as the floor needs them: the latent (+ its per-128
    scales when quantized) with the rotary key, and the indexer key (+ its scale). What the cache allocates is
    `KVCache.bytes_per_position` (which also counts the scales of an unquantized cache)."""
    C, R, Dk = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim
    lat = (C + 4 * max(C // 128, 1) if quantized else C * dtype_bytes) + R * dtype_bytes
    idx = (Dk + 4) if quantized else Dk * dtype_bytes + 4
    return {"latent": lat, "indexer": idx}


def memory_need(cfg: ModelConfig, world: int, rank: int, dtype: torch.dtype, max_len: int, batch: int,
                head_fp8: bool = False) -> dict:
    """What the rank needs on the device: its weights (the planner's count), ~4% for the fast path's fused
    copies, one full tensor drawn in fp32 while building (+ its cast), its cache, the fast path's rotary angle table
    (the planner's count), and 4 GiB of workspace; with `head_fp8` (--draft-head-fp8) the FP8 copy of the eagle
    drafts' head (the planner's count)."""
    from ..model.layers import Rotary
    from ..parallel.memory import draft_head_fp8_bytes, rank_weight_bytes

    weights = sum(rank_weight_bytes(cfg, ParallelPlan(world), rank, dtype).values())
    biggest = max(math.prod(ts.shape) for ts in checkpoint_spec(cfg).values()) * 6
    cache = KVCache.bytes_per_position(cfg, dtype, quantized=True) * max_len * batch * cfg.num_hidden_layers
    head = draft_head_fp8_bytes(cfg, ParallelPlan(world), "eagle", 1, rank) if head_fp8 else 0
    rope = Rotary.angle_table_bytes(cfg)
    need = weights * 1.04 + head + biggest + cache + rope + 4 * GIB
    return {"weights_gib": weights / GIB, "draft_head_fp8_gib": head / GIB, "cache_gib": cache / GIB,
            "rope_table_gib": rope / GIB, "need_gib": need / GIB}


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


def expected_local_experts(cfg: ModelConfig, world: int, tokens: int) -> float:
    """Expected distinct local experts per MoE layer if each token picked its K experts uniformly at random."""
    p = cfg.num_experts_per_tok / cfg.n_routed_experts
    return cfg.n_routed_experts / world * (1 - (1 - p) ** tokens)


def collective_latency(args) -> dict:
    """us per all-reduce / all-gather: measured (`--collective-json`: an `mtp.bench.collectives` or
    `mtp.bench.allreduce` file, read by `mtp.plan.collectives`, priced under `--allreduce`) or the assumption.
    'price' is the pricing object (left out of the JSON: `latency_view`)."""
    if args.collective_json:
        m = MeasuredComm(read(args.collective_json), args.tp, getattr(args, "allreduce", "nccl"),
                         getattr(args, "collective_growth", 1.0))
        lat = {"assumed": False, "world": m.table.world, "scale": m.scale, "allreduce": m.allreduce, "price": m,
               "source": f"measured ({m.describe()})"}
        if not m.table.has("all_gather", "nccl"):  # an mtp.bench.allreduce file: all-reduces only
            lat["gather_us"] = args.allreduce_us
            lat["source"] += f"; all-gather ASSUMED {args.allreduce_us} us (--allreduce-us)"
        return lat
    return {"source": f"ASSUMED {args.allreduce_us} us per collective (no multi-GPU measurement given)",
            "assumed": True, "us": args.allreduce_us}


def latency_view(lat: dict) -> dict:
    """`collective_latency`'s answer as the result JSON holds it."""
    return {k: (v.to_dict() if k == "price" else v) for k, v in lat.items()}


def latency_us(lat: dict, op: str, nbytes: int, fused: bool = False) -> float:
    """One collective's latency (`MeasuredComm`: the measured entry with the nearest message size at least as
    large). fused: an all-reduce at a block boundary, joined with the add + norm + quant under oneshot."""
    if lat["assumed"]:
        return lat["us"]
    if op == "all_reduce":
        return lat["price"].all_reduce_us(nbytes, fused)
    us = lat["price"].all_gather_us(nbytes)
    return lat["gather_us"] if us is None else us


def boundary_all_reduces(counts: dict, draft: bool = False) -> int:
    """How many of a forward's all-reduces sit at a block boundary, where the fast path under
    allreduce='oneshot' fuses them with the add + norm + quant (mtp/parallel/DESIGN.md): in a target forward every
    one but the embedding's (the last block's is resolved by the same kernel with the add alone); in an MTP draft
    forward o_proj's only (the embedding's is plain, and the module reduces its FFN itself)."""
    n = counts["all_reduce"]
    return min(n, 1) if draft else max(n - 1, 0)


def comm_ms(lat: dict, counts: dict, times: int = 1, draft: bool = False) -> float:
    """Latency of the collectives in `counts`, `times` over; the block boundaries' all-reduces at their fused price
    (`boundary_all_reduces`). Each call at its own size where `counts` lists them (`{op}_call_bytes`: a draft
    forward's all-gathers, `rank_steps.draft_collectives`), else at the mean size (total bytes / number)."""
    ms = 0.0
    for op in ("all_reduce", "all_gather"):
        n = counts[op]
        if not n:
            continue
        sizes = counts.get(f"{op}_call_bytes")
        if op == "all_gather" and sizes is not None and len(sizes) == n:
            ms += sum(latency_us(lat, op, b) for b in sizes) * 1e-3
            continue
        per = counts[f"{op}_bytes"] // n
        fused = boundary_all_reduces(counts, draft) if op == "all_reduce" else 0
        ms += (fused * latency_us(lat, op, per, True) + (n - fused) * latency_us(lat, op, per)) * 1e-3
    return ms * times


def step_key(row: dict) -> str:
    """Which timing of a target step the projection reads: 'graph_ms_b2b' (replays back to back: the GPU's time per
    step when the host launches ahead, as the overlap scheduler's decode loop does and as the speculative steps'
    GPU time is measured), else 'graph_ms' (one replay per event pair: up to ~0.5 ms of host launch latency in it,
    BENCHMARKS.md session 14; files from before the b2b timing), else 'eager_ms' (no CUDA)."""
    return next(k for k in ("graph_ms_b2b", "graph_ms", "eager_ms") if row.get(k) is not None)


def project(res: dict, args) -> dict:
    """Per context: plain TPOT = step(w=1) + its collectives; MTP k: (step(w=k+1) + draft + collectives of the
    verify and the k draft forwards) / AL(k). draft = measured eagle-k spec step - the target step at w = k+1
    measured with it (same depth, spec context); at longer contexts plus k x (indexer per layer there - at the
    spec context). A tree of depth D with an AL given (--tree-al): (its verify + its draft + collectives) / AL,
    the draft taken from its measured tree step as the chains' (else the eagle-D chain's draft: a lower bound,
    a tree's draft forwards are wider). Target steps are read back to back (`step_key`: the speculative steps'
    GPU time has no host launch latency either); a tree's verify is one replay per event pair."""
    lat = collective_latency(args)
    spec = res.get("spec_step", {})
    L0 = spec.get("prompt_len")
    dc = res["draft_collectives_per_forward"]
    dev = res["device"]
    ovh = getattr(args, "real_overhead", 1.0)
    headline = getattr(args, "headline_al", [])
    out = {"collective_latency": latency_view(lat), "accept_per_position": args.accept, "note": " ".join(project.__doc__.split()),
           "real_overhead": {"factor": ovh, "source": REAL_OVERHEAD_SOURCE if ovh == REAL_OVERHEAD
                             else "ASSUMED (--real-overhead): real / (simulated rank + collectives)"},
           "headline_al": headline, "contexts": {}}
    first = next(iter(res["contexts"].values()), None)
    if first is not None:
        out["target_step_timing"] = step_key(first["widths"][1])
    for L, ctx in res["contexts"].items():
        widths = ctx["widths"]
        key = step_key(widths[1])

        def ix_ms(ctx_, w):
            r = ctx_["indexer"].get(w, {})
            return (r.get("scores_us_per_layer", 0.0) + r.get("topk_us_per_layer", 0.0)) / 1e3

        plain = (widths[1][key] + comm_ms(lat, widths[1]["collectives"])) * ovh
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
            cm = comm_ms(lat, widths[k + 1]["collectives"]) + comm_ms(lat, dc, times=k, draft=True)
            step = (widths[k + 1][key] + draft + cm) * ovh
            al = args.al if (args.al and k == args.k) else accept_len(args.accept, k)
            # draft < 0: the target step timed alone (random verify tokens) routed to more local experts than the
            # verify inside the speculative step; the whole step is still measured, its split is not.
            row[f"eagle_k{k}"] = {"step_ms": step, "verify_ms": widths[k + 1][key],
                                  "draft_ms": draft if draft >= 0 else None,
                                  "collectives_ms": cm, "AL": al, "tpot_ms": step / al, "tok_s_per_user": 1e3 * al / step,
                                  "speedup_vs_plain": al * plain / step}
            if k == args.k and headline:  # the headline acceptance lengths, beside the --accept one
                row[f"eagle_k{k}"]["at_AL"] = {a: {"tpot_ms": step / a, "tok_s_per_user": 1e3 * a / step}
                                               for a in headline}

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
            cm = comm_ms(lat, t["collectives"]) + comm_ms(lat, dc, times=D, draft=True)
            step = (t["tree"]["ms"] + max(draft, 0.0) + cm) * ovh
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
