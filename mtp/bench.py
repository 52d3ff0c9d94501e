"""`mtp-bench`: decode-step latency of DeepSeek-V3.2 at real width with random FP8 weights, in one run:
measured copy bandwidth (the roofline's ceiling), our target step for verify widths 1..K+1 (eager and graph),
whole speculative steps in eager / graph / overlap mode with GPU idle time, the same truncated model through
transformers' eager implementation, and an analytic byte count per step (weights touched, including the union
of routed experts the K+1 tokens pick, plus KV reads) giving the HBM roofline and our percentage of it.
Projections to the full 61-layer model use the measured per-layer costs. Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
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
    from .moe import MoE

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
    from .moe import MoE

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


def bench_ours(args, bw: float) -> dict:
    from .engine import generate
    from .fastpath import enable_fast_path
    from .layers import glue
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
            graph_ms = _time_ms(_capture(fwd).replay)
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
    res["target_step"] = widths
    # whole speculative steps (draft K + verify K+1 + accept + commit) in each mode
    spec = {}
    prompts = ids[:, :L].tolist()
    for draft, k in (("none", 0), ("eagle", args.k)):
        for mode in ("eager", "graph", "overlap"):
            out = generate(model, prompts, args.new_tokens, draft=draft, k=k, mode=mode)
            m = out.metrics
            d = m.to_dict()
            per_step = m.time_decode_s / max(m.target_forwards, 1) * 1e3
            spec[f"{draft}_k{k}_{mode}"] = {
                "step_ms_wall": per_step, "decode_tok_s": m.decode_tok_s, "AL": m.mean_accepted_len,
                "gpu_idle_frac": d.get("graph/gpu_idle_frac"), "capture_s": d.get("graph/capture_s"),
                "graph_pool_bytes": d.get("graph/pool_bytes"),
                "gpu_step_ms": m.gpu_busy_ms / m.graph_replays if m.graph_replays else None}
    res["spec_step"] = spec
    # per-layer costs for projections: attention-only share from a dense vs MoE split is not separable here;
    # use bytes: the measured graph time scaled by the byte ratio of the full model
    del model
    torch.cuda.empty_cache()
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
        except Exception as e:  # keep our numbers even if this transformers version differs
            res["hf_error"] = repr(e)[:500]
    _project(res, args)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1, default=float)
    os.replace(tmp, args.out)
    _table(res)


def _project(res: dict, args) -> None:
    """Full-model TPOT from measured per-step time scaled by bytes: (61 layers + MTP) / measured layers."""
    o = res["ours"]["target_step"]
    w1 = o[1]
    per_byte_ms = w1["graph_ms"] / w1["bytes"]["total"]
    full = {}
    for w, r in o.items():
        b = r["bytes"]
        moe_layers = args.layers - args.dense_layers
        per_moe = b["weights_experts"] / max(moe_layers, 1)
        dense_per_layer = (b["weights_dense"]) / args.layers
        full_bytes = 61 * dense_per_layer + 58 * per_moe + b["lm_head"] + b["kv"] / args.layers * 61
        full[w] = {"bytes": full_bytes, "tpot_ms_1gpu_est": full_bytes * r["graph_ms"] / b["total"]}
    res["projection_full_61_layers"] = {"note": "measured ms/byte of this run times the full model's bytes; one GPU, "
                                        "no TP; for TP=8 divide bytes by 8 and add all-reduce latency",
                                        "per_width": full, "ms_per_byte_w1": per_byte_ms}


def _table(res: dict) -> None:
    print(f"\n{res['device']}  copy {res['copy_TBps']:.2f} TB/s  torch {res['torch']}")
    print(f"{'what':34s} {'ms':>9s} {'roofline ms':>12s} {'% roof':>7s}")
    for w, r in res["ours"]["target_step"].items():
        print(f"{'target step w=' + str(w) + ' eager':34s} {r['eager_ms']:9.3f}")
        print(f"{'target step w=' + str(w) + ' graph':34s} {r['graph_ms']:9.3f} {r['roofline_ms']:12.3f} "
              f"{r['pct_of_roofline_graph']:7.1f}")
        print(f"{'  same, unfused glue':34s} {r['graph_ms_unfused_glue']:9.3f}")
    for name, r in res["ours"]["spec_step"].items():
        idle = r["gpu_idle_frac"]
        extra = f" idle {100 * idle:.1f}%" if idle is not None else ""
        print(f"{'spec ' + name:34s} {r['step_ms_wall']:9.3f}  (wall per step){extra}")
    if "hf_error" in res:
        print("transformers baseline failed:", res["hf_error"])
    if "hf" in res:
        print(f"{'transformers eager decode':34s} {res['hf']['decode_ms']:9.3f}  ({res['hf']['layers']} layers)"
              f"  ours is {res['speedup_vs_hf_w1']:.1f}x faster (w=1 graph, per layer)")


if __name__ == "__main__":
    main()
