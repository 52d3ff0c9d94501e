"""What a lossy verifier costs, measured on the outputs: agreement with strict greedy decoding and task accuracy.

- Agreement: relaxed and sampled outputs against the strict (plain greedy) outputs of the same prompts.
  `identical` counts outputs equal token for token; `token_agreement` is the tokens before the first
  difference over the longer output's length, pooled over prompts (after the first difference the two texts
  are shifted, so equal tokens further on mean little).
- Accuracy (GSM8K-style): the last number of the output (after `</think>` when the model closed its
  thinking) against the last number of the reference answer (GSM8K writes `<reasoning> #### 42`), compared
  as numbers; thousands separators are ignored. Only prompts with an answer count.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# An optional sign, digits with optional thousands separators, an optional decimal part.
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
_END_THINK = "</think>"


def last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def predicted_answer(output: str) -> float | None:
    """The output's answer: the last number after the end of its thinking (or of the whole output)."""
    head, sep, tail = output.rpartition(_END_THINK)
    return last_number(tail) if sep and last_number(tail) is not None else last_number(output)


def is_correct(output: str, answer: str) -> bool:
    ref, got = last_number(answer), predicted_answer(output)
    if ref is None:
        raise ValueError(f"reference answer {answer!r} has no number: task accuracy needs numeric answers")
    return got is not None and abs(got - ref) <= 1e-6 * max(1.0, abs(ref))


def accuracy(records: Sequence[dict]) -> dict:
    """`quality/answered`, `quality/correct`, `quality/accuracy` over the records that carry an answer
    ({} when none does)."""
    answered = [r for r in records if r.get("answer") is not None]
    if not answered:
        return {}
    correct = sum(is_correct(r["output"], r["answer"]) for r in answered)
    return {"quality/answered": len(answered), "quality/correct": correct,
            "quality/accuracy": correct / len(answered)}


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(records: Sequence[dict], strict: Sequence[dict]) -> dict:
    """Agreement of `records` with the strict outputs of the same prompts (matched by id), plus the strict
    run's accuracy when the prompts have answers. Keys: `quality/strict_compared`, `quality/strict_identical`,
    `quality/strict_token_agreement`, `quality/strict_accuracy`."""
    ref = {r["id"]: r for r in strict}
    pairs = [(r, ref[r["id"]]) for r in records if r["id"] in ref]
    if not pairs:
        return {}
    prefix = sum(_common_prefix(r["tokens"], s["tokens"]) for r, s in pairs)
    longest = sum(max(len(r["tokens"]), len(s["tokens"])) for r, s in pairs)
    out = {"quality/strict_compared": len(pairs),
           "quality/strict_identical": sum(r["tokens"] == s["tokens"] for r, s in pairs),
           "quality/strict_token_agreement": prefix / longest if longest else 1.0}
    acc = accuracy([s for _, s in pairs])
    if acc:
        out["quality/strict_accuracy"] = acc["quality/accuracy"]
    return out
