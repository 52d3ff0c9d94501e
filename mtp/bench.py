"""`mtp-bench`: decode-step latency of DeepSeek-V3.2 at real width with random FP8 weights, in one run:
measured copy bandwidth (the roofline's ceiling), our target step for verify widths 1..K+1 (eager and graph),
whole speculative steps in eager / graph / overlap mode with GPU idle time, the same truncated model through
transformers' eager implementation, and an analytic byte count per step (weights touched, including the union
of routed experts the K+1 tokens pick, plus KV reads) giving the HBM roofline and our percentage of it.
Projections to the full 61-layer model use the measured per-layer costs. Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch



def _time_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    x = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = _time_ms(lambda: y.copy_(x), iters=10)
    del x, y
    return 2 * (1 << 29) * 2 / (ms * 1e-3)


def step_bytes(model, n_experts_touched: list[int], S: int, B: int) -> dict:
    """Bytes one target forward must read: every non-expert weight once, the routed experts actually picked,
    the lm_head, and the KV cache of S positions per row (FP8 latent + scales + bf16 rope key + indexer key)."""
    from .model.moe import MoE

    dense_bytes, expert_bytes = 0, 0
    for li, layer in enumerate(model.model.layers):
        for name, p in layer.named_parameters():
            if ".experts." in f".{name}":
                continue
            dense_bytes += p.numel() * p.element_size()
        if isinstance(layer.mlp, MoE):
            e0 = layer.mlp.experts[0]
            per_expert = sum(p.numel() * p.element_size() for p in e0.parameters())
            expert_bytes += per_expert * n_experts_touched[li]
    head = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    cfg = model.cfg
    kv_per_pos = cfg.kv_lora_rank + 4 * (cfg.kv_lora_rank // 128) + 2 * cfg.qk_rope_head_dim + cfg.index_head_dim + 4
    kv = kv_per_pos * S * B * cfg.num_hidden_layers
    return {"weights_dense": dense_bytes, "weights_experts": expert_bytes, "lm_head": head, "kv": kv,
            "total": dense_bytes + expert_bytes + head + kv}


def _count_experts(model, ids) -> tuple[dict, list]:
    """Distinct routed experts per layer for the tokens of one forward: a pre-hook re-runs the (cheap)
    reference router on each MoE input, whichever path computes the experts."""
    from .model.moe import MoE

    seen: dict[int, set] = {}
    hooks = []
    for li, layer in enumerate(model.model.layers):
        if isinstance(layer.mlp, MoE):
            def hook(mod, inp, li=li):
                x = inp[0].reshape(-1, inp[0].shape[-1])
                seen.setdefault(li, set()).update(mod.gate(x)[1].flatten().tolist())
            hooks.append(layer.mlp.register_forward_pre_hook(hook))
    return seen, hooks


def _capture(fn) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        fn()
    return graph


def kernel_profile(replay, steps: int = 10, top: int = 30) -> dict:
    """Kernel time inside `steps` replays (torch.profiler / CUPTI sees the kernels of a replayed graph):
    per-kernel-name total and count per step, the sum of kernel time per step, and the number of kernels per
    step. Compared with the graph's event time this splits a step into kernel work and the gaps between
    kernels (launch latency, tails of under-filled kernels)."""
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            replay()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = e.cuda_time_total
        if t <= 0 or e.key.startswith("cuda"):  # runtime API rows, not device work
            continue
        rows.append({"name": e.key[:120], "us_per_step": t / steps, "calls_per_step": e.count / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    return {"kernel_us_per_step": sum(r["us_per_step"] for r in rows),
            "kernels_per_step": sum(r["calls_per_step"] for r in rows), "top": rows[:top]}


def bench_ours(args, bw: float) -> dict:
    from .decode.engine import generate, release
    from .backends.fast_path import enable_fast_path
    from .model.layers import glue
    from .synthetic import random_model, real_config

    cfg = real_config(layers=args.layers, dense_layers=args.dense_layers, mtp_modules=1)
    t0 = time.perf_counter()
    model = random_model(cfg, device="cuda", dtype=torch.bfloat16)
    enable_fast_path(model)
    build_s = time.perf_counter() - t0
    res = {"config": {"layers": args.layers, "dense_layers": args.dense_layers, "mtp_modules": 1,
                      "prompt_len": args.prompt_len, "batch": args.batch}, "build_s": build_s,
           "gpu_mem_gib": torch.cuda.memory_allocated() / 2**30}
    B, L = args.batch, args.prompt_len
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (B, L + args.k + 1), device="cuda", generator=g)
    widths = {}
    for w in range(1, args.k + 2):
        kv = model.new_cache(B, L + w + 8)
        with torch.no_grad():
            model(ids[:, :L], kv)  # prefill (reference naive attention, tiled FP8 GEMMs)
        base = kv.seq_lens.clone()
        blk = ids[:, L:L + w]
        S = L + w + 8

        def fwd():
            kv.truncate(base)
            model(blk, kv, kv_len=S)

        with torch.no_grad():
            eager_ms = _time_ms(fwd)
            graph = _capture(fwd)
            graph_ms = _time_ms(graph.replay)
            prof = kernel_profile(graph.replay) if args.profile and w in (1, args.k + 1) else None
            del graph
            glue.reset()  # same step with the unfused glue, side by side
            graph_plain_ms = _time_ms(_capture(fwd).replay)
            glue.compile()
            seen, hooks = _count_experts(model, blk)
            fwd()
            for h in hooks:
                h.remove()
        touched = [len(seen.get(li, ())) for li in range(cfg.num_hidden_layers)]
        by = step_bytes(model, touched, L + w, B)
        roof_ms = by["total"] / bw * 1e3
        widths[w] = {"eager_ms": eager_ms, "graph_ms": graph_ms, "graph_ms_unfused_glue": graph_plain_ms,
                     "experts_touched": touched, "bytes": by,
                     "roofline_ms": roof_ms, "pct_of_roofline_graph": 100 * roof_ms / graph_ms}
        if prof is not None:
            widths[w]["profile"] = prof
    res["target_step"] = widths
    # whole speculative steps (draft K + verify K+1 + accept + commit) in each mode
    spec = {}
    prompts = ids[:, :L].tolist()
    runs = [("none", 0, None), ("eagle", args.k, None)]
    if args.draft_vocab:  # the draft head over the first N ids only (cost; random weights accept nothing)
        runs.append(("eagle", args.k, args.draft_vocab))
    for draft, k, nv in runs:
        for mode in ("eager", "graph", "overlap") if nv is None else ("graph", "overlap"):
            opts = {"draft_vocab": range(nv)} if nv else {}
            # the first call captures (kept by generate for the next call); the second is the one timed
            generate(model, prompts, 8, draft=draft, k=k, mode=mode, **opts)
            out = generate(model, prompts, args.new_tokens, draft=draft, k=k, mode=mode, **opts)
            m = out.metrics
            d = m.to_dict()
            per_step = m.time_decode_s / max(m.target_forwards, 1) * 1e3
            spec[f"{draft}_k{k}{f'_vocab{nv}' if nv else ''}_{mode}"] = {
                "step_ms_wall": per_step, "decode_tok_s": m.decode_tok_s, "AL": m.mean_accepted_len,
                "gpu_idle_frac": d.get("graph/gpu_idle_frac"), "capture_s": d.get("graph/capture_s"),
                "graph_pool_bytes": d.get("graph/pool_bytes"),
                "gpu_step_ms": m.gpu_busy_ms / m.graph_replays if m.graph_replays else None}
    res["spec_step"] = spec
    release(model)  # generate's kept engines hold the model and their graphs' memory pools
    del model, out, kv, fwd
    gc.collect()
    torch.cuda.empty_cache()
    res["gpu_mem_gib_after_release"] = torch.cuda.memory_allocated() / 2**30
    return res


def bench_hf(args) -> dict:
    """transformers' DeepseekV32ForCausalLM, bf16, same truncated depth, random weights on the GPU."""
    import transformers
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    layers = min(args.layers, args.hf_layers)
    c = DeepseekV32Config(num_hidden_layers=layers, first_k_dense_replace=args.dense_layers,
                          rope_parameters={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                           "rope_theta": 10000.0})
    c._attn_implementation = "eager"
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = DeepseekV32ForCausalLM(c).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    B, L = args.batch, args.prompt_len
    ids = torch.randint(0, c.vocab_size, (B, L + 1), device="cuda")
    with torch.no_grad():
        out = model(ids[:, :L], use_cache=True)
        pkv = out.past_key_values
        nxt = ids[:, L:L + 1]
        ms = _time_ms(lambda: model(nxt, past_key_values=pkv, use_cache=True), iters=5, warmup=1)
    res = {"layers": layers, "decode_ms": ms, "transformers": transformers.__version__}
    del model
    torch.cuda.empty_cache()
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--dense-layers", type=int, default=1)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--hf", action="store_true", help="also time transformers' eager implementation")
    ap.add_argument("--hf-layers", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                    help="also time the eagle step with a draft vocabulary of N ids (mtp.draft.vocab)")
    ap.add_argument("--profile", action="store_true",
                    help="per-kernel time of the graph step at w=1 and w=K+1 (torch.profiler), in the JSON and table")
    ap.add_argument("--accept", type=float, default=0.85,
                    help="per-position draft acceptance for the full-model projection (DeepSeek reports 85-90%% "
                         "for the first MTP token)")
    ap.add_argument("--allreduce-us", type=float, default=10.0,
                    help="assumed latency of one small all-reduce, for the TP 8 projection")
    ap.add_argument("--out", default="bench.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("mtp-bench needs a CUDA GPU")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "args": vars(args)}
    bw = copy_bandwidth()
    res["copy_TBps"] = bw / 1e12
    res["ours"] = bench_ours(args, bw)
    if args.hf:
        try:
            res["hf"] = bench_hf(args)
            ours1 = res["ours"]["target_step"][1]["graph_ms"]
            res["speedup_vs_hf_w1"] = res["hf"]["decode_ms"] / ours1 * (args.layers / res["hf"]["layers"])
            # no implementation beats the byte floor: transformers' time over it bounds any speedup claim
            roof1 = res["ours"]["target_step"][1]["roofline_ms"]
            res["speedup_bound_vs_hf_w1"] = res["hf"]["decode_ms"] / roof1 * (args.layers / res["hf"]["layers"])
        except Exception as e:  # keep our numbers even if this transformers version differs
            res["hf_error"] = repr(e)[:500]
    _project(res, args)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1, default=float)
    os.replace(tmp, args.out)
    _table(res)


NOMINAL_HBM_TBps = {"H100": 3.35, "H200": 4.8}  # spec sheets: only the ratio is used, to carry one GPU's
# measured ms/byte to the other


def _project(res: dict, args) -> None:
    """Full-model estimates from this run. Bytes: every layer's non-expert weights, 58 MoE layers' touched
    experts, lm_head and KV, from the measured per-layer bytes. Time: the measured ms/byte at the same width
    (so our % of roofline carries over). MTP: the measured draft cost of the eagle step (whole spec step minus
    the target forward at width K+1; it does not grow with depth) and AL = sum_j p^j for a per-position
    acceptance p (--accept). TP: weight and KV bytes / TP per GPU plus 2 all-reduces per layer at --allreduce-us
    each (an assumption, not measured here). The other GPU: scaled by the spec-sheet HBM ratio."""
    o = res["ours"]["target_step"]
    per_width = {}
    for w, r in o.items():
        b = r["bytes"]
        moe_layers = args.layers - args.dense_layers
        per_moe = b["weights_experts"] / max(moe_layers, 1)
        dense_per_layer = b["weights_dense"] / args.layers
        full_bytes = 61 * dense_per_layer + 58 * per_moe + b["lm_head"] + b["kv"] / args.layers * 61
        per_width[int(w)] = {"bytes": full_bytes, "ms_per_byte": r["graph_ms"] / b["total"]}
    spec = res["ours"]["spec_step"].get(f"eagle_k{args.k}_graph", {})
    draft_ms = (spec.get("gpu_step_ms") or float("nan")) - o[args.k + 1]["graph_ms"]
    here = next((g for g in NOMINAL_HBM_TBps if g in res["device"]), None)
    p = args.accept
    al = sum(p ** j for j in range(args.k + 1))
    table = {}
    for gpu in NOMINAL_HBM_TBps:
        scale = NOMINAL_HBM_TBps[here] / NOMINAL_HBM_TBps[gpu] if here else float("nan")
        for tp in (1, 8):
            comm_ms = 0.0 if tp == 1 else (2 * 61 + 2) * args.allreduce_us * 1e-3

            def t(w, tp=tp, scale=scale, comm_ms=comm_ms):
                x = per_width[w]
                return x["bytes"] / tp * x["ms_per_byte"] * scale + comm_ms

            plain = t(1)
            step = t(args.k + 1) + draft_ms * scale / tp + comm_ms / 61 * args.k  # draft: 1 layer per forward
            table[f"{gpu}_tp{tp}"] = {"tpot_plain_ms": plain, "spec_step_ms": step, "AL": al,
                                      "tpot_mtp_ms": step / al, "mtp_speedup": al * plain / step}
    res["projection_full_61_layers"] = {
        "note": " ".join(_project.__doc__.split()), "accept_per_position": p, "k": args.k,
        "draft_ms_measured": draft_ms, "measured_on": here, "allreduce_us_assumed": args.allreduce_us,
        "bytes_per_width": {w: x["bytes"] for w, x in per_width.items()}, "table": table}


def _table(res: dict) -> None:
    print(f"\n{res['device']}  copy {res['copy_TBps']:.2f} TB/s  torch {res['torch']}")
    print(f"{'what':34s} {'ms':>9s} {'roofline ms':>12s} {'% roof':>7s}")
    for w, r in res["ours"]["target_step"].items():
        print(f"{'target step w=' + str(w) + ' eager':34s} {r['eager_ms']:9.3f}")
        print(f"{'target step w=' + str(w) + ' graph':34s} {r['graph_ms']:9.3f} {r['roofline_ms']:12.3f} "
              f"{r['pct_of_roofline_graph']:7.1f}")
        print(f"{'  same, unfused glue':34s} {r['graph_ms_unfused_glue']:9.3f}")
        if "profile" in r:
            p = r["profile"]
            print(f"  kernels/step {p['kernels_per_step']:.0f}, kernel time {p['kernel_us_per_step'] / 1e3:.3f} ms of "
                  f"{r['graph_ms']:.3f} ms; top:")
            for k in p["top"][:12]:
                print(f"    {k['us_per_step']:8.1f} us  x{k['calls_per_step']:5.1f}  {k['name'][:70]}")
    for name, r in res["ours"]["spec_step"].items():
        idle = r["gpu_idle_frac"]
        extra = f" idle {100 * idle:.1f}%" if idle is not None else ""
        print(f"{'spec ' + name:34s} {r['step_ms_wall']:9.3f}  (wall per step){extra}")
    if "hf_error" in res:
        print("transformers baseline failed:", res["hf_error"])
    pj = res.get("projection_full_61_layers", {})
    for name, r in pj.get("table", {}).items():
        print(f"{'full 61 layers ' + name:34s} TPOT plain {r['tpot_plain_ms']:6.2f} ms, MTP k={pj['k']} "
              f"{r['tpot_mtp_ms']:6.2f} ms (AL {r['AL']:.2f}, {r['mtp_speedup']:.2f}x)")
    if "hf" in res:
        print(f"{'transformers eager decode':34s} {res['hf']['decode_ms']:9.3f}  ({res['hf']['layers']} layers)"
              f"  ours is {res['speedup_vs_hf_w1']:.1f}x faster (w=1 graph, per layer; at the HBM roofline "
              f"{res.get('speedup_bound_vs_hf_w1', float('nan')):.1f}x)")


if __name__ == "__main__":
    main()
