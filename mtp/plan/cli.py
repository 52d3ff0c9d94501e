"""`mtp-plan`: memory (`mtp.parallel.memory`, the default) or, with --speed, the analytic speed model.

    mtp-plan --speed --gpu h200 --tp 8 --batch 1 --k 3 --al 2.8        # bundled DeepSeek-V3.2 config
    mtp-plan --speed --gpu h20 --tp 1 --ep 144 --dp-attention --nodes 18 --batch 32
    mtp-plan --speed --compare-published --json                        # zartbot's TL;DR tables, reproduced
    mtp-plan --speed --calibrate eval/results/s9/h200/bench_tp8_batch.json eval/results/bench_tp8_h200_final_s4.json:ctx=32768
    mtp-plan --speed --gpu h200 --tp 8 --al 2.8 --plot speed.png
    mtp-plan --speed --gpu h200 --tp 8 --k 3 --al 2.8 --collectives eval/results/s9/x4/allreduce_4gpu.json --allreduce oneshot
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from ..model.config import ConfigError, ModelConfig
from .collectives import GROWTH, IMPLS, MeasuredComm, read as read_collectives
from .cost import Layout
from .hardware import GPUS, gpu as gpu_by_name
from .speed import Efficiency, SpeedReport, Workload, accept_len, predict

DEFAULT_CONFIG = "deepseek_v32_671b_config.json"
DATA = Path(__file__).resolve().parents[1] / "data"


def resolve_config(name: str) -> Path:
    """A path, a checkpoint folder holding config.json, or a config bundled in mtp/data by file name."""
    p = Path(name)
    if p.is_dir():
        p = p / "config.json"
    if p.exists():
        return p
    if (DATA / name).exists():
        return DATA / name
    raise FileNotFoundError(f"CONFIG: {name!r} is neither a file, a folder with config.json, nor a bundled config "
                            f"({', '.join(sorted(f.name for f in DATA.glob('*config*.json')))})")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mtp-plan --speed", description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help="config.json, a checkpoint folder, or a "
                    f"bundled config name (default {DEFAULT_CONFIG})")
    ap.add_argument("--speed", action="store_true", required=True)
    ap.add_argument("--gpu", default="h200", help=f"one of {', '.join(GPUS)}")
    ap.add_argument("--tp", type=int, default=None, help="attention tensor parallel (default: the GPU's default)")
    ap.add_argument("--ep", type=int, default=None, help="expert parallel (default: --tp)")
    ap.add_argument("--dp-attention", action="store_true", help="data-parallel attention groups, all-to-all MoE")
    ap.add_argument("--nodes", type=int, default=None, help="nodes (default: GPUs / the GPU's per-node count)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per attention group")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens = keys at decode")
    ap.add_argument("--k", type=int, default=0, help="MTP drafts per step")
    ap.add_argument("--al", type=float, default=None, help="mean accepted length per step (1 + accepted drafts)")
    ap.add_argument("--accept", type=float, nargs="+", default=None,
                    help="conditional acceptance per draft position (instead of --al)")
    ap.add_argument("--experts-touched", type=float, default=None,
                    help="routed experts a rank reads per MoE layer in the verify forward (default: uniform routing; "
                         "a measured run's local_experts_touched mean reproduces that run)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--compare-published", action="store_true", help="reproduce zartbot's TL;DR tables")
    ap.add_argument("--calibrate", nargs="+", metavar="FILE", default=None,
                    help="measured JSONs (mtp-bench TP=1, --tp N rank, collectives) to fit efficiencies on; "
                         "FILE:b=1,8:ctx=8192 keeps those batch sizes / contexts of a file")
    ap.add_argument("--collectives", metavar="FILE", default=None,
                    help="measured all-reduce latencies (python -m mtp.bench.allreduce or mtp.bench.collectives JSON) "
                         "for the decode forwards' communication instead of the GPU table's link formula")
    ap.add_argument("--allreduce", choices=IMPLS, default="nccl",
                    help="with --collectives: which measured rows price the all-reduces (oneshot: the block "
                         "boundaries at the fused one-shot + add + norm + quant, the rest plain one-shot)")
    ap.add_argument("--collective-growth", type=float, default=GROWTH,
                    help="with --collectives measured on fewer GPUs than --tp: ASSUMED latency growth per doubling")
    ap.add_argument("--plot", metavar="FILE", default=None, help="tok/s vs batch for k = 0..3 (matplotlib)")
    return ap


def parse(argv: list[str]) -> tuple[argparse.Namespace, ModelConfig, Layout, Workload]:
    ap = parser()
    a = ap.parse_args(argv)
    try:
        g = gpu_by_name(a.gpu)
    except ValueError as e:
        ap.error(str(e))
    if a.al is not None and a.accept is not None:
        ap.error("--al and --accept: give one")
    if a.accept is not None and not all(0.0 <= p <= 1.0 for p in a.accept):
        ap.error(f"--accept: rates must be in [0, 1], got {a.accept}")
    if a.al is None and a.accept is None and a.k:
        ap.error(f"--k {a.k} needs --al or --accept (how many tokens a step keeps)")
    tp = a.tp if a.tp is not None else g.default_tp
    ep = a.ep if a.ep is not None else tp
    if a.nodes is None:
        nodes = max(1, -(-ep // g.gpus_per_node))
    else:
        nodes = a.nodes
    try:
        lay = Layout(tp, ep, a.dp_attention, nodes, g.mlp_split if tp > 16 else "blocks")
        al = a.al if a.al is not None else (accept_len(a.accept, a.k) if a.accept else 1.0)
        wl = Workload(a.batch, a.context, a.k, al, experts_touched=a.experts_touched)
    except ValueError as e:
        ap.error(str(e))
    if lay.world > nodes * g.gpus_per_node:
        ap.error(f"--nodes {nodes}: {lay.world} ranks need at least {-(-lay.world // g.gpus_per_node)} nodes of "
                 f"{g.gpus_per_node} {g.name}")
    try:
        cfg = ModelConfig.from_json(resolve_config(a.config))
    except (FileNotFoundError, ConfigError) as e:
        ap.exit(2, f"mtp-plan: error: {e}\n")
    if cfg.num_attention_heads % tp or cfg.n_routed_experts % ep:
        ap.error(f"--tp {tp} / --ep {ep}: {cfg.num_attention_heads} heads and {cfg.n_routed_experts} experts must "
                 f"divide evenly")
    return a, cfg, lay, wl


def format_report(r: SpeedReport) -> str:
    s = r.summary()
    lay, wl = r.layout, r.workload
    lines = [f"mtp-plan --speed: {r.gpu} x {r.gpus}, TP{lay['tp']} EP{lay['ep']}"
             f"{' DP-attention' if lay['dp_attention'] else ''}, {lay['nodes']} node(s); batch {wl['batch']}, "
             f"context {wl['context']}, k={wl['k']}, AL {wl['al']:.3f}",
             f"  efficiency: {r.efficiency}"]
    for label, f, mult in (("prefill", r.prefill, 1), ("verify (width k+1)", r.verify, 1),
                           (f"draft (x{wl['k']})", r.draft, wl["k"])):
        if f is None:
            continue
        lines += ["", f"{label}: {f.serial_ms:.3f} ms serial, {f.overlap_ms:.3f} ms overlapped",
                  f"  {'term':16s} {'layers':>6s} {'GFLOP':>10s} {'MB':>10s} {'comm KB':>9s} {'compute ms':>10s} "
                  f"{'memory ms':>9s} {'launch ms':>9s} {'comm ms':>8s}  bound"]
        for t in f.terms:
            lines.append(f"  {t.name:16s} {t.layers:6d} {t.flops / 1e9:10.2f} {t.bytes / 1e6:10.1f} "
                         f"{t.comm_bytes / 1e3:9.1f} {t.compute_ms:10.4f} {t.memory_ms:9.4f} {t.launch_ms:9.4f} "
                         f"{t.comm_ms:8.4f}  {t.bound}")
    lines += ["", f"TTFT {s['ttft_ms']:.2f} ms ({s['ttft_overlap_ms']:.2f} overlapped); step {s['step_ms']:.3f} ms "
              f"({s['step_overlap_ms']:.3f} overlapped); TPOT {s['tpot_ms']:.3f} ms ({s['tpot_overlap_ms']:.3f})",
              f"tok/s per user {s['tok_s_user']:.1f} ({s['tok_s_user_overlap']:.1f} overlapped); "
              f"per GPU {s['tok_s_gpu']:.1f} ({s['tok_s_gpu_overlap']:.1f})"]
    lines += [f"note: {n}" for n in r.notes]
    return "\n".join(lines)


def speed_main(argv: list[str]) -> int:
    a, cfg, lay, wl = parse(argv)
    g = gpu_by_name(a.gpu)
    if a.compare_published:
        from .published import compare, format_rows
        rows = compare(cfg)
        print(json.dumps(rows, indent=1) if a.json else format_rows(rows, cfg))
        return 0
    eff = Efficiency()
    cal = None
    if a.calibrate:
        from .calibrate import calibrate, format_calibration
        try:
            cal = calibrate(cfg, a.calibrate)
        except ValueError as e:
            parser().error(str(e))
        eff = cal.efficiency
    if a.plot:
        from .plot import plot_speed
        plot_speed(cfg, a.plot, wl.al, wl.k, a.calibrate or [], eff, wl.context)
    if cal is not None and cal.link:
        g = dataclasses.replace(g, **cal.link)
    measured = None
    if a.collectives:
        if lay.tp > g.gpus_per_node:
            parser().error(f"--collectives: measured within one node; TP{lay.tp} spans nodes of {g.gpus_per_node}")
        try:  # the model books the norm-quant kernel a fused all-reduce absorbs as one attention-class launch
            measured = MeasuredComm(read_collectives(a.collectives), lay.tp, a.allreduce, a.collective_growth,
                                    held_us=eff.launch_of("attention"))
        except ValueError as e:
            parser().error(f"--collectives: {e}")
    elif a.allreduce != "nccl":
        parser().error(f"--allreduce {a.allreduce} needs --collectives (a measured mtp.bench.allreduce file)")
    if cal is not None:
        cal.collectives = (f"communication from {a.collectives} (--collectives, --allreduce {a.allreduce})"
                           if a.collectives else
                           f"link fitted on {cal.link_source} (--calibrate)" if cal.link else
                           "no collectives file given (--collectives): the GPU table's link formula")
    r = predict(cfg, g, lay, wl, eff, measured)
    if cal is not None:
        r.notes.append(f"efficiencies fitted on {cal.gpu} decode steps (batch and widths of the files); prefill and "
                       f"other GPUs ({g.name}) take them as they are")
    if a.json:
        d = r.to_dict()
        if cal is not None:
            d["calibration"] = cal.to_dict()
        print(json.dumps(d, indent=1))
    else:
        if cal is not None:
            print(format_calibration(cal) + "\n")
        print(format_report(r))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--speed" in argv:
        return speed_main(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("mtp-plan --speed [CONFIG] [options]: the analytic speed model (mtp-plan --speed --help); "
              "without --speed, the memory planner:")
    from ..parallel.memory import main as memory_main
    return memory_main(argv)


if __name__ == "__main__":
    sys.exit(main())
