"""Terminal output (rich): the progress bar while prompts run, the acceptance table at the end."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mtp.stats import BOOTSTRAP_MIN_ROWS
from mtp.verify.registry import verifier


def console(stderr: bool = False) -> Console:
    # Pipes and log files get a fixed width instead of rich's 80-column default, so tables do not wrap.
    c = Console(stderr=stderr)
    return c if c.is_terminal else Console(stderr=stderr, width=200)


def progress() -> Progress:
    """Progress on stderr, so stdout keeps only the results."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[status]}"), console=console(stderr=True))


def _f(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def ci_text(m: dict | None, key: str, digits: int = 2, sep: str = " ") -> str:
    """`value (lo-hi)` of a figure with a 95% interval (`_lo` / `_hi` companions); the bare value without one.
    `sep` goes between the value and the interval (a newline in table cells)."""
    if not m or m.get(key) is None:
        return "-"
    lo, hi = m.get(f"{key}_lo"), m.get(f"{key}_hi")
    text = _f(m[key], digits)
    return text if lo is None or hi is None else f"{text}{sep}({_f(lo, digits)}-{_f(hi, digits)})"


LATENCY_QS = ("mean", "p50", "p90", "p99")


def latency_text(m: dict | None, name: str) -> str:
    """`mean p50/p90/p99` in ms of a per-request latency (`speed/{name}_{q}_s`)."""
    if not m or m.get(f"speed/{name}_mean_s") is None:
        return "-"
    ms = [m[f"speed/{name}_{q}_s"] * 1e3 for q in LATENCY_QS]
    return f"{ms[0]:.1f} {ms[1]:.1f}/{ms[2]:.1f}/{ms[3]:.1f}"


def latency_table(metrics: dict) -> Table:
    """Per-request TTFT and TPOT in ms, `mean p50/p90/p99` (one sample per request; medians over the timing
    repeats), per category and overall, with the baseline's beside them when there is one."""
    base = metrics.get("baseline")
    t = Table(title="per-request latency, ms: mean p50/p90/p99 (TTFT: time to first token; TPOT: time per output "
                    "token after it)", title_justify="left")
    t.add_column("category")
    t.add_column("requests", justify="right")
    runs = [("", metrics)] + ([("base ", base)] if base else [])
    for prefix, _ in runs:
        for name in ("TTFT", "TPOT"):
            t.add_column(f"{prefix}{name}", justify="right", no_wrap=True)
    rows = list(metrics["per_category"]) + ["all"]
    for i, cat in enumerate(rows):
        own = metrics["overall"] if cat == "all" else metrics["per_category"][cat]
        cells = [cat, str(own.get("count/requests", "-"))]
        for _, src in runs:
            m = src["overall"] if cat == "all" else src["per_category"].get(cat)
            cells += [latency_text(m, "ttft"), latency_text(m, "tpot")]
        t.add_row(*cells, end_section=i == len(rows) - 2)
    return t


def spread_text(m: dict | None, key: str, digits: int, unit: str = "") -> str:
    """`median (min-max)` of a metric with `_min` / `_max` companions; the bare median for one repeat."""
    if not m or m.get(key) is None:
        return "-"
    lo, hi = m.get(f"{key}_min"), m.get(f"{key}_max")
    text = _f(m[key], digits) + unit
    return text if lo is None or lo == hi else f"{text} ({_f(lo, digits)}-{_f(hi, digits)})"


def timing_note(metrics: dict) -> str:
    """How to read the speed columns: repeats, and whether the device's speed means anything."""
    n = metrics["overall"].get("timing/repeats", 1)
    order = ", baseline and speculative interleaved" if metrics.get("baseline") else ""
    text = f"tok/s, speedup: median (min-max) of {n} repeats{order}" if n > 1 else "tok/s, speedup: one run"
    text = (f"AL, acc@j, rate: value (95% interval, bootstrap over prompts; none under {BOOTSTRAP_MIN_ROWS} "
            f"prompts)\n{text}")
    note = metrics["run"].get("device_note")
    return f"{text}; {note}" if note else text


def acceptance_table(metrics: dict, title: str) -> Table:
    """One row per category plus `all`: prompts, tokens, AL, acceptance per position, speed, speedup; for
    relaxed / sampled verification the accepts the strict rule would have rejected and the agreement with
    strict greedy outputs (`token agreement (identical/compared)`); task accuracy when prompts have answers.
    The title's second line says how the speed was measured."""
    k = len(metrics["per_position"])
    base = metrics.get("baseline")
    t = Table(title=f"{title}\n{timing_note(metrics)}", title_justify="left")
    for col in ("category", "prompts", "steps", "new tok", "AL"):
        t.add_column(col, justify="left" if col == "category" else "right")
    for j in range(1, k + 1):
        t.add_column(f"acc@{j}", justify="right")
    if k:
        t.add_column("rate", justify="right")  # accepted / proposed drafts
    lossy = not verifier(metrics["run"].get("verify", "strict")).greedy_output
    if lossy:
        t.add_column("relaxed-only" if metrics["run"]["verify"] == "relaxed" else "not argmax", justify="right")
    t.add_column("decode tok/s", justify="right")
    if base:
        t.add_column("base tok/s", justify="right")
        t.add_column("speedup", justify="right")
    o = metrics["overall"]
    agree = lossy and "quality/strict_compared" in o
    if agree:
        t.add_column("= strict", justify="right")
    # (header, (category metrics, its baseline metrics) -> value); the baseline, when it is the strict
    # run, stands for strict accuracy too
    acc = []
    if "quality/accuracy" in o:
        acc.append(("accuracy", lambda m, b: m.get("quality/accuracy")))
    if base and "quality/accuracy" in base["overall"]:
        acc.append(("base acc.", lambda m, b: b and b.get("quality/accuracy")))
    if "quality/strict_accuracy" in o and metrics.get("strict_reference") != "baseline.jsonl":
        acc.append(("strict acc.", lambda m, b: m.get("quality/strict_accuracy")))
    for header, _ in acc:
        t.add_column(header, justify="right")
    degen = o.get("quality/degenerate_rows", 0)
    if degen:  # outputs that are one token repeated: their acceptance says nothing about the drafts
        t.add_column("degenerate", justify="right", style="bold red")
    flagged = o.get("quality/flagged_rows", 0)
    if flagged:  # loops, a lossy verifier accepting everything (eval/quality.py)
        t.add_column("flagged", justify="right", style="bold red")
    rows = list(metrics["per_category"].items()) + [("all", o)]
    for i, (name, m) in enumerate(rows):
        cells = [name, str(m["count/prompts"]), str(m["count/row_steps"]), str(m["count/new_tokens"]),
                 ci_text(m, "accept/mean_len", sep="\n")]
        cells += [ci_text(m, f"accept/pos_{j}", sep="\n") for j in range(1, k + 1)]
        if k:
            cells.append(ci_text(m, "accept/rate", sep="\n"))
        if lossy:
            cells.append(f"{m['accept/relaxed_only']} ({m['accept/relaxed_only_share']:.0%})")
        cells.append(spread_text(m, "speed/decode_tok_s", 1))
        b = base and (base["overall"] if name == "all" else base["per_category"].get(name))
        if base:
            sp = metrics["speedup"]["overall"] if name == "all" else metrics["speedup"]["per_category"].get(name)
            cells += [spread_text(b, "speed/decode_tok_s", 1), spread_text(sp, "decode", 2, "x")]
        if agree:
            cells.append(f"{_f(m.get('quality/strict_token_agreement'))} "
                         f"({m.get('quality/strict_identical', 0)}/{m.get('quality/strict_compared', 0)})")
        cells += [_f(get(m, b)) for _, get in acc]
        if degen:
            cells.append(str(m.get("quality/degenerate_rows", 0)))
        if flagged:
            cells.append(str(m.get("quality/flagged_rows", 0)))
        t.add_row(*cells, end_section=i == len(rows) - 2)
    return t


def quality_lines(metrics: dict) -> list[str]:
    """What a lossy verifier cost, in words: agreement with strict greedy outputs, and task accuracy."""
    o, run = metrics["overall"], metrics["run"]
    lines = []
    if not verifier(run.get("verify", "strict")).greedy_output:
        lines.append(f"accepted drafts the strict rule would have rejected (not the target's argmax): "
                     f"{o['accept/relaxed_only']} of {o['count/accepted_drafts']} "
                     f"({o['accept/relaxed_only_share']:.0%})")
        if "quality/strict_compared" in o:
            lines.append(f"{run['verify']} vs strict greedy outputs ({metrics['strict_reference']}): "
                         f"{o['quality/strict_identical']}/{o['quality/strict_compared']} identical, token "
                         f"agreement {o['quality/strict_token_agreement']:.2f} (tokens before the first difference)")
    if "quality/accuracy" in o:
        parts = [f"{run.get('verify', 'spec')} {ci_text(o, 'quality/accuracy')} ({o['quality/correct']}/"
                 f"{o['quality/answered']})"]
        b = (metrics.get("baseline") or {}).get("overall", {})
        if "quality/accuracy" in b:
            parts.append(f"baseline {ci_text(b, 'quality/accuracy')}")
        if "quality/strict_accuracy" in o and metrics.get("strict_reference") != "baseline.jsonl":
            parts.append(f"strict {o['quality/strict_accuracy']:.2f}")
        lines.append("task accuracy (last number of the output vs the answer; 95% Wilson interval): "
                     + ", ".join(parts))
    return lines



def flagged_lines(metrics: dict) -> list[str]:
    """The flagged rows and why, and the acceptance without them (empty when no row is flagged)."""
    fl = metrics.get("flagged") or {}
    if not fl.get("count"):
        return []
    o, k = metrics["overall"], len(metrics["per_position"])
    why = ", ".join(f"{i}: {'; '.join(r)}" for i, r in list(fl["reasons"].items())[:10])
    lines = [f"flagged rows: {fl['count']} of {o['count/prompts']} ({why}); their acceptance reports the loop, "
             "not the drafts"]
    if o.get("count/unflagged_prompts"):
        u = {key.replace("accept_unflagged/", "accept/"): v for key, v in o.items()
             if key.startswith("accept_unflagged/")}
        acc = " / ".join(ci_text(u, f"accept/pos_{j}") for j in range(1, k + 1))
        lines.append(f"without them ({o['count/unflagged_prompts']} prompts, {o['count/unflagged_row_steps']} "
                     f"steps): AL {ci_text(u, 'accept/mean_len')}, acc {acc}, rate {ci_text(u, 'accept/rate')} "
                     f"(all rows: AL {ci_text(o, 'accept/mean_len')})")
    else:
        lines.append("every row is flagged: no acceptance figure of this run says anything about the drafts")
    return lines


def tree_line(tree: dict) -> str:
    """What a verified node of a tree run bought, in words (with adaptive length: a live node too)."""
    text = f"tree {tree['shape']}: tokens per verified node {tree['tokens_per_node']:.3f} ({tree['nodes']} nodes)"
    if tree["min_draft_prob"]:
        text += (f", per live node {tree['tokens_per_live_node']:.3f} (min_draft_prob {tree['min_draft_prob']:g}: "
                 f"{tree['live_nodes'] / max(tree['row_steps'], 1):.2f} live nodes per step)")
    return text


def tree_table(tree: dict) -> Table:
    """A tree run's acceptance by depth and sibling rank: P(the path reaches depth d) and its split by the rank
    of the accepted node there (rank 0 = the drafter's top-1)."""
    t = Table(title=f"tree {tree['shape']}: acceptance by depth and rank", title_justify="left")
    ranks = max(len(row) for row in tree["accept_depth_rank"])
    for col in ["depth", "accepted", *(f"rank {r}" for r in range(ranks))]:
        t.add_column(col, justify="right")
    for d, (p, row) in enumerate(zip(tree["accept_depth"], tree["accept_depth_rank"]), 1):
        t.add_row(str(d), _f(p, 3), *(_f(x, 3) for x in row), *([""] * (ranks - len(row))))
    return t
