"""What a lossy verifier costs, measured on the outputs: agreement with strict greedy decoding and task accuracy.

- Agreement: relaxed and sampled outputs against the strict (plain greedy) outputs of the same prompts.
  `identical` counts outputs equal token for token; `token_agreement` is the tokens before the first
  difference over the longer output's length, pooled over prompts (after the first difference the two texts
  are shifted, so equal tokens further on mean little).
- Accuracy (GSM8K-style): the last number of the output (after `</think>` when the model closed its
  thinking) against the last number of the reference answer (GSM8K writes `<reasoning> #### 42`), compared
  as numbers; thousands separators are ignored. Only prompts with an answer count.
- Loops: an output whose tail repeats one n-gram (`winfo_winfo_winfo...`) or is mostly made of n-grams it
  repeats (`test.test_sqlite3.test_sqlite3.sqlite3.sqlite3.`), or, under a lossy verifier, whose
  drafts were accepted nearly always (AL at the ceiling k + 1: the relaxed rule accepting a loop the drafter
  predicts perfectly). Such rows report the loop, not the drafts; they are flagged (`flags`), and acceptance
  is reported with and without them (eval/aggregate.py).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

from mtp.stats import wilson
from mtp.verify.registry import verifier

# An optional sign, digits with optional thousands separators, an optional decimal part.
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
_END_THINK = "</think>"


# The tail of an output that is examined, and when a periodic suffix counts as a loop: at least LOOP_MIN_TOKENS
# tokens long and LOOP_MIN_REPEATS whole periods (three identical lines of code can be legitimate; four
# periods over 16+ tokens with nothing else at the end are not text). Periods up to LOOP_TAIL / 4.
LOOP_TAIL = 128
LOOP_MIN_TOKENS = 16
LOOP_MIN_REPEATS = 4
# Loops with variations (`test_sqlite3.test_sqlite3.sqlite3.sqlite3.`) have no exact period: the tail's last
# REPEAT_TAIL tokens are flagged when the REPEAT_N-grams occurring REPEAT_MIN_COUNT+ times there cover at least
# REPEAT_COVER of them. Measured on the bundled model's default run: its three looping outputs 0.53-0.94,
# `test_importlib.test_importlib.test_importlib.util` then real text 0.50, the other outputs 0.00-0.28;
# the four outputs of `verify=relaxed thinking=true dataset.per_category=1` 0.31-0.91.
REPEAT_TAIL = 64
REPEAT_N = 3
REPEAT_MIN_COUNT = 3
REPEAT_COVER = 0.6
# A row of a lossy verifier whose acceptance rate (accepted / proposed drafts) is at least this, over at least
# AL_CEILING_MIN_STEPS steps, accepted (nearly) everything: flagged. Strict verification is lossless, so there
# a high AL is the target's own output and is left alone.
AL_CEILING_RATE = 0.95
AL_CEILING_MIN_STEPS = 4


def loop_period(tokens: Sequence[int]) -> int | None:
    """The smallest period p whose repetition makes up the output's tail (the last LOOP_TAIL tokens), as a
    suffix of at least LOOP_MIN_TOKENS tokens and LOOP_MIN_REPEATS periods; None when there is none."""
    tail = list(tokens[-LOOP_TAIL:])
    for p in range(1, len(tail) // LOOP_MIN_REPEATS + 1):
        n = p  # length of the p-periodic suffix
        while n < len(tail) and tail[-n - 1] == tail[-n - 1 + p]:
            n += 1
        if n >= max(LOOP_MIN_TOKENS, LOOP_MIN_REPEATS * p):
            return p
    return None


def repeated_cover(tokens: Sequence[int]) -> float:
    """Share of the output's last REPEAT_TAIL tokens covered by REPEAT_N-grams that occur there at least
    REPEAT_MIN_COUNT times (0.0 for a tail shorter than LOOP_MIN_TOKENS)."""
    tail = list(tokens[-REPEAT_TAIL:])
    if len(tail) < LOOP_MIN_TOKENS:
        return 0.0
    grams = [tuple(tail[i: i + REPEAT_N]) for i in range(len(tail) - REPEAT_N + 1)]
    counts = Counter(grams)
    covered = {i + j for i, g in enumerate(grams) if counts[g] >= REPEAT_MIN_COUNT for j in range(REPEAT_N)}
    return len(covered) / len(tail)


def flags(record: dict, verify: str) -> list[str]:
    """Why a row's acceptance is not evidence about the drafts ([] when it is): `loop (period p)` for a
    repeating tail, else `repeated 3-grams (x% of the tail)` for a tail mostly made of its repeats (the stop
    token that ended the row left out), `accepted everything (rate r)` for a lossy verifier's row at the AL
    ceiling."""
    toks = record["tokens"][:-1] if record.get("finish_reason") == "stop" else record["tokens"]
    out = []
    if (p := loop_period(toks)) is not None:
        out.append(f"loop (period {p})")
    elif (cover := repeated_cover(toks)) >= REPEAT_COVER:
        out.append(f"repeated {REPEAT_N}-grams ({cover:.0%} of the tail)")
    hist = record["row_accepted_hist"]
    k, steps = len(hist) - 1, sum(hist)
    if not verifier(verify).greedy_output and k and steps >= AL_CEILING_MIN_STEPS:
        rate = sum(a * c for a, c in enumerate(hist)) / (k * steps)
        if rate >= AL_CEILING_RATE:
            out.append(f"accepted everything (rate {rate:.2f})")
    return out


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
    """`quality/answered`, `quality/correct`, `quality/accuracy` with its 95% Wilson interval
    (`quality/accuracy_lo` / `_hi`: one independent outcome per prompt) over the records that carry an answer
    ({} when none does)."""
    answered = [r for r in records if r.get("answer") is not None]
    if not answered:
        return {}
    correct = sum(is_correct(r["output"], r["answer"]) for r in answered)
    lo, hi = wilson(correct, len(answered))
    return {"quality/answered": len(answered), "quality/correct": correct,
            "quality/accuracy": correct / len(answered), "quality/accuracy_lo": lo, "quality/accuracy_hi": hi}


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
