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


def sweep_summary(rows: Sequence[dict], path: Path) -> Path:
    """AL and decode tok/s against k, one line per series (draft mode, verifier, runtime mode...)."""
    series: dict[str, list[dict]] = {}
    for r in rows:
        series.setdefault(r["series"], []).append(r)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: r["k"])
        ks = [r["k"] for r in rs]
        a1.plot(ks, [r["accept/mean_len"] for r in rs], marker="o", label=name)
        a2.plot(ks, [r["speed/decode_tok_s"] for r in rs], marker="o", label=name)
    ks = sorted({r["k"] for r in rows})
    top = max(max(ks) + 1, max(r["accept/mean_len"] for r in rows)) * 1.05  # AL lies in [1, k + 1]
    a1.set(xlabel="k (drafts per step)", ylabel="mean accepted length (AL)", xticks=ks, ylim=(0.95, top),
           title="AL vs k")
    a2.set(xlabel="k (drafts per step)", ylabel="decode tokens / s", xticks=ks, title="decode speed vs k")
    a2.set_ylim(bottom=0)
    a1.legend(fontsize=8)
    return _save(fig, path)
