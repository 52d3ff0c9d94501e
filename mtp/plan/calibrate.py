"""Hold the speed model against our measurements and fit its efficiencies on them.

Measured files (read by their keys):
- `mtp-bench` TP=1 JSON ('ours'): a captured target step of a few full-width layers, widths 1..4;
- `mtp-bench --tp N` rank JSON ('contexts', or 'batches' of them): one simulated rank of TP=N at full depth,
  step per context and width (collectives counted, not run: the model's communication is left out of these
  rows), and the indexer timed alone;
- `mtp.bench.collectives` JSON ('ops'): NCCL all-reduce / all-gather latencies on N GPUs.

Compute-bound terms and the indexer's bytes enter the fit at their peak time. The whole-step rows (the indexer
timed alone is held out, a check) fit, by non-negative least squares on relative error, one achieved bandwidth
fraction per kernel class (weights + head, experts, attention; at most 1), a fixed cost per kernel launch (one
for every class but the indexer, one for the indexer, whose cost is not its bytes) and a cost per launch per
token row past the first (small-batch kernels whose time grows with rows before bytes do). The collectives fit
the link's per-step latency and bandwidth. Every row is then printed with the roofline and the calibrated prediction and the residual.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..model.config import ModelConfig
from .cost import Layout, Shape, forward_terms
from .hardware import GB, GPU, gpu as gpu_by_name
from .speed import Efficiency, time_terms

# fitted unknowns: 1/bandwidth fraction of these kind groups, then launch costs
BW_GROUPS = {"weights": ("weights", "head"), "experts": ("experts",), "attention": ("attention",)}
LAUNCH_GROUPS = {"launch": ("weights", "head", "experts", "attention"), "indexer_launch": ("indexer",)}


@dataclass
class Row:
    source: str
    label: str
    cfg: ModelConfig
    layout: Layout
    shape: Shape
    measured_ms: float
    only: tuple[str, ...] = ()  # term names this row times (empty: the whole forward minus communication)
    measured_kernels: float | None = None
    roofline_ms: float = 0.0
    calibrated_ms: float = 0.0


@dataclass
class Calibration:
    gpu: str
    efficiency: Efficiency
    rows: list[Row]
    link: dict = field(default_factory=dict)  # fitted GPU link fields (from a collectives JSON)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"gpu": self.gpu, "bandwidth_fraction": dict(self.efficiency.bw),
                "launch_us": dict(self.efficiency.launch), "per_row_launch_us": self.efficiency.per_row_launch, "link": self.link, "notes": self.notes,
                "rows": [{"source": r.source, "label": r.label, "measured_ms": r.measured_ms,
                          "roofline_ms": r.roofline_ms, "calibrated_ms": r.calibrated_ms,
                          "residual": r.calibrated_ms / r.measured_ms - 1, "measured_kernels": r.measured_kernels,
                          "model_kernels": _kernels(r)} for r in self.rows]}


def device_key(device: str) -> str | None:
    """The GPU table's name for a torch device name ('NVIDIA H200' -> 'h200'; an H20 with 141 GB -> 'h20-3e')."""
    words = device.lower().replace("-", " ").split()
    for key in ("h800", "h100", "h200", "b200", "l40s"):
        if key in words:
            return key
    if "h20" in words:
        return "h20-3e" if "141" in device or "3e" in device.lower() else "h20"
    return None


def _device(d: dict, path: str) -> str:
    key = device_key(str(d.get("device", "")))
    if key is None:
        raise ValueError(f"--calibrate {path}: field 'device' = {d.get('device')!r} is not a GPU of the table")
    return key


def rows_from(path: str, base: ModelConfig) -> tuple[str, list[Row], dict | None]:
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--calibrate {path}: cannot read a JSON file ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"--calibrate {path}: expected a JSON object, got {type(d).__name__}")
    if "ops" in d:
        return _device(d, path), [], d
    dev = _device(d, path)
    src = Path(path).name
    if "ours" in d:  # TP=1 mtp-bench: a few layers at full width
        c = d["ours"]["config"]
        cfg = dataclasses.replace(base, num_hidden_layers=c["layers"], first_k_dense_replace=c["dense_layers"])
        return dev, [Row(src, f"TP1 {c['layers']}L ctx {c['prompt_len']} w{w}", cfg, Layout(),
                         Shape(c["batch"], int(w), c["prompt_len"] + int(w), touched=_touched(v.get("experts_touched"))),
                         v["graph_ms"]) for w, v in d["ours"]["target_step"].items() if "graph_ms" in v], None
    if "contexts" not in d and "batches" not in d:
        raise ValueError(f"--calibrate {path}: no 'ours', 'contexts', 'batches' or 'ops' field: not an mtp-bench, "
                         f"rank or collectives JSON")
    c = d["config"]
    cfg = dataclasses.replace(base, num_hidden_layers=c["num_hidden_layers"],
                              first_k_dense_replace=c["first_k_dense_replace"])
    tp = int(d["tp"])
    batches = d["batches"] if "batches" in d else {str(d["args"]["batch"]): {"contexts": d["contexts"]}}
    rows = []
    for B, entry in batches.items():
        for L, ctx in entry["contexts"].items():
            for w, v in ctx["widths"].items():
                if "graph_ms" in v:
                    routed = v.get("local_experts_touched") or {}
                    rows.append(Row(src, f"TP{tp} rank b{B} ctx {L} w{w}", cfg, Layout(tp, tp),
                                    Shape(int(B), int(w), int(L) + int(w), touched=routed.get("mean")), v["graph_ms"],
                                    measured_kernels=v.get("kernels_per_step")))
            for w, v in (ctx.get("indexer") or {}).items():
                if "ms_per_step" in v:
                    rows.append(Row(src, f"TP{tp} indexer b{B} ctx {L} w{w}", cfg, Layout(tp, tp),
                                    Shape(int(B), int(w), int(L) + int(w)), v["ms_per_step"], only=("indexer",)))
    return dev, rows, None


def _touched(per_layer: list | None) -> float | None:
    """Mean routed experts read per MoE layer from mtp-bench's per-layer list (dense layers show 0)."""
    moe = [n for n in per_layer or [] if n]
    return sum(moe) / len(moe) if moe else None


def _terms(r: Row):
    t = forward_terms(r.cfg, r.layout, r.shape)
    return [x for x in t if x.name in r.only] if r.only else t


def _kernels(r: Row) -> float:
    return sum(t.launches * t.layers for t in _terms(r))


def _peak_s(t, g: GPU) -> tuple[float, float]:
    return (t.flops_fp8 / (g.fp8_tflops * 1e12) + t.flops_bf16 / (g.bf16_tflops * 1e12),
            t.bytes / (g.hbm_gbps * GB))


def _fixed(t, g: GPU) -> bool:
    """Terms whose time is not fitted as bytes: compute-bound ones, and the indexer (its launches are fitted)."""
    c, m = _peak_s(t, g)
    return c > m or not any(t.kind in kinds for kinds in BW_GROUPS.values())


def _fixed_s(r: Row, g: GPU) -> float:
    """Seconds of the row's `_fixed` terms at peak."""
    return sum(max(_peak_s(t, g)) * t.layers for t in _terms(r) if _fixed(t, g))


def _features(r: Row, g: GPU) -> np.ndarray:
    """Seconds at full bandwidth per bandwidth group, and launches per launch group (the row's time is their
    dot product with [1/fraction..., launch s...])."""
    terms = _terms(r)
    bw = [sum(t.bytes * t.layers for t in terms if t.kind in kinds and not _fixed(t, g)) / (g.hbm_gbps * GB)
          for kinds in BW_GROUPS.values()]
    la = [sum(t.launches * t.layers for t in terms if t.kind in kinds) for kinds in LAUNCH_GROUPS.values()]
    rows = r.shape.rows * r.shape.width
    extra = [sum(t.launches * t.layers for t in terms if t.kind in LAUNCH_GROUPS["launch"]) * (rows - 1)]
    return np.array(bw + la + extra, dtype=np.float64)


def nnls(A: np.ndarray, b: np.ndarray, iters: int = 50) -> np.ndarray:
    """Least squares with x >= 0: solve on the free set, drop the most negative, repeat."""
    free = np.ones(A.shape[1], dtype=bool)
    x = np.zeros(A.shape[1])
    for _ in range(iters):
        x = np.zeros(A.shape[1])
        x[free] = np.linalg.lstsq(A[:, free], b, rcond=None)[0]
        if (x >= 0).all():
            return x
        free[np.argmin(np.where(free, x, np.inf))] = False
    return np.clip(x, 0, None)


def fit_link(ops: dict, g: GPU) -> dict:
    """us = 2 (p-1)/p bytes / bw + ceil(log2 p) * step, over every measured all-reduce."""
    import math
    p = int(ops["world"])
    rows = ops["ops"].get("all_reduce", [])
    if len(rows) < 2:
        raise ValueError("--calibrate: the collectives JSON needs >= 2 all_reduce rows in 'ops'")
    A = np.array([[2 * (p - 1) / p * r["bytes"] / GB, math.ceil(math.log2(p))] for r in rows])
    b = np.array([r["us"] for r in rows], dtype=np.float64)
    inv_bw, step = nnls(A, b)
    return {"link_latency_us": float(step), "link_gbps": float(1e6 / inv_bw) if inv_bw > 0 else g.link_gbps}


def calibrate(base: ModelConfig, paths: list[str]) -> Calibration:
    rows, devices, link_json = [], set(), None
    for p in paths:
        dev, rs, ops = rows_from(p, base)
        devices.add(dev)
        rows += rs
        link_json = ops or link_json
    if not rows:
        raise ValueError(f"--calibrate {' '.join(paths)}: no step rows (give an mtp-bench or rank JSON)")
    if len(devices) > 1:
        raise ValueError(f"--calibrate: files from different GPUs ({sorted(devices)}); calibrate one GPU at a time")
    g = gpu_by_name(devices.pop())
    fit = [r for r in rows if not r.only]  # whole steps; the indexer timed alone is a held-out check
    if not fit:
        raise ValueError(f"--calibrate {' '.join(paths)}: no whole-step rows to fit on")
    A = np.stack([_features(r, g) for r in fit])
    b = np.array([r.measured_ms * 1e-3 for r in fit])
    nb = len(BW_GROUPS)
    # 1 / fraction = 1 + y with y >= 0 (no class beats the HBM peak); relative error: rows scaled by 1 / measured
    floor = A[:, :nb].sum(axis=1) + np.array([_fixed_s(r, g) for r in fit])
    y = nnls(A / b[:, None], (b - floor) / b)
    x = y + np.r_[np.ones(nb), np.zeros(A.shape[1] - nb)]
    bw = tuple((k, 1.0 / x[i]) for i, group in enumerate(BW_GROUPS.values()) for k in group)
    launch = tuple((k, x[nb + j] * 1e6) for j, group in enumerate(LAUNCH_GROUPS.values()) for k in group)
    per_row = x[nb + len(LAUNCH_GROUPS)] * 1e6
    eff = Efficiency(bw=bw, launch=launch, per_row_launch=per_row,
                     source=f"calibrated on {', '.join(Path(p).name for p in paths)}")
    for r in rows:
        terms = _terms(r)
        n = r.shape.rows * r.shape.width
        r.roofline_ms = time_terms(terms, g, r.layout, rows=n).work_ms
        r.calibrated_ms = time_terms(terms, g, r.layout, eff, n).work_ms
    cal = Calibration(g.name, eff, rows)
    if link_json is not None:
        cal.link = fit_link(link_json, g)
    cal.notes = misses(cal)
    return cal


def misses(cal: Calibration) -> list[str]:
    """What the fit says the pure roofline leaves out."""
    out = []
    for k, f in dict(cal.efficiency.bw).items():
        if k in BW_GROUPS and f < 0.5:
            out.append(f"{k}: {f * 100:.0f}% of HBM bandwidth achieved: the roofline's bytes explain under half of "
                       f"this class's time")
    la = dict(cal.efficiency.launch)
    steps = [r for r in cal.rows if not r.only]
    if steps and la.get("weights", 0) > 0:
        r = steps[0]
        share = la["weights"] * _kernels(r) * 1e-3 / r.measured_ms
        out.append(f"fixed cost per kernel {la['weights']:.2f} us x {_kernels(r):.0f} kernels = {share * 100:.0f}% of "
                   f"the {r.label} step: latency the byte roofline does not have")
    if la.get("indexer", 0) > 0:
        out.append(f"indexer: {la['indexer']:.1f} us per launch (scores + radix top-k) where its bytes take "
                   f"~1 us: the top-k selection, not the key read, is its cost")
    alone = [r for r in cal.rows if r.only == ("indexer",)]
    if alone:
        gap = sum(r.calibrated_ms - r.measured_ms for r in alone) / len(alone)
        out.append(f"held out: the indexer timed alone takes {gap:.2f} ms per step less than the steps' fit gives "
                   f"it: that much of the long-context step is attention over the selected keys beyond its bytes"
                   if gap > 0 else f"held out: the indexer timed alone takes {-gap:.2f} ms per step more than the "
                   f"steps' fit gives it")
    routed = [r for r in cal.rows if r.shape.touched is not None and not r.only]
    if routed:
        gaps = []
        for r in routed:
            u = [t for t in forward_terms(r.cfg, r.layout, dataclasses.replace(r.shape, touched=None))
                 if t.name == "routed_experts"][0].weight_bytes
            m = [t for t in forward_terms(r.cfg, r.layout, r.shape) if t.name == "routed_experts"][0].weight_bytes
            gaps.append((u / m - 1, r.label))
        worst = max(gaps, key=lambda g: abs(g[0]))
        out.append(f"routing: the rows use the experts each run touched; uniform routing would read "
                   f"{worst[0] * 100:+.0f}% of those expert bytes at {worst[1]} (random weights route unevenly)")
    bad = [r for r in cal.rows if not r.only and abs(r.calibrated_ms / r.measured_ms - 1) > 0.10]
    if bad:
        out.append("rows off by more than 10% after the fit: " + ", ".join(f"{r.label} "
                   f"({(r.calibrated_ms / r.measured_ms - 1) * 100:+.0f}%)" for r in bad))
    return out


def format_calibration(cal: Calibration) -> str:
    lines = [f"calibration on {cal.gpu} (model outputs vs recorded measurements; communication not in these rows):",
             "  bandwidth fraction: " + ", ".join(f"{k} {v:.3f}" for k, v in dict(cal.efficiency.bw).items()),
             "  fixed cost per launch: " + ", ".join(f"{k} {v:.2f} us" for k, v in dict(cal.efficiency.launch).items())
             + f"; + {cal.efficiency.per_row_launch:.3f} us per launch per token row past the first"]
    if cal.link:
        lines.append(f"  link (fitted on the collectives JSON): {cal.link['link_latency_us']:.2f} us per step, "
                     f"{cal.link['link_gbps']:.0f} GB/s")
    lines.append(f"  {'row':36s} {'measured':>9s} {'roofline':>9s} {'calibrated':>10s} {'residual':>8s} "
                 f"{'kernels meas/model':>19s}")
    for r in cal.rows:
        k = f"{r.measured_kernels:.0f}/{_kernels(r):.0f}" if r.measured_kernels else ""
        k = k or ("held out" if r.only else "")
        lines.append(f"  {r.label:36s} {r.measured_ms:9.3f} {r.roofline_ms:9.3f} {r.calibrated_ms:10.3f} "
                     f"{(r.calibrated_ms / r.measured_ms - 1) * 100:7.1f}% {k:>19s}")
    lines += [f"  misses: {n}" for n in cal.notes]
    return "\n".join(lines)
