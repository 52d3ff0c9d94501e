"""Terminal output (rich): the progress bar while prompts run, the acceptance table at the end."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


def console(stderr: bool = False) -> Console:
    # Pipes and log files get a fixed width instead of rich's 80-column default, so tables do not wrap.
    c = Console(stderr=stderr)
    return c if c.is_terminal else Console(stderr=stderr, width=140)


def progress() -> Progress:
    """Progress on stderr, so stdout keeps only the results."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[status]}"), console=console(stderr=True))


def _f(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


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
    note = metrics["run"].get("device_note")
    return f"{text}; {note}" if note else text


def acceptance_table(metrics: dict, title: str) -> Table:
    """One row per category plus `all`: prompts, tokens, AL, acceptance per position, speed, speedup; the
    title's second line says how the speed was measured."""
    k = len(metrics["per_position"])
    base = metrics.get("baseline")
    t = Table(title=f"{title}\n{timing_note(metrics)}", title_justify="left")
    for col in ("category", "prompts", "new tok", "AL"):
        t.add_column(col, justify="left" if col == "category" else "right")
    for j in range(1, k + 1):
        t.add_column(f"acc@{j}", justify="right")
    t.add_column("decode tok/s", justify="right")
    if base:
        t.add_column("base tok/s", justify="right")
        t.add_column("speedup", justify="right")
    rows = list(metrics["per_category"].items()) + [("all", metrics["overall"])]
    for i, (name, m) in enumerate(rows):
        cells = [name, str(m["count/prompts"]), str(m["count/new_tokens"]), _f(m["accept/mean_len"])]
        cells += [_f(m[f"accept/pos_{j}"]) for j in range(1, k + 1)]
        cells.append(spread_text(m, "speed/decode_tok_s", 1))
        if base:
            b = base["overall"] if name == "all" else base["per_category"].get(name)
            sp = metrics["speedup"]["overall"] if name == "all" else metrics["speedup"]["per_category"].get(name)
            cells += [spread_text(b, "speed/decode_tok_s", 1), spread_text(sp, "decode", 2, "x")]
        t.add_row(*cells, end_section=i == len(rows) - 2)
    return t
