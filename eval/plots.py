"""PNG plots with matplotlib's Agg backend (no display needed): per-run acceptance and sweep summaries."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

from mtp.stats import BOOTSTRAP_MIN_ROWS

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _yerr(mid: Sequence, lo: Sequence, hi: Sequence) -> list[list[float]] | None:
    """matplotlib's asymmetric yerr from values and interval ends (None when no point has an interval; a
    point without one gets no bar, not a zero-width one)."""
    if all(x is None for x in lo):
        return None
    nan = float("nan")
    return [[m - l if l is not None else nan for m, l in zip(mid, lo)],
            [h - m if h is not None else nan for m, h in zip(mid, hi)]]


def acceptance_per_position(per_position: Sequence[dict], title: str, path: Path) -> Path:
    """P(draft j accepted) and P(draft j accepted | draft j-1 accepted) for j = 1..k, with 95% intervals
    (bootstrap over prompts) as error bars."""
    pos = [p["pos"] for p in per_position]
    w = 0.38
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for shift, key, label in ((-w / 2, "accept", "accepted"), (w / 2, "accept_cond", "accepted | previous accepted")):
        mid = [p[key] for p in per_position]
        ax.bar([x + shift for x in pos], mid, w, label=label, capsize=3,
               yerr=_yerr(mid, [p.get(f"{key}_lo") for p in per_position], [p.get(f"{key}_hi") for p in per_position]))
    n = per_position[0].get("prompts") if per_position else None
    sub = f"\n95% intervals over {n} prompts, {per_position[0]['steps']} steps" if n else ""
    ax.set(xlabel="draft position", ylabel="rate", ylim=(0, 1.05), xticks=pos, title=title + sub)
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


def _errorbar(ax, ks, rows, key: str, ends: tuple[str, str] = ("_min", "_max"), **kw) -> None:
    """Values at k with error bars from `key + ends` (medians with min-max, or values with a 95% interval:
    `("_lo", "_hi")`); rows without the metric are left out."""
    pts = [(k, r[key], r.get(key + ends[0]), r.get(key + ends[1])) for k, r in zip(ks, rows) if r.get(key) is not None]
    if not pts:
        return
    mid = [p[1] for p in pts]
    ax.errorbar([p[0] for p in pts], mid, yerr=_yerr(mid, [p[2] for p in pts], [p[3] for p in pts]) or [
        [0.0] * len(pts)] * 2, capsize=3, **kw)


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
        _errorbar(a1, ks, rs, "accept/mean_len", ("_lo", "_hi"), marker="o", color=color, label=name)
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
           title="AL vs k (95% intervals over prompts)")
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


def acceptance_breakdown(bd: dict, title: str, path: Path) -> Path:
    """AL with 95% intervals by phase (thinking / answer / tool call), output position and context length, one
    panel each (eval/breakdown.py); the prompts and steps behind each bar under it."""
    names = {"phase": "phase", "output_pos": "output position (tokens generated)", "context": "context length (tokens)"}
    splits = [s for s in names if bd.get(s)]
    fig, axes = plt.subplots(1, len(splits), figsize=(5 * len(splits), 3.8), squeeze=False)
    for ax, split in zip(axes[0], splits):
        groups = bd[split]
        mid = [g["accept/mean_len"] for g in groups.values()]
        x = list(range(len(groups)))
        ax.bar(x, mid, capsize=3, yerr=_yerr(mid, [g["accept/mean_len_lo"] for g in groups.values()],
                                            [g["accept/mean_len_hi"] for g in groups.values()]))
        ax.set_xticks(x, [f"{name}\n{g['count/prompts']}p {g['count/row_steps']}s" for name, g in groups.items()],
                      fontsize=7)
        ax.set(xlabel=names[split], ylabel="AL", title=f"AL by {split.replace('_', ' ')}")
        for i, g in enumerate(groups.values()):  # the relaxed verifier's extra accepts: thinking only
            if g.get("accept/relaxed_only"):
                ax.annotate(f"relaxed-only {g['accept/relaxed_only']}", (i, mid[i]), ha="center", va="bottom",
                            fontsize=7, xytext=(0, 12), textcoords="offset points")
        ax.set_ylim(bottom=1.0 if all(m >= 1.0 for m in mid) else 0.0)
    fig.suptitle(f"{title} (p: prompts, s: steps; 95% intervals over prompts, none under {BOOTSTRAP_MIN_ROWS} "
                 "prompts)", fontsize=9)
    return _save(fig, path)
