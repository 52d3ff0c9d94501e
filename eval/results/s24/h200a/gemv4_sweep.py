"""Session 24 scratch: the few-row weight-streaming GEMV (fp8_gemm's _gemv_kernel, what a TP=8 rank's layer GEMVs run
at w = 2..4) over its plan (bn, K groups per slice, warps, stages) at M = 4 (and 2), the rank's shapes, graph replays,
each setting checked against the default's output."""
import json, os, sys, time
import torch
from mtp.bench import kernels as gk
from mtp.kernels import fp8_gemm as fg
from mtp.kernels.act_quant import act_quant
from mtp.model.fp8 import weight_quant

DEV = "cuda"
SHAPES = [("q_a|wk|kv_a", 2240, 7168), ("q_b", 3072, 1536), ("q_b|wq_b", 11264, 1536), ("o_proj", 7168, 2048)]
out = {}
t0 = time.time()
for name, N, K in SHAPES:
    G = K // 128
    nbytes = N * K + -(-N // 128) * G * 4
    ws = [weight_quant(torch.randn(N, K, device=DEV) * 0.02) for _ in range(gk.n_sets(N * K))]
    for M in (4, 2):
        xq = act_quant(torch.randn(M, K, device=DEV).bfloat16())
        ref = fg.fp8_gemm(*xq, *ws[0], out_dtype=torch.float32)
        d_bn = fg.default_plan(M, N, G, xq[0].device)["bn"]
        d_splits = fg.default_splits(N, G, xq[0].device, d_bn)
        res = [dict(bn=d_bn, splits=d_splits, warps=4, stages=3, default=True,
                    us=gk.graph_us([lambda w=w, s=s: fg.fp8_gemm(*xq, w, s, out_dtype=torch.bfloat16) for w, s in ws]))]
        for bn in (16, 32, 64, 128):
            for gps in (1, 2, 4, 8):
                if G % gps and gps > 1:
                    continue
                splits = -(-G // gps)
                for warps in (2, 4, 8):
                    for stages in ((2, 3, 4) if warps == 4 else (3,)):
                        kw = dict(bn=bn, splits=splits, num_warps=warps, num_stages=stages)
                        try:
                            y = fg.fp8_gemm(*xq, *ws[0], out_dtype=torch.float32, **kw)
                            err = gk.rel_err(y, ref)
                            if not err < 1e-5:
                                res.append(dict(bn=bn, splits=splits, warps=warps, stages=stages, err=err)); continue
                            t = gk.graph_us([lambda w=w, s=s: fg.fp8_gemm(*xq, w, s, out_dtype=torch.bfloat16, **kw)
                                             for w, s in ws])
                        except Exception as e:
                            res.append(dict(bn=bn, splits=splits, warps=warps, stages=stages, error=str(e)[:120]))
                            continue
                        res.append(dict(bn=bn, splits=splits, warps=warps, stages=stages, us=round(t, 2)))
        ok = sorted((r for r in res if "us" in r), key=lambda r: r["us"])
        out[f"{name} M={M}"] = dict(N=N, K=K, M=M, bytes=nbytes, default=res[0], best=ok[:8], all=res)
        print(f"{name} M={M} {N}x{K}: default {res[0]['us']:.2f} us (bn {d_bn}, splits {d_splits}); best",
              [(r['bn'], r['splits'], r['warps'], r['stages'], r['us']) for r in ok[:4]],
              f"({time.time() - t0:.0f} s)", flush=True)
    del ws
    torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "gemv4_sweep.json"), "w"), indent=1)
