"""Time the indexer top-k and the routed-expert kernels, old vs new, side by side in one run on one GPU.

    python -m mtp.bench.topk_moe [--out DIR] [--only topk,topk1,moe,moe_batch,moe_down_nb] [--quick]

topk: torch.topk (`topk_from_scores`, sorted=False: the old fast path) vs `radix_topk`, the indexer scores
kernel alone, the whole `indexer_topk` per impl (torch / radix / radix_fused: histograms in the scores
kernel), at S = 8192 / 32768 / 131072 and T = 1..4 score rows (B = 1), plus a sweep of the radix select's
chunks per row; at S = 8192 / 32768 each impl with a zeroed top-k workspace per call (a memset) and with the kept,
re-armed one, and a sweep of the scores kernel's launch settings (`indexer_scores`: block_s, num_warps,
num_stages, programs) x radix / radix_fused, each checked bit for bit against the default kernel's scores,
ranked by mean us over T = 1..4 (`best_settings`: printed after the section, the best per S and impl). Each result is first checked against `topk_select_ref` (exact set; ties included).
Then (rows 'topk1', `one_launch_section`; --only topk1 runs it alone, at S = 8192 / 32768 / 65536) the radix
top-k's phases in one cooperative launch beside its three launches at T = 1, 2, 4, 8: alone, inside `indexer_topk`
(radix, radix_fused), the scores and the top-k in one launch (`indexer_one_launch`), and sweeps of their chunks (and
warps).
Timing as in `mtp.bench.kernels`: CUDA-graph replays timed with CUDA events, median of 15. The scores a top-k
reads were just written by the scores kernel, so they sit in L2 here as in the decode step.
moe: `moe_experts` layout 'pairs' (old) vs 'persistent' (new) at one rank of TP=8 and at TP=1, T = 1..4, with
% of the HBM floor (see `moe_section`).
moe_split (not in the default --only): one TP=8 'split' rank's experts with the shared slot at T = 1..4, pairs vs
persistent (default / 'waves' slices, switch moe_item_regs on and off, switch moe_x8: gate/up on x pre-quantized,
switch moe_tma: the weight tiles by TMA) and a sweep of the K slices (`moe_split_section`).
moe_knobs (not in the default --only): the split rank's default call against its launch knobs and tma on / off
(`moe_knobs_section`, every variant checked bit-equal first).
moe_down_nb (not in the default --only): the split rank's default call (gate/up + down + combine) against the down
projection by output block (`moe_experts(down_nb=True)`, no combine) at its tiles and stage counts, each checked within
1e-5 of the default; each kernel's exposed us per call for both (the old down + combine vs the new down), and a token's
bits alone vs among four (`moe_down_nb_section`).
moe_batch (not in the default --only): every `moe_experts` layout that takes T tokens (pairs, persistent,
grouped at each M-block, the reference static loop where it is not too slow) at T = 1 .. 4096, one rank of TP=8
and TP=1, with GB/s of expert weights touched, TFLOP/s and the HBM floor: what `moe.GROUPED_ABOVE` and
`moe_grouped.default_block_m` are to be set from (see `moe_batch_section`).
Prints a table last (sweep rows only in the JSON and the log) and writes everything as JSON to
DIR/gpu_topk_moe.json (DIR: $OUT, else eval/results).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from mtp.bench.kernels import graph_us, report
from mtp.model.fp8 import act_quant as act_quant_ref
from mtp.kernels.indexer import SCORES_DEFAULT, indexer_scores, indexer_topk, topk_from_scores
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


def _indexer_case(k8, ks, S: int, T: int, H: int, D: int, k: int):
    """One row's indexer inputs over the keys (k8, ks): T random quantized queries of H heads, their head weights,
    the row length S - T, the default kernel's scores and the reference top-k of them."""
    q8, qs = act_quant_ref(torch.randn(1, T, H, D, device=DEV))
    w = torch.randn(1, T, H, device=DEV) * H ** -0.5 * D ** -0.5
    lens = torch.tensor([S - T], device=DEV, dtype=torch.int32)
    sc = indexer_scores(q8, qs[..., 0], w, k8, ks[..., 0], lens)
    return q8, qs, w, lens, sc, topk_select_ref(sc, lens, k)


def topk_section(quick: bool, sizes: tuple[int, ...] | None = None, H: int = 64, k: int = 2048):
    D = 128
    sizes = sizes or ((8192, 32768) if quick else (8192, 32768, 131072))
    for S in sizes:
        k8, ks = act_quant_ref(torch.randn(1, S, D, device=DEV))
        for T in (1, 2, 3, 4):
            shape = f"S={S} T={T}"
            q8, qs, w, lens, sc, want = _indexer_case(k8, ks, S, T, H, D, k)
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
            row("topk", shape, "scores + torch.topk", t_scores + t_old)
            row("topk", shape, "scores + radix_topk", t_scores + t_new)
            args = (q8, qs[..., 0], w, k8, ks[..., 0], lens, k)
            for impl in ("torch", "radix", "radix_fused"):  # the whole indexer_topk call, one graph
                try:
                    idx, sc2 = indexer_topk(*args, impl=impl)
                    if impl != "torch":
                        check(f"indexer_topk {impl} {shape}", torch.equal(idx, topk_select_ref(sc2, lens, k)))
                    row("topk", shape, f"indexer_topk impl={impl}", graph_us([lambda: indexer_topk(*args, impl=impl)]))
                except Exception as e:  # the fused epilogue may not compile: keep the other numbers
                    check(f"indexer_topk {impl} {shape}", False, f"{type(e).__name__}: {str(e)[:300]}")
            if S in SWEEP_S:
                sweep_scores(S, T, args, want_scores=sc, quick=quick)
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
    log(best_settings())
    one_launch_section(quick, sizes, H, k)


def one_launch_section(quick: bool, sizes: tuple[int, ...] | None = None, H: int = 64, k: int = 2048):
    """The radix top-k's phases in one cooperative launch (`topk_one_launch.radix_topk_one_launch`) beside its three
    launches (`radix_topk`), at T = 1, 2, 4, 8 score rows (B = 1): the top-k alone, the whole `indexer_topk`
    (radix and radix_fused, kept workspace) with one_launch off / on, and the scores with the top-k in one launch
    (`indexer_one_launch.indexer_topk_one_launch`); then (not --quick, T = 1, 4, 8) the one-launch kernel's chunks
    per row and warps, and the scores + top-k launch's chunks. Each result checked against `topk_select_ref` first
    (and the scores against the default scores kernel's, bit for bit)."""
    from mtp.kernels.indexer_one_launch import indexer_grid, indexer_topk_one_launch
    from mtp.kernels.topk_one_launch import one_launch_grid, radix_topk_one_launch

    D = 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for S in sizes or ((8192, 32768) if quick else (8192, 32768, 65536)):
        k8, ks = act_quant_ref(torch.randn(1, S, D, device=DEV))
        for T in (1, 2, 4, 8):
            shape = f"S={S} T={T}"
            q8, qs, w, lens, sc, want = _indexer_case(k8, ks, S, T, H, D, k)
            grid = one_launch_grid(T, S, sms)
            check(f"one launch {shape} grid {grid}", torch.equal(radix_topk_one_launch(sc, lens, k), want))
            t3 = graph_us([lambda: radix_topk(sc, lens, k, rearm=True)])
            t1 = graph_us([lambda: radix_topk_one_launch(sc, lens, k, rearm=True)])
            row("topk1", shape, "radix_topk 3 launches", t3)
            row("topk1", shape, "radix_topk one launch", t1, speedup=round(t3 / t1, 2), grid=str(grid))
            args = (q8, qs[..., 0], w, k8, ks[..., 0], lens, k)
            for impl in ("radix", "radix_fused"):
                for one in (False, True):
                    name = f"indexer_topk {impl} {'one launch' if one else '3 launches'}"
                    try:
                        idx, sc2 = indexer_topk(*args, impl=impl, rearm=True, one_launch=one)
                        check(f"{name} {shape}", torch.equal(idx, topk_select_ref(sc2, lens, k)))
                        us = graph_us([lambda: indexer_topk(*args, impl=impl, rearm=True, one_launch=one)])
                    except Exception as e:  # keep the other numbers
                        check(f"{name} {shape}", False, f"{type(e).__name__}: {str(e)[:300]}")
                        continue
                    row("topk1", shape, name, us)
            try:  # the scores and the top-k in one launch
                idx, sc2 = indexer_topk_one_launch(*args, rearm=True)
                check(f"indexer one launch {shape} scores bit-identical to the default kernel", torch.equal(sc2, sc))
                check(f"indexer one launch {shape} index set", torch.equal(idx, want))
                us = graph_us([lambda: indexer_topk_one_launch(*args, rearm=True)])
                row("topk1", shape, "indexer scores + top-k one launch", us, grid=str(indexer_grid(1, T, S, sms)))
            except Exception as e:  # keep the other numbers
                check(f"indexer one launch {shape}", False, f"{type(e).__name__}: {str(e)[:300]}")
            if quick or T not in (1, 4, 8):
                continue
            for chunks in (8, 16, 32, 64, 128):
                for nw in (None, 4, 8, 16):
                    g = one_launch_grid(T, S, sms, chunks)
                    if g is None:
                        continue
                    try:
                        ok = torch.equal(radix_topk_one_launch(sc, lens, k, chunks=chunks, num_warps=nw), want)
                        us = graph_us([lambda: radix_topk_one_launch(sc, lens, k, chunks=chunks, rearm=True,
                                                                     num_warps=nw)])
                    except Exception as e:  # a config that does not compile or fit is skipped
                        log(f"[topk1] chunks={chunks} nw={nw} failed: {type(e).__name__}: {str(e)[:200]}")
                        continue
                    check(f"one launch {shape} chunks={chunks} nw={nw}", ok)
                    row("topk1", shape, f"one launch chunks={chunks} nw={nw}", us, grid=str(g))
            for chunks in (16, 32, 64, 128):  # the scores + top-k launch's programs per row
                g = indexer_grid(1, T, S, sms, chunks)
                if g is None:
                    continue
                try:
                    idx, sc2 = indexer_topk_one_launch(*args, rearm=True, chunks=chunks)
                    ok = torch.equal(idx, want) and torch.equal(sc2, sc)
                    us = graph_us([lambda: indexer_topk_one_launch(*args, rearm=True, chunks=chunks)])
                except Exception as e:
                    log(f"[topk1] indexer chunks={chunks} failed: {type(e).__name__}: {str(e)[:200]}")
                    continue
                check(f"indexer one launch {shape} chunks={chunks}", ok)
                row("topk1", shape, f"indexer one launch chunks={chunks}", us, grid=str(g))
        del k8, ks
        torch.cuda.empty_cache()


SWEEP_S = (8192, 32768)
SWEEP: dict[tuple[int, str, str], dict[int, float]] = {}  # (S, impl, setting) -> {T: us}


def scores_settings(quick: bool) -> list[dict]:
    """The scores kernel's launch settings the sweep times (`indexer.indexer_scores`): today's kernel (one
    program per block) at other tile widths and warps, and the looping kernel at 1-4 programs per SM, 64- and
    128-key tiles, 2-4 tiles in flight."""
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    out = [dict(SCORES_DEFAULT)]
    out += [dict(block_s=bs, num_warps=nw, num_stages=3, programs=None)
            for bs, nw in ((32, 4), (128, 4), (128, 8))]
    loops = [(1, 64, 3, 4), (2, 64, 3, 4), (2, 128, 3, 4)] if quick else \
        [(m, bs, st, 4) for m in (1, 2) for bs in (64, 128) for st in (2, 3, 4)] + [(4, 64, 3, 4), (2, 128, 3, 8)]
    out += [dict(block_s=bs, num_warps=nw, num_stages=st, programs=m * sm) for m, bs, st, nw in loops]
    return out


def setting_name(kw: dict) -> str:
    return f"bs={kw['block_s']} nw={kw['num_warps']} st={kw['num_stages']} P={kw['programs']}"


def sweep_scores(S: int, T: int, args: tuple, want_scores: torch.Tensor, quick: bool) -> None:
    """`indexer_topk` graph-timed at every scores setting, radix and radix_fused, with the kept (re-armed) top-k
    workspace; and at the default setting with a zeroed workspace per call (the memset launch). Checked: scores bit
    for bit against the default kernel's, index sets against `topk_select_ref`."""
    q8, qs, w, k8, ks, lens, k = args
    shape = f"S={S} T={T}"
    for impl in ("radix", "radix_fused"):
        for rearm in (False, True):
            try:
                idx, sc = indexer_topk(*args, impl=impl, rearm=rearm)
                check(f"indexer_topk {impl} rearm={rearm} {shape}", torch.equal(idx, topk_select_ref(sc, lens, k)))
                us = graph_us([lambda: indexer_topk(*args, impl=impl, rearm=rearm)])
            except Exception as e:
                check(f"indexer_topk {impl} rearm={rearm} {shape}", False, f"{type(e).__name__}: {str(e)[:300]}")
                continue
            row("topk", shape, f"{impl} {'kept ws' if rearm else 'memset ws'}", us)
        for kw in scores_settings(quick):
            name = setting_name(kw)
            try:
                idx, sc = indexer_topk(*args, impl=impl, rearm=True, scores=kw)
                ok = torch.equal(idx, topk_select_ref(sc, lens, k))
                bits = torch.equal(sc, want_scores)
                us = graph_us([lambda: indexer_topk(*args, impl=impl, rearm=True, scores=kw)])
            except Exception as e:  # a setting that does not compile or fit is skipped
                log(f"[topk] {shape} {impl} {name} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            check(f"sweep {impl} {name} {shape} index set", ok)
            check(f"sweep {impl} {name} {shape} scores bit-identical to the default kernel", bits)
            row("topk", shape, f"sweep {impl} {name}", us)
            SWEEP.setdefault((S, impl, name), {})[T] = us


def best_settings() -> str:
    """Per S: each impl's settings ranked by their mean over T (only those timed at every T), best first."""
    lines = ["[topk sweep] indexer_topk us (kept workspace), mean over T; best 5 per (S, impl) and the default"]
    for S in SWEEP_S:
        for impl in ("radix", "radix_fused"):
            ts = {n: v for (s, i, n), v in SWEEP.items() if s == S and i == impl}
            if not ts:
                continue
            n_t = max(len(v) for v in ts.values())
            mean = {n: sum(v.values()) / len(v) for n, v in ts.items() if len(v) == n_t}
            ranked = sorted(mean, key=mean.get)
            default = setting_name(SCORES_DEFAULT)
            for n in ranked[:5] + ([default] if default in mean and default not in ranked[:5] else []):
                per_t = " ".join(f"T{t}={us:.1f}" for t, us in sorted(ts[n].items()))
                tag = " (default)" if n == default else ""
                lines.append(f"S={S:<6} {impl:<11} {n:<32} mean {mean[n]:7.2f} us  {per_t}{tag}")
            if ranked:
                lines.append(f"S={S:<6} {impl:<11} BEST {ranked[0]}")
    return "\n".join(lines)


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB, read + write bytes per second (the ceiling the % columns use)."""
    from triton.testing import do_bench

    n = 1 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    del src, dst
    return 2 * n / ms * 1e3


def routing_sets(T: int, E: int, e_loc: int, n: int, g: torch.Generator) -> list[torch.Tensor]:
    """n routings [T, 8] (distinct random experts of E per token, as the router gives) mapped to this rank's
    experts [0, e_loc) (others -1); token 0 always has a local expert, so that every call computes one."""
    sets = []
    for _ in range(n):
        idx = torch.stack([torch.randperm(E, generator=g)[:8] for _ in range(T)])
        if not (idx[0] < e_loc).any():
            idx[0, 0] = torch.randint(0, e_loc, (1,), generator=g)
        sets.append(torch.where(idx < e_loc, idx, -1).int().to(DEV))
    return sets


def _expert_stack(n: int, I: int, D: int) -> list[torch.Tensor]:
    """n random experts' FP8 gate, up and down weights and scales, stacked: [w_gate, s_gate, w_up, s_up, w_down,
    s_down] as `moe_experts` takes them."""
    from mtp.model.fp8 import weight_quant

    ws = []
    for N, K in ((I, D), (I, D), (D, I)):
        parts = [weight_quant(torch.randn(N, K, device=DEV) * 0.02) for _ in range(n)]
        ws += [torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])]
        del parts
    return ws


def _expert_bytes(I: int, D: int) -> int:
    """One expert's gate + up + down FP8 weights and fp32 block scales."""
    return 3 * I * D + 3 * (I // 128) * (D // 128) * 4


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if DEV == "cuda" else 4


def _time_moe_variants(section: str, shape: str, variants, call, sets, ref, floor_us: float) -> dict:
    """Each (name, kwargs) of `variants` as call(routing, **kwargs): checked on sets[0] against `ref` (5% relative),
    then timed over every routing of `sets` in one graph; a config that does not compile is skipped, and said so.
    {name: us} of those timed."""
    res = {}
    for name, kw in variants:
        try:
            y = call(sets[0], **kw)
            err = ((y - ref).norm() / ref.norm()).item()
            us = graph_us([lambda s=s: call(s, **kw) for s in sets])
        except Exception as e:
            log(f"[{section}] {shape} {name} failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        check(f"moe_experts {shape} {name}", err < 0.05, f"rel err {err:.2e}")
        res[name] = us
        row(section, shape, name, us, pct_floor=round(100 * floor_us / us, 1), floor_us=round(floor_us, 2))
    return res


def moe_section(quick: bool, D: int = 7168, I: int = 2048, E: int = 256, ranks=((32, "TP=8"), (256, "TP=1"))):
    """moe_experts at one rank of TP=8 (32 local experts of 256) and at TP=1 (256), T = 1..4: the pairs layout
    (old) vs the persistent one (new), and a sweep of the new one's K slices and grid. Bytes: the distinct
    experts' gate + up + down FP8 weights and scales, over the measured copy bandwidth (% of the HBM floor).
    Routings rotate over 8 sets per graph, so each call reads other experts' weights (from HBM)."""
    from mtp.kernels.moe import default_splits, moe_experts, moe_experts_ref

    bw = copy_bandwidth()
    log(f"[bw] copy {bw / 1e9:.0f} GB/s")
    g = torch.Generator().manual_seed(0)
    expert_bytes = _expert_bytes(I, D)
    for e_loc, tag in ranks:
        if quick and e_loc == E:
            continue
        ws = _expert_stack(e_loc, I, D)
        for T in (1, 2, 3, 4):
            x = torch.randn(T, D, device=DEV).bfloat16()
            rw = torch.rand(T, 8, device=DEV)
            sets = routing_sets(T, E, e_loc, 8, g)
            active = sum(len(set(s[s >= 0].tolist())) for s in sets) / len(sets)
            floor_us = active * expert_bytes / bw * 1e6
            shape = f"{tag} T={T} ({active:.2f} experts)"
            ref = moe_experts_ref(x, sets[0], rw, *ws, out_dtype=torch.float32)
            variants = [("pairs (old)", dict(layout="pairs")), ("persistent (new)", dict(layout="persistent"))]
            if not quick:
                G, GI = D // 128, I // 128
                dflt = default_splits(T, G, GI)
                for sg in (4, 8, 14):
                    for sd in (1, 2, 4, 8):
                        if (sg, sd) != dflt:
                            variants.append((f"persistent splits=({sg},{sd})",
                                             dict(layout="persistent", splits=(sg, sd))))
                sm = _sms()
                variants += [("persistent 2/SM gu, 3 stages", dict(layout="persistent", programs=(2 * sm, 2 * sm),
                                                                   gate_up_stages=3)),
                             ("persistent 1/SM down", dict(layout="persistent", programs=(sm, sm)))]
            res = _time_moe_variants("moe", shape, variants, lambda s, **kw: moe_experts(
                x, s, rw, *ws, out_dtype=torch.float32, **kw), sets, ref, floor_us)
            if "pairs (old)" in res and "persistent (new)" in res:
                log(f"[moe] {shape}: speedup {res['pairs (old)'] / res['persistent (new)']:.2f}x")
        del ws
        torch.cuda.empty_cache()


def split_rank_cases(D: int, Is: int, E: int, world: int, slice_bytes: int, bw: float, ws):
    """One 'split' rank's experts call at T = 1..4 tokens (8 routed of E + the shared slice E per token): yields (T,
    x, xq, rw, sets, floor_us, shape, ref): x bf16 and xq = its (x8, sx) (the bits of the norm kernel's for the bf16
    y it stores, `norm_quant`), 8 routings `sets`, the floor of their distinct slices' bytes at the copy bandwidth
    bw, and the reference output on sets[0]."""
    from mtp.kernels.act_quant import act_quant
    from mtp.kernels.moe import moe_experts_ref

    g = torch.Generator().manual_seed(0)
    for T in (1, 2, 3, 4):
        x = torch.randn(T, D, device=DEV).bfloat16()
        xq = act_quant(x)
        rw = torch.rand(T, 8, device=DEV)
        sets = [torch.stack([torch.randperm(E, generator=g)[:8] for _ in range(T)]).int().to(DEV) for _ in range(8)]
        active = sum(len(set(s.flatten().tolist())) + 1 for s in sets) / len(sets)
        shared = torch.full((T, 1), E, dtype=torch.int32, device=DEV)
        ref = moe_experts_ref(x, torch.cat([sets[0], shared], 1), torch.cat([rw, torch.ones(T, 1, device=DEV)], 1),
                              *ws, out_dtype=torch.float32)
        yield (T, x, xq, rw, sets, active * slice_bytes / bw * 1e6, f"split TP={world} T={T} ({active:.1f} slices)",
               ref)


def moe_split_section(quick: bool, D: int = 7168, I: int = 2048, E: int = 256, world: int = 8):
    """moe_experts on one 'split' rank of TP=`world` (every expert at 1/world of its width, the shared expert
    stacked last and run as every token's implicit slot: `shared=True`), T = 1..4 tokens of 8 routed experts each:
    the pair grid, the persistent layout with `default_splits` and with `wave_splits` ('waves'), each with switch
    `moe_item_regs` (`moe_experts(item_regs=True)`, also with its next-item L2 prefetch; checked bit-equal to the
    switch off on every routing), with switch `moe_x8` ('x8': gate/up reads x quantized beforehand, `moe_experts(xq=)`,
    as the block's norm hands it; its quantization is not timed, the norm does it anyway; checked bit-equal to x
    quantized in the loop on every routing), with switch `moe_tma` ('tma': the weight tiles by TMA, on item_regs + x8;
    checked bit-equal to cp.async on every routing), and a sweep of the persistent K slices with and without them, so
    that each width's choice is a measurement (the step's gate/up + down + combine launches, one `moe_experts` call).
    Bytes: the distinct experts' slices (routed + shared) over the measured copy bandwidth. Routings rotate over 8
    sets per graph (other experts' weights each call, from HBM)."""
    from mtp.kernels.moe import default_splits, moe_experts, waves_for

    bw = copy_bandwidth()
    Is = I // world
    ws = _expert_stack(E + 1, Is, D)  # E routed + 1 shared slice, one stack
    sm = _sms()
    for T, x, xq, rw, sets, floor_us, shape, ref in split_rank_cases(D, Is, E, world, _expert_bytes(Is, D), bw, ws):
        waves = waves_for(T * 9, E + 1, D, Is, (sm, 2 * sm))  # what splits='waves' runs
        dflt = default_splits(T, D // 128, Is // 128)
        variants = [("pairs", dict(layout="pairs")),
                    (f"persistent default {dflt}", dict(layout="persistent")),
                    (f"persistent waves {waves}", dict(layout="persistent", splits="waves")),
                    # switch moe_item_regs (`moe_items`: no dependent load before an item's tiles), and without its
                    # next-item L2 prefetch: the same bits (checked below)
                    (f"item_regs waves {waves}", dict(layout="persistent", splits="waves", item_regs=True)),
                    (f"item_regs waves {waves} + next-pf", dict(layout="persistent", splits="waves", item_regs=True,
                                                                item_prefetch=True)),
                    (f"item_regs default {dflt}", dict(layout="persistent", item_regs=True)),
                    # switch moe_x8: gate/up on x8 / sx, no quantization in its K loop (the same bits, checked below)
                    (f"item_regs waves {waves} x8", dict(layout="persistent", splits="waves", item_regs=True, xq=xq)),
                    (f"persistent waves {waves} x8", dict(layout="persistent", splits="waves", xq=xq)),
                    # switch moe_tma: the weight tiles by TMA, beside the default it would replace (item_regs, x8;
                    # the same bits, checked below)
                    (f"item_regs waves {waves} x8 tma", dict(layout="persistent", splits="waves", item_regs=True,
                                                             xq=xq, tma=True))]
        if not quick:
            for sg in (2, 4, 7, 14, 28):
                for sd in (1, 2):
                    if (sg, sd) != waves:
                        variants.append((f"persistent splits=({sg},{sd})", dict(layout="persistent", splits=(sg, sd))))
                    variants.append((f"item_regs splits=({sg},{sd})", dict(layout="persistent", splits=(sg, sd),
                                                                          item_regs=True)))
                    # a K group costs fewer instructions with x8: the fastest slice count may move
                    variants.append((f"item_regs x8 splits=({sg},{sd})", dict(layout="persistent", splits=(sg, sd),
                                                                             item_regs=True, xq=xq)))
        call = lambda s, **kw: moe_experts(x, s, rw, *ws, out_dtype=torch.float32, shared=True, **kw)  # noqa: E731
        _time_moe_variants("moe_s", shape, variants, call, sets, ref, floor_us)
        same = all(torch.equal(call(s, layout="persistent", splits="waves", item_regs=True),
                               call(s, layout="persistent", splits="waves")) for s in sets)
        check(f"moe_experts {shape} item_regs bit-equal to off (waves, {len(sets)} routings)", same)
        for regs in (True, False):
            same = all(torch.equal(call(s, layout="persistent", splits="waves", item_regs=regs, xq=xq),
                                   call(s, layout="persistent", splits="waves", item_regs=regs)) for s in sets)
            check(f"moe_experts {shape} x8 bit-equal to x quantized in the loop (item_regs {'on' if regs else 'off'}, "
                  f"waves, {len(sets)} routings)", same)
        same = all(torch.equal(call(s, layout="persistent", splits="waves", item_regs=True, xq=xq, tma=True),
                               call(s, layout="persistent", splits="waves", item_regs=True, xq=xq)) for s in sets)
        check(f"moe_experts {shape} tma bit-equal to cp.async (item_regs, x8, waves, {len(sets)} routings)", same)
    del ws
    torch.cuda.empty_cache()


def knob_variants(sm: int, quick: bool) -> list[tuple[str, dict]]:
    """`moe_experts`' launch knobs for `moe_knobs_section`: the persistent kernels' warps (gate/up runs one program
    of 4 warps per SM, one warp per scheduler: Nsight Compute, session 17), pipeline stages, and the down kernel's
    grid. Session 18 (H200, BENCHMARKS.md) also timed down work items of 256 rows (two 128-row N-blocks an item, code
    not kept): none beat the default by more than the run-to-run spread at every width. 'tma': the weight tiles by
    TMA (`moe_experts(tma=True)`, switch moe_tma), alone and with other knobs."""
    # tma (switch moe_tma): the weight tiles by TMA; with 8 warps too (its K loops hold 90 / 46 fewer registers a
    # thread at one token, sm_90 code: gate/up 158, down 122)
    v = [("tma", dict(tma=True)), ("tma gu warps 8", dict(tma=True, warps=(8, 4))),
         ("gu warps 8", dict(warps=(8, 4))), ("gu stages 5", dict(gate_up_stages=5)),
         ("gu stages 6", dict(gate_up_stages=6)), ("gu warps 8 stages 5", dict(warps=(8, 4), gate_up_stages=5)),
         ("down warps 8", dict(warps=(4, 8))), ("down 3/SM 3 stages", dict(programs=(sm, 3 * sm), down_stages=3)),
         ("down 4/SM 2 stages", dict(programs=(sm, 4 * sm), down_stages=2))]
    if not quick:
        v += [("tma gu stages 5", dict(tma=True, gate_up_stages=5)),
          ("tma down 3/SM 3 stages", dict(tma=True, programs=(sm, 3 * sm), down_stages=3)),
          ("gu stages 3", dict(gate_up_stages=3)), ("gu warps 8 stages 6", dict(warps=(8, 4), gate_up_stages=6)),
              ("down 1/SM", dict(programs=(sm, sm))), ("down 2 stages", dict(down_stages=2)),
              ("down warps 8 3/SM 3 stages", dict(warps=(4, 8), programs=(sm, 3 * sm), down_stages=3))]
    return v


def moe_knobs_section(quick: bool, D: int = 7168, I: int = 2048, E: int = 256, world: int = 8):
    """The split rank's experts as the step runs them (`moe_split_section`'s stack and routings: item_regs, 'waves'
    slices, the shared slot, x8 (switch moe_x8, since session 18's end; session 18's h200a timed x quantized in the
    loop), PDL off) at T = 1..4, the default launch against each of `knob_variants`, every variant checked bit-equal
    (torch.equal) to the default on each of the 8 routings, then timed in one graph over them."""
    from mtp.kernels.moe import moe_experts

    Is = I // world
    ws = _expert_stack(E + 1, Is, D)
    sm = _sms()
    for T, x, xq, rw, sets, floor_us, shape, ref in split_rank_cases(D, Is, E, world, _expert_bytes(Is, D),
                                                                     copy_bandwidth(), ws):
        call = lambda s, **kw: moe_experts(x, s, rw, *ws, out_dtype=torch.float32, shared=True,  # noqa: E731
                                           layout="persistent", splits="waves", item_regs=True, xq=xq, **kw)
        base = [call(s) for s in sets]
        variants = [("default", {})]
        for name, kw in knob_variants(sm, quick):
            try:
                same = all(torch.equal(call(s, **kw), b) for s, b in zip(sets, base))
            except Exception as e:  # e.g. shared memory past the SM's for a stage count: said, not timed
                log(f"[moe_knobs] {shape} {name} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            check(f"moe_experts {shape} {name} bit-equal to the default ({len(sets)} routings)", same)
            if same:
                variants.append((name, kw))
        _time_moe_variants("moe_knobs", shape, variants, call, sets, ref, floor_us)
    del ws
    torch.cuda.empty_cache()


def down_nb_variants(quick: bool, tma: bool) -> list[tuple[str, dict]]:
    """`moe_experts(down_nb=True)`'s knobs for `moe_down_nb_section`: its tile (BN rows, K groups an iteration), its
    num_stages (the indirection halves the depth: (S + 1) // 2 buffers), TMA on / off."""
    from mtp.kernels.moe_down_nb import DEFAULT_STAGES, DOWN_NB_ROWS

    tiles = [(64, 2), (128, 2), (32, 2), (64, 1)] if quick else [(r, gu) for r in DOWN_NB_ROWS for gu in (2, 1)]
    v = [(f"down_nb {r}x{gu}", dict(down_nb=True, down_tile=(r, gu))) for r, gu in tiles]
    v += [(f"down_nb 64x2 stages {st}", dict(down_nb=True, down_tile=(64, 2), down_stages=st))
          for st in ((7, 9, 13) if quick else (5, 7, 9, 13, 15)) if st != DEFAULT_STAGES[2]]
    if tma:  # the default's tiles by TMA, so the other side: cp.async
        v += [(f"down_nb {r}x2 cp.async", dict(down_nb=True, down_tile=(r, 2), tma=False)) for r in (64, 128)]
    if not quick:
        v += [(f"down_nb {r}x2 stages {st}", dict(down_nb=True, down_tile=(r, 2), down_stages=st))
              for r in (32, 128) for st in (7, 9, 13)]  # 128 rows at 13: past the shared memory, said and skipped
    return v


def _kernel_us(call, sets) -> dict[str, float]:
    """Exposed us per call of each kernel of `call` over the routings `sets` (one graph of every call, profiled over 5
    replays: `mtp.bench.timing.kernel_profile`), by kernel name."""
    from mtp.bench.timing import kernel_profile
    from mtp.decode.graphs import capture_graph

    g = capture_graph(lambda: [call(s) for s in sets], warmup=1)
    prof = kernel_profile(g.replay, steps=5, top=20)
    del g
    return {r["name"]: r["exposed_us_per_step"] / len(sets) for r in prof["top"]}


def moe_down_nb_section(quick: bool, D: int = 7168, I: int = 2048, E: int = 256, world: int = 8):
    """The split rank's experts as the step runs them (`moe_split_section`'s stack and routings: item_regs, 'waves'
    slices, the shared slot, x8, TMA where the GPU has it; PDL off) at T = 1..4: gate/up + down + combine (the default)
    against gate/up + the down projection by output block (`moe_experts(down_nb=True)`, switch moe_down_nb:
    no combine) at each of `down_nb_variants`, every variant checked within fp32 reordering (1e-5 relative) of the
    default on each of the 8 routings, then timed in one graph over them; then each kernel's exposed us per call
    (`_kernel_us`: the old down + combine against the new down) for the default and down_nb at its default tile, and
    a token's row at T = 1 checked bit-equal to the same token's row at T = 4 (batch invariance) on the real shapes."""
    from mtp.kernels.moe import has_tma, moe_experts

    Is = I // world
    ws = _expert_stack(E + 1, Is, D)
    tma = has_tma(torch.device(DEV))
    rows = {}
    for T, x, xq, rw, sets, floor_us, shape, ref in split_rank_cases(D, Is, E, world, _expert_bytes(Is, D),
                                                                     copy_bandwidth(), ws):
        call = lambda s, **kw: moe_experts(x, s, rw, *ws, out_dtype=torch.float32, shared=True,  # noqa: E731
                                           layout="persistent", item_regs=True, xq=xq,
                                           **dict(dict(splits="waves", tma=tma), **kw))
        base = [call(s) for s in sets]
        variants = [("default (down + combine)", {})]
        for name, kw in down_nb_variants(quick, tma):
            try:
                err = max(((call(s, **kw) - b).norm() / b.norm()).item() for s, b in zip(sets, base))
            except Exception as e:  # e.g. shared memory past the SM's for a stage count: said, not timed
                log(f"[moe_down_nb] {shape} {name} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            check(f"moe_experts {shape} {name} within 1e-5 of the default ({len(sets)} routings)", err < 1e-5,
                  f"rel err {err:.2e}")
            variants.append((name, kw))
        _time_moe_variants("moe_down_nb", shape, variants, call, sets, ref, floor_us)
        for name, kw in (("default", {}), ("down_nb", dict(down_nb=True))):
            per = _kernel_us(lambda s, kw=kw: call(s, **kw), sets)
            rows[(T, name)] = per
            log(f"[moe_down_nb] {shape} {name} exposed us per call: " +
                ", ".join(f"{k[:40]} {v:.2f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1])))
            row("moe_dnb", shape, f"kernels {name}", sum(per.values()), kernels={k[:60]: round(v, 2)
                                                                                  for k, v in per.items()})
        if T == 4:  # batch invariance on the real shapes: each token alone = its row among the four
            s = sets[0]
            four = call(s, down_nb=True, splits=(2, 1))
            same = all(torch.equal(moe_experts(x[p:p + 1], s[p:p + 1], rw[p:p + 1], *ws, out_dtype=torch.float32,
                                               shared=True, layout="persistent", splits=(2, 1), item_regs=True,
                                               xq=tuple(t[p:p + 1] for t in xq), tma=tma, down_nb=True)[0], four[p])
                       for p in range(4))
            check(f"moe_experts {shape} down_nb: each token alone bit-equal to its row among 4", same)


BATCH_T = (1, 4, 8, 16, 32, 64, 96, 128, 256, 512, 1024, 4096)


def uniform_routing(T: int, E: int, e_loc: int, n: int, g: torch.Generator) -> list[torch.Tensor]:
    """n routings [T, 8]: 8 distinct experts of E per token, uniform (a random permutation's first 8), mapped to
    this rank's [0, e_loc) (others -1)."""
    sets = []
    for _ in range(n):
        idx = torch.rand(T, E, generator=g).argsort(dim=1)[:, :8]
        sets.append(torch.where(idx < e_loc, idx, -1).int().to(DEV))
    return sets


def reference_static(x, idx, rw, wg, sg, wu, su, wd, sd):
    """The reference routed sum as `MoE.routed` runs it on CUDA (the fast path's old fallback above 64 tokens):
    every local expert on every token, times its routing weight (0 where not chosen); no host sync."""
    from mtp.model.fp8 import fp8_gemm_ref

    T, E = x.shape[0], wg.shape[0]
    w_TE = torch.zeros(T, E + 1, device=x.device).scatter_(1, torch.where(idx >= 0, idx, E).long(), rw)[:, :E]
    x8, sx = act_quant_ref(x.float())
    y = torch.zeros(T, wd.shape[1], device=x.device)
    for e in range(E):
        h = torch.nn.functional.silu(fp8_gemm_ref(x8, sx, wg[e], sg[e])) * fp8_gemm_ref(x8, sx, wu[e], su[e])
        h8, sh = act_quant_ref(h)
        y += fp8_gemm_ref(h8, sh, wd[e], sd[e]) * w_TE[:, e:e + 1]
    return y


def moe_batch_section(quick: bool, E: int = 256, ranks=((32, "TP=8"), (256, "TP=1"))):
    """moe_experts at batch sizes T = 1 .. 4096, one rank of TP=8 (32 local experts, uniform routing over 256, the
    others' slots -1) and TP=1 (256): each layout that takes T (pairs and persistent up to their limits, grouped at
    every M-block, the reference static loop while T x E <= 8192), CUDA-graph replays rotating over 4 routings.
    Per row: us, GB/s of the distinct experts' weights touched (gate + up + down FP8 + scales), TFLOP/s of the
    routed pairs' useful math (3 x 2 x D x I per local pair), the HBM floor (those bytes over the measured copy
    bandwidth) and % of it. Checked: every variant against `moe_experts_ref` on the first 32 tokens (each token's
    result depends on its own routing only). Prints a summary table (us per layout) last."""
    from mtp.kernels.moe_grouped import BLOCK_MS

    bw = copy_bandwidth()
    log(f"[bw] copy {bw / 1e9:.0f} GB/s")
    g = torch.Generator().manual_seed(1)
    summary = []
    for e_loc, tag in ranks:
        if not (quick and e_loc == E):
            summary += _moe_batch_rank(quick, E, e_loc, tag, bw, g)
            torch.cuda.empty_cache()
    cols = ["persistent", "pairs", *[f"grouped bm={bm}" for bm in BLOCK_MS], "reference"]
    lines = [f"{'shape':<14} {'floor':>8} " + " ".join(f"{c.replace('grouped ', 'g '):>10}" for c in cols)]
    for shape, floor_us, best in summary:
        lines.append(f"{shape:<14} {floor_us:8.1f} " + " ".join(f"{best[c]:10.1f}" if c in best else f"{'-':>10}"
                                                              for c in cols))
    log("[moe_batch] us per call (floor: expert bytes / copy bandwidth)\n" + "\n".join(lines))


def _moe_batch_rank(quick: bool, E: int, e_loc: int, tag: str, bw: float, g: torch.Generator,
                    D: int = 7168, I: int = 2048) -> list[tuple[str, float, dict]]:
    """`moe_batch_section` for one rank of e_loc experts: (shape, floor us, {variant: us}) per T."""
    from mtp.kernels.moe import PAIRS_MAX_TOKENS, PERSISTENT_MAX_PAIRS, moe_experts, moe_experts_ref
    from mtp.kernels.moe_grouped import BLOCK_MS, default_block_m

    expert_bytes = _expert_bytes(I, D)
    ws = _expert_stack(e_loc, I, D)
    out = []
    for T in ((1, 16, 64, 128, 512) if quick else BATCH_T):
        x = torch.randn(T, D, device=DEV).bfloat16()
        rw = torch.rand(T, 8, device=DEV)
        sets = uniform_routing(T, E, e_loc, 4, g)
        active = sum(len(set(s[s >= 0].tolist())) for s in sets) / len(sets)
        pairs = sum(int((s >= 0).sum()) for s in sets) / len(sets)
        nbytes, flops = active * expert_bytes, pairs * 6 * D * I
        floor_us = nbytes / bw * 1e6
        shape = f"{tag} T={T}"
        variants = [(f"grouped bm={bm}", dict(layout="grouped", block_m=bm)) for bm in BLOCK_MS]
        if T <= PAIRS_MAX_TOKENS:
            variants.insert(0, ("pairs", dict(layout="pairs")))
        if T * 8 <= PERSISTENT_MAX_PAIRS:
            variants.insert(0, ("persistent", dict(layout="persistent")))
        n = min(T, 32)
        ref = moe_experts_ref(x[:n], sets[0][:n], rw[:n], *ws, out_dtype=torch.float32)
        best = {}
        for name, kw in variants:
            try:
                y = moe_experts(x, sets[0], rw, *ws, out_dtype=torch.float32, **kw)
                err = ((y[:n] - ref).norm() / ref.norm().clamp_min(1e-30)).item()
                us = graph_us([lambda s=s: moe_experts(x, s, rw, *ws, out_dtype=torch.float32, **kw) for s in sets])
            except Exception as e:  # a config that does not compile or fit is skipped
                log(f"[moe_batch] {shape} {name} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            check(f"moe_batch {shape} {name}", err < 0.05, f"rel err {err:.2e}")
            best[name] = us
            row("moe_b", shape, name, us, GBps=round(nbytes / us / 1e3, 1), TFLOPs=round(flops / us / 1e6, 1),
                floor_us=round(floor_us, 1), pct_floor=round(100 * floor_us / us, 1),
                default=name == f"grouped bm={default_block_m(T)}")
        if T * e_loc <= 8192:
            y = reference_static(x, sets[0], rw, *ws)[:n]
            err = ((y - ref).norm() / ref.norm().clamp_min(1e-30)).item()  # same formulas, batched GEMMs
            check(f"moe_batch {shape} reference (static loop)", err < 1e-2, f"rel err {err:.2e}")
            us = graph_us([lambda: reference_static(x, sets[0], rw, *ws)], reps=5)
            best["reference"] = us
            row("moe_b", shape, "reference (static loop)", us, floor_us=round(floor_us, 1),
                pct_floor=round(100 * floor_us / us, 1))
        out.append((shape, floor_us, best))
    return out


def table() -> str:
    lines = [f"{'section':<6} {'shape':<28} {'variant':<28} {'us':>9}  extra"]
    for r in ROWS:
        if any(m in r["variant"] for m in ("chunks=", "splits=", "/SM", "sweep ")):
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
    sections = [("topk", topk_section), ("topk1", one_launch_section), ("moe", moe_section),
                ("moe_batch", moe_batch_section), ("moe_split", moe_split_section),
                ("moe_knobs", moe_knobs_section), ("moe_down_nb", moe_down_nb_section)]
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
    report(out, ROWS, CHECKS, t0, os.path.join(args.out, "gpu_topk_moe.json"), table())


if __name__ == "__main__":
    main()
