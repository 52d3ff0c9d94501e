"""`mtp-bench --tp N`: one rank of a TP=N / EP=N group of the 671B model, timed on one device.

    python -m mtp.bench --tp 8 --layers 61 --prompt-len 1024 8192 32768 --profile --json tp8.json   # one H200
    python -m mtp.bench --tp 2 --layers 2 --prompt-len 24 40 --k 1                                  # CPU, tiny

Rank r (default: the rank holding the most weight bytes) is built at its real shapes (H/N heads, E/N experts,
V/N vocabulary rows, D/N eh_proj rows; random FP8 weights drawn on the device, only this rank's slices:
`random_parallel_model`) inside `simulate.simulated_rank`, so every collective is a no-op; they are counted per
step, not timed. For each context length the target cache is filled with random valid FP8 entries
(`fill_cache_random`: no prefill is run) and one target forward per verify width 1..K+1 is CUDA-graph captured
and timed, with
- the rank's byte floor: its non-expert trunk weights, the routed experts its slice was sent (distinct local
  experts the step's tokens chose, measured with the reference router; random weights route arbitrarily),
  its lm_head rows, and the cache it must read (the indexer keys of every position once the indexer runs,
  at least top-k latent entries), over the copy bandwidth measured in the same run; and the % of it reached;
- kernels per step (and per layer) from the profiler, with their busy time (the union of their spans) and the idle
  time between them; with --profile the per-kernel table. The graph's `graph_ms` times one replay per CUDA event
  pair (a sync after each: it holds the host's launch latency, 0 to ~0.5 ms depending on the captured graph);
  `graph_ms_b2b` times 8 replays back to back (the GPU's time per step when the host launches ahead). Compare
  kernel variants on busy (+ idle) or b2b: they repeat within ~0.03 ms where graph_ms does not (BENCHMARKS.md,
  session 14);
- the lightning indexer (scores + top-k) of one layer timed alone at that context, and per step;
- with `--trees chain3,2x2,...` (`TreeShape.parse` names): per tree shape the target verify forward over its N
  nodes with the tree mask, beside the causal verify of a chain of the same N tokens (graph ms, ms per node,
  bytes per node from the rank's byte floor; a few replays each on the same built rank); with `--tree-al
  2x2=2.9 ...` (acceptance lengths measured elsewhere, e.g. mtp-eval) the projection adds their tok/s per user.
Then whole speculative steps (`mtp.generate`, graph/overlap mode: plain, eagle and vanilla k = 1..K; with
`--draft-head-fp8` also eagle k = K with the drafts' logits from an FP8 copy of the head, `mtp.draft.head_fp8`, whose
bytes on the rank and the planner's count go in the JSON) at the shortest context, which measures the draft cost at
these shapes. `projection` adds the collectives back:
n x a latency that is measured (`--collective-json`, from `python -m mtp.bench.collectives` on N GPUs) or
assumed (`--allreduce-us`, printed as assumed), and divides by the acceptance length of `--accept`.
The JSON is rewritten (atomically) after every part, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from ..model.config import ModelConfig
from .timing import copy_bandwidth, timer
from ..parallel.layout import ParallelPlan
from ..placement import choose_layout
from ..kernels.dispatch import FastPathOptions
from ..parallel.memory import GIB
from .rank_model import extrapolate, memory_need, project, step_key
from .rank_report import log, print_table, save
from .rank_steps import draft_collectives, spec_steps, target_steps


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


def check_memory(cfg: ModelConfig, args, world: int, rank: int, dtype: torch.dtype) -> dict:
    """Say up front whether the rank fits this GPU at cfg's depth; if not, exit naming the depths that fit."""
    need = memory_need(cfg, world, rank, dtype, max(args.prompt_len) + args.k + 1,
                       max(getattr(args, "batches", [args.batch])),
                       head_fp8=getattr(args, "draft_head_fp8", False) and not args.no_spec)
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
        split = getattr(args, "layout", "contiguous") == "split"  # `run` resolved 'auto'
        plan = ParallelPlan(world, expert_layout="split" if split else "contiguous")  # other layouts: routes forced
        model = random_parallel_model(cfg, comm, plan, device="cuda" if cuda else "cpu", dtype=dtype, seed=args.seed)
        part["build_s"] = time.perf_counter() - t0
        part["param_gib"] = param_bytes(model) / GIB
        if cuda:
            from ..backends.fast_path import enable_fast_path

            # mtp-bench --kernels, --elementwise
            enable_fast_path(model, elementwise=args.elementwise,
                             options=FastPathOptions.for_world(world, **(args.kernels or {})))
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
                    for r in sp["runs"].values():  # the verify forward of the same depth, to split off the draft
                        if "tree" in r and "error" not in r:
                            r["verify_ms"] = part["contexts"][L0]["trees"][r["tree"]]["tree"]["ms"]
                        elif "tree" not in r:  # timed as the projection reads it (back to back on a GPU)
                            row = part["contexts"][L0]["widths"][r["k"] + 1]
                            r["verify_ms"] = row[step_key(row)]
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
    "old": (dict(gemv=False, norm_quant=False, router=False, prologue=False, absorb=False, index_weights=False,
                 pdl=False),
            dict(indexer_topk="torch", moe_layout="pairs")),
    "new+pdl": (dict(pdl=True, pdl_tokens=64, pdl_early_tokens=64), dict()),
    # the split-K CUDA-core GEMV only up to 1 / 2 rows, the tensor-core GEMM above (its cost grows with the rows)
    "gemv1": (dict(gemv_rows=1), dict()),
    "gemv2": (dict(gemv_rows=2), dict()),
    "gemv1+pdl": (dict(gemv_rows=1, pdl=True), dict()),
    # the few-row tensor-core GEMV at 2..4 rows with 8 K groups a slice and 4 stages (`FastPathOptions.deep_tune`;
    # the default since session 24: -0.06 to -0.07 ms a step at w = 2..4), and the plan before
    "gemm_deep": (dict(gemm_deep_rows=4), dict()),
    "gemm_deep_off": (dict(gemm_deep_rows=0), dict()),
    "gemm_deep_q_b_off": (dict(gemm_deep_q_b=False), dict()),
    # the indexer's head weights as cuBLAS mm (+ its split-K reduce) + scale instead of `kernels.index_weights`
    "cublas_ixw": (dict(index_weights=False), dict()),
    # the experts' layout by size (persistent for T * J <= 64) on every MoE, also on a rank holding every expert's
    # slice ('split'), which `fast_module` gives the pair grid above SPLIT_PERSISTENT_TOKENS (4) tokens
    "moe_by_size": (dict(), dict(moe_layout=None)),
    "moe_pairs": (dict(), dict(moe_layout="pairs")),  # the pair grid on every MoE, whatever its rank holds
    # the persistent experts' K slices sized for every pair a distinct local expert (`moe.wave_splits`; a split
    # rank up to its persistent_tokens; the default since session 12), the same with the persistent layout at every
    # width, and the slices of `moe.default_splits` (the switch off)
    "moe_waves": (dict(moe_wave_splits=True), dict()),
    "moe_waves_by_size": (dict(moe_wave_splits=True), dict(moe_layout=None)),
    "moe_no_waves": (dict(moe_wave_splits=False), dict()),
    # the persistent experts' work items with no dependent load before their weight tiles (ids from registers, the
    # scales one K group ahead, gate/up's fix-up loads in flight at once; `mtp.kernels.moe_items`): the same bits.
    # The default since session 17; moe_item_regs_off: the item loop before
    "moe_item_regs": (dict(moe_item_regs=True), dict()),
    "moe_item_regs_off": (dict(moe_item_regs=False), dict()),
    # the kv prologue's latent and indexer key of a token in two programs (`mla_prologue_fused`): the same bits
    "kv_split": (dict(kv_split=True), dict()),  # the default since session 18
    "kv_split_off": (dict(kv_split=False), dict()),
    # the persistent experts' gate/up on the block's quantized input (x8, sx) instead of x quantized again in each K
    # group (`moe.moe_experts(xq=)`): the same bits
    "moe_x8": (dict(moe_x8=True), dict()),  # the default since session 18
    "moe_x8_off": (dict(moe_x8=False), dict()),
    # the persistent experts' weight tiles by TMA (host tensor descriptors, `moe.moe_experts(tma=True)`) instead of
    # cp.async: the same bits. Off by default until timed
    "moe_tma": (dict(moe_tma=True), dict()),
    "moe_tma_off": (dict(moe_tma=False), dict()),
    # the persistent experts' down projection by output block, every expert in one pipelined loop, no combine launch
    # (`moe.moe_experts(down_nb=True)`, `mtp.kernels.moe_down_nb`): another fp32 sum order. On by default since session 20
    "moe_down_nb": (dict(moe_down_nb=True), dict()),
    "moe_down_nb_off": (dict(moe_down_nb=False), dict()),
    # the down kernel's plan from the router's ids before its PDL wait and its rows of its loop's first 8 experts (or
    # of all of them) asked of L2 there (`moe.moe_experts(down_pf_experts=)`), where gate/up triggers it after its wait:
    # with gate/up's trigger after its wait at one token too (moe_gate_up_aw), without it (w >= 2 only), all experts;
    # and gate/up's trigger moved alone. The same bits. On by default (8 experts, the trigger moved) on a
    # tensor-parallel rank since session 25
    "moe_down_pf_off": (dict(moe_down_pf_experts=0, moe_gate_up_aw=False), dict()),
    "moe_down_pf": (dict(moe_down_pf_experts=8, moe_gate_up_aw=True), dict()),
    "moe_down_pf_noaw": (dict(moe_down_pf_experts=8, moe_gate_up_aw=False), dict()),
    "moe_down_pf_all": (dict(moe_down_pf_experts=64, moe_gate_up_aw=True), dict()),
    "moe_gate_up_aw": (dict(moe_down_pf_experts=0, moe_gate_up_aw=True), dict()),
    # mla_decode's stage 2 and absorb_out as two launches; the cast after a row-parallel all-reduce as a launch
    "unfused_absorb_out": (dict(fuse_absorb_out=False), dict()),  # = defaults since fa04e59 (kept: its name is in
    # session 11's BENCHMARKS commands)
    "fused_absorb_out": (dict(fuse_absorb_out=True), dict()),
    "unfused_out_cast": (dict(fuse_out_cast=False), dict()),
    # the MLA prologue's pairs of launches (kv prologue, q_a norm; q prologue, absorb q) apart: 2 launches more
    "unfused_prologue": (dict(fuse_prologue=False), dict()),
    # the shared expert's own gate | up GEMV, silu * up and down instead of the experts' implicit last slot
    "unfused_shared": (dict(shared_in_experts=False), dict()),
    # the indexer top-k's zeroed workspace per call (a memset launch per layer) instead of the kept, re-armed one
    "topk_memset": (dict(topk_rearm=False), dict()),
    # the indexer scores kernel looping over its key blocks, 2 programs per SM of an H100 / H200 (132 SMs)
    "ix_loop": (dict(), dict(indexer_scores=dict(programs=264, num_stages=3))),
    # the default switches again: listed between others (kept as defaults#2, ...), it shows one run's spread
    "defaults": (dict(), dict()),
    # every fusion switch of session 11 off: the launches the session started from, on the same rank (not the split
    # rank's persistent experts up to SPLIT_PERSISTENT_TOKENS, FastMoE.persistent_tokens: variant moe_pairs times
    # the pair grid)
    "s10": (dict(fuse_prologue=False, fuse_absorb_out=False, fuse_out_cast=False, topk_rearm=False,
                 shared_in_experts=False), dict()),
    # the indexer top-k's three radix phases in one cooperative launch (`topk_one_launch`), and the same with its
    # histogram phase in the scores kernel's epilogue (radix_fused: scores + one top-k launch per layer)
    "topk_one_launch": (dict(topk_one_launch=True), dict()),
    "topk_one_launch_fused": (dict(topk_one_launch=True), dict(indexer_topk="radix_fused")),
    # the indexer's scores and top-k in one cooperative launch (`indexer_one_launch`)
    "indexer_one_launch": (dict(indexer_one_launch=True), dict()),
    # the indexer top-k's kernels before session 15 (V1) and with fewer dependent round trips on the split kernel's
    # path (V2, the default; `topk._topk_split_kernel`): the same index sets
    "topk_split_v1": (dict(topk_split_v2=False), dict()),
    "topk_split_v2": (dict(topk_split_v2=True), dict()),
    # the top-k's histogram pass in the scores kernel's epilogue, its split and write as their own launches (one launch
    # fewer per layer past 2048 keys; in isolation 2 us faster at one query row, slower at 2..4: session 11), at every
    # width; and the histogram as its own launch at every width (fused_hist_rows 0: the default before session 14,
    # which takes radix_fused at one row)
    "radix_fused": (dict(), dict(indexer_topk="radix_fused")),
    "hist_launch": (dict(fused_hist_rows=0), dict()),
    # programmatic dependent launch on every Triton kernel of the decode step (as new+pdl since session 12: each
    # triggers its successor at its start, loads / L2-prefetches its constant weights, then waits): attention,
    # indexer, top-k, MoE, norms, adds, silu * up, the few-row GEMM; not the NCCL all-reduce, the cuBLAS lm_head,
    # torch glue or the final norm (the chain restarts after each); at every width with the trigger at each kernel's
    # start (session 12-14's pdl_all; the default since session 15 triggers after the wait past one token), at one
    # token only (the default of sessions 12-14), and no PDL at all
    "pdl_all": (dict(pdl=True, pdl_tokens=64, pdl_early_tokens=64), dict()),
    "pdl_w1": (dict(pdl=True, pdl_tokens=1, pdl_early_tokens=64), dict()),
    "no_pdl": (dict(pdl=False), dict()),
    # PDL without the kernels' explicit L2 prefetches of their constant weights before the wait (pdl_prefetch_tokens
    # 0: compiled out; launch and wait as before, the same bits): at the default widths, and at every width (a
    # guess for why pdl_all loses at w >= 2: the few-row GEMM's slab prefetch competing with the running kernel)
    "pdl_nopf": (dict(pdl=True, pdl_tokens=1, pdl_early_tokens=64, pdl_prefetch_tokens=0), dict()),
    "pdl_all_nopf": (dict(pdl=True, pdl_tokens=64, pdl_early_tokens=64, pdl_prefetch_tokens=0), dict()),
    # PDL at every width, the prefetches for one-token calls only (session 13, h200a: at w = 1 they helped, at
    # w = 2..4 pdl_all_nopf beat pdl_all by 0.25-0.40 ms; h200b: neither beat no PDL at w >= 2, BENCHMARKS.md)
    "pdl_all_pf1": (dict(pdl=True, pdl_tokens=64, pdl_early_tokens=64, pdl_prefetch_tokens=1), dict()),
    # PDL with each kernel triggering its successor right after its own wait instead of at its start (at most two
    # grids resident: `_triton.PDL_AFTER_WAIT`): at every width beyond one token (= the default since session 15),
    # at every width including one token, and at one token only
    "pdl_all_aw": (dict(pdl=True, pdl_tokens=64, pdl_early_tokens=1), dict()),
    "pdl_all_aw1": (dict(pdl=True, pdl_tokens=64, pdl_early_tokens=0), dict()),
    "pdl_aw": (dict(pdl=True, pdl_tokens=1, pdl_early_tokens=0), dict()),
    # the default PDL (every width, after the wait past one token) with the weights' L2 prefetches before the wait
    # for one-token calls only (with the trigger after the wait a kernel's prefetch no longer overlaps a chain)
    "pf_w1": (dict(pdl_prefetch_tokens=1), dict()),
    # the FFN's all-reduced sum added in its own block (`add_rounded`, then the next block's norm), as under NCCL
    # before session 15 (the simulated rank's all-reduce is NCCL's): one launch more per layer than the hand-off
    "ffn_add_in_block": (dict(mlp_reduce_norm=False), dict()),
    # the split-K GEMV's plan before session 17: o_proj's K = 2048 in 2 slices + the fix-up, 8 warps (the default
    # since: one slice, 4 warps; `gemv_splitk.gemv_plan`)
    "gemv_split": (dict(gemv_one_slice=0), dict()),
    "gemv_w4": (dict(gemv_warps=4), dict()),
    # the add + norm + quant kernel on the model-width rows at 8 warps, the default before session 18 (since: 32,
    # `norm_quant.row_tiles`; alone on an H200 3.84-3.86 vs 4.58-4.60 us a row of 7168, 122 launches a step of one
    # TP=8 rank): the default -0.14 to -0.17 ms a step against this at 1k (H200, BENCHMARKS.md session 18)
    "norm_8_warps": (dict(norm_warps=8), dict()),
    # MLA stage 1 with 2 / 4 programs per (row, head block, key split), each the softmax and 256 / 128 of the 512
    # output channels (`mla_decode(channel_splits=)`, the same bits) at every width, where the default takes them by
    # score rows (`mla_decode.channel_splits_for`: four tokens' grids overflow the SMs)
    "mla_cs1": (dict(mla_channel_splits=1), dict()),  # the kernel before session 18 (default: by rows)
    "mla_cs2": (dict(mla_channel_splits=2), dict()),
    "mla_cs4": (dict(mla_channel_splits=4), dict()),
    # the decode step's argmaxes over the vocabulary and the health check of its logits by torch (torch.argmax 27.8 us
    # a call, the check ~35 us: H200, session 19's eagle k = 3 profile) instead of one launch of
    # `kernels.logits_scan` each (the default; the same indices and flag). Both sit in the engine's step, past the
    # forward: the target steps timed here do not run them; the speculative steps (--profile, spec_step) do, so time
    # the switch there with `--kernels logits_scan=0` against the defaults
    "logits_scan": (dict(logits_scan=True), dict()),
    "logits_scan_off": (dict(logits_scan=False), dict()),
    # the router with no split-K and one arrival (`router.moe_route_fused(impl="one")`: each program 2 experts'
    # whole dot, the last one routes every token by ranks) up to 16 tokens, against the default's 'auto' (grouped:
    # two arrivals in a chain; 9.2 us exposed per MoE layer at every width, H200, session 19). Default: up to 8 tokens
    "router_one": (dict(router_one_tokens=16), dict()),  # every call of <= 16 tokens
    "router_one_off": (dict(router_one_tokens=0), dict()),  # the grouped impl ('auto') at every width
    # the default (session 21): impl one up to 8 tokens, its routing split over its last programs to arrive, one
    # token each from 2 tokens (`moe_route_fused(split_tail=True)`: the same bits); against: split from 3 tokens, and
    # session 20's default (impl one unsplit up to 2 tokens, grouped above)
    "router_split3": (dict(router_one_tokens=8, router_one_split=3), dict()),
    "router_split_off": (dict(router_one_tokens=2, router_one_split=0), dict()),
    # the decode step's glue by torch ops (session 21, issue 25; the defaults launch one kernel each, the same bits):
    # the chain step's accept + commit + count (47 launches; in the engine's step, past the forward: time it in the
    # speculative steps, `--profile --kernels step_commit=0` against the defaults, as logits_scan)
    "step_commit_off": (dict(step_commit=False), dict()),
    # a forward's slots and rotary angles computed (5 launches) instead of one gather from the angle table; the
    # vocabulary-parallel embedding's mask and lookup by torch (8 launches) instead of one kernel; an MTP module's
    # enorm, hnorm and cat as 3 launches instead of one (spec steps only, as step_commit); all four together
    "rope_table_off": (dict(rope_table=False), dict()),
    "vocab_embed_off": (dict(vocab_embed=False), dict()),
    "mtp_norms_off": (dict(mtp_norms=False), dict()),
    "glue_off": (dict(step_commit=False, rope_table=False, vocab_embed=False, mtp_norms=False), dict()),
    # the four glue kernels launched without programmatic dependent launch (session 21's launches; the default since
    # session 22 gives them PDL as the step's other Triton kernels, the same bits: predicted -7 to -13 us an eagle
    # k = 3 step, measured 7.619 -> 7.613 ms, within noise); spec steps mostly, as step_commit (a target step runs a
    # gather and an embedding)
    "glue_pdl_off": (dict(glue_pdl=False), dict()),
    # a tree step's compaction, hidden rows and counters by torch ops (~36 launches) instead of one launch of
    # `kernels.tree_commit` (the default since session 23, the same bits); tree spec steps only: time them with
    # `--trees 2x1x1 --kernels tree_glue=0` against the defaults, as step_commit
    "tree_glue_off": (dict(tree_glue=False), dict()),
    # a tree forward's slots, angles and visibility by torch ops (18 launches a forward, 3 tree forwards an eagle 2x1x1
    # step) instead of one launch of `kernels.lookup.tree_slots` (the default since session 23, the same bits); tree
    # spec steps only: `--trees 2x1x1 --kernels tree_fwd_glue=0` against the defaults
    "tree_fwd_glue_off": (dict(tree_fwd_glue=False), dict()),
    # the strict tree verdict by torch ops (~25 launches a step) instead of one launch of `kernels.tree_verdict` (the
    # default since session 25, the same integers); strict tree spec steps only: `--trees 2x1x1 --kernels
    # tree_verdict=0` against the defaults
    "tree_verdict_off": (dict(tree_verdict=False), dict()),
    # a strict chain step's verdict by torch ops (5 launches) instead of inside the commit kernel (the default since
    # session 25, the same bits); spec steps only, as step_commit
    "strict_commit_off": (dict(strict_commit=False), dict()),
    # a chain step's draft window by torch ops (11 launches, its cache's truncate and x_{n-1} too) instead of one of
    # `kernels.draft_window` (the default since session 25, the same bits); spec steps only, as step_commit
    "draft_window_off": (dict(draft_window=False), dict()),
    # a tree step's first window by torch ops (12 launches) instead of one launch of `kernels.draft_window.tree_window`
    "tree_window_off": (dict(tree_window=False), dict()),
    # a column-parallel rank's fp32 casts of eh_proj and the heads' logits after their gathered copy (2 launches past
    # one row) instead of by that copy (the default since session 25, the same bits)
    "gather_cast_off": (dict(gather_cast=False), dict()),
}


def kernel_variants(model, comm, args, cuda: bool, bw, time_fn, world: int, res: dict) -> dict:
    """Each named variant's target steps at every context (no speculative steps); every module's switches, top-k,
    scores settings and expert layout are restored afterwards, so each variant starts from the defaults. A name
    listed again is timed again and kept as 'name#2', 'name#3'... (alternating variants shows a run's drift). A
    variant that fails is recorded and the others still run."""
    from ..backends.fast_path import FastMLA, FastMoE, set_kernel_options, set_kernels

    out: dict = {}
    for name in args.kernel_variants:
        if name not in KERNEL_VARIANTS:
            raise SystemExit(f"--kernel-variants: unknown variant {name!r}; known: {sorted(KERNEL_VARIANTS)}")
        key = name if name not in out else f"{name}#{sum(k.split('#')[0] == name for k in out) + 1}"
        flags, options = KERNEL_VARIANTS[name]
        kept = [(m, m.topk_impl, m.scores_tune) for m in model.modules() if isinstance(m, FastMLA)]
        layouts = [(m, m.expert_layout, m.persistent_tokens) for m in model.modules() if isinstance(m, FastMoE)]
        old = set_kernels(model, **flags)
        if options:
            set_kernel_options(model, **options)
        log(f"kernel variant {key!r}: switches {flags}, options {options}")
        try:
            out[key] = {"switches": flags, "options": options, "contexts": {}}
            for L in args.prompt_len:
                out[key]["contexts"][L] = target_steps(model, comm, args, L, cuda, bw, time_fn, world)
                save(res, args.out)
        except Exception as e:  # keep the default run's numbers
            out[key]["error"] = repr(e)[:1000]
            log(f"kernel variant {key!r} failed: {out[key]['error']}")
        finally:
            set_kernels(model, **vars(old))  # bumps the model's version: graphs are captured again
            for m, topk, scores in kept:
                m.topk_impl, m.scores_tune = topk, scores
            for m, lay, pt in layouts:
                m.expert_layout, m.persistent_tokens = lay, pt
    return out


def run(args) -> dict:
    """The whole --tp N run; returns the result dict (also written to args.out when given)."""
    cuda = torch.cuda.is_available()
    world = args.tp
    cfg = rank_config(args, world, cuda, args.layers)
    args.layout = choose_layout(getattr(args, "layout", "contiguous"), cfg.moe_intermediate_size, world)
    dtype = torch.bfloat16 if cuda else torch.float32
    rank = default_rank(cfg, world, dtype) if args.rank is None else args.rank
    if not 0 <= rank < world:
        raise SystemExit(f"--rank must be in [0, {world}), got {rank}")
    depths = tuple(args.extrapolate or ())
    busiest = getattr(args, "route", "measured") == "busiest"
    res: dict = {"mode": f"simulated rank {rank} of TP={world} / EP={world} (torch fake process group: collectives "
                         f"counted, not run), expert layout {args.layout!r}"
                         + ("; routed as its BUSIEST rank" if busiest else ""), "expert_layout": args.layout,
                 "tp": world, "rank": rank,
                 "rank_choice": "given (--rank)" if args.rank is not None else "default: most weight bytes",
                 "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                 "date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args), "fast_path": cuda,
                 # the switches its fast path had (`mtp.plan.calibrate.measured_code` counts its launches by them)
                 "fast_path_options": vars(FastPathOptions.for_world(world, **(getattr(args, "kernels", None) or {})))
                 if cuda else None,
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
