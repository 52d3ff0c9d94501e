"""The measurements of `mtp-bench --tp N` on a built rank: target steps per width (graph time, kernels, local
experts, byte floor), the indexer alone, tree verifies, whole speculative steps, a draft forward's collectives.
"""

from __future__ import annotations

import math
import statistics
import time
import traceback

import torch

from ..decode.graphs import capture_graph
from ..draft.modes import drafter
from .rank_model import expected_local_experts, rank_floor
from .rank_report import log
from .timing import difference_profile, gpu_state, kernel_profile, profile_call, spec_step_times, timer


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
                local = set(mod.local_ids())
                seen.setdefault(li, set()).update(e for e in ids if e in local)
            hooks.append(layer.mlp.register_forward_pre_hook(hook))
    return seen, hooks


def force_busiest(model, args, tokens: int, world: int) -> dict:
    """--route busiest: each MoE layer's router output replaced by a draw of the uniform group-limited router
    for `tokens` tokens, renamed so that the simulated rank is that step's busiest rank under --layout
    (`experts.busiest_routes`, seeded by --seed and the token count; `forced_route.force_routes`): its distinct
    local experts per layer are the drawn busiest count, with no cap, each computing the tokens the draw sent it.
    Bumps the model's version when the tables were allocated anew (graphs captured before read the old ones)."""
    from ..parallel.modules import ExpertParallelMoE
    from .experts import busiest_routes
    from .forced_route import force_routes

    moes = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, ExpertParallelMoE)]
    local = moes[0].local_ids() if moes else ()
    draws = busiest_routes(model.cfg, args.layout, world, tokens, len(moes), args.seed + 1000 * tokens,
                           local) if moes else []
    if any([force_routes(m, d.w_TK, d.ids_TK) for m, d in zip(moes, draws)]):
        model.bump_version()
    mine = torch.tensor(list(local))
    return {"layout": args.layout, "tokens": tokens, "drawn_per_moe_layer": [d.count for d in draws],
            "local_pairs_per_moe_layer": [int(torch.isin(d.ids_TK, mine).sum()) for d in draws],
            "note": "per MoE layer a draw of the uniform group-limited router for these tokens, with the busiest "
                    "rank's experts renamed to this rank's; the router's output is replaced by it per token "
                    "(mtp.bench.forced_route), so the rank computes the drawn count of distinct local experts "
                    "(realised: counted on the eager step) on the (token, expert) pairs the draw sent it"}


B2B_REPLAYS = 8  # graph replays per timed call for graph_ms_b2b
# calls per captured graph when `indexer_alone` times the scores or the top-k (one call per replay timed ~10 us of
# launch latency into each, session 14 at 32k w = 1: top-k 34.9 us a layer where the step's profile holds ~24 for
# its histogram + split + write, scores 15.3 where it holds ~5). The keys then stay in L2 across the calls (~1 us of
# HBM reads a call at 32k not paid): slightly optimistic.
INDEXER_REPS = 8


def rank_token_ids(model, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random token ids that this rank's embedding holds: [vocab_start, vocab_start + rows) of a vocabulary-parallel
    embedding, any id otherwise. On a simulated rank the all-reduce after the embedding adds no other rank's row, so
    an id outside the rank's shard embeds as zeros where the real group embeds its row: the first layer then sees a
    zero hidden state, its indexer scores every key 0 and the radix top-k meets its slowest case, every key tied
    (~250 us at 32k where a real layer's takes ~10: `mtp.bench.topk_data`, BENCHMARKS.md session 14). An id inside
    the shard embeds exactly as in the real group (the owner's row plus zeros)."""
    emb = model.model.embed_tokens
    lo = int(getattr(emb, "vocab_start", 0))
    return torch.randint(lo, lo + emb.num_embeddings, shape, generator=g)


@torch.no_grad()
def indexer_alone(model, cache, L: int, w: int, time_fn, cuda: bool) -> dict:
    """One layer's lightning indexer at context L for w queries, alone: scores over the L + w keys, then
    top-k (the kernels the fast path runs at the defaults' widths above `FastPathOptions.fused_hist_rows`: the radix
    top-k's histogram as its own launch; at one row the step folds it into the scores kernel, `radix_fused`; their
    references on CPU), each timed as a graph of INDEXER_REPS calls. Per layer, and x layers per step."""
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

    one = bool(getattr(getattr(model, "fast_options", None), "topk_one_launch", False))
    from ..kernels.topk import radix_topk
    from ..kernels.topk_one_launch import radix_topk_one_launch

    select = radix_topk_one_launch if one else radix_topk  # chosen once, not in the timed call

    def topk():  # the top-k the fast path runs (`FastMLA.topk_impl`, switch topk_one_launch); torch.topk on reference
        if cuda and impl != "torch":
            out["i"] = select(out["s"], lens, cfg.index_topk)
        else:
            out["i"] = ix.topk_from_scores(out["s"], cfg.index_topk)

    res = {}
    for name, fn in (("scores", scores), ("topk", topk)):
        fn()
        if cuda:  # INDEXER_REPS calls per graph: a replay per timed call would add the host's launch latency to each
            graph = capture_graph(lambda fn=fn: [fn() for _ in range(INDEXER_REPS)])
            res[f"{name}_us_per_layer"] = time_fn(graph.replay) * 1e3 / INDEXER_REPS
            del graph
        else:
            res[f"{name}_us_per_layer"] = time_fn(fn) * 1e3
    res["topk_impl"] = impl if cuda else "torch"
    res["topk_one_launch"] = cuda and impl != "torch" and one
    res["layers"] = cfg.num_hidden_layers
    res["ms_per_step"] = (res["scores_us_per_layer"] + res["topk_us_per_layer"]) * cfg.num_hidden_layers / 1e3
    return res


def _state_text(st: dict | None) -> str:
    """`timing.gpu_state` for the log line: SM clock, temperature, power, throttle mask; '' without a reading."""
    if not st:
        return ""
    if "error" in st:
        return f", GPU state unread ({st['error']})"
    f = lambda k, fmt: "?" if st.get(k) is None else format(st[k], fmt)  # noqa: E731
    return (f", SM {f('sm_mhz', '.0f')} MHz, {f('temp_c', '.0f')} C, {f('power_w', '.0f')} W, throttle "
            f"{st.get('throttle_reasons') or '?'}")


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
    ids = rank_token_ids(model, (B, K + 1), g).to(model.device)
    widths, indexer = {}, {}
    for w in range(1, K + 2):
        blk = ids[:, :w]

        def fwd():
            cache.truncate(base)
            model(blk, cache, kv_len=L + w)

        forced = force_busiest(model, args, B * w, world) if getattr(args, "route", "measured") == "busiest" else None
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
        if forced:
            forced["realised_per_moe_layer"] = [touched[li] for li in sorted(touched)]
            r["busiest_rank"] = forced
        if args.eager or not cuda:
            r["eager_ms"] = time_fn(fwd)
        if cuda:
            graph = capture_graph(fwd)
            r["graph_ms"] = time_fn(graph.replay)
            # back to back: the GPU's time per step when the host launches ahead (the engine's overlap scheduler), no
            # per-replay launch latency in it (graph_ms's one replay per event pair holds it: up to ~0.5 ms, session 14)
            r["graph_ms_b2b"] = time_fn(lambda: [graph.replay() for _ in range(B2B_REPLAYS)]) / B2B_REPLAYS
            r["gpu_state"] = gpu_state(model.device)  # right after the timing: clocks, temperature, power
            prof = kernel_profile(graph.replay, steps=3, top=40)
            del graph
            r["kernels_per_step"] = prof["kernels_per_step"]
            r["kernels_per_layer"] = prof["kernels_per_step"] / cfg.num_hidden_layers
            r["kernel_us_per_step"] = prof["kernel_us_per_step"]
            r["busy_us_per_step"], r["idle_us_per_step"] = prof["busy_us_per_step"], prof["idle_us_per_step"]
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
        log(f"  L={L} w={w}: {'graph' if cuda else 'eager'} {step_ms:.3f} ms"
            + (f" ({r['graph_ms_b2b']:.3f} back to back)" if cuda else "") + ", "
            f"{r['collectives']['all_reduce']} all-reduce + {r['collectives']['all_gather']} all-gather, "
            f"floor {by['total'] / 1e9:.2f} GB" + (f" ({r['pct_of_floor']:.1f}% of it)" if bw else "")
            + (f", {r['kernels_per_step']:.0f} kernels, busy {r['busy_us_per_step'] / 1e3:.3f} ms + idle "
               f"{r['idle_us_per_step'] / 1e3:.3f} ms (profiled replays)" if cuda else "") + _state_text(r.get("gpu_state")))
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
    busiest = getattr(args, "route", "measured") == "busiest"
    forced = force_busiest(model, args, cache.batch * N, comm.world) if busiest else None
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
            realised = [len(seen[li]) for li in sorted(seen)]
        if cuda:
            graph = capture_graph(fn)
            ms[kind] = time_fn(graph.replay)
            del graph
        else:
            ms[kind] = time_fn(fn)
    row = tree_row(shape, ms, floor, model.runtime.absorb_max_tokens)
    row["collectives"] = collectives
    if forced:
        forced["realised_per_moe_layer"] = realised
        row["busiest_rank"] = forced
    if bw:
        row["floor_ms"] = floor["tree"] / bw * 1e3
        row["pct_of_floor"] = 100 * row["floor_ms"] / ms["tree"]
    log(f"  L={L} tree {shape.name} (N={N}): {ms['tree']:.3f} ms ({ms['tree'] / N:.3f} per node), chain of {N}: "
        f"{ms['chain']:.3f} ms; floor {floor['tree'] / N / 1e6:.1f} MB per node")
    return row


SPEC_PROFILE_SHORT = 8  # new tokens of the short profiled run (`spec_profile`)


def spec_profile(run, new_tokens: int, top: int = 40) -> dict:
    """Per-step kernel profile of a whole speculative step (draft + verify + accept + commit, as `generate` replays
    it): run(n) generates n new tokens and returns its metrics; two profiled runs, SPEC_PROFILE_SHORT and new_tokens
    tokens, differ only in their steps, so the prefill and the rest of the setup cancel
    (`timing.difference_profile`)."""
    if new_tokens <= SPEC_PROFILE_SHORT:
        raise ValueError(f"spec_profile: --new-tokens must exceed {SPEC_PROFILE_SHORT} to profile a step, "
                         f"got {new_tokens}")
    a, b = profile_call(lambda: run(SPEC_PROFILE_SHORT)), profile_call(lambda: run(new_tokens))
    prof = difference_profile(a, b, b["result"].target_forwards - a["result"].target_forwards, top)
    log(f"    per-step profile ({prof['steps']} steps): {prof['kernels_per_step']:.0f} kernels, busy "
        f"{prof['busy_us_per_step'] / 1e3:.3f} ms; top exposed: " + ", ".join(
            f"{r['name'][:28]} {r['exposed_us_per_step']:.0f}" for r in prof["top"][:8]))
    return prof


@torch.no_grad()
def spec_steps(model, args, L: int, cuda: bool) -> dict:
    """Whole speculative steps (draft K + verify K+1 + accept + commit) through `mtp.generate` at context L:
    plain, eagle and vanilla k = 1..K (vanilla past the checkpoint's MTP modules repeats the last one); with
    --draft-vocab N eagle k = K over ids 0..N-1, on a vocabulary-parallel head once per layout (`_balanced`,
    `_by_shard`: `draft.vocab.SubHead`), and with --draft-head-fp8 the FP8 copies of those rows too; and the
    eagle tree step of every --trees shape (`generate_tree`). As for the chains, the first call captures the step
    (kept per model and settings) and the second, timed, replays it."""
    from ..decode.engine import generate, release
    from ..decode.tree import generate_tree
    from ..parallel.modules import set_draft_vocab_by_shard
    from ..spec.tree_shape import TreeShape

    g = torch.Generator().manual_seed(args.seed + 2)
    prompts = rank_token_ids(model, (args.batch, L), g).tolist()
    modes = args.spec_modes if cuda else ("eager",)
    # (draft, k, FP8 head copy, draft vocabulary size or 0, its layout: None | 'balanced' | 'by_shard')
    runs = [("none", 0, False, 0, None)] + [(d, k, False, 0, None) for d in ("eagle", "vanilla")
                                            for k in range(1, args.k + 1)]
    if getattr(args, "draft_head_fp8", False):  # --draft-head-fp8: eagle k = K with the FP8 copy of the head
        runs.append(("eagle", args.k, True, 0, None))
    nv = getattr(args, "draft_vocab", None)
    if nv:  # --draft-vocab N: eagle k = K scoring the first N ids (random weights: the cost, not the acceptance)
        layouts = vocab_layouts(model)
        for fp8_head in (False, True) if getattr(args, "draft_head_fp8", False) else (False,):
            runs += [("eagle", args.k, fp8_head, nv, layout) for layout in layouts]
    out = {}
    for draft, k, fp8_head, vocab, layout in runs:
        opts = {"reuse_modules": True} if drafter(draft).modules_needed(k) > model.n_mtp else {}
        if fp8_head:
            opts["draft_head_fp8"] = True
        if vocab:
            opts["draft_vocab"] = range(vocab)
        if layout is not None:
            set_draft_vocab_by_shard(model, layout == "by_shard")
        name = f"{draft}_k{k}{'_head_fp8' if fp8_head else ''}{f'_vocab{vocab}' if vocab else ''}" + (
            f"_{layout}" if layout else "")
        for mode in modes:
            t0 = time.perf_counter()
            if mode != "eager":  # the first call captures the step (kept by generate); the second is timed
                generate(model, prompts, 4, draft=draft, k=k or None, mode=mode, **opts)
            m = generate(model, prompts, args.new_tokens, draft=draft, k=k or None, mode=mode, **opts).metrics
            out[f"{name}_{mode}"] = {
                "draft": draft, "k": k, "mode": mode, "steps": m.target_forwards, **spec_step_times(m),
                "AL_random_weights": m.mean_accepted_len}
            if fp8_head and not vocab:
                out[f"{name}_{mode}"]["draft_head_fp8"] = draft_head_memory(model, k)
            if vocab:
                out[f"{name}_{mode}"].update(draft_vocab=vocab, draft_vocab_layout=layout or "one process",
                                             draft_vocab_rows=vocab_rows(model, vocab, layout))
            log(f"  spec {name} {mode}: {out[f'{name}_{mode}']['step_ms_wall']:.3f} ms/step wall "
                f"({time.perf_counter() - t0:.1f} s)")
            if cuda and args.profile and k == args.k and mode == modes[-1]:
                out[f"{name}_{mode}"]["profile"] = spec_profile(
                    lambda n: generate(model, prompts, n, draft=draft, k=k or None, mode=mode, **opts).metrics,
                    args.new_tokens)
        release(model)
        if layout is not None:
            set_draft_vocab_by_shard(model, False)
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
            out[key] = {"draft": "eagle", "tree": name, "k": shape.max_depth, "nodes": shape.n_nodes, "mode": mode,
                        "steps": m.target_forwards, "graph_captures": m.graph_captures, **spec_step_times(m),
                        "AL_random_weights": m.mean_accepted_len}
            log(f"  spec tree {name} {mode}: " + (f"GPU {out[key]['gpu_step_ms']:.3f} ms/step" if m.graph_replays else
                                                  f"{out[key]['step_ms_wall']:.3f} ms/step wall"))
        release(model)  # a kept tree engine holds its buffers and graphs
    return {"prompt_len": L, "modes": tuple(modes), "runs": out,
            "note": "generate() / generate_tree() with a real prefill of a random prompt of this length"}


def vocab_layouts(model) -> tuple[str | None, ...]:
    """The draft vocabulary layouts to time on this model: on a vocabulary-parallel head both, balanced (the default)
    and by shard (the layout before it, `parallel.modules.set_draft_vocab_by_shard`); on one process's head one."""
    from ..parallel.modules import VocabParallelHead

    return ("balanced", "by_shard") if isinstance(model.mtp[0].shared_head.head, VocabParallelHead) else (None,)


def vocab_rows(model, vocab: int, layout: str | None) -> int:
    """Rows of the draft head over ids 0..vocab-1 on this rank (`draft.vocab.rows_per_rank`)."""
    from ..draft.vocab import rows_per_rank

    if layout is None:
        return vocab
    world = model.mtp[0].shared_head.head.comm.world
    return rows_per_rank(range(vocab), model.cfg.vocab_size, world, layout == "by_shard")


def draft_head_memory(model, k: int) -> dict:
    """The FP8 copy of the eagle drafts' head (module 0's, made by the speculative steps before: `shared_fp8_head`
    returns the kept one): its bytes on this rank, and what the memory planner counts for it
    (`parallel.memory.draft_head_fp8_bytes`)."""
    from ..draft.head_fp8 import shared_fp8_head
    from ..parallel.layout import ParallelPlan
    from ..parallel.memory import draft_head_fp8_bytes
    from ..parallel.modules import VocabParallelHead

    head = model.mtp[0].shared_head.head
    comm = head.comm if isinstance(head, VocabParallelHead) else None
    world, rank = (comm.world, comm.rank) if comm is not None else (1, 0)
    return {"bytes": shared_fp8_head(model, 0).nbytes,
            "planned_bytes": draft_head_fp8_bytes(model.cfg, ParallelPlan(world), "eagle", k, rank),
            "bf16_head_bytes": head.weight.numel() * head.weight.element_size()}


@torch.no_grad()
def draft_collectives(model, comm) -> dict:
    """Collectives of one MTP-module forward (one draft forward), counted on an eager call: the embedding's,
    attention's and FFN's all-reduces, the eh_proj output's and the logits' all-gathers. `all_gather_call_bytes`
    lists each all-gather's bytes in issue order, so the projection prices each at its own size
    (`rank_model.comm_ms`): eh_proj's [1, D / W] is 1/18 of the logits' [1, V / W] at the real widths."""
    cache = model.new_cache(1, 8, n_layers=1)
    ids = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    h = torch.zeros(1, 1, model.cfg.hidden_size, dtype=model.dtype, device=model.device)
    comm.reset()
    model.mtp_forward(0, ids, h, cache, kv_len=1)
    out = dict(comm.counts)
    out["all_gather_call_bytes"] = [math.prod(shape) * getattr(torch, dtype).itemsize
                                    for kind, shape, dtype in comm.calls if kind == "all_gather"]
    return out
