"""Time the fused decode kernels against the current path at TP=8 per-rank shapes, in one device call.

    python -m mtp.bench.fused [--out DIR] [--only gemv,norm,router,step,index_weights] [--quick] [--gemv-tp 8,1]
                              [--sweep]

Sections (each new kernel next to what the fast path ran before it, same process, same inputs):
- gemv: on every GEMV weight of a TP=8 rank and of TP=1 full width (`--gemv-tp 8,1`), rows 1..8, x pre-quantized:
  the old tensor-core kernel (`fp8_gemm.fp8_gemm`: wgmma, swap-AB, pipelined K loop) vs the split-K GEMV on CUDA
  cores (`gemv_splitk.fp8_gemv`) vs the same on tensor cores (`fp8_gemv(mma=True)`); prints a table (us and % of
  copy bandwidth per shape x M x kernel) and the winner per M and weight size (the rule for a per-M choice);
  `--sweep`: at M = 1 and 4 on the rank also x quantized in the kernel, a PDL chain, and a tile sweep;
- norm: residual add + RMSNorm + quant in one kernel vs the old step (cast + add, compiled RMSNorm, act_quant);
- router: `router.moe_route_fused` (impl "serial"; "grouped" at 4, 8, 16 warps; "one" at 4, 8, and at 8 with its
  routing split over its last programs, `split_tail`) vs `moe.moe_route`, E = 256, D = 7168, T = 1..5, 8, 64
  (`--only router`);
- prologue: `mla_prologue` (2 kernels) vs the unfused MLA prologue steps, and `absorb` vs the two einsums, one
  rank's 16 heads;
- index_weights: the indexer's head weights in one launch (`index_weights`) vs the cuBLAS GEMM + scale it replaced,
  rows 1..64, with the kernels per call of each (`mtp.bench.index_weights`); `--sweep`: also its tiles;
- step: one rank of TP=8 (rank 0 of a one-process "world" of 8 whose collectives are the identity, so they are
  excluded as in the issue's measurement), 1 dense + 2 MoE layers at real width, FP8 random weights, 1024-token
  prompt; the captured target forward at widths 1..4 with each switch of the model's `FastPathOptions` alone,
  all off (the old fast path) and all on, and the kernel count per step (torch profiler over graph replays).
A full run compiles ~150 kernel variants (each GEMV tile / row count / PDL choice is its own binary) and
builds a 3-layer rank model: if one 10-minute device call is too short, run `--only gemv,norm,router,prologue`
and `--only step` as two calls (or `--quick`).
Timing: CUDA-graph replays (launch gaps removed, as in a captured step), CUDA events, median of 15; kernel inputs
rotate over copies exceeding 3x the L2 so weights come from HBM (`mtp.bench.kernels`' method). Prints one line
per measurement and a table last; writes DIR/gpu_fused.json (DIR: $OUT, else eval/results).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from mtp.bench import kernels as gk  # copy bandwidth, graph timing, rows and checks
from mtp.bench.index_weights import index_weights_section
from mtp.model.fp8 import act_quant as act_quant_ref
from mtp.model.fp8 import fp8_gemm_ref, weight_quant
from mtp.kernels import available
from mtp.kernels.act_quant import act_quant
from mtp.kernels.fp8_gemm import fp8_gemm
from mtp.kernels.gemv_splitk import fp8_gemv, gemv_plan
from mtp.kernels.moe import moe_route, moe_route_ref
from mtp.kernels.norm_quant import add_rms_norm_quant, add_rms_norm_quant_ref
from mtp.kernels.router import GROUPED_MAX_TOKENS, ONE_MAX_TOKENS, moe_route_fused
from mtp.parallel.comm import Comm

DEV = "cuda"
# (name, N, K, calls per MoE layer at TP=8) -- per rank: 16 heads, 32 experts, shared expert 2 blocks of 128
RANK_GEMVS = [("q_a|wk|kv_a", 2240, 7168, 1), ("q_b|wq_b", 16 * 192 + 64 * 128, 1536, 1), ("o_proj", 7168, 2048, 1),
              ("shared gate|up", 512, 7168, 1), ("shared down", 7168, 256, 1),
              ("dense gate|up", 4608, 7168, 0), ("dense down", 7168, 2304, 0)]
# (name, N, K) at TP=1 full width (q_a|wk|kv_a is replicated: the rank's shape): 128 heads; the dense MLP's and
# the shared expert's gate | up stacked (`fuse_rows`); the shared (= one expert's) down
TP1_GEMVS = [("q_b|wq_b", 128 * 192 + 64 * 128, 1536), ("o_proj", 7168, 128 * 128), ("dense gate|up", 2 * 18432, 7168),
             ("dense down", 7168, 18432), ("shared gate|up", 2 * 2048, 7168), ("shared down", 7168, 2048)]
GEMV_KERNELS = ("old", "fma", "mma")  # fp8_gemm.fp8_gemm (wgmma, swap-AB) / fp8_gemv (CUDA cores) / fp8_gemv mma


def _gemv_calls(kernel: str, xq, pdl: bool = False):
    """One call of a GEMV kernel on the pre-quantized rows xq (what the fused norm hands over), bf16 out."""
    if kernel == "old":
        return lambda w, s: fp8_gemm(*xq, w, s, out_dtype=torch.bfloat16)
    return lambda w, s: fp8_gemv(None, w, s, xq=xq, out_dtype=torch.bfloat16, mma=kernel == "mma", pdl=pdl)


def gemv_section(quick: bool, tps: tuple[int, ...] = (8, 1), sweep: bool = False) -> dict:
    """old vs fma vs mma on every GEMV shape of a TP=8 rank and of TP=1, rows 1..8, then the table and the rule
    they imply (`gemv_table`). With sweep also, at M = 1 and 4 on the rank's shapes, x quantized in the kernel
    and a PDL chain, and a tile sweep of both new kernels on the MoE layer's GEMVs (each variant compiles: the
    sweep does not fit the same 10-minute call as both TPs)."""
    out = {}
    Ms = [1, 2, 4, 8] if quick else list(range(1, 9))
    shapes = ([("TP8", n, N, K) for n, N, K, _ in RANK_GEMVS] if 8 in tps else []) + \
             ([("TP1", n, N, K) for n, N, K in TP1_GEMVS] if 1 in tps else [])
    for tp, name, N, K in shapes:
        ws = [weight_quant(torch.randn(N, K, device=DEV) * 0.02) for _ in range(gk.n_sets(N * K))]
        w8, sw = ws[0]
        nbytes = N * K + -(-N // 128) * (K // 128) * 4  # fp8 weight + fp32 block scales
        for M in Ms:
            x = torch.randn(M, K, device=DEV).bfloat16()
            xq = act_quant(x)
            ref = fp8_gemm_ref(*act_quant_ref(x), w8, sw)
            res = {}
            for kern in GEMV_KERNELS:
                y = fp8_gemm(*xq, w8, sw) if kern == "old" else fp8_gemv(None, w8, sw, xq=xq, mma=kern == "mma")
                err = gk.rel_err(y, ref)
                tol = 1e-4 if kern == "fma" else 1e-3  # the MMAs sum a group in their own order (test_kernels)
                gk.check(f"gemv {kern} {tp} {name} M={M}", err < tol, f"rel err {err:.2e}")
                call = _gemv_calls(kern, xq)
                res[kern] = gk.graph_us([lambda w=w, s=s, c=call: c(w, s) for w, s in ws])
                gk.row(f"gemv {kern}", f"{tp} {name} M={M} {N}x{K}", res[kern], nbytes)
            if sweep and tp == "TP8" and M in (1, 4):
                for kern in ("fma", "mma"):
                    res[f"{kern} x in kernel"] = gk.graph_us(
                        [lambda w=w, s=s, mma=kern == "mma": fp8_gemv(x, w, s, mma=mma) for w, s in ws])
                    try:  # a chain of PDL launches: each GEMV requests its weights while the previous one finishes
                        res[f"{kern} pdl chain"] = gk.graph_us([lambda w=w, s=s, c=_gemv_calls(kern, xq, True): c(w, s)
                                                                for w, s in ws])
                    except Exception as e:  # PDL in graph capture unsupported here: record, go on
                        gk.log(f"[gemv] pdl failed: {type(e).__name__}: {str(e)[:200]}")
                        res[f"{kern} pdl chain"] = float("nan")
                    for k_ in (f"{kern} x in kernel", f"{kern} pdl chain"):
                        gk.row(f"gemv {k_}", f"{tp} {name} M={M} {N}x{K}", res[k_], nbytes)
            out[f"{tp} {name} M={M}"] = dict(res, N=N, K=K, M=M, bytes=nbytes, tp=tp, name=name,
                                             plan_fma=gemv_plan(N, K // 128, x.device),
                                             plan_mma=gemv_plan(N, K // 128, x.device, mma=True))
        if sweep and tp == "TP8" and name in ("q_a|wk|kv_a", "o_proj", "shared gate|up"):
            for kern, M in (("fma", 1), ("mma", 4)):
                xq = act_quant(torch.randn(M, K, device=DEV).bfloat16())
                res = []
                for bn in (8, 16, 32, 64):
                    for gps in (2, 4, 8):
                        if (K // 128) % gps or (kern == "mma" and bn < 16) or (kern == "fma" and bn > 32):
                            continue
                        mma = kern == "mma"
                        t = gk.graph_us([lambda w=w, s=s: fp8_gemv(None, w, s, xq=xq, bn=bn, gps=gps, mma=mma)
                                         for w, s in ws])
                        res.append(dict(bn=bn, gps=gps, us=round(t, 2)))
                res.sort(key=lambda r: r["us"])
                out[f"sweep {kern} {name} M={M}"] = res
                gk.log(f"[sweep] {kern} {name} M={M}: best {res[:3]}, worst {res[-1]}")
        del ws
        torch.cuda.empty_cache()
    out["table"], out["rule"] = gemv_table(out)
    gk.log(out["table"])
    gk.log(out["rule"])
    return out


def gemv_table(res: dict) -> tuple[str, str]:
    """The compact table (us and % of copy bandwidth, shape x M x kernel) and, per row count, the winner on each
    weight in order of size: the rule for a per-M, per-size choice of kernel."""
    cells = [r for r in res.values() if isinstance(r, dict) and "bytes" in r]
    if not cells:
        return "", ""
    Ms = sorted({r["M"] for r in cells})
    shapes = list(dict.fromkeys((r["tp"], r["name"], r["N"], r["K"], r["bytes"]) for r in cells))
    by = {(r["tp"], r["name"], r["M"]): r for r in cells}
    lines = ["GEMV us (% of copy bandwidth), x pre-quantized, bf16 out; * = fastest of the three",
             f"{'shape':<34} {'kernel':<4} " + " ".join(f"{'M=' + str(m):>12}" for m in Ms)]
    for tp, name, N, K, nb in shapes:
        for kern in GEMV_KERNELS:
            row = []
            for m in Ms:
                r = by[tp, name, m]
                us = r[kern]
                best = min(r[k] for k in GEMV_KERNELS)
                pct = 100 * nb / us / 1e3 / gk.COPY_BW
                row.append(f"{us:6.2f} ({pct:3.0f}){'*' if us == best else ' '}")
            label = f"{tp} {name} {N}x{K}" if kern == "old" else ""
            lines.append(f"{label:<34} {kern:<4} " + " ".join(f"{c:>12}" for c in row))
    rule = ["Winner per M, weights in order of size (MB); kernels within 3% of the fastest all named:"]
    for m in Ms:
        parts = []
        for tp, name, N, K, nb in sorted(shapes, key=lambda s: s[4]):
            r = by[tp, name, m]
            best = min(r[k] for k in GEMV_KERNELS)
            win = "/".join(k for k in GEMV_KERNELS if r[k] <= best * 1.03)
            parts.append(f"{tp} {name} {nb / 2**20:.1f}: {win}")
        rule.append(f"  M={m}: " + "; ".join(parts))
    return "\n".join(lines), "\n".join(rule)


def norm_section() -> dict:
    from mtp.model.layers import compiled_ops

    elementwise = compiled_ops()  # the old step's compiled RMSNorm
    out = {}
    D = 7168
    w = (torch.rand(D, device=DEV) + 0.5).bfloat16()
    for M in (1, 4):
        h = torch.randn(M, D, device=DEV)
        d = torch.randn(M, D, device=DEV).bfloat16()
        hn, y, x8, sx = add_rms_norm_quant(h, d, w, 1e-6)
        rh, ry, _, _ = add_rms_norm_quant_ref(h, d, w, 1e-6)
        k8, ks = act_quant_ref(y)
        ok = torch.equal(hn, rh) and torch.equal(sx, ks) and torch.equal(x8.view(torch.uint8), k8.view(torch.uint8))
        gk.check(f"add_rms_norm_quant M={M}", ok and (y.float() - ry.float()).abs().max().item() <= ry.float().abs().max().item() * 2 ** -7,
                 "h bit-equal, quant bit-exact, y within a bf16 ulp")

        def old():
            h2 = h + d.to(h.dtype)
            yy = elementwise.rms_norm(h2, w, 1e-6, torch.bfloat16)
            return act_quant(yy)

        t_old = gk.graph_us([old])
        t_old_noq = gk.graph_us([lambda: elementwise.rms_norm(h + d.to(h.dtype), w, 1e-6, torch.bfloat16)])
        t_new = gk.graph_us([lambda: add_rms_norm_quant(h, d, w, 1e-6)])
        qa = torch.randn(M, 1536, device=DEV).bfloat16()
        wq = w[:1536]
        t_qa_old = gk.graph_us([lambda: elementwise.rms_norm(qa, wq, 1e-6, torch.bfloat16)])
        t_qa_new = gk.graph_us([lambda: add_rms_norm_quant(qa, None, wq, 1e-6, store_y=False)])
        for k_, t in (("old: cast+add, norm, act_quant", t_old), ("old: cast+add, norm", t_old_noq),
                      ("new: add+norm+quant", t_new), ("q_a norm old", t_qa_old), ("q_a norm+quant new", t_qa_new)):
            gk.row(k_, f"M={M} D={D if 'q_a' not in k_ else 1536}", t, M * D * 11)
        out[f"M={M}"] = dict(old_us=t_old, old_without_quant_us=t_old_noq, new_us=t_new, qa_old_us=t_qa_old,
                             qa_new_us=t_qa_new)
    return out


def router_section() -> dict:
    out = {}
    E, D = 256, 7168
    wg = (torch.randn(E, D, device=DEV) * 0.02).bfloat16()
    bias = torch.randn(E, device=DEV) * 0.05
    for T in (1, 2, 3, 4, 5, 8, 64):
        x = torch.randn(T, D, device=DEV).bfloat16()
        wr, ir = moe_route_ref(x, wg, bias)
        t = {"old (2 launches)": gk.graph_us([lambda: moe_route(x, wg, bias)])}
        # (impl, warps, split_tail): impl one's routing in its last program, or split over its last T to arrive
        variants = [("serial", 4, False)] + (
            [("grouped", nw, False) for nw in (4, 8, 16)] if T <= GROUPED_MAX_TOKENS else []) + (
            [("one", 4, False), ("one", 8, False), ("one", 8, True)] if T <= ONE_MAX_TOKENS else [])
        for impl, nw, split in variants:
            name = f"{impl} split" if split else impl
            w, idx = moe_route_fused(x, wg, bias, impl=impl, num_warps=nw, split_tail=split)
            agree = (idx == ir).float().mean().item()
            ok = agree > 0.99 and gk.rel_err(w, wr) < 1e-3
            if split:  # the unsplit tail's bits
                ok = ok and all(torch.equal(a, b) for a, b in zip(
                    (w, idx), moe_route_fused(x, wg, bias, impl=impl, num_warps=nw)))
            gk.check(f"moe_route_fused {name} {nw} warps T={T}", ok, f"idx agree {agree:.4f}")
            t[f"1 launch, {name}, {nw} warps"] = gk.graph_us(
                [lambda impl=impl, nw=nw, split=split: moe_route_fused(x, wg, bias, impl=impl, num_warps=nw,
                                                                       split_tail=split)])
        for k_, us in t.items():
            gk.row(f"router {k_}", f"T={T} E={E} D={D}", us, E * D * 2)
        out[f"T={T}"] = t
    return out


def prologue_section() -> dict:
    """The MLA prologue of one TP=8 rank (16 heads): two kernels vs the unfused steps they replace."""
    import dataclasses

    from mtp.model.attention import MLA
    from mtp.model.cache import KVCache
    from mtp.kernels.absorb import absorb_out, absorb_out_ref, absorb_q, absorb_q_ref
    from mtp.kernels.mla_prologue import mla_kv_prologue, mla_kv_prologue_ref, mla_q_prologue, mla_q_prologue_ref
    from mtp.model.layers import Rotary, compiled_ops, use_elementwise
    from mtp.model.presets import real_config

    cfg = dataclasses.replace(real_config(layers=1, dense_layers=1, mtp_modules=0), num_attention_heads=16)
    with torch.device(DEV):
        mla = MLA(cfg, torch.bfloat16)
    use_elementwise(mla, compiled_ops())  # the unfused steps as the fast path ran them: compiled
    mla.indexer.k_norm.weight.data.fill_(1.0)
    mla.indexer.k_norm.bias.data.zero_()
    mla.kv_a_layernorm.weight.data.fill_(1.0)
    out = {}
    for T in (1, 4):
        Q, C, R = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        a = torch.randn(1, T, Q + 128 + C + R, device=DEV).bfloat16()
        qq = torch.randn(1, T, 16 * 192 + 64 * 128, device=DEV).bfloat16()
        pos = torch.arange(T, device=DEV)[None] + 100
        cos, sin = Rotary(cfg).to(DEV).angles(pos)
        cache = KVCache(cfg, 1, 1, 256, device=DEV, dtype=torch.bfloat16, quantized=True).layer(0)
        q_nope = qq[..., :16 * 192].view(1, T, 16, 192)[..., :128]
        o_lat = torch.randn(1, T, 16, 512, device=DEV).bfloat16()
        wkb = (torch.randn(16, 128, 512, device=DEV) * 0.05).bfloat16()
        t = {"absorb q old": gk.graph_us([lambda: absorb_q_ref(q_nope, wkb)]),
             "absorb q new": gk.graph_us([lambda: absorb_q(q_nope, wkb)]),
             "absorb out old": gk.graph_us([lambda: absorb_out_ref(o_lat, wkb)]),
             "absorb out new": gk.graph_us([lambda: absorb_out(o_lat, wkb)]),
             "kv old": gk.graph_us([lambda: mla_kv_prologue_ref(mla, cache, pos, a, cos, sin)]),
             "kv new": gk.graph_us([lambda: mla_kv_prologue(mla, cache, pos, a, cos, sin)]),
             "q old": gk.graph_us([lambda: mla_q_prologue_ref(mla, qq, cos, sin)]),
             "q new": gk.graph_us([lambda: mla_q_prologue(mla, qq, cos, sin)])}
        for k_, v in t.items():
            gk.row(f"mla {k_}", f"T={T} H=16 Hi=64", v, 1)
        out[f"T={T}"] = t
    return out


class _LocalComm(Comm):
    """Rank 0 of a world of `world` without a process group: collectives are the identity (excluded from the
    measurement, as in the issue's TP=8 rank numbers); all_gather_last returns the local part."""

    def __init__(self, world: int):
        self.group, self.rank, self.world = None, 0, world

    def all_reduce(self, t):
        return t

    def all_gather_last(self, t, out_dtype=None):
        return t.to(out_dtype or t.dtype)


def step_section(quick: bool) -> dict:
    from mtp.backends.fast_path import enable_fast_path, set_kernels
    from mtp.decode.graphs import capture_graph
    from mtp.parallel.layout import ParallelPlan
    from mtp.parallel.synthetic import random_parallel_model
    from mtp.model.presets import real_config
    from mtp.bench.timing import kernel_profile, time_ms

    cfg = real_config(layers=3, dense_layers=1, mtp_modules=0)
    t0 = time.time()
    model = random_parallel_model(cfg, _LocalComm(8), ParallelPlan(world=8), device=DEV, dtype=torch.bfloat16)
    enable_fast_path(model)
    gk.log(f"[step] built the TP=8 rank model in {time.time() - t0:.1f} s, {torch.cuda.memory_allocated() / 2**30:.1f} GiB")
    L = 1024
    ids = torch.randint(0, cfg.vocab_size, (1, L + 4), device=DEV, generator=torch.Generator(device=DEV).manual_seed(0))
    kv = model.new_cache(1, L + 16)
    with torch.no_grad():
        model(ids[:, :L], kv)
    base = kv.seq_lens.clone()
    off = dict(gemv=False, norm_quant=False, router=False, prologue=False, absorb=False)
    on = dict(gemv=True, norm_quant=True, router=True, prologue=True, absorb=True)
    variants = [("old (all off)", off), ("gemv", dict(off, gemv=True)), ("norm_quant", dict(off, norm_quant=True)),
                ("router", dict(off, router=True)), ("prologue", dict(off, prologue=True)),
                ("absorb", dict(off, absorb=True)), ("new (all on)", on), ("new + pdl", dict(on, pdl=True))]
    if quick:
        variants = [variants[0], variants[-2], variants[-1]]
    out = {}
    for w in ((1, 4) if quick else (1, 2, 3, 4)):
        blk = ids[:, L:L + w]

        def fwd():
            kv.truncate(base)
            return model(blk, kv, kv_len=L + w + 8)

        res = {}
        logits = {}
        for name, sw in variants:
            set_kernels(model, **dict(dict(pdl=False), **sw))
            try:
                with torch.no_grad():
                    logits[name] = fwd().logits.float()
                    g = capture_graph(fwd)
                    ms = time_ms(g.replay)
                    prof = kernel_profile(g.replay, steps=5) if w in (1, 4) else None
                    del g
            except Exception as e:  # (PDL under graph capture) keep the other variants
                gk.check(f"step w={w} {name}", False, f"{type(e).__name__}: {str(e)[:300]}")
                continue
            res[name] = dict(step_ms=ms, per_layer_us=ms * 1e3 / cfg.num_hidden_layers)
            if prof:
                res[name].update(kernels_per_step=prof["kernels_per_step"], kernel_us_per_step=prof["kernel_us_per_step"],
                                 top=prof["top"][:15])
            gk.log(f"[step] w={w} {name}: {ms:.3f} ms per 3-layer step"
                   + (f", {prof['kernels_per_step']:.0f} kernels, {prof['kernel_us_per_step']:.0f} us of kernel time" if prof else ""))
        ref = logits["old (all off)"]
        for name in logits:
            d = gk.rel_err(logits[name], ref)
            gk.check(f"step w={w} {name} vs old logits", d < 5e-2, f"rel L2 {d:.2e}")
        out[f"w={w}"] = res
    set_kernels(model, **on, pdl=False)
    del model, kv
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT") or "eval/results")
    ap.add_argument("--quick", action="store_true", help="fewer widths, no tile sweep, only old vs all-new steps")
    ap.add_argument("--only", default="", help="comma list of sections: gemv,norm,router,prologue,index_weights,step")
    ap.add_argument("--gemv-tp", default="8,1", help="gemv section: the TP degrees whose weight shapes to time")
    ap.add_argument("--sweep", action="store_true", help="gemv and index_weights sections: also sweep the new "
                                                         "kernels' tiles")
    args = ap.parse_args()
    if not available():
        sys.exit("gpu_fused: needs triton and a CUDA device")
    props = torch.cuda.get_device_properties(0)
    gk.L2 = getattr(props, "L2_cache_size", gk.L2)
    import triton

    meta = dict(device=props.name, sms=props.multi_processor_count, torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d %H:%M"))
    gk.log(f"[env] {meta}")
    torch.manual_seed(0)
    only = set(args.only.split(",")) if args.only else {"gemv", "norm", "router", "prologue", "index_weights", "step"}
    out = dict(meta=meta)
    t0 = time.time()
    out["bandwidth"] = gk.copy_bandwidth()
    tps = tuple(int(t) for t in args.gemv_tp.split(","))
    gk.run_sections([("gemv", lambda: gemv_section(args.quick, tps, args.sweep)), ("norm", norm_section), ("router", router_section),
                     ("prologue", prologue_section), ("index_weights", lambda: index_weights_section(args.sweep)),
                     ("step", lambda: step_section(args.quick))], only, out)
    gk.finish(out, t0, os.path.join(args.out, "gpu_fused.json"))
    if "step" in out and "error" not in out["step"]:
        gk.log("\nTP=8 rank step (3 layers: 1 dense + 2 MoE), ms per step:")
        for wk, res in out["step"].items():
            gk.log(f"  {wk}: " + ", ".join(f"{n} {r['step_ms']:.3f}" + (f" ({r['kernels_per_step']:.0f} k)" if "kernels_per_step" in r else "")
                                         for n, r in res.items()))


if __name__ == "__main__":
    main()
