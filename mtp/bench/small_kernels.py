"""Launch settings of the TP=8 rank's latency-bound kernels, swept at the rank's decode shapes (H200).

Nsight Compute on one TP=8 split rank (`mtp.bench.ncu_step`, BENCHMARKS.md session 17) times each kernel of a MoE
layer alone at one token: the row norm (`norm_quant`, then one program of 8 warps per row) 6.2 us, MLA stage 1
(`mla_decode`, 17 programs of one 64-key tile each at 1k) 11.1 us at 1.4% of DRAM bandwidth, the o_proj split-K GEMV
(x quantized in the kernel, 78 registers: 3 programs per SM, its 896 programs in 2.3 waves) 11.2 us, where a kernel
that does nothing takes ~2 us. Each section here times the default against other settings of the same kernel, in
graph replays (`kernels.graph_us`), and checks every setting's output against the default's (a reduction in another
order changes the last bits, so the check is a tolerance, printed):
- norm: `add_rms_norm_quant` at 4 / 8 / 16 / 32 warps (the row's 7168 channels over more threads: a shorter
  chain per thread);
- stage1: `mla_decode` (stage 1 + stage 2) at 16 heads with 16 / 32 / 64 keys per tile and 1 / 2 / 4 x the default
  KV slices, dense 1k and the top-2048 of 32k, T = 1 and 4;
- mla_cs: `mla_decode` at 16 heads with stage 1's output channels split over 1 / 2 / 4 / 8 programs (the same
  bits, checked), dense 1k and the top-2048 of 32k, T = 1, 2, 4;
- combine: the experts' combine over its channel block and warps (the same bits);
- gemv: `fp8_gemv` on o_proj (7168 x 2048, x quantized in the kernel) and q_a | wk | kv_a (2240 x 7168, x
  pre-quantized) at one row, over BN, groups per slice and warps;
- head: `fp8_gemv` on the FP8 copy of the drafts' head (`draft.head_fp8`: the TP=8 shard, 16160 x 7168, x quantized
  in the kernel) at 1 and 4 rows, over BN, groups per slice, warps and CUDA cores / tensor cores (mma), beside the
  bf16 head's GEMM (torch) and the weight's byte time at the copy bandwidth;
- kvnorm: the kv prologue + q_a norm launch (`mla_prologue_fused.mla_kv_prologue_norm`, 6.4 us alone at one token)
  with a token's latent and indexer key in one program or in two (switch kv_split: the same bits, checked), T = 1
  and 4;
- logits: the argmax over the vocabulary (129280) and the logits' health flag, torch's ops (torch.argmax; isfinite,
  amax, amin) against the logits scan kernel (`logits_scan`, switch logits_scan: the same indices and flag, checked),
  R = 1 (a draft), 4 (an eagle k = 3 verify), 8 and 64 rows (a tree's nodes), fp32 and bf16.

    python -m mtp.bench.small_kernels --out DIR [--only norm,stage1,mla_cs,combine,gemv,head,kvnorm,logits]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from mtp.bench import kernels as gk
from mtp.kernels import available

DEV = "cuda"


def norm_section() -> dict:
    from mtp.kernels.norm_quant import add_rms_norm_quant, row_tiles

    D = 7168
    out = {}
    w = (torch.rand(D, device=DEV) + 0.5).bfloat16()
    default_warps = row_tiles(D)[1]
    for M in (1, 4):
        h = torch.randn(M, D, device=DEV)
        d = torch.randn(M, D, device=DEV)  # the o_proj's fp32 sum, rounded to bf16 in the kernel

        def call(nw, h=h, d=d):
            return add_rms_norm_quant(h, d, w, 1e-6, round_dtype=torch.bfloat16, num_warps=nw)

        want = call(None)
        res = {}
        for nw in (4, 8, 16, 32):
            got = call(nw)
            same_h = torch.equal(got[0], want[0])
            dy = (got[1].float() - want[1].float()).abs().max().item()
            gk.check(f"norm M={M} warps={nw}", same_h and dy <= want[1].float().abs().max().item() * 2 ** -7,
                     f"h equal {same_h}, y max diff {dy:.2e} (a bf16 ulp allowed), x8 equal "
                     f"{torch.equal(got[2].view(torch.uint8), want[2].view(torch.uint8))}")
            res[nw] = gk.graph_us([lambda nw=nw: call(nw)])
            gk.row(f"norm warps={nw}" + (" (default)" if nw == default_warps else ""), f"M={M} D={D}", res[nw],
                   M * D * 15)
        out[f"M={M}"] = res
    return out


def stage1_section() -> dict:
    from mtp.kernels.mla_decode import default_splits, mla_decode

    out = {}
    H = 16
    for T in (1, 4):
        for S, J, tag in ((1024 + T, None, "dense 1k"), (32768 + T, 2048, "top-2048 of 32k")):
            q, qpe, kv8, kvs, pe, lens, idx, keys, nbytes = gk.mla_case(1, T, H, S, J)
            base = default_splits(T, J or S)
            want = mla_decode(q, qpe, kv8, kvs, pe, lens, 0.1, topk_idx=idx)
            res = {}
            for bn in (16, 32, 64):
                for mult in (1, 2, 4):
                    splits = min(base * mult, (J or S) // bn)
                    name = f"bn={bn} splits={splits}"
                    if name in res:
                        continue
                    try:
                        got = mla_decode(q, qpe, kv8, kvs, pe, lens, 0.1, topk_idx=idx, block_n=bn, splits=splits)
                        err = gk.rel_err(got, want)
                        gk.check(f"stage1 T={T} {tag} {name}", err < 1e-2, f"rel err vs default {err:.2e}")
                        res[name] = gk.graph_us([lambda bn=bn, sp=splits: mla_decode(
                            q, qpe, kv8, kvs, pe, lens, 0.1, topk_idx=idx, block_n=bn, splits=sp)])
                    except Exception as e:  # a setting that does not compile: record it, go on
                        gk.check(f"stage1 T={T} {tag} {name}", False, f"{type(e).__name__}: {str(e)[:200]}")
                        continue
                    gk.row(f"mla {name}" + (" (default)" if (bn, mult) == (64, 1) else ""), f"T={T} {tag}",
                           res[name], nbytes)
            out[f"T={T} {tag}"] = res
    return out


def mla_cs_section() -> dict:
    """MLA stage 1's channel splits (`mla_decode(channel_splits=)`, `FastPathOptions.mla_channel_splits`: CS programs
    per (row, head block, key split), each the softmax and 512 / CS output channels) at the rank's 16 heads, dense 1k
    and the top-2048 of 32k, T = 1 / 2 / 4, CS = 1 / 2 / 4 / 8, each checked bit-equal to CS = 1; mla_decode (stage 1
    + stage 2) per call over rotating caches (at 1k one cache stays in L2; the step reads 61 layers' caches)."""
    from mtp.kernels.mla_decode import CHANNEL_SPLITS, channel_splits_for, mla_decode

    out = {}
    H = 16
    for T in (1, 2, 4):
        for S, J, tag in ((1024 + T, None, "dense 1k"), (32768 + T, 2048, "top-2048 of 32k")):
            q, qpe, kv8, kvs, pe, lens, idx, keys, nbytes = gk.mla_case(1, T, H, S, J)
            sets = [(kv8, kvs, pe)] + [gk.mla_inputs(1, T, H, S)[2:] for _ in range(min(31, gk.n_sets(keys * 656) - 1))]
            want = mla_decode(q, qpe, kv8, kvs, pe, lens, 0.1, topk_idx=idx)
            res = {}
            for cs in CHANNEL_SPLITS:
                got = mla_decode(q, qpe, kv8, kvs, pe, lens, 0.1, topk_idx=idx, channel_splits=cs)
                gk.check(f"mla_cs T={T} {tag} CS={cs}", torch.equal(got, want),
                         f"bit-equal to CS = 1 ({int((got != want).sum())} of {got.numel()} differ)")
                res[cs] = gk.graph_us([lambda s=s, cs=cs: mla_decode(q, qpe, *s, lens, 0.1, topk_idx=idx,
                                                                     channel_splits=cs) for s in sets])
                gk.row(f"mla CS={cs}" + (" (default)" if cs == channel_splits_for(T) else ""), f"T={T} {tag}",
                       res[cs], nbytes)
            out[f"T={T} {tag}"] = res
            del sets
    return out


def combine_section() -> dict:
    """The experts' combine (`moe._combine`: y[t] = the sum over 8 routed slots and the shared one of the down
    kernel's per-slot rows) at a 'split' rank's shape, over its channel block and warps (each channel's sum in the
    same order: the same bits)."""
    from mtp.kernels.moe import COMBINE_BLOCK_D, COMBINE_WARPS, _combine

    D, J = 7168, 8
    out = {}
    for T in (1, 4):
        part = torch.randn(1, T * (J + 1), D, device=DEV)
        idx = torch.randint(0, 256, (T, J), device=DEV, dtype=torch.int32)

        def call(bd, nw, T=T, part=part, idx=idx):
            return _combine(part, idx, None, T, D, J, 1, torch.float32, True, False, block_d=bd, num_warps=nw)

        want = call(COMBINE_BLOCK_D, COMBINE_WARPS)
        res = {}
        for bd in (256, 512, 1024, 2048):
            for nw in (1, 2, 4, 8):
                if bd < 32 * nw:
                    continue
                key = f"block_d={bd} warps={nw}"
                gk.check(f"combine T={T} {key}", torch.equal(call(bd, nw), want), "bit-equal to the default")
                res[key] = gk.graph_us([lambda bd=bd, nw=nw: call(bd, nw)])
                default = (bd, nw) == (COMBINE_BLOCK_D, COMBINE_WARPS)
                gk.row(f"combine {key}" + (" (default)" if default else ""), f"T={T} D={D}", res[key],
                       T * (J + 1) * D * 4 + T * D * 4)
        out[f"T={T}"] = dict(sorted(res.items(), key=lambda kv: kv[1]))
    return out


def gemv_section() -> dict:
    from mtp.kernels.act_quant import act_quant
    from mtp.kernels.gemv_splitk import fp8_gemv, gemv_plan
    from mtp.model.fp8 import weight_quant

    out = {}
    for name, N, K, pre in (("o_proj", 7168, 2048, False), ("q_a|wk|kv_a", 2240, 7168, True)):
        ws = [weight_quant(torch.randn(N, K, device=DEV) * 0.02) for _ in range(gk.n_sets(N * K))]
        x = torch.randn(1, K, device=DEV).bfloat16()
        xq = act_quant(x) if pre else None
        nbytes = N * K + -(-N // 128) * (K // 128) * 4
        plan = gemv_plan(N, K // 128, x.device)
        want = fp8_gemv(x, *ws[0], xq=xq)
        res = {}
        for bn in (8, 16, 32):
            for gps in (4, 8, 16):
                if (K // 128) % gps:
                    continue
                for nw in (2, 4, 8):
                    key = f"bn={bn} gps={gps} warps={nw}"
                    try:
                        got = fp8_gemv(x, *ws[0], xq=xq, bn=bn, gps=gps, num_warps=nw)
                        err = gk.rel_err(got, want)
                        gk.check(f"gemv {name} {key}", err < 1e-3, f"rel err vs default {err:.2e}")
                        res[key] = gk.graph_us([lambda w=w, s=s, bn=bn, gps=gps, nw=nw: fp8_gemv(
                            x, w, s, xq=xq, bn=bn, gps=gps, num_warps=nw) for w, s in ws])
                    except Exception as e:
                        gk.check(f"gemv {name} {key}", False, f"{type(e).__name__}: {str(e)[:200]}")
                        continue
                    default = (bn, gps, nw) == (plan["bn"], plan["gps"], plan["num_warps"])
                    gk.row(f"gemv {key}" + (" (default)" if default else ""), f"{name} M=1 {N}x{K}", res[key],
                           nbytes)
        out[name] = dict(sorted(res.items(), key=lambda kv: kv[1]), plan=plan)
        del ws
        torch.cuda.empty_cache()
    return out


def head_section() -> dict:
    from mtp.kernels.gemv_splitk import fp8_gemv, gemv_plan
    from mtp.model.fp8 import weight_quant

    N, K = 16160, 7168  # the TP=8 shard of the 129280-row head
    w8, sw = weight_quant(torch.randn(N, K, device=DEV) * 0.02)  # 116 MB: larger than L2, one set suffices
    wb = torch.randn(N, K, device=DEV).bfloat16() * 0.02
    nbytes = N * K + sw.numel() * 4
    out = {}
    for M in (1, 4):
        x = torch.randn(M, K, device=DEV).bfloat16()
        plan = gemv_plan(N, K // 128, x.device)
        want = fp8_gemv(x, w8, sw)
        res = {"bf16 torch (bf16 weight)": gk.graph_us([lambda: x @ wb.t()])}
        gk.row("head bf16 torch", f"M={M} {N}x{K} (2 B/weight)", res["bf16 torch (bf16 weight)"], 2 * N * K)
        for mma in (False, True):
            for bn in (8, 16, 32, 64, 128):
                for gps in (4, 8):
                    if bn * gps * 128 > 65536 or (mma and bn < 16):
                        continue
                    for nw in (4, 8):
                        key = f"{'mma' if mma else 'fma'} bn={bn} gps={gps} warps={nw}"
                        try:
                            got = fp8_gemv(x, w8, sw, bn=bn, gps=gps, num_warps=nw, mma=mma)
                            err = gk.rel_err(got, want)
                            gk.check(f"head M={M} {key}", err < 1e-3, f"rel err vs default {err:.2e}")
                            res[key] = gk.graph_us([lambda bn=bn, gps=gps, nw=nw, mma=mma: fp8_gemv(
                                x, w8, sw, bn=bn, gps=gps, num_warps=nw, mma=mma)])
                        except Exception as e:
                            gk.check(f"head M={M} {key}", False, f"{type(e).__name__}: {str(e)[:200]}")
                            continue
                        default = not mma and (bn, gps, nw) == (plan["bn"], plan["gps"], plan["num_warps"])
                        gk.row(f"head {key}" + (" (default)" if default else ""), f"M={M} {N}x{K}", res[key], nbytes)
        out[f"M={M}"] = dict(sorted(res.items(), key=lambda kv: kv[1]), plan=plan)
    out["floor_us"] = nbytes / gk.COPY_BW / 1e3
    return out


def kvnorm_section() -> dict:
    import dataclasses

    from mtp.kernels.mla_prologue_fused import mla_kv_prologue_norm
    from mtp.model.attention import MLA
    from mtp.model.cache import KVCache
    from mtp.model.layers import Rotary
    from mtp.model.presets import real_config

    # one TP=8 rank's MLA (16 heads; q_lora 1536, latent 512 + rope 64, indexer key 128), random norm parameters
    cfg = dataclasses.replace(real_config(layers=1, dense_layers=1, mtp_modules=0), num_attention_heads=16)
    with torch.device(DEV):
        mla = MLA(cfg, torch.bfloat16)
    mla.kv_a_layernorm.weight.data = (torch.rand(cfg.kv_lora_rank, device=DEV) + 0.5).bfloat16()
    mla.q_a_layernorm.weight.data = (torch.rand(cfg.q_lora_rank, device=DEV) + 0.5).bfloat16()
    mla.indexer.k_norm.weight.data = torch.rand(128, device=DEV) + 0.5
    mla.indexer.k_norm.bias.data = torch.randn(128, device=DEV) * 0.1
    Q, C, R = cfg.q_lora_rank, mla.C, mla.R
    out = {}
    for T in (1, 4):
        a = (torch.randn(1, T, Q + 128 + C + R, device=DEV) * 2).bfloat16()
        pos = torch.arange(1000, 1000 + T, device=DEV)[None]
        cos, sin = Rotary(cfg).to(DEV).angles(pos)
        caches = [KVCache(cfg, 1, 1, 1024 + T, device=DEV, dtype=torch.bfloat16, quantized=True).layer(0)
                  for _ in range(2)]
        res = {}
        outs = {}
        for split, cache in ((False, caches[0]), (True, caches[1])):
            outs[split] = mla_kv_prologue_norm(mla, cache, pos, a, cos, sin, torch.bfloat16, kv_split=split)
            res[split] = gk.graph_us([lambda c=cache, s=split: mla_kv_prologue_norm(mla, c, pos, a, cos, sin,
                                                                                     torch.bfloat16, kv_split=s)])
            gk.row("kv prologue + q_a norm" + (" kv_split" if split else " (default)"), f"T={T}", res[split],
                   T * 2 * (Q + 128 + C + R))
        same = all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.element_size() == 1 else
                   torch.equal(x, y) for x, y in zip(outs[False], outs[True]))
        same = same and all(torch.equal(getattr(caches[0], n).view(torch.uint8), getattr(caches[1], n).view(torch.uint8))
                            for n in ("kv", "kv_scale", "pe", "idx_k", "idx_k_scale"))
        gk.check(f"kvnorm T={T} kv_split bit-equal", same, "outputs and cache buffers, torch.equal")
        out[f"T={T}"] = res
    return out


def logits_section() -> dict:
    """torch vs `logits_scan` side by side per (rows, dtype): 'torch argmax', 'torch flag' (the health check alone),
    'torch both' (the old verify: check, then argmax), 'scan argmax', 'scan both' (one launch). Four input sets
    rotate (a few MB: L2-resident, as the logits the lm_head has just written are in the step)."""
    from mtp.kernels.logits_scan import logits_scan, logits_scan_ref

    V = 129280
    out = {}
    flag_t = torch.zeros((), dtype=torch.bool, device=DEV)
    flag_k = torch.zeros((), dtype=torch.bool, device=DEV)
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for R in (1, 4, 8, 64):
            xs = [torch.randn(R, V, device=DEV).to(dtype) for _ in range(4)]
            xs[1][0, -1] = float("nan")  # a flagged set too: both paths store the flag
            for x in xs:
                want = logits_scan_ref(x, flag_t)
                got = logits_scan(x, flag_k)
                gk.check(f"logits R={R} {name}", torch.equal(got, want) and bool(flag_t) == bool(flag_k),
                         f"indices equal {torch.equal(got, want)}, flag {bool(flag_k)} vs torch {bool(flag_t)}")
                flag_t.zero_()
                flag_k.zero_()
            cases = {"torch argmax": lambda x: x.argmax(-1),
                     "torch flag": lambda x: logits_scan_ref(x, flag_t, argmax=False),
                     "torch both": lambda x: logits_scan_ref(x, flag_t),
                     "scan argmax": lambda x: logits_scan(x),
                     "scan both": lambda x: logits_scan(x, flag_k)}
            res = {}
            for case, fn in cases.items():
                res[case] = gk.graph_us([lambda x=x, fn=fn: fn(x) for x in xs])
                gk.row(f"logits {case}", f"R={R} V={V} {name}", res[case], R * V * xs[0].element_size())
            out[f"R={R} {name}"] = res
            del xs
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "eval/results")
    ap.add_argument("--only", default="norm,stage1,mla_cs,combine,gemv,head,kvnorm,logits",
                    help="comma list of sections: norm,stage1,mla_cs,combine,gemv,head,kvnorm,logits")
    args = ap.parse_args()
    if not available():
        sys.exit("mtp.bench.small_kernels: needs triton and a CUDA device")
    props = torch.cuda.get_device_properties(0)
    gk.L2 = getattr(props, "L2_cache_size", gk.L2)
    torch.manual_seed(0)
    out = dict(meta=dict(device=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                         date=time.strftime("%Y-%m-%d %H:%M")))
    t0 = time.time()
    out["bandwidth"] = gk.copy_bandwidth()
    gk.run_sections([("norm", norm_section), ("stage1", stage1_section), ("mla_cs", mla_cs_section),
                     ("combine", combine_section), ("gemv", gemv_section), ("head", head_section),
                     ("kvnorm", kvnorm_section),
                     ("logits", logits_section)],
                    set(args.only.split(",")), out)
    gk.finish(out, t0, os.path.join(args.out, "small_kernels.json"))


if __name__ == "__main__":
    main()
