"""PNG plots with matplotlib's Agg backend (no display needed): per-run acceptance and sweep summaries."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def acceptance_per_position(per_position: Sequence[dict], title: str, path: Path) -> Path:
    """P(draft j accepted) and P(draft j accepted | draft j-1 accepted) for j = 1..k."""
    pos = [p["pos"] for p in per_position]
    w = 0.38
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.bar([x - w / 2 for x in pos], [p["accept"] for p in per_position], w, label="accepted")
    ax.bar([x + w / 2 for x in pos], [p["accept_cond"] for p in per_position], w,
           label="accepted | previous accepted")
    ax.set(xlabel="draft position", ylabel="rate", ylim=(0, 1.05), xticks=pos, title=title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def accepted_length_hist(hist: Sequence[int], title: str, path: Path) -> Path:
    """How many drafts each verify step accepted (0..k); AL = 1 + mean of this."""
    total = max(sum(hist), 1)
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.bar(range(len(hist)), [c / total for c in hist])
    ax.set(xlabel="drafts accepted per step", ylabel="fraction of steps", xticks=list(range(len(hist))),
           title=title)
    return _save(fig, path)


def _errorbar(ax, ks, rows, key: str, **kw) -> None:
    """Medians at k with min-max error bars (rows without the metric are left out)."""
    pts = [(k, r[key], r.get(f"{key}_min"), r.get(f"{key}_max")) for k, r in zip(ks, rows) if r.get(key) is not None]
    if not pts:
        return
    mid = [p[1] for p in pts]
    lo = [m - (p[2] if p[2] is not None else m) for m, p in zip(mid, pts)]
    hi = [(p[3] if p[3] is not None else m) - m for m, p in zip(mid, pts)]
    ax.errorbar([p[0] for p in pts], mid, yerr=[lo, hi], capsize=3, **kw)


def sweep_figure(rows: Sequence[dict]):
    """AL, decode tok/s (with each series' baseline, dashed) and speedup against k, one line per series
    (draft mode, verifier, runtime mode, tree...); speed points are medians over repeats with min-max bars.
    A sweep with tree runs adds AL against the verified nodes per step."""
    series: dict[str, list[dict]] = {}
    for r in rows:
        series.setdefault(r["series"], []).append(r)
    with_trees = any(r.get("tree/nodes") for r in rows)
    fig, axes = plt.subplots(1, 4 if with_trees else 3, figsize=(20 if with_trees else 15, 3.8))
    a1, a2, a3 = axes[:3]
    for i, (name, rs) in enumerate(sorted(series.items())):
        rs = sorted(rs, key=lambda r: r["k"])
        ks = [r["k"] for r in rs]
        color = f"C{i % 10}"
        a1.plot(ks, [r["accept/mean_len"] for r in rs], marker="o", color=color, label=name)
        _errorbar(a2, ks, rs, "speed/decode_tok_s", marker="o", color=color, label=name)
        _errorbar(a2, ks, rs, "base/decode_tok_s", marker="x", linestyle="--", color=color,
                  label=f"{name}: baseline (draft=none)")
        _errorbar(a3, ks, rs, "speedup_decode", marker="o", color=color, label=name)
        if with_trees:  # a tree's cost is its verify width, not its depth k
            pts = sorted((r["tree/nodes"], r["accept/mean_len"]) for r in rs if r.get("tree/nodes"))
            axes[3].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color, label=name)
    ks = sorted({r["k"] for r in rows})
    top = max(max(ks) + 1, max(r["accept/mean_len"] for r in rows)) * 1.05  # AL lies in [1, k + 1]
    a1.set(xlabel="k (drafts per step)", ylabel="mean accepted length (AL)", xticks=ks, ylim=(0.95, top),
           title="AL vs k")
    a2.set(xlabel="k (drafts per step)", ylabel="decode tokens / s", xticks=ks, title="decode speed vs k")
    a2.set_ylim(bottom=0)
    a3.axhline(1.0, color="grey", linewidth=0.8)
    a3.set(xlabel="k (drafts per step)", ylabel="speedup over the baseline (decode)", xticks=ks,
           title="speedup vs k")
    if with_trees:
        axes[3].set(xlabel="verified nodes per step (root included)", ylabel="AL", title="AL vs verify width")
    a1.legend(fontsize=8)
    a2.legend(fontsize=7)
    notes = sorted({r["device_note"] for r in rows if r.get("device_note")})
    if notes:
        fig.suptitle("; ".join(notes), fontsize=8)
    return fig


def sweep_summary(rows: Sequence[dict], path: Path) -> Path:
    return _save(sweep_figure(rows), path)


def tree_acceptance(tree: dict, title: str, path: Path) -> Path:
    """P(the accepted path reaches depth d), stacked by the sibling rank of its node at depth d."""
    rows = tree["accept_depth_rank"]
    depths = list(range(1, len(rows) + 1))
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    bottom = [0.0] * len(rows)
    for r in range(max(len(row) for row in rows)):
        share = [row[r] if r < len(row) else 0.0 for row in rows]
        ax.bar(depths, share, bottom=bottom, label=f"rank {r}")
        bottom = [b + s for b, s in zip(bottom, share)]
    ax.set(xlabel="depth (drafts accepted)", ylabel="fraction of steps", ylim=(0, 1.05), xticks=depths,
           title=f"{title}\ntree {tree['shape']}: {tree['tokens_per_node']:.2f} tokens per verified node")
    ax.legend(fontsize=8)
    return _save(fig, path)
