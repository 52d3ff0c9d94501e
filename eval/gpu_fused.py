"""Time the fused decode kernels against the current path at TP=8 per-rank shapes, in one device call.

    python3 eval/gpu_fused.py [--out DIR] [--only gemv,norm,router,step] [--quick]

Sections (each new kernel next to what the fast path ran before it, same process, same inputs):
- gemv: `gemv_splitk.fp8_gemv` (x quantized in-kernel, and pre-quantized as the fused norm hands it over, and
  as a PDL chain) vs `fp8_gemm.fp8_linear` (old default plan) on the rank-sized weights, rows 1..4; a tile
  sweep at M = 1 on the MoE layer's GEMVs;
- norm: residual add + RMSNorm + quant in one kernel vs the old step (cast + add, compiled RMSNorm, act_quant);
- router: `router.moe_route_fused` vs `moe.moe_route`, E = 256, D = 7168;
- prologue: `mla_prologue` (2 kernels) vs the unfused MLA prologue steps, and `absorb` vs the two einsums, one
  rank's 16 heads;
- step: one rank of TP=8 (rank 0 of a one-process "world" of 8 whose collectives are the identity, so they are
  excluded as in the issue's measurement), 1 dense + 2 MoE layers at real width, FP8 random weights, 1024-token
  prompt; the captured target forward at widths 1..4 with each switch of `kernels.dispatch.SWITCHES` alone,
  all off (the old fast path) and all on, and the kernel count per step (torch profiler over graph replays).
A full run compiles ~150 kernel variants (each GEMV tile / row count / PDL choice is its own binary) and
builds a 3-layer rank model: if one 10-minute device call is too short, run `--only gemv,norm,router,prologue`
and `--only step` as two calls (or `--quick`).
Timing: CUDA-graph replays (launch gaps removed, as in a captured step), CUDA events, median of 15; kernel inputs
rotate over copies exceeding 3x the L2 so weights come from HBM (eval/gpu_kernels.py's method). Prints one line
per measurement and a table last; writes DIR/gpu_fused.json (DIR: $OUT, else eval/results).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

if not __package__:  # run as a script (python3 eval/gpu_fused.py): the repository root for `eval` and `mtp`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eval import gpu_kernels as gk  # copy bandwidth, graph timing, rows and checks
from mtp.model.fp8 import act_quant as act_quant_ref
from mtp.model.fp8 import fp8_gemm_ref, weight_quant
from mtp.kernels import available
from mtp.kernels.act_quant import act_quant
from mtp.kernels.dispatch import set_fast_kernels
from mtp.kernels.fp8_gemm import fp8_linear
from mtp.kernels.gemv_splitk import fp8_gemv, gemv_plan
from mtp.kernels.moe import moe_route, moe_route_ref
from mtp.kernels.norm_quant import add_rms_norm_quant, add_rms_norm_quant_ref
from mtp.kernels.router import moe_route_fused
from mtp.parallel.comm import Comm

DEV = "cuda"
# (name, N, K, calls per MoE layer at TP=8) -- per rank: 16 heads, 32 experts, shared expert 2 blocks of 128
RANK_GEMVS = [("q_a|wk|kv_a", 2240, 7168, 1), ("q_b|wq_b", 16 * 192 + 64 * 128, 1536, 1), ("o_proj", 7168, 2048, 1),
              ("shared gate|up", 512, 7168, 1), ("shared down", 7168, 256, 1),
              ("dense gate|up", 4608, 7168, 0), ("dense down", 7168, 2304, 0)]


def gemv_section(quick: bool) -> dict:
    out = {}
    Ms = [1, 4] if quick else [1, 2, 3, 4]
    for name, N, K, per_layer in RANK_GEMVS:
        ws = [weight_quant(torch.randn(N, K, device=DEV) * 0.02) for _ in range(gk.n_sets(N * K))]
        w8, sw = ws[0]
        nbytes = N * K + N * K // 16384 * 4
        for M in Ms:
            x = torch.randn(M, K, device=DEV).bfloat16()
            xq = act_quant(x)
            ref = fp8_gemm_ref(*act_quant_ref(x), w8, sw)
            err = gk.rel_err(fp8_gemv(x, w8, sw, out_dtype=torch.float32), ref)
            gk.check(f"fp8_gemv {name} M={M}", err < 1e-4, f"rel err {err:.2e}")
            old = gk.graph_us([lambda w=w, s=s: fp8_linear(x, w, s) for w, s in ws])
            new = gk.graph_us([lambda w=w, s=s: fp8_gemv(x, w, s) for w, s in ws])
            pre = gk.graph_us([lambda w=w, s=s: fp8_gemv(None, w, s, xq=xq, out_dtype=torch.bfloat16) for w, s in ws])
            try:  # a chain of PDL launches: each GEMV requests its weights while the previous one finishes
                pdl = gk.graph_us([lambda w=w, s=s: fp8_gemv(None, w, s, xq=xq, out_dtype=torch.bfloat16, pdl=True)
                                   for w, s in ws])
            except Exception as e:  # PDL in graph capture unsupported here: record, go on
                gk.log(f"[gemv] pdl failed: {type(e).__name__}: {str(e)[:200]}")
                pdl = float("nan")
            plan = gemv_plan(N, K // 128, x.device)
            gk.row("gemv old (fp8_linear)", f"{name} M={M} {N}x{K}", old, nbytes)
            gk.row("gemv new", f"{name} M={M} {N}x{K}", new, nbytes, plan=f"bn{plan['bn']} gps{plan['gps']}")
            gk.row("gemv new, prequant x", f"{name} M={M} {N}x{K}", pre, nbytes,
                   floor_us=round(nbytes / gk.COPY_BW / 1e3, 2))
            gk.row("gemv new, prequant, pdl", f"{name} M={M} {N}x{K}", pdl, nbytes)
            out[f"{name} M={M}"] = dict(old_us=old, new_us=new, prequant_us=pre, pdl_chain_us=pdl, saved_us=old - pre,
                                        per_moe_layer=per_layer)
        if not quick and per_layer:  # the tile: what gemv_plan leaves on the table (each variant compiles: few)
            for M in (1,):
                x = torch.randn(M, K, device=DEV).bfloat16()
                xq = act_quant(x)
                res = []
                for bn in (8, 16, 32):
                    for gps in (2, 4, 8):
                        if (K // 128) % gps:
                            continue
                        for nw in (4, 8):
                            t = gk.graph_us([lambda w=w, s=s: fp8_gemv(None, w, s, xq=xq, bn=bn, gps=gps,
                                                                       num_warps=nw) for w, s in ws])
                            res.append(dict(bn=bn, gps=gps, num_warps=nw, us=round(t, 2)))
                res.sort(key=lambda r: r["us"])
                out[f"sweep {name} M={M}"] = res
                gk.log(f"[sweep] {name} M={M}: best {res[:3]}, worst {res[-1]}")
        del ws
        torch.cuda.empty_cache()
    return out


def norm_section() -> dict:
    from mtp.model.layers import elementwise

    elementwise.compile()
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
    for T in (1, 2, 4, 5, 64):
        x = torch.randn(T, D, device=DEV).bfloat16()
        w, idx = moe_route_fused(x, wg, bias)
        wr, ir = moe_route_ref(x, wg, bias)
        agree = (idx == ir).float().mean().item()
        gk.check(f"moe_route_fused T={T}", agree > 0.99 and gk.rel_err(w, wr) < 1e-3, f"idx agree {agree:.4f}")
        t_old = gk.graph_us([lambda: moe_route(x, wg, bias)])
        t_new = gk.graph_us([lambda: moe_route_fused(x, wg, bias)])
        gk.row("router old (2 launches)", f"T={T} E={E} D={D}", t_old, E * D * 2)
        gk.row("router new (1 launch)", f"T={T} E={E} D={D}", t_new, E * D * 2)
        out[f"T={T}"] = dict(old_us=t_old, new_us=t_new)
    return out


def prologue_section() -> dict:
    """The MLA prologue of one TP=8 rank (16 heads): two kernels vs the unfused steps they replace."""
    import dataclasses

    from mtp.model.attention import MLA
    from mtp.model.cache import KVCache
    from mtp.kernels.absorb import absorb_out, absorb_out_ref, absorb_q, absorb_q_ref
    from mtp.kernels.mla_prologue import mla_kv_prologue, mla_kv_prologue_ref, mla_q_prologue, mla_q_prologue_ref
    from mtp.model.layers import Rotary, elementwise
    from mtp.model.presets import real_config

    elementwise.compile()
    cfg = dataclasses.replace(real_config(layers=1, dense_layers=1, mtp_modules=0), num_attention_heads=16)
    with torch.device(DEV):
        mla = MLA(cfg, torch.bfloat16)
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

    def all_gather_last(self, t):
        return t


def step_section(quick: bool) -> dict:
    from mtp.backends.fast_path import enable_fast_path
    from mtp.decode.graphs import capture_graph
    from mtp.parallel.layout import ParallelPlan
    from mtp.parallel.synthetic import random_parallel_model
    from mtp.model.presets import real_config
    from mtp.timing import kernel_profile, time_ms

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
            set_fast_kernels(**dict(dict(pdl=False), **sw))
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
    set_fast_kernels(**on, pdl=False)
    del model, kv
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT") or "eval/results")
    ap.add_argument("--quick", action="store_true", help="fewer widths, no tile sweep, only old vs all-new steps")
    ap.add_argument("--only", default="", help="comma list of sections: gemv,norm,router,prologue,step")
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
    only = set(args.only.split(",")) if args.only else {"gemv", "norm", "router", "prologue", "step"}
    out = dict(meta=meta)
    t0 = time.time()
    out["bandwidth"] = gk.copy_bandwidth()
    gk.run_sections([("gemv", lambda: gemv_section(args.quick)), ("norm", norm_section), ("router", router_section),
                     ("prologue", prologue_section), ("step", lambda: step_section(args.quick))], only, out)
    gk.finish(out, t0, os.path.join(args.out, "gpu_fused.json"))
    if "step" in out and "error" not in out["step"]:
        gk.log("\nTP=8 rank step (3 layers: 1 dense + 2 MoE), ms per step:")
        for wk, res in out["step"].items():
            gk.log(f"  {wk}: " + ", ".join(f"{n} {r['step_ms']:.3f}" + (f" ({r['kernels_per_step']:.0f} k)" if "kernels_per_step" in r else "")
                                         for n, r in res.items()))


if __name__ == "__main__":
    main()
