"""`mtp-plan --speed --plot FILE`: tok/s per user and per GPU against batch for MTP k = 0..3, one row of panels
per GPU type (each at its default TP), with the measured steps of the rank JSONs overlaid: where MTP stops paying.

Acceptance: the acceptance length given for k (--al at --k) fixes one per-position rate p (AL = 1 + p + ... + p^k);
every k' then gets AL(k') = 1 + p + ... + p^k'. matplotlib is imported when a plot is drawn, not before.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..model.config import ModelConfig
from .calibrate import device_key, parse_spec
from .cost import Layout
from .hardware import GPUS
from .speed import Efficiency, Workload, accept_len, predict

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
KS = (0, 1, 2, 3)


def rate_for(al: float, k: int) -> float:
    """The per-position acceptance p with accept_len([p], k) == al (bisection; al in [1, k + 1])."""
    if k == 0:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if accept_len([mid], k) < al else (lo, mid)
    return (lo + hi) / 2


def curves(cfg: ModelConfig, gpu_name: str, p: float, context: int, eff: Efficiency = Efficiency(),
           batches=BATCHES) -> dict[int, list[tuple[int, float, float]]]:
    """{k: [(batch, tok/s per user, tok/s per GPU)]} at the GPU's default TP (overlapped communication)."""
    g = GPUS[gpu_name]
    lay = Layout(g.default_tp, g.default_tp, nodes=max(1, g.default_tp // g.gpus_per_node),
                 mlp_split=g.mlp_split if g.default_tp > 16 else "blocks")
    out = {}
    for k in KS:
        rows = []
        for B in batches:
            s = predict(cfg, g, lay, Workload(B, context, k, accept_len([p], k)), eff).summary()
            rows.append((B, s["tok_s_user_overlap"], s["tok_s_gpu_overlap"]))
        out[k] = rows
    return out


def measured_points(files: list[str]) -> list[dict]:
    """Per rank JSON, batch, context and width: the measured target step (no draft, no communication). A file's
    row selection (`FILE:b=1:ctx=8192`, `mtp.plan.calibrate.parse_spec`) applies here too."""
    pts = []
    for spec in files:
        f, keep = parse_spec(spec)
        d = json.loads(Path(f).read_text())
        if "tp" not in d or ("contexts" not in d and "batches" not in d):
            continue
        batches = d.get("batches") or {str(d["args"]["batch"]): {"contexts": d["contexts"]}}
        for B, entry in batches.items():
            for L, ctx in entry["contexts"].items():
                if int(B) not in keep.get("b", {int(B)}) or int(L) not in keep.get("ctx", {int(L)}):
                    continue
                for w, v in ctx["widths"].items():
                    if "graph_ms" in v:
                        pts.append({"device": d.get("device", ""), "tp": int(d["tp"]), "batch": int(B),
                                    "context": int(L), "w": int(w), "ms": v["graph_ms"]})
    return pts


def plot_speed(cfg: ModelConfig, path: str, al: float, k_al: int, files: list[str], eff: Efficiency = Efficiency(),
               context: int = 1024, gpus: tuple[str, ...] = tuple(GPUS)) -> dict:
    """Draw the panels to `path`; returns the data drawn ({gpu: curves}, measured points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = rate_for(al, k_al) if k_al else 0.8
    data = {g: curves(cfg, g, p, context, eff) for g in gpus}
    pts = measured_points(files)
    fig, axes = plt.subplots(len(gpus), 2, figsize=(11, 3.2 * len(gpus)), squeeze=False)
    for row, g in zip(axes, gpus):
        for k, rows in data[g].items():
            bs = [r[0] for r in rows]
            row[0].plot(bs, [r[1] for r in rows], marker="o", ms=3, label=f"k={k} (AL {accept_len([p], k):.2f})")
            row[1].plot(bs, [r[2] for r in rows], marker="o", ms=3, label=f"k={k}")
        for m in (x for x in pts if device_key(x["device"]) == g and x["tp"] == GPUS[g].default_tp
                  and x["context"] == context and x["w"] - 1 in KS):
            k = m["w"] - 1
            user = 1e3 * accept_len([p], k) / m["ms"]
            row[0].scatter([m["batch"]], [user], marker="x", color="k", zorder=5)
            row[1].scatter([m["batch"]], [user * m["batch"] / m["tp"]], marker="x", color="k", zorder=5)
        tp = GPUS[g].default_tp
        row[0].set_title(f"{g} x {tp} (TP{tp}): tok/s per user")
        row[1].set_title(f"{g} x {tp}: tok/s per GPU")
        for ax in row:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch")
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=7)
    fig.suptitle(f"mtp-plan --speed, context {context}, per-position acceptance {p:.3f}; x: measured target step "
                 f"at w = k+1 (rank JSON, no draft or collectives)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {"curves": data, "measured": pts, "p": p}
