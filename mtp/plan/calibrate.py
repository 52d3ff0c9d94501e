"""Hold the speed model against our measurements and fit its efficiencies on them, within physical bounds.

Measured files (read by their keys):
- `mtp-bench` TP=1 JSON ('ours'): a captured target step of a few full-width layers, widths 1..4;
- `mtp-bench --tp N` rank JSON ('contexts', or 'batches' of them): one simulated rank of TP=N at full depth,
  step per batch, context and width (collectives counted, not run: communication is left out of these rows), and
  the indexer timed alone;
- `mtp.bench.collectives` JSON ('ops'): NCCL all-reduce / all-gather latencies on N GPUs.
A file name may carry a row selection, `FILE:b=1:ctx=8192,32768` (batch sizes, contexts): to take the batch-1
rows of a run whose larger batches measured something else.

The model: each term costs layers x max(FLOPs / (peak x compute fraction), bytes / (HBM x bandwidth fraction))
plus launches x a fixed cost, with one bandwidth and one compute fraction per kernel group (dense weights + head,
routed experts, attention + indexer), one fixed cost per launch shared by every kernel but the indexer's, and the
indexer's own (its cost is the top-k selection, not its bytes). `PARAMS` gives each parameter's bounds and why;
`mtp.plan.fit` fits them on relative error over the whole-step rows (the indexer timed alone is held out, a check)
and says which ones the rows cannot separate. A held-out check fits the low half of the batch sizes and predicts
the high half, and the other way round. The collectives fit the link's per-step latency and bandwidth.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..model.config import ModelConfig
from .cost import Layout, Shape, forward_terms
from .collectives import read_json_object
from .fit import FitResult, Param, fit_bounded, smooth_max
from .hardware import GB, GPU, gpu as gpu_by_name
from .speed import Efficiency, peak_s, time_terms

# kernel groups sharing one bandwidth and one compute fraction, and one fixed cost per launch
GROUPS = {"weights": ("weights", "head"), "experts": ("experts",), "attention": ("attention", "indexer")}
LAUNCH_GROUPS = {"launch": ("weights", "head", "experts", "attention"), "indexer_launch": ("indexer",)}
_BW = ("[0.3, 1]: no kernel beats the HBM peak (a plain copy reaches ~0.87 of it on an H200, mtp-bench "
       "copy_TBps); a class whose time is under 0.3 of its bytes' is not bandwidth-bound, and that time belongs "
       "to its launches or FLOPs, which have terms of their own")
_FLOP = ("[0.01, 1] of the dense tensor-core peak: 1 is the datasheet; 0.01 admits CUDA-core kernels (H200 fp32 "
         "FMA ~67 TFLOPS = 0.034 of the FP8 peak) and tensor-core GEMMs whose M is padded to 64 rows for a few "
         "tokens")
PARAMS = ([Param(f"bw_{g}", "of HBM peak", 0.3, 1.0, _BW, inverse=True) for g in GROUPS]
          + [Param(f"flops_{g}", "of tensor peak", 0.01, 1.0, _FLOP, inverse=True) for g in GROUPS]
          + [Param("launch", "us per launch", 0.0, 20.0, "[0, 20] us: a graph-replayed kernel's fixed cost "
                   "(launch, ramp, tail) is a few us on Hopper; never negative"),
             Param("indexer_launch", "us per launch", 0.0, 500.0, "[0, 500] us: the indexer's scores + radix "
                   "top-k over up to 32k keys; never negative")])


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

    @property
    def residual(self) -> float:
        return self.calibrated_ms / self.measured_ms - 1


@dataclass
class Calibration:
    gpu: str
    efficiency: Efficiency
    rows: list[Row]
    fit: FitResult
    holdout: list[dict] = field(default_factory=list)  # fit on some batch sizes, error on the others
    link: dict = field(default_factory=dict)  # fitted GPU link fields (from a collectives JSON)
    link_source: str = ""  # the collectives JSON the link was fitted on
    collectives: str = ""  # where the projection's communication comes from (set by the caller)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        f = self.fit
        return {"gpu": self.gpu, "efficiency_source": self.efficiency.source,
                "parameters": {p.name: {"value": f.values[p.name], "unit": p.unit, "bounds": [p.lo, p.hi],
                                        "why_bounds": p.why, "at_bound": f.bound.get(p.name),
                                        "rel_sigma": f.rel_sigma.get(p.name),
                                        "not_separable": f.unresolved.get(p.name)} for p in f.params},
                "bandwidth_fraction": dict(self.efficiency.bw), "compute_fraction": dict(self.efficiency.compute),
                "launch_us": dict(self.efficiency.launch), "link": self.link, "link_source": self.link_source,
                "collectives": self.collectives, "holdout": self.holdout,
                "notes": self.notes,
                "rows": [{"source": r.source, "label": r.label, "fitted": not r.only, "measured_ms": r.measured_ms,
                          "roofline_ms": r.roofline_ms, "calibrated_ms": r.calibrated_ms, "residual": r.residual,
                          "measured_kernels": r.measured_kernels, "model_kernels": _kernels(r)}
                         for r in self.rows]}


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


def parse_spec(spec: str) -> tuple[str, dict[str, set[int]]]:
    """'FILE:b=1:ctx=8192,32768' -> ('FILE', {'b': {1}, 'ctx': {8192, 32768}})."""
    path, *sels = spec.split(":")
    keep: dict[str, set[int]] = {}
    for sel in sels:
        key, _, vals = sel.partition("=")
        try:
            if key not in ("b", "ctx") or not vals:
                raise ValueError
            keep[key] = {int(v) for v in vals.split(",")}
        except ValueError:
            raise ValueError(f"--calibrate {spec}: row selection {sel!r} must be b=N[,N...] or ctx=N[,N...]") \
                from None
    return path, keep


def _field(d: dict, key: str, path: str, where: str):
    try:
        return d[key]
    except (KeyError, TypeError):
        raise ValueError(f"--calibrate {path}: missing field {where}{key!r}") from None


# the switches session 11 added, all off: how the fast path launched before them (a file without
# 'fast_path_options' was written by that code)
BEFORE_SESSION_11 = dict(fuse_prologue=False, fuse_absorb_out=False, fuse_out_cast=False, topk_rearm=False,
                         shared_in_experts=False)
# switches a file may not record because the code that wrote it had none: what that code did (a switch added on by
# default changes the launches of the files written before it)
UNRECORDED = dict(moe_down_nb=False,  # session 20: before it, every persistent call had its combine launch
                  rope_table=False, vocab_embed=False, mtp_norms=False,  # session 21: the glue's torch launches
                  gather_cast=False)  # session 25: the fp32 casts after the gathered copies


def measured_code(d: dict) -> tuple[object, str]:
    """(launch limits, expert layout) of the code that wrote the mtp-bench JSON `d` (or its 'ours' part): its
    recorded `fast_path_options` over this code's thresholds, else the switches before session 11 (which recorded
    neither); a switch it did not record as `UNRECORDED` gives it; the layout it recorded ('expert_layout'), else 'contiguous' (mtp-bench --tp N before 'auto')."""
    from .kernels import Limits

    lim = Limits.current()
    known = {f.name for f in dataclasses.fields(lim)}
    opts = d.get("fast_path_options")
    flags = BEFORE_SESSION_11 if opts is None else {k: v for k, v in opts.items() if k in known}
    # the code before session 21 (no rope_table switch to record) launched an arange for every forward's slots
    old_slots = opts is None or "rope_table" not in opts
    return (dataclasses.replace(lim, **dict(UNRECORDED, **flags), slots_arange=old_slots),
            d.get("expert_layout", "contiguous"))


def rows_from(spec: str, base: ModelConfig) -> tuple[str, list[Row], dict | None]:
    path, keep = parse_spec(spec)
    d = read_json_object(path, f"--calibrate {path}")
    if "ops" in d:
        return _device(d, path), [], d
    dev = _device(d, path)
    src = Path(path).name
    if "ours" in d:  # TP=1 mtp-bench: a few layers at full width
        c = _field(d["ours"], "config", path, "ours.")
        cfg = dataclasses.replace(base, num_hidden_layers=c["layers"], first_k_dense_replace=c["dense_layers"])
        lim, lay = measured_code(d["ours"])
        rows = [Row(src, f"TP1 {c['layers']}L b{c['batch']} ctx {c['prompt_len']} w{w}", cfg, Layout(),
                    Shape(c["batch"], int(w), c["prompt_len"] + int(w), touched=_touched(v.get("experts_touched")),
                          expert_layout=lay, launch_limits=lim),
                    _ms(v, "graph_ms", path, f"ours.target_step.{w}."))
                for w, v in _field(d["ours"], "target_step", path, "ours.").items() if "graph_ms" in v]
        return dev, _select(rows, keep, spec), None
    if "contexts" not in d and "batches" not in d:
        raise ValueError(f"--calibrate {path}: no 'ours', 'contexts', 'batches' or 'ops' field: not an mtp-bench, "
                         f"rank or collectives JSON")
    c = _field(d, "config", path, "")
    cfg = dataclasses.replace(base, num_hidden_layers=c["num_hidden_layers"],
                              first_k_dense_replace=c["first_k_dense_replace"])
    tp = int(_field(d, "tp", path, ""))
    verify = int((d.get("args") or {}).get("k") or 0) + 1  # mtp-bench's cache holds the context + k + 1 keys
    batches = d["batches"] if "batches" in d else {str(d["args"]["batch"]): {"contexts": d["contexts"]}}
    lim, lay = measured_code(d)
    rows = []
    for B, entry in batches.items():
        for L, ctx in _field(entry, "contexts", path, f"batches.{B}.").items():
            for w, v in _field(ctx, "widths", path, f"batches.{B}.contexts.{L}.").items():
                if "graph_ms" in v:
                    routed = v.get("local_experts_touched") or {}
                    rows.append(Row(src, f"TP{tp} rank b{B} ctx {L} w{w}", cfg, Layout(tp, tp),
                                    Shape(int(B), int(w), int(L) + int(w), touched=routed.get("mean"),
                                          cache_len=int(L) + max(verify, int(w)), expert_layout=lay,
                                          launch_limits=lim),
                                    # back to back where timed (since session 14): the GPU's time per step, which
                                    # the model estimates, without one replay's host launch latency
                                    _ms(v, "graph_ms_b2b" if "graph_ms_b2b" in v else "graph_ms", path,
                                        f"batches.{B}.contexts.{L}.widths.{w}."),
                                    measured_kernels=v.get("kernels_per_step")))
            for w, v in (ctx.get("indexer") or {}).items():
                if "ms_per_step" in v:
                    rows.append(Row(src, f"TP{tp} indexer b{B} ctx {L} w{w}", cfg, Layout(tp, tp),
                                    Shape(int(B), int(w), int(L) + int(w), expert_layout=lay, launch_limits=lim),
                                    _ms(v, "ms_per_step", path, f"batches.{B}.contexts.{L}.indexer.{w}."),
                                    only=("indexer",)))
    return dev, _select(rows, keep, spec), None


def _ms(v: dict, key: str, path: str, where: str) -> float:
    x = v[key]
    if not isinstance(x, (int, float)) or not x > 0:
        raise ValueError(f"--calibrate {path}: field {where}{key} = {x!r} is not a positive time in ms")
    return float(x)


def _select(rows: list[Row], keep: dict[str, set[int]], spec: str) -> list[Row]:
    out = [r for r in rows if r.shape.rows in keep.get("b", {r.shape.rows})
           and r.shape.context - r.shape.width in keep.get("ctx", {r.shape.context - r.shape.width})]
    if rows and not out:
        have = sorted({(r.shape.rows, r.shape.context - r.shape.width) for r in rows})
        raise ValueError(f"--calibrate {spec}: the selection keeps no row (the file has (batch, context) {have})")
    return out


def _touched(per_layer: list | None) -> float | None:
    """Mean routed experts read per MoE layer from mtp-bench's per-layer list (dense layers show 0)."""
    moe = [n for n in per_layer or [] if n]
    return sum(moe) / len(moe) if moe else None


def _terms(r: Row):
    t = forward_terms(r.cfg, r.layout, r.shape)
    if r.only == ("indexer",):  # timed alone: its scores and top-k, not the head weights of the step
        from .kernels import StepShape, indexer_select

        n = indexer_select(StepShape(r.shape.rows, r.shape.width, r.shape.context, r.layout.tp), r.shape.launch_limits)
        return [dataclasses.replace(x, launches=n) for x in t if x.name == "indexer"]
    return [x for x in t if x.name in r.only] if r.only else t


def _kernels(r: Row) -> float:
    return sum(t.launches * t.layers for t in _terms(r))


def _group(kind: str, groups: dict) -> int:
    return next(i for i, kinds in enumerate(groups.values()) if kind in kinds)


class StepModel:
    """The rows' predicted seconds as a torch function of `PARAMS` (the fit's model; `efficiency` turns a
    parameter vector into the `Efficiency` that `time_terms` applies, the same arithmetic)."""

    def __init__(self, rows: list[Row], g: GPU):
        cols = []  # (row, group, launch group, compute s, memory s, layers, launches x layers) per term
        for i, r in enumerate(rows):
            for t in _terms(r):
                c, m = peak_s(t, g)
                cols.append((i, _group(t.kind, GROUPS), _group(t.kind, LAUNCH_GROUPS), c, m, t.layers,
                             t.launches * t.layers))
        a = np.array(cols, dtype=np.float64).reshape(-1, 7)
        self.n = len(rows)
        self.row, self.grp, self.lgrp = (torch.tensor(a[:, j], dtype=torch.long) for j in range(3))
        self.comp, self.mem, self.layers, self.launches = (torch.tensor(a[:, j]) for j in range(3, 7))

    def __call__(self, x: torch.Tensor, sharpness: float | None = None) -> torch.Tensor:
        ng = len(GROUPS)
        bw, fl, la = x[:ng], x[ng:2 * ng], x[2 * ng:]
        per = self.layers * smooth_max(self.comp / fl[self.grp], self.mem / bw[self.grp], sharpness) \
            + self.launches * la[self.lgrp] * 1e-6
        return torch.zeros(self.n, dtype=torch.float64).index_add(0, self.row, per)


def efficiency(values: dict[str, float], source: str) -> Efficiency:
    return Efficiency(bw=tuple((k, values[f"bw_{g}"]) for g, kinds in GROUPS.items() for k in kinds),
                      compute=tuple((k, values[f"flops_{g}"]) for g, kinds in GROUPS.items() for k in kinds),
                      launch=tuple((k, values[name]) for name, kinds in LAUNCH_GROUPS.items() for k in kinds),
                      source=source)


def fit_rows(rows: list[Row], g: GPU) -> FitResult:
    return fit_bounded(StepModel(rows, g), torch.tensor([r.measured_ms * 1e-3 for r in rows]), PARAMS)


def _predict_ms(r: Row, g: GPU, eff: Efficiency) -> float:
    return time_terms(_terms(r), g, r.layout, eff).work_ms


def holdout(rows: list[Row], g: GPU) -> list[dict]:
    """Fit on the lower half of the batch sizes and predict the upper half, then the other way round."""
    sizes = sorted({r.shape.rows for r in rows})
    if len(sizes) < 2:
        return []
    low = set(sizes[:len(sizes) // 2])
    out = []
    for train in (low, set(sizes) - low):
        fit_on = [r for r in rows if r.shape.rows in train]
        test = [r for r in rows if r.shape.rows not in train]
        eff = efficiency(fit_rows(fit_on, g).values, "held-out fit")
        errs = [(r.label, _predict_ms(r, g, eff) / r.measured_ms - 1) for r in test]
        out.append({"fit_on_batches": sorted(train), "fit_rows": len(fit_on),
                    "predict_batches": sorted({r.shape.rows for r in test}),
                    "mean_abs_error": sum(abs(e) for _, e in errs) / len(errs),
                    "max_abs_error": max(abs(e) for _, e in errs), "rows": dict(errs)})
    return out


def fit_link(ops: dict, g: GPU) -> dict:
    """us = 2 (p-1)/p bytes / bw + ceil(log2 p) * step, over every measured all-reduce (relative error)."""
    import math
    p = int(ops["world"])
    rows = ops["ops"].get("all_reduce", [])
    if len(rows) < 2:
        raise ValueError("--calibrate: the collectives JSON needs >= 2 all_reduce rows in 'ops'")
    ring = torch.tensor([2 * (p - 1) / p * r["bytes"] / GB * 1e6 for r in rows], dtype=torch.float64)
    steps = math.ceil(math.log2(p))
    params = [Param("link_latency_us", "us", 0.0, 100.0, "one log2 step of a small all-reduce"),
              Param("link_gbps", "GB/s", 1.0, 5000.0, "one direction of the link")]
    f = fit_bounded(lambda x, _sharpness: ring / x[1] + steps * x[0], torch.tensor([r["us"] for r in rows]), params)
    return dict(f.values)


def calibrate(base: ModelConfig, paths: list[str]) -> Calibration:
    rows, devices, link_json, link_source = [], set(), None, ""
    for p in paths:
        dev, rs, ops = rows_from(p, base)
        devices.add(dev)
        rows += rs
        if ops is not None:
            link_json, link_source = ops, parse_spec(p)[0]
    if not rows:
        raise ValueError(f"--calibrate {' '.join(paths)}: no step rows (give an mtp-bench or rank JSON)")
    if len(devices) > 1:
        raise ValueError(f"--calibrate: files from different GPUs ({sorted(devices)}); calibrate one GPU at a time")
    g = gpu_by_name(devices.pop())
    fit_on = [r for r in rows if not r.only]  # whole steps; the indexer timed alone is a held-out check
    if len(fit_on) < len(PARAMS):
        raise ValueError(f"--calibrate {' '.join(paths)}: {len(fit_on)} whole-step rows for {len(PARAMS)} "
                         f"parameters; give more rows")
    fit = fit_rows(fit_on, g)
    eff = efficiency(fit.values, f"calibrated on {', '.join(Path(parse_spec(p)[0]).name for p in paths)}")
    for r in rows:
        r.roofline_ms = _predict_ms(r, g, Efficiency())
        r.calibrated_ms = _predict_ms(r, g, eff)
    cal = Calibration(g.name, eff, rows, fit, holdout(fit_on, g))
    if link_json is not None:
        cal.link, cal.link_source = fit_link(link_json, g), link_source
    cal.notes = misses(cal)
    return cal


def misses(cal: Calibration) -> list[str]:
    """What the model leaves out, as the fit and the files show it."""
    out = []
    f = cal.fit
    steps = [r for r in cal.rows if not r.only]
    counted = [r for r in steps if r.measured_kernels]
    if counted:
        ratio = [r.measured_kernels / _kernels(r) for r in counted]
        lo, hi = min(counted, key=lambda r: r.measured_kernels), max(counted, key=lambda r: r.measured_kernels)
        diff = [r.measured_kernels - _kernels(r) for r in counted]
        out.append(f"kernel count (mtp.plan.kernels, the fast path's launch structure): the profile saw "
                   f"{lo.measured_kernels:.0f} ({lo.label}) to {hi.measured_kernels:.0f} ({hi.label}) kernels per "
                   f"step, the model counts {_kernels(lo):.0f} / {_kernels(hi):.0f}; profile - model = "
                   f"{min(diff):+.0f} to {max(diff):+.0f} per step over {len(counted)} rows (x{min(ratio):.3f} to "
                   f"x{max(ratio):.3f})")
    if f.determined("launch") and steps:
        r = steps[0]
        share = f.values["launch"] * _kernels(r) * 1e-3 / r.measured_ms
        out.append(f"fixed cost per launch {f.values['launch']:.2f} us x {_kernels(r):.0f} kernels = "
                   f"{share * 100:.0f}% of the {r.label} step: latency the byte roofline does not have")
    for name, side in f.bound.items():
        out.append(f"{name} sits at its {side} bound: the rows want it outside the physical range, so another "
                   f"effect the model lacks is in this class's time")
    alone = [r for r in cal.rows if r.only == ("indexer",)]
    if alone:
        gap = sum(r.calibrated_ms - r.measured_ms for r in alone) / len(alone)
        out.append(f"held out: the indexer timed alone takes {gap:.2f} ms per step less than the steps' fit gives "
                   f"it: that much of the long-context step is attention over the selected keys beyond its bytes"
                   if gap > 0 else f"held out: the indexer timed alone takes {-gap:.2f} ms per step more than the "
                   f"steps' fit gives it")
    routed = [r for r in steps if r.shape.touched is not None]
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
    bad = [r for r in steps if abs(r.residual) > 0.10]
    if bad:
        out.append("rows off by more than 10% after the fit: " + ", ".join(f"{r.label} ({r.residual * 100:+.0f}%)"
                                                                          for r in bad))
    return out


def format_calibration(cal: Calibration) -> str:
    f = cal.fit
    lines = [f"calibration on {cal.gpu} (model outputs vs recorded measurements; communication not in these rows;"
             f" bounded least squares on relative error over {len(f.residuals)} whole-step rows):"]
    lines += [f"  {p.name:16s} {f.describe(p.name)}" for p in f.params]
    lines += [f"  bounds: bandwidth {_BW}", f"          FLOPs {_FLOP}"]
    if cal.link:
        lines.append(f"  link (fitted on the collectives JSON): {cal.link['link_latency_us']:.2f} us per step, "
                     f"{cal.link['link_gbps']:.0f} GB/s")
    lines.append(f"  {'row':36s} {'measured':>9s} {'roofline':>9s} {'calibrated':>10s} {'residual':>8s} "
                 f"{'kernels meas/model':>19s}")
    for r in cal.rows:
        k = f"{r.measured_kernels:.0f}/{_kernels(r):.0f}" if r.measured_kernels else ""
        k = k or ("held out" if r.only else "")
        lines.append(f"  {r.label:36s} {r.measured_ms:9.3f} {r.roofline_ms:9.3f} {r.calibrated_ms:10.3f} "
                     f"{r.residual * 100:7.1f}% {k:>19s}")
    for h in cal.holdout:
        lines.append(f"  held out: fit on batch {h['fit_on_batches']} ({h['fit_rows']} rows), predict batch "
                     f"{h['predict_batches']}: mean |error| {h['mean_abs_error'] * 100:.1f}%, max "
                     f"{h['max_abs_error'] * 100:.1f}%")
    lines += [f"  misses: {n}" for n in cal.notes]
    if cal.collectives:
        lines.append(f"  collectives: {cal.collectives}")
    return "\n".join(lines)
