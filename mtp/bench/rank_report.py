"""What `mtp-bench --tp N` prints and writes: the progress log, the atomic JSON, the summary table.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


CPU_NOTICE = ("CPU RUN: these are CPU times of a small simulated rank, not GPU numbers; its tok/s projection says "
              "nothing about a GPU deployment (run on a CUDA GPU for that)")


def save(res: dict, path: str | None) -> None:
    """The result as JSON at `path` (--out); nothing when no file was asked for."""
    if path is None:
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(res, indent=1, default=float))
    os.replace(tmp, out)


def _busy_ms(r: dict) -> str:
    """A width's busy kernel time in ms from the profiled replays (`timing.kernel_profile`), '-' without one."""
    return format(r["busy_us_per_step"] / 1e3, "8.3f") if "busy_us_per_step" in r else "-"


def print_table(res: dict) -> None:
    """Per-kernel profiles first (long), then the summary lines, so the end of the output is the summary."""
    if res["device"] == "cpu":
        print(f"*** {CPU_NOTICE} ***")
    for L, ctx in res["contexts"].items():
        ws = list(ctx["widths"])
        for w in (ws[0], ws[-1]):
            top = ctx["widths"][w].get("profile_top")
            if top:
                print(f"kernels of the target step, context {L}, w={w} (per step; exposed = not overlapped by "
                      f"earlier kernels, the duration counts a PDL launch's wait):")
                for k in top[:12]:
                    ex = k.get("exposed_us_per_step")
                    ex = f"{ex:9.1f} us exposed" if ex is not None else ""
                    print(f"  {ex} {k['us_per_step']:9.1f} us  x{k['calls_per_step']:6.1f}  {k['name'][:80]}")
    cfgd = res["config"]
    if res.get("extrapolated"):
        print(f"\n*** {res['extrapolated']} ***")
    print(f"\n{res['mode']}\n{res['device']}, torch {res['torch']}, {cfgd['num_hidden_layers']} layers "
          f"({cfgd['first_k_dense_replace']} dense), params {res['param_gib']:.2f} GiB/rank, built in "
          f"{res['build_s']:.0f} s" + (f", copy {res['copy_TBps']:.2f} TB/s" if "copy_TBps" in res else ""))
    print(f"{'context':>8s} {'w':>2s} {'step ms':>8s} {'b2b ms':>8s} {'busy ms':>8s} {'floor ms':>9s} {'% floor':>8s} "
          f"{'kernels':>8s} {'k/layer':>8s} {'AR+AG':>7s} {'experts':>8s} {'indexer ms/step':>16s}")
    for L, ctx in res["contexts"].items():
        for w, r in ctx["widths"].items():
            ix = ctx["indexer"][w]
            f = lambda key, fmt: format(r[key], fmt) if key in r else "-"  # noqa: E731
            c = r["collectives"]
            print(f"{L:>8} {w:>2} {format(r.get('graph_ms', r.get('eager_ms')), '8.3f'):>8s} {f('graph_ms_b2b', '8.3f'):>8s} "
                  f"{_busy_ms(r):>8s} {f('floor_ms', '9.3f'):>9s} "
                  f"{f('pct_of_floor', '8.1f'):>8s} {f('kernels_per_step', '8.0f'):>8s} {f('kernels_per_layer', '8.1f'):>8s} "
                  f"{c['all_reduce']:>3}+{c['all_gather']:<3} {r['local_experts_touched']['mean']:8.2f} "
                  f"{format(ix['ms_per_step'], '16.3f') if 'ms_per_step' in ix else 'no indexer':>16s}")
    for name, var in res.get("variants", {}).items():
        if "error" in var:
            print(f"kernel variant {name}: FAILED {var['error'][:300]}")
        for L, ctx in var.get("contexts", {}).items():
            for w, r in ctx["widths"].items():
                print(f"{L:>8} {w:>2} {r.get('graph_ms', float('nan')):8.3f} {r.get('graph_ms_b2b', float('nan')):8.3f} "
                      f"{_busy_ms(r):>8s} {r.get('floor_ms', float('nan')):9.3f} "
                      f"{r.get('pct_of_floor', float('nan')):8.1f} {r.get('kernels_per_step', 0):8.0f} "
                      f"{r.get('kernels_per_layer', 0):8.1f}  variant {name}")
    for L, ctx in res["contexts"].items():
        for w, r in ctx["widths"].items():
            b = r.get("busiest_rank")
            if b:
                print(f"{L:>8} {w:>2} busiest rank of layout {b['layout']!r}: {statistics.mean(b['realised_per_moe_layer']):.2f}"
                      f" local experts per MoE layer (drawn {statistics.mean(b['drawn_per_moe_layer']):.2f}), "
                      f"{statistics.mean(b['local_pairs_per_moe_layer']):.1f} (token, expert) pairs")
    print_trees(res["contexts"])
    print("caches: random valid FP8 entries at each context (fill_cache_random), no prefill run; experts: distinct "
          "local experts the step's tokens chose (measured), mean per MoE layer; AR+AG: collectives per step (not run)")
    for L, ctx in res["contexts"].items():
        for w, ix in ctx["indexer"].items():
            if "ms_per_step" in ix:
                print(f"indexer alone, context {L}, w={w}: scores {ix['scores_us_per_layer']:.1f} us + top-k "
                      f"{ix['topk_us_per_layer']:.1f} us per layer = {ix['ms_per_step']:.3f} ms per step ({ix['layers']} layers)")
    spec = res.get("spec_step")
    if spec:
        print(f"speculative steps at context {spec['prompt_len']} (generate, real prefill):")
        for name, r in spec["runs"].items():
            if "error" in r:
                print(f"  {name:24s} FAILED {r['error'][:200]}")
                continue
            gpu = f", GPU {r['gpu_step_ms']:.3f} ms" if r["gpu_step_ms"] else ""
            print(f"  {name:24s} {r['step_ms_wall']:8.3f} ms/step wall{gpu}")
            if r.get("draft_vocab"):
                print(f"  {'':24s} its draft vocabulary: {r['draft_vocab']} ids, {r['draft_vocab_layout']}, "
                      f"{r['draft_vocab_rows']} head rows on this rank")
            h = r.get("draft_head_fp8")
            if h:
                print(f"  {'':24s} its FP8 head copy: {h['bytes'] / 1e6:.1f} MB on this rank (planner: "
                      f"{h['planned_bytes'] / 1e6:.1f} MB), beside the bf16 head's {h['bf16_head_bytes'] / 1e6:.1f} MB")
    if "spec_step_error" in res:
        print(f"speculative steps failed: {res['spec_step_error']}")
    print_projection(res)
    if res["device"] == "cpu":
        print(f"*** {CPU_NOTICE} ***")
    sys.stdout.flush()


def print_projection(res: dict) -> None:
    """The projection's lines (`rank_model.project`): also what `mtp.bench.reproject` prints."""
    pj = res.get("projection")
    if not pj:
        return
    print(f"projection ({pj['deployment']}); collectives: {pj['collective_latency']['source']}; "
          f"acceptance per position {pj['accept_per_position']}")
    if pj.get("target_step_timing"):
        print(f"  target steps: {pj['target_step_timing']} ("
              + ("replays back to back: no host launch latency" if pj["target_step_timing"] == "graph_ms_b2b"
                 else "one replay per event pair: host launch latency included") + ")")
    if "real_overhead" in pj:
        print(f"  x {pj['real_overhead']['factor']:.2f} real-vs-simulated overhead, {pj['real_overhead']['source']}")
    for L, row in pj["contexts"].items():
        for n, r in row.items():
            if "at_AL" in r:
                print(f"  HEADLINE context {L}, eagle k={n[len('eagle_k'):]}: " + "; ".join(
                    f"AL {a:.2f} -> {v['tok_s_per_user']:.0f} tok/s per user" for a, v in r["at_AL"].items())
                      + f" (AL {r['AL']:.2f} from --accept: {r['tok_s_per_user']:.0f})")
    for L, row in pj["contexts"].items():
        parts = [f"plain {row['plain']['tpot_ms']:.2f} ms ({row['plain']['tok_s_per_user']:.0f} tok/s)"]
        parts += [f"eagle k={n[len('eagle_k'):]} {r['tpot_ms']:.2f} ms ({r['tok_s_per_user']:.0f} tok/s, AL {r['AL']:.2f})"
                  for n, r in row.items() if n.startswith("eagle_k")]
        parts += [f"tree {n[len('tree_'):]} {r['tpot_ms']:.2f} ms ({r['tok_s_per_user']:.0f} tok/s, AL {r['AL']:.2f} "
                  f"given)" for n, r in row.items() if n.startswith("tree_")]
        print(f"  context {L}: " + "; ".join(parts))
    first = next(iter(pj["contexts"].values()), None)
    for name, v in pj["other_deployments"].items():
        if v == "this run" and first:
            best = max((r for n, r in first.items() if n.startswith("eagle_k")),
                       key=lambda r: r["tok_s_per_user"], default=None)
            v = (f"this run, context {next(iter(pj['contexts']))}: plain {first['plain']['tok_s_per_user']:.0f} "
                 f"tok/s per user" + (f", with MTP {best['tok_s_per_user']:.0f} (AL {best['AL']:.2f})" if best else ""))
        print(f"  {name}: {v}")
    for name, v in pj["references_tok_s_per_user"].items():
        if res["device"] != "cpu":  # published GPU numbers beside CPU times would read as a comparison
            print(f"  reference: {name}: {v:.0f} tok/s per user")


def print_trees(contexts: dict) -> None:
    """The `--trees` rows: each tree's verify beside the chain of the same node count (per context)."""
    rows = [(L, r) for L, ctx in contexts.items() for r in ctx.get("trees", {}).values()]
    if not rows:
        return
    print(f"{'context':>8s} {'tree':>10s} {'N':>3s} {'tree ms':>8s} {'ms/node':>8s} {'chain ms':>9s} "
          f"{'tree/chain':>10s} {'MB/node':>8s} {'% floor':>8s}")
    for L, r in rows:
        pct = format(r["pct_of_floor"], "8.1f") if "pct_of_floor" in r else "       -"
        print(f"{L:>8} {r['shape']:>10s} {r['nodes']:>3} {r['tree']['ms']:8.3f} {r['tree']['ms_per_node']:8.3f} "
              f"{r['chain']['ms']:9.3f} {r['tree_over_chain']:10.2f} {r['tree']['bytes_per_node'] / 1e6:8.1f} {pct}"
              + ("" if r.get("attention", "kernels") == "kernels" else f"  attention: {r['attention']}"))
    sys.stdout.flush()
