"""Acceptance split by phase (thinking / answer / tool call), by output position and by context length.

Every verify step of a row is recorded with where it started (`steps` in samples.jsonl: [output position,
drafts accepted, phase] per step, from the engine's step events): the output position is the number of tokens
the row had generated before the step, the context length that plus the prompt's tokens, the phase that of the
text the row had written so far. A step's drafts continue that text, so they are scored in its phase; a step
that crosses `</think>` counts as thinking. Each group's acceptance (AL, rate, per position) comes with
intervals from a bootstrap over the prompts that have steps in it (`mtp.decode.metrics.AcceptanceStats`).

The relaxed verifier relaxes only inside thinking spans, so its extra accepts (`accept/relaxed_only`) belong to
the thinking phase; they are shown there (the engine counts them per run, not per step).
"""

from __future__ import annotations

from collections.abc import Sequence

from mtp.decode.metrics import AcceptanceStats

PHASES = ("thinking", "answer", "tool_call")
# Bucket lower edges, x4 apart: output positions from the first tokens on, context lengths from short prompts
# to DeepSeek-V3.2's 128K window.
OUTPUT_POS_EDGES = (0, 16, 64, 256, 1024, 4096)
CONTEXT_EDGES = (0, 128, 512, 2048, 8192, 32768)


class StepLog:
    """Per row, [output position, drafts accepted] of each verify step, from `StepEvent`s (the first event is the
    prefill's token, not a verify step)."""

    def __init__(self, B: int):
        self.rows: list[list[list[int]]] = [[] for _ in range(B)]
        self.made = [0] * B
        self.events = 0

    def __call__(self, ev) -> None:
        self.events += 1
        for b, (new, a) in enumerate(zip(ev.new_tokens, ev.accepted)):
            if new and self.events > 1:
                self.rows[b].append([self.made[b], a])
            self.made[b] += len(new)

    def hists(self, k: int) -> list[list[int]]:
        """Accepted-count histogram [k+1] per row, rebuilt from the events: what `GenerateResult.row_accepted_hist`
        (the engine's device counters, which mtp-eval records) must equal (tests/eval/test_run.py)."""
        out = [[0] * (k + 1) for _ in self.rows]
        for hist, steps in zip(out, self.rows):
            for _, a in steps:
                hist[a] += 1
        return out


def _calls_start(tok, tokens: Sequence[int], start: int) -> int | None:
    """The first output position from which the text written so far holds a DSML tool-call block (positions
    from `start` on), or None. The markers are plain text over several tokens, so this decodes prefixes
    (binary search: a prefix that holds the marker stays holding it)."""
    from mtp.text.dsml import CALLS_OPEN

    marker = CALLS_OPEN.lstrip("\n")
    if marker not in tok.decode(list(tokens)):
        return None
    lo, hi = start, len(tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        if marker in tok.decode(list(tokens[:mid])):
            hi = mid
        else:
            lo = mid + 1
    return lo


def phase_steps(tok, thinking: bool, tokens: Sequence[int], steps: Sequence[Sequence[int]]) -> list[list]:
    """[pos, accepted, phase] per step: thinking up to `</think>` (for a prompt in thinking mode), then the answer,
    from the start of a DSML tool-call block on tool_call."""
    end_think = next((i + 1 for i, t in enumerate(tokens) if t == tok.end_think_id), None) if thinking else 0
    answer_from = len(tokens) + 1 if end_think is None else end_think
    calls = _calls_start(tok, tokens, answer_from) if answer_from <= len(tokens) else None
    out = []
    for pos, a in steps:
        phase = ("thinking" if pos < answer_from else "tool_call" if calls is not None and pos >= calls
                 else "answer")
        out.append([pos, a, phase])
    return out


def bucket(x: int, edges: Sequence[int]) -> str:
    """The label of x's bucket: `lo-hi` (inclusive), `lo+` for the last."""
    i = max(j for j, e in enumerate(edges) if x >= e)
    return f"{edges[i]}+" if i == len(edges) - 1 else f"{edges[i]}-{edges[i + 1] - 1}"


def _groups(records: Sequence[dict], key) -> dict[str, list[list[int]]]:
    """group -> one accepted-count histogram per record (k+1 counts) over the steps `key(record, step)` puts there."""
    k = len(records[0]["row_accepted_hist"]) - 1
    out: dict[str, dict[int, list[int]]] = {}
    for i, r in enumerate(records):
        for step in r.get("steps") or []:
            hist = out.setdefault(key(r, step), {}).setdefault(i, [0] * (k + 1))
            hist[min(step[1], k)] += 1
    return {g: list(rows.values()) for g, rows in out.items()}


def _ordered(groups: dict, order: Sequence[str]) -> list[str]:
    return [g for g in order if g in groups]


def breakdown(records: Sequence[dict], relaxed_only: int | None = None) -> dict:
    """{"phase" | "output_pos" | "context": {group: AcceptanceStats.to_dict()}}, groups in a fixed order;
    `relaxed_only` (the run's relaxed accepts) goes to the thinking phase, 0 to the others."""
    if not records or not any(r.get("steps") for r in records):
        return {}
    k = len(records[0]["row_accepted_hist"]) - 1
    splits = {
        "phase": (lambda r, s: s[2], PHASES),
        "output_pos": (lambda r, s: bucket(s[0], OUTPUT_POS_EDGES),
                       [bucket(e, OUTPUT_POS_EDGES) for e in OUTPUT_POS_EDGES]),
        "context": (lambda r, s: bucket(r["prompt_tokens"] + s[0], CONTEXT_EDGES),
                    [bucket(e, CONTEXT_EDGES) for e in CONTEXT_EDGES]),
    }
    out = {}
    for name, (key, order) in splits.items():
        groups = _groups(records, key)
        out[name] = {g: AcceptanceStats.from_rows(groups[g], k).to_dict() for g in _ordered(groups, order)}
    if relaxed_only is not None:
        for g, d in out["phase"].items():
            d["accept/relaxed_only"] = relaxed_only if g == "thinking" else 0
    return out


def flat(bd: dict) -> dict:
    """`breakdown/{split}/{group}/{key}` for loggers (numbers only)."""
    return {f"breakdown/{split}/{g}/{key}": v for split, groups in bd.items() for g, d in groups.items()
            for key, v in d.items() if v is not None}
