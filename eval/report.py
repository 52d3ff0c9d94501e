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


def acceptance_table(metrics: dict, title: str) -> Table:
    """One row per category plus `all`: prompts, tokens, AL, acceptance per position, speed, speedup."""
    k = len(metrics["per_position"])
    base = metrics.get("baseline")
    t = Table(title=title, title_justify="left")
    for col in ("category", "prompts", "new tok", "AL"):
        t.add_column(col, justify="left" if col == "category" else "right")
    for j in range(1, k + 1):
        t.add_column(f"acc@{j}", justify="right")
    t.add_column("decode tok/s", justify="right")
    if base:
        t.add_column("base tok/s", justify="right")
        t.add_column("speedup", justify="right")
    degen = metrics["overall"].get("quality/degenerate_rows", 0)
    if degen:  # outputs that are one token repeated: their acceptance says nothing about the drafts
        t.add_column("degenerate", justify="right", style="bold red")
    rows = list(metrics["per_category"].items()) + [("all", metrics["overall"])]
    for i, (name, m) in enumerate(rows):
        cells = [name, str(m["count/prompts"]), str(m["count/new_tokens"]), _f(m["accept/mean_len"])]
        cells += [_f(m[f"accept/pos_{j}"]) for j in range(1, k + 1)]
        cells.append(_f(m["speed/decode_tok_s"], 1))
        if base:
            b = base["overall"] if name == "all" else base["per_category"].get(name)
            sp = metrics["speedup"]["overall"] if name == "all" else metrics["speedup"]["per_category"].get(name)
            cells += [_f(b and b["speed/decode_tok_s"], 1), _f(sp and sp["decode"]) + "x"]
        if degen:
            cells.append(str(m.get("quality/degenerate_rows", 0)))
        t.add_row(*cells, end_section=i == len(rows) - 2)
    return t
