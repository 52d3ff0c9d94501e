"""Check and time the Triton kernels of `mtp.kernels` on one GPU, in one run (device time is scarce).

    python -m mtp.bench.kernels [--out DIR] [--quick]

Prints one line per measurement, a table last (kernel, shape, us, GB/s, % of the measured copy bandwidth)
and writes everything as JSON to DIR/gpu_kernels.json (DIR: $OUT, else eval/results).
Timing: CUDA-graph replays (launch gaps removed, as in a captured decode step) timed with CUDA events,
median of 15; inputs rotate over enough copies to exceed 3x the L2 cache, so every byte comes from HBM.
Bytes counted are the fewest the op must move (each weight / cache byte read once).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

from mtp.model.fp8 import fp8_gemm_ref, weight_quant
from mtp.model.fp8 import act_quant as act_quant_ref
from mtp.decode.graphs import capture_graph
from mtp.kernels import available
from mtp.kernels.act_quant import act_quant
from mtp.kernels.fp8_gemm import default_plan, default_splits, fp8_linear
from mtp.kernels.indexer import indexer_scores, indexer_scores_ref, topk_from_scores
from mtp.kernels.mla_decode import mla_decode, mla_decode_ref
from mtp.kernels.moe import gate_logits, moe_experts, moe_experts_ref, moe_route, moe_route_ref

DEV = "cuda"
ROWS: list[dict] = []
CHECKS: list[dict] = []
COPY_BW = float("nan")
L2 = 50 << 20


def log(*a):
    print(*a, flush=True)


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check(name: str, ok: bool, detail: str):
    CHECKS.append(dict(name=name, ok=bool(ok), detail=detail))
    log(f"[check] {'PASS' if ok else 'FAIL'} {name}: {detail}")


def n_sets(bytes_per_set: int) -> int:
    return max(1, min(64, math.ceil(3 * L2 / max(1, bytes_per_set))))


def graph_us(fns, reps: int = 15) -> float:
    """Median microseconds per call: one graph calls every fn once (rotating inputs), replayed `reps` times."""
    calls = list(fns)
    while len(calls) < 8:
        calls = calls + list(fns)
    for f in fns:
        f()
    torch.cuda.synchronize()
    def run_all() -> None:
        for f in calls:
            f()

    g = capture_graph(run_all, warmup=1)
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / len(calls))
    del g
    return statistics.median(ts)


def row(kernel: str, shape: str, us: float, nbytes: float, **extra):
    gbs = nbytes / us / 1e3
    r = dict(kernel=kernel, shape=shape, us=round(us, 2), GBps=round(gbs, 1), pct_copy=round(100 * gbs / COPY_BW, 1), **extra)
    ROWS.append(r)
    log(f"[time] {kernel:<22} {shape:<34} {us:9.2f} us {gbs:8.1f} GB/s {r['pct_copy']:6.1f}% {extra if extra else ''}")
    return r


# ----------------------------------------------------------------------------- sections
def copy_bandwidth():
    global COPY_BW
    from triton.testing import do_bench

    n = 1 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    COPY_BW = 2 * n / ms / 1e6
    log(f"[bw] device copy {COPY_BW:.1f} GB/s (read + write, 1 GiB)")
    ms_r = do_bench(lambda: src.view(torch.int32).sum(dtype=torch.int32), warmup=50, rep=300, return_mode="median")
    rd = n / ms_r / 1e6
    row("copy (ceiling)", "1 GiB d2d", ms * 1e3, 2 * n)
    row("read (torch.sum)", "1 GiB", ms_r * 1e3, n)
    return dict(copy_GBps=COPY_BW, read_GBps=rd)


def act_quant_section():
    for M, K in [(8, 7168), (4096, 7168)]:
        x = torch.randn(M, K, device=DEV).bfloat16() * 3
        y8, s = act_quant(x)
        r8, rs = act_quant_ref(x)
        check(f"act_quant {M}x{K}", torch.equal(s, rs) and torch.equal(y8.view(torch.uint8), r8.view(torch.uint8)), "bit-exact")
        xs = [x.clone() for _ in range(n_sets(x.numel() * 3))]
        us = graph_us([lambda x=x: act_quant(x) for x in xs])
        row("act_quant", f"M={M} K={K} bf16", us, M * K * 3 + M * K // 32)


GEMV_SHAPES = [(18432, 7168), (7168, 18432), (2048, 7168), (576, 7168), (1536, 7168)]


def gemv_section(quick: bool):
    best = {}
    for N, K in GEMV_SHAPES:
        wbytes = N * K
        ws = [weight_quant(torch.randn(N, K, device=DEV) * 0.02) for _ in range(n_sets(wbytes))]
        w8, sw = ws[0]
        wb = [w8.float().bfloat16() for _ in range(n_sets(2 * wbytes))]  # the bf16 baseline's own weight copies
        Ms = [1, 4, 8] if quick else [1, 2, 4, 8, 16, 32, 64]
        for M in Ms:
            x = torch.randn(M, K, device=DEV).bfloat16()
            y = fp8_linear(x, w8, sw, out_dtype=torch.float32)
            x8, sx = act_quant_ref(x)
            err = rel_err(y, fp8_gemm_ref(x8, sx, w8, sw))
            check(f"fp8_linear M={M} {N}x{K}", err < 1e-3, f"rel err {err:.2e}")
            us = graph_us([lambda w=w, s=s: fp8_linear(x, w, s) for w, s in ws])
            plan = default_plan(M, N, K // 128, x.device)
            row("fp8_linear (ours)", f"M={M} N={N} K={K}", us, wbytes + N * K // 16384 * 4 + M * (K + N) * 2,
                floor_us=round(wbytes / COPY_BW / 1e3, 2), plan=f"bn{plan['bn']} s{plan['splits']} fuse={int(plan['fuse_quant'])}")
            us_b = graph_us([lambda w=w: torch.matmul(x, w.t()) for w in wb])
            row("torch bf16 matmul", f"M={M} N={N} K={K}", us_b, 2 * wbytes + M * (K + N) * 2)
            if M >= 16:  # where to stop fusing the activation quant: time the other choice too
                for fq in (True, False):
                    us = graph_us([lambda w=w, s=s: fp8_linear(x, w, s, fuse_quant=fq) for w, s in ws])
                    row(f"fp8_linear fuse={fq}", f"M={M} N={N} K={K}", us, wbytes)
        # launch-parameter sweep at M = 1 and 8: what the defaults leave on the table
        G = K // 128
        variants = [dict(bn=128, fuse_quant=False), dict(bn=128, fuse_quant=True), dict(bn=64, fuse_quant=False),
                    dict(bn=64, fuse_quant=True), dict(bn=128, fuse_quant=False, num_stages=4)]
        for M in ([1] if quick else [1, 8]):
            x = torch.randn(M, K, device=DEV).bfloat16()
            results = []
            for v in variants:
                d = default_splits(N, G, torch.device(DEV), v.get("bn", 128))
                for splits in sorted({d, min(G, 2 * d)}):
                    us = graph_us([lambda w=w, s=s: fp8_linear(x, w, s, splits=splits, **v) for w, s in ws])
                    results.append(dict(v, splits=splits, us=round(us, 2), pct_copy=round(100 * wbytes / us / 1e3 / COPY_BW, 1)))
            us = graph_us([lambda w=w, s=s: fp8_linear(x, w, s) for w, s in ws])
            results.append(dict(default_plan(M, N, G, torch.device(DEV)), us=round(us, 2), default=True))
            results.sort(key=lambda r: r["us"])
            best[f"M={M} N={N} K={K}"] = dict(sweep=results)
            log(f"[sweep] M={M} N={N} K={K}: best {results[0]}, 2nd {results[1]}, worst {results[-1]}")
        del ws, wb
        torch.cuda.empty_cache()
    return best


def gemm_large_section():
    N, K = 18432, 7168
    w8, sw = weight_quant(torch.randn(N, K, device=DEV) * 0.02)
    wb = w8.float().bfloat16()
    for M in [256, 2048]:
        x = torch.randn(M, K, device=DEV).bfloat16()
        y = fp8_linear(x, w8, sw, out_dtype=torch.float32)
        x8, sx = act_quant_ref(x)
        err = rel_err(y, fp8_gemm_ref(x8, sx, w8, sw))
        check(f"fp8_linear prefill M={M}", err < 1e-3, f"rel err {err:.2e}")
        flops = 2 * M * N * K
        us = graph_us([lambda: fp8_linear(x, w8, sw)])
        row("fp8_linear prefill", f"M={M} N={N} K={K}", us, N * K + M * K * 2 + M * N * 2, TFLOPs=round(flops / us / 1e6, 1))
        us = graph_us([lambda: torch.matmul(x, wb.t())])
        row("torch bf16 prefill", f"M={M} N={N} K={K}", us, 2 * N * K + M * K * 2 + M * N * 2, TFLOPs=round(flops / us / 1e6, 1))


def random_fp8(*shape):
    b = torch.randint(0, 256, shape, dtype=torch.uint8, device=DEV)
    b[(b & 0x7F) == 0x7F] = 0  # no NaN codes
    return b.view(torch.float8_e4m3fn)


def moe_section():
    E, D, I, J = 256, 7168, 2048, 8
    # routing
    wg = (torch.randn(E, D, device=DEV) * 0.02).bfloat16()
    bias = torch.randn(E, device=DEV) * 0.05
    for T in [1, 4, 64]:
        x = torch.randn(T, D, device=DEV).bfloat16()
        w, idx = moe_route(x, wg, bias)
        wr, ir = moe_route_ref(x, wg, bias)
        check(f"moe_route T={T}", (idx == ir).float().mean().item() > 0.99 and rel_err(w, wr) < 1e-3,
              f"idx agree {(idx == ir).float().mean().item():.4f}, w err {rel_err(w, wr):.1e}")
        us = graph_us([lambda: moe_route(x, wg, bias)])
        row("moe_route (2 kernels)", f"T={T} E={E} D={D}", us, E * D * 2 + T * D * 2)
        us = graph_us([lambda: gate_logits(x, wg)])
        row("moe gate_logits only", f"T={T} E={E} D={D}", us, E * D * 2 + T * D * 2)
    # experts at full width: 256 stacked experts, 8 routed per token
    wgt, wup, wdn = random_fp8(E, I, D), random_fp8(E, I, D), random_fp8(E, D, I)
    sg = torch.rand(E, I // 128, D // 128, device=DEV) * 1e-3
    su = torch.rand(E, I // 128, D // 128, device=DEV) * 1e-3
    sd = torch.rand(E, D // 128, I // 128, device=DEV) * 1e-3
    sweeps = {}
    for T in [1, 2, 3, 4, 8]:
        x = torch.randn(T, D, device=DEV).bfloat16()
        idx = torch.stack([torch.randperm(E, device=DEV)[:J] for _ in range(T)]).int()
        rw = torch.rand(T, J, device=DEV)
        U = idx.unique().numel()
        if T <= 2:
            y = moe_experts(x, idx, rw, wgt, sg, wup, su, wdn, sd, out_dtype=torch.float32)
            yr = moe_experts_ref(x, idx, rw, wgt, sg, wup, su, wdn, sd, out_dtype=torch.float32)
            # random-byte fp8 weights are heavy-tailed: a few h elements that land on an fp8 rounding boundary
            # move the output more than with Gaussian weights (tests/kernels/test_kernels_gpu.py holds those to 5e-3)
            check(f"moe_experts T={T} full width", rel_err(y, yr) < 2e-2, f"rel err {rel_err(y, yr):.2e}")
        nbytes = U * 3 * I * D
        if T in (1, 4):
            res = []
            for gs in (3, 4, 5):
                for ds in (3, 4, 5):
                    us = graph_us([lambda: moe_experts(x, idx, rw, wgt, sg, wup, su, wdn, sd, gate_up_stages=gs, down_stages=ds)])
                    res.append(dict(gate_up_stages=gs, down_stages=ds, us=round(us, 2)))
            res.sort(key=lambda r: r["us"])
            sweeps[f"T={T}"] = res
            log(f"[sweep] moe T={T}: best {res[0]}, worst {res[-1]}")
        us = graph_us([lambda: moe_experts(x, idx, rw, wgt, sg, wup, su, wdn, sd)])
        row("moe_experts", f"T={T} {U} experts D={D} I={I}", us, nbytes, floor_us=round(nbytes / COPY_BW / 1e3, 1))
    return sweeps


def mla_inputs(B, T, H, S):
    kv8, kvs = act_quant_ref(torch.randn(B, S, 512, device=DEV))
    pe = torch.randn(B, S, 64, device=DEV).bfloat16()
    q = (torch.randn(B, T, H, 512, device=DEV) * 0.05).bfloat16()
    qpe = (torch.randn(B, T, H, 64, device=DEV) * 0.05).bfloat16()
    return q, qpe, kv8, kvs, pe


MLA_CONFIGS = [dict(variant="fused", block_h=64, block_n=64, num_warps=8, num_stages=2),
               dict(variant="split4", block_h=64, block_n=32, num_warps=8, num_stages=2),
               dict(variant="fused", block_h=64, block_n=64, num_warps=8, num_stages=3),
               dict(variant="fused", block_h=64, block_n=128, num_warps=8, num_stages=1)]


def mla_case(B: int, T: int, H: int, S: int, J: int | None):
    """Inputs of one mla_decode case: q, q_pe, the cache (kv8, scales, pe), row lengths S - T, the top-J
    indices per query (None: dense), the keys read and the bytes moved."""
    q, qpe, kv8, kvs, pe = mla_inputs(B, T, H, S)
    lens = torch.full((B,), S - T, dtype=torch.int32, device=DEV)
    idx = None
    if J:
        idx = torch.stack([torch.randperm(S - T + t + 1, device=DEV)[:J] for t in range(T)]).int().view(B, T, J)
    keys = B * T * J if J else B * (S - T + 1)
    return q, qpe, kv8, kvs, pe, lens, idx, keys, keys * 656 + B * T * H * (576 + 512) * 2


def mla_section(quick: bool):
    H, B, scale = 128, 1, 0.1352 ** 2 * 192 ** -0.5
    cases = [(1, 4096, None), (2, 4096, None), (1, 32768, None), (2, 32768, None), (4, 32768, None), (1, 32768, 2048), (4, 32768, 2048)]
    best_cfg = {}
    for T, S, J in cases:
        q, qpe, kv8, kvs, pe, lens, idx, keys, nbytes = mla_case(B, T, H, S, J)
        flops = 2 * B * T * H * (J if J else S) * (576 + 512)
        ref = mla_decode_ref(q, qpe, kv8, kvs, pe, lens, scale, topk_idx=idx)
        sets = [mla_inputs(B, T, H, S)[2:] for _ in range(min(31, n_sets(keys * 656) - 1))]
        sets.insert(0, (kv8, kvs, pe))
        cfgs = MLA_CONFIGS if (not quick and T in (1, 4)) else MLA_CONFIGS[:2]
        res = []
        for cfg in cfgs:
            try:
                o = mla_decode(q, qpe, kv8, kvs, pe, lens, scale, topk_idx=idx, **cfg)
                err = rel_err(o, ref)
                us = graph_us([lambda s=s: mla_decode(q, qpe, *s, lens, scale, topk_idx=idx, **cfg) for s in sets])
            except Exception as e:  # a config that does not compile (registers, shared memory) is skipped
                log(f"[mla] config {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            check(f"mla_decode T={T} S={S} J={J} {cfg}", err < 1e-2, f"rel err {err:.2e}")
            res.append((us, cfg))
            log(f"[mla] T={T} S={S} J={J} {cfg}: {us:.1f} us")
        if not res:
            continue
        if T == 1 and (J or S == 4096):  # short work per row: how many KV slices pay off
            for sp in (8, 16, 32, 64):
                us = graph_us([lambda s=s: mla_decode(q, qpe, *s, lens, scale, topk_idx=idx, splits=sp) for s in sets])
                log(f"[mla-splits] T={T} S={S} J={J} splits={sp}: {us:.1f} us")
                best_cfg[f"splits T={T} S={S} J={J} ns={sp}"] = round(us, 2)
        us, cfg = min(res, key=lambda r: r[0])
        best_cfg[f"T={T} S={S} J={J}"] = cfg
        row("mla_decode" + (" sparse" if J else ""), f"B={B} T={T} H={H} S={S}" + (f" J={J}" if J else ""), us, nbytes,
            TFLOPs=round(flops / us / 1e6, 1), cfg=f"{cfg['variant']} h{cfg['block_h']}n{cfg['block_n']}w{cfg['num_warps']}s{cfg['num_stages']}")
        del sets
    return best_cfg


def mla_rank_section():
    """One TP=8 rank's 16 heads: the heads-per-program tile (16 = H rounded up, mma.sync; 32; 64 = the wgmma
    tile with 48 masked heads), dense at S = 1024 and with the top-k 2048 of S = 32768, T = 1..4, each
    checked against the fp32 reference. The fastest per case decides mla_decode.MIN_BLOCK_H."""
    H, B, scale = 16, 1, 0.1352 ** 2 * 192 ** -0.5
    best = {}
    for T, S, J in [(1, 1024, None), (2, 1024, None), (4, 1024, None), (1, 32768, 2048), (4, 32768, 2048)]:
        q, qpe, kv8, kvs, pe, lens, idx, keys, nbytes = mla_case(B, T, H, S, J)
        ref = mla_decode_ref(q, qpe, kv8, kvs, pe, lens, scale, topk_idx=idx)
        sets = [mla_inputs(B, T, H, S)[2:] for _ in range(min(31, n_sets(keys * 656) - 1))]
        sets.insert(0, (kv8, kvs, pe))
        res = {}
        for mbh in (16, 32, 64):
            try:
                o = mla_decode(q, qpe, kv8, kvs, pe, lens, scale, topk_idx=idx, min_block_h=mbh)
                err = rel_err(o, ref)
                us = graph_us([lambda s=s: mla_decode(q, qpe, *s, lens, scale, topk_idx=idx, min_block_h=mbh)
                               for s in sets])
            except Exception as e:  # a tile that does not compile is skipped
                log(f"[mla_rank] min_block_h={mbh} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            check(f"mla_decode H=16 T={T} S={S} J={J} min_block_h={mbh}", err < 1e-2, f"rel err {err:.2e}")
            res[mbh] = us
            row("mla_decode H=16" + (" sparse" if J else ""), f"T={T} S={S}" + (f" J={J}" if J else "")
                + f" heads/program {mbh}", us, nbytes)
        if res:
            best[f"T={T} S={S} J={J}"] = dict(us={k: round(v, 2) for k, v in res.items()}, best=min(res, key=res.get))
        del sets
    return best


def indexer_section():
    H, D, B = 64, 128, 1
    for T, S in [(1, 4096), (1, 32768), (4, 32768)]:
        q8, qs = act_quant_ref(torch.randn(B, T, H, D, device=DEV))
        qs = qs[..., 0]
        w = torch.randn(B, T, H, device=DEV) * 0.01
        lens = torch.full((B,), S - T, dtype=torch.int32, device=DEV)
        sets = []
        for _ in range(n_sets(S * 132)):
            k8, ks = act_quant_ref(torch.randn(B, S, D, device=DEV))
            sets.append((k8, ks[..., 0]))
        sc = indexer_scores(q8, qs, w, *sets[0], lens)
        ref = indexer_scores_ref(q8, qs, w, *sets[0], lens)
        fin = torch.isfinite(ref)
        err = ((sc[fin] - ref[fin]).abs().max() / ref[fin].abs().max()).item()
        check(f"indexer T={T} S={S}", err < 1e-3 and torch.equal(fin, torch.isfinite(sc)), f"max err {err:.1e}")
        us = graph_us([lambda s=s: indexer_scores(q8, qs, w, *s, lens) for s in sets])
        row("indexer_scores", f"B={B} T={T} H={H} S={S}", us, B * S * (D + 4) + B * T * S * 4)
        for srt in (False, True):
            us = graph_us([lambda: topk_from_scores(sc, 2048, sorted=srt)])
            row(f"indexer topk sorted={srt}", f"B={B} T={T} S={S} k=2048", us, B * T * S * 4)


def kernel_resources() -> list[dict]:
    """Registers, spills, shared memory and the instructions that matter, for every compiled variant."""
    import mtp.kernels.act_quant as aq
    import mtp.kernels.fp8_gemm as fg
    import mtp.kernels.indexer as ix
    import mtp.kernels.mla_decode as ml
    import mtp.kernels.moe as mo

    fns = [aq._act_quant_kernel, fg._gemv_kernel, fg._gemm_kernel, mo._gate_logits_kernel,
           mo._route_kernel, mo._moe_gate_up_kernel, mo._moe_down_kernel, mo._moe_combine_kernel, ml._mla_stage1,
           ml._mla_stage1_fused,
           ml._mla_stage2, ix._indexer_kernel]
    out = []
    for fn in fns:
        try:
            for dev_cache in fn.device_caches.values():
                for k in dev_cache[0].values():
                    ptx = k.asm.get("ptx", "")
                    r = dict(kernel=fn.__name__, regs=k.n_regs, spills=k.n_spills, shared=k.metadata.shared,
                             warps=k.metadata.num_warps, stages=k.metadata.num_stages,
                             wgmma=ptx.count("wgmma.mma_async"), mma_sync=ptx.count("mma.sync"),
                             cp_async=ptx.count("cp.async"), ld_v4=ptx.count("ld.global.v4"),
                             tma=ptx.count("cp.async.bulk.tensor"))
                    out.append(r)
                    log(f"[res] {r}")
        except Exception as e:  # the cache layout is a Triton internal
            log(f"[res] {fn.__name__}: {type(e).__name__}: {e}")
    return out


def table():
    lines = [f"{'kernel':<22} {'shape':<34} {'us':>9} {'GB/s':>8} {'%copy':>6}  extra"]
    for r in ROWS:
        extra = {k: v for k, v in r.items() if k not in ("kernel", "shape", "us", "GBps", "pct_copy")}
        lines.append(f"{r['kernel']:<22} {r['shape']:<34} {r['us']:9.2f} {r['GBps']:8.1f} {r['pct_copy']:6.1f}  {extra if extra else ''}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT") or "eval/results")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and no launch sweeps")
    ap.add_argument("--only", default="", help="comma list of sections: bw,act,gemv,gemm,moe,mla,indexer "
                                               "(and mla_rank: one TP=8 rank's 16 heads, not in the default set)")
    args = ap.parse_args()
    if not available():
        sys.exit("gpu_kernels: needs triton and a CUDA device")
    global L2
    props = torch.cuda.get_device_properties(0)
    L2 = getattr(props, "L2_cache_size", L2)
    import triton

    meta = dict(device=props.name, sms=props.multi_processor_count, l2_bytes=L2, torch=torch.__version__,
                triton=triton.__version__, date=time.strftime("%Y-%m-%d %H:%M"))
    log(f"[env] {meta}")
    torch.manual_seed(0)
    only = set(args.only.split(",")) if args.only else {"bw", "act", "gemv", "gemm", "moe", "mla", "indexer"}
    out = dict(meta=meta)
    t0 = time.time()
    out["bandwidth"] = copy_bandwidth()  # always: every % below is relative to it
    sections = [("act", act_quant_section), ("gemv", lambda: gemv_section(args.quick)), ("gemm", gemm_large_section),
                ("moe", moe_section), ("mla", lambda: mla_section(args.quick)), ("indexer", indexer_section),
                ("mla_rank", mla_rank_section)]
    run_sections(sections, only, out)
    out["resources"] = kernel_resources()
    finish(out, t0, os.path.join(args.out, "gpu_kernels.json"))


def run_sections(sections, only: set, out: dict) -> None:
    """Run each (name, fn) named in `only` into out[name]; a failing section is recorded, the others still run."""
    for name, fn in sections:
        if name not in only:
            continue
        t = time.time()
        try:
            out[name] = fn()
        except Exception as e:  # keep the other sections' numbers
            import traceback

            traceback.print_exc()
            out[name] = dict(error=f"{type(e).__name__}: {e}")
            check(f"section {name}", False, f"{type(e).__name__}: {str(e)[:300]}")
        log(f"[section] {name} took {time.time() - t:.1f} s")
        torch.cuda.empty_cache()


def finish(out: dict, t0: float, path: str) -> None:
    """`report` with this module's rows, checks and table."""
    report(out, ROWS, CHECKS, t0, path, table())


def report(out: dict, rows: list, checks: list, t0: float, path: str, table_text: str) -> None:
    """Write the run's JSON (out + rows + checks + wall time) to path, then print the failed checks and the table."""
    out["rows"], out["checks"] = rows, checks
    out["wall_s"] = round(time.time() - t0, 1)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    n_fail = sum(not c["ok"] for c in checks)
    log(f"\nchecks: {len(checks) - n_fail} passed, {n_fail} failed; wall {out['wall_s']} s")
    for c in checks:
        if not c["ok"]:
            log(f"  FAIL {c['name']}: {c['detail']}")
    log(table_text)


if __name__ == "__main__":
    main()
