"""Timing helpers of the benchmarks (`mtp-bench`, `mtp.bench.parallel`, `mtp-bench --tp N`, `mtp.bench.collectives`): CUDA-event
medians, graph capture, kernel profiles of a replayed graph, and the device's copy bandwidth (the byte floor's
ceiling)."""

from __future__ import annotations

import statistics
import time

import torch


def time_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median CUDA-event time of fn() in ms, after `warmup` calls."""
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


def spec_step_times(m) -> dict:
    """Per-step figures of a generate call's metrics: wall ms per decode step without the drafter's pass over
    the prompt (which `time_decode_s` holds once per call, so dividing it by the steps would spread a prefill
    over them), that pass in ms, and the GPU ms per replayed step graph (None off graph modes)."""
    dp = getattr(m, "time_draft_prefill_s", 0.0)
    return {"step_ms_wall": (m.time_decode_s - dp) / max(m.target_forwards, 1) * 1e3,
            "draft_prefill_ms": dp * 1e3,
            "gpu_step_ms": m.gpu_busy_ms / m.graph_replays if m.graph_replays else None}


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    x = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x), iters=10)
    del x, y
    return 2 * (1 << 29) * 2 / (ms * 1e-3)


def step_bytes(model, n_experts_touched: list[int], S: int, B: int) -> dict:
    """Bytes one target forward must read: every non-expert weight once, the routed experts actually picked,
    the lm_head, and the KV cache of S positions per row (FP8 latent + scales + bf16 rope key + indexer key)."""
    from ..model.cache import KVCache
    from ..model.moe import MoE

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
    kv_per_pos = KVCache.bytes_per_position(cfg, model.dtype, quantized=model.runtime.numerics == "fp8")
    kv = kv_per_pos * S * B * cfg.num_hidden_layers
    return {"weights_dense": dense_bytes, "weights_experts": expert_bytes, "lm_head": head, "kv": kv,
            "total": dense_bytes + expert_bytes + head + kv}


def tree_verify_fns(model, cache, L: int, shape, seed: int = 0) -> dict:
    """For `mtp-bench --trees`: the target verify forward over a tree's N nodes after the cache's first L
    positions, as a tree (`tree_depth` / `tree_mask`: each node sees the cache and its ancestors) and as a chain
    of the same N tokens (the causal verify a chain of N - 1 drafts runs), each a fn() that rolls the cache back
    first, for timing side by side. Random node tokens."""
    B, N, dev = cache.batch, shape.n_nodes, cache.seq_lens.device
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.cfg.vocab_size, (B, N), generator=g).to(dev)
    base = torch.full((B,), L, dtype=torch.long, device=dev)
    depth, mask = shape.depth_tensor(dev), shape.ancestor_mask(dev)

    def tree():
        cache.truncate(base)
        model(ids, cache, kv_len=L + N, tree_depth=depth, tree_mask=mask)

    def chain():
        cache.truncate(base)
        model(ids, cache, kv_len=L + N)

    return {"tree": tree, "chain": chain}


def tree_row(shape, ms: dict, total_bytes: dict, absorb_max_tokens: int) -> dict:
    """One `--trees` entry: per kind ('tree', 'chain' of the same node count) the step ms, ms and bytes per node
    (`total_bytes`: the step's byte floor), and the tree's cost over the chain's. A verify of more than
    `absorb_max_tokens` (RuntimeOptions) nodes takes the naive reference attention, not the kernels: said in
    'attention'."""
    N = shape.n_nodes
    row = {"shape": shape.name, "nodes": N, "depth": shape.max_depth, "parents": list(shape.parents),
           "attention": "kernels" if N <= absorb_max_tokens else f"reference (N > absorb_max_tokens {absorb_max_tokens})"}
    for kind in ms:
        row[kind] = {"ms": ms[kind], "ms_per_node": ms[kind] / N, "bytes": total_bytes[kind],
                     "bytes_per_node": total_bytes[kind] / N}
    if "tree" in ms and "chain" in ms:
        row["tree_over_chain"] = ms["tree"] / ms["chain"]
    return row


GPU_STATE_FIELDS = ("clocks.sm", "clocks.mem", "temperature.gpu", "power.draw", "clocks_throttle_reasons.active")
GPU_STATE_KEYS = ("sm_mhz", "mem_mhz", "temp_c", "power_w", "throttle_reasons")


def parse_gpu_state(line: str) -> dict:
    """One `nvidia-smi --query-gpu=<GPU_STATE_FIELDS> --format=csv,noheader,nounits` line -> {sm_mhz, mem_mhz, temp_c,
    power_w, throttle_reasons}: numbers, the throttle bit mask as its hex string; a field nvidia-smi cannot read
    ('[N/A]', '[Not Supported]') is None. Anything else is refused by name: a wrong reading must not pass as one."""
    parts = [p.strip() for p in line.strip().split(",")]
    if len(parts) != len(GPU_STATE_FIELDS):
        raise ValueError(f"nvidia-smi: expected {len(GPU_STATE_FIELDS)} fields ({', '.join(GPU_STATE_FIELDS)}), "
                         f"got {line.strip()!r}")
    out: dict = {}
    for key, field, raw in zip(GPU_STATE_KEYS, GPU_STATE_FIELDS, parts):
        if raw.startswith("[") or raw in ("N/A", ""):
            out[key] = None
        elif key == "throttle_reasons":
            int(raw, 16)  # a bit mask such as 0x0000000000000004
            out[key] = raw
        else:
            try:
                out[key] = float(raw)
            except ValueError:
                raise ValueError(f"nvidia-smi: field {field} is not a number: {raw!r} in {line.strip()!r}") from None
    return out


def gpu_state(device: torch.device | None = None) -> dict | None:
    """The GPU's SM / memory clocks, temperature, power draw and active throttle reasons now (`parse_gpu_state`), read
    with nvidia-smi for the device's UUID, or None where there is no GPU or no nvidia-smi, or {"error": ...} where
    nvidia-smi refuses the query (the reading is a diagnostic beside a timing: a run-to-run drift of 0.2-0.5 ms on
    the TP=8 rank, BENCHMARKS.md session 13, may be clocks). A reading nvidia-smi gives in another form raises."""
    import shutil
    import subprocess

    if not torch.cuda.is_available() or shutil.which("nvidia-smi") is None:
        return None
    props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    uuid = str(getattr(props, "uuid", "") or "")
    sel = ["-i", uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"] if uuid else []
    res = subprocess.run(["nvidia-smi", *sel, f"--query-gpu={','.join(GPU_STATE_FIELDS)}",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    if res.returncode != 0:  # said beside the timing, not raised: the timing stands without it
        return {"error": f"nvidia-smi exit {res.returncode}: {(res.stderr or res.stdout).strip()[:200]}"}
    return parse_gpu_state(res.stdout.strip().splitlines()[0])


def exposed_us(spans) -> dict[str, float]:
    """Per kernel name, the time its kernels add to the device's busy time: spans (name, start, end) in any order,
    each span counted from the later of its start and the end of every span that started before it (clamped at 0).
    With programmatic dependent launch a kernel starts while its predecessor runs and waits (`gdc_wait`), so its
    duration holds its predecessor's tail; the exposed time does not, and the names' exposed times sum to the union
    of the spans (the step's busy time), where the durations sum to more."""
    out: dict[str, float] = {}
    frontier = float("-inf")
    for name, start, end in sorted(spans, key=lambda t: (t[1], t[2])):
        out[name] = out.get(name, 0.0) + max(0.0, end - max(start, frontier))
        frontier = max(frontier, end)
    return out


def kernel_profile(replay, steps: int = 10, top: int = 30) -> dict:
    """Kernel time inside `steps` replays (torch.profiler / CUPTI sees the kernels of a replayed graph):
    per-kernel-name total and count per step, the sum of kernel time per step, and the number of kernels per
    step. Compared with the graph's event time this splits a step into kernel work and the gaps between
    kernels (launch latency, tails of under-filled kernels). Each row also has `exposed_us_per_step`
    (`exposed_us`: the duration less its overlap with kernels that started earlier; under PDL a kernel's duration
    counts the wait for its predecessor) and the rows are sorted by it; `busy_us_per_step` is the union of every
    device span (what the rows' exposed times sum to, unless the filter below drops a row); `idle_us_per_step` is the rest of the replays' span (first kernel's start to last kernel's
    end, per step): the device running no kernel between launches (graph launch gaps, PDL waits not overlapped)."""
    replay()
    prof, spans, _ = _profiled(lambda: [replay() for _ in range(steps)])
    exposed = exposed_us(spans)
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = e.cuda_time_total
        if t <= 0 or e.key.startswith("cuda"):  # runtime API rows, not device work
            continue
        rows.append({"name": e.key[:120], "us_per_step": t / steps, "calls_per_step": e.count / steps,
                     "exposed_us_per_step": exposed.get(e.key, 0.0) / steps})
    rows.sort(key=lambda r: -r["exposed_us_per_step"])
    busy = sum(exposed.values()) / steps  # the union of every device span: idle below is the rest of the same spans
    span = (max(e for _, _, e in spans) - min(s for _, s, _ in spans)) / steps if spans else 0.0
    return {"kernel_us_per_step": sum(r["us_per_step"] for r in rows),
            "busy_us_per_step": busy, "idle_us_per_step": max(0.0, span - busy),
            "kernels_per_step": sum(r["calls_per_step"] for r in rows), "top": rows[:top]}


def span_totals(spans) -> dict:
    """Per kernel name over spans (name, start, end) in us: device time, calls and exposed time (`exposed_us`), and
    the spans' busy time (their union)."""
    exposed = exposed_us(spans)
    out = {name: {"us": 0.0, "calls": 0, "exposed_us": exposed[name]} for name in exposed}
    for name, start, end in spans:
        out[name]["us"] += end - start
        out[name]["calls"] += 1
    return {"kernels": out, "busy_us": sum(exposed.values())}


def difference_profile(short: dict, long: dict, steps: int, top: int = 40) -> dict:
    """Per-step kernel profile of a loop from two profiled runs of it that differ only in their number of steps
    (`span_totals` of each; `steps` = the long run's steps less the short one's): what the same setup (a prefill,
    graph captures) costs in both cancels, each name's totals are the long run's less the short run's, per step.
    Rows sorted by exposed us per step; a name the short run has and the long one lacks is dropped (it cannot
    belong to the steps). Raises on steps < 1: no step to divide by."""
    if steps < 1:
        raise ValueError(f"difference_profile: the long run must have more steps than the short one, got {steps}")
    rows = []
    for name, b in long["kernels"].items():
        a = short["kernels"].get(name, {"us": 0.0, "calls": 0, "exposed_us": 0.0})
        rows.append({"name": name[:120], "us_per_step": (b["us"] - a["us"]) / steps,
                     "calls_per_step": (b["calls"] - a["calls"]) / steps,
                     "exposed_us_per_step": (b["exposed_us"] - a["exposed_us"]) / steps})
    rows.sort(key=lambda r: -r["exposed_us_per_step"])
    return {"steps": steps, "busy_us_per_step": (long["busy_us"] - short["busy_us"]) / steps,
            "kernels_per_step": sum(r["calls_per_step"] for r in rows), "top": rows[:top]}


def _profiled(fn):
    """One call of fn under torch.profiler's CUDA activity (CUPTI: the kernels of replayed graphs too), the device
    synchronized before and after: (the profile, its device spans (name, start, end) in us, fn's return value)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = fn()
        if cuda:
            torch.cuda.synchronize()
    spans = [(e.key, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
    return prof, spans, result


def profile_call(fn) -> dict:
    """`span_totals` of the CUDA work of one call of fn (`_profiled`; runtime API rows, named cuda*, left out), with
    fn's return value under "result"."""
    _, spans, result = _profiled(fn)
    return {**span_totals([t for t in spans if not t[0].startswith("cuda")]), "result": result}


def timer(cuda: bool, iters: int = 20, warmup: int = 3):
    """fn -> median ms: CUDA events on a GPU, the host clock on CPU (eager work, synchronous there)."""
    if cuda:
        return lambda fn: time_ms(fn, iters=iters, warmup=warmup)

    def cpu_ms(fn) -> float:
        for _ in range(warmup):
            fn()
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)

    return cpu_ms
