"""metrics.json from sample records: overall, per category, per draft position, speedup, strict mismatches.

Acceptance and speed are exact merges of the engine's own `SpecMetrics` per batch (each record carries its
batch's metrics; batches never mix categories, so per-category merges are exact too). Row-level numbers in
the records (accepted lengths per prompt) are for browsing samples, not for these aggregates.

Uncertainty: every acceptance figure (AL, rate, per position, overall and per category) gets a 95% interval
from a bootstrap over prompts (`_lo` / `_hi` keys; mtp.stats says why prompts and not steps), computed from
the records' per-row histograms; the point values stay the engine's. Task accuracy gets a Wilson interval.
Rows flagged by eval/quality.py (loops, a lossy verifier accepting everything) are listed under `flagged`, and
the acceptance of the other rows is reported beside the full one (`accept_unflagged/*`).

Speed has a spread: every batch ran `timing.repeats` times (each record keeps the metrics and wall time of
every repeat), and repeat r of a run is the merge of repeat r of its batches. Every `speed/*` and `time/*`
number is the median over repeats; tok/s also gets `_min` / `_max`. A speedup is the median (min, max) of
the per-repeat ratios spec_r / base_r: the two halves of a pair ran back to back, so a load change between
repeats cancels in the ratio instead of widening it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from statistics import median

from mtp.decode.metrics import AcceptanceStats, SpecMetrics
from mtp.verify.registry import verifier

from . import breakdown, quality, trees

SPREAD = ("speed/decode_tok_s", "speed/e2e_tok_s")  # reported with _min / _max next to the median


def _batches(records: Sequence[dict]) -> dict[str, dict]:
    """First record of each batch (it carries the batch metrics), in file order."""
    out: dict[str, dict] = {}
    for r in records:
        out.setdefault(r["batch"], r)
    return out


def _repeats(r: dict) -> list:
    """[metrics, wall_s] of every timed repeat of the record's batch (the first is the run whose tokens were
    kept); records written before repeats existed have one."""
    return r.get("repeats") or [[r["batch_metrics"], r["batch_wall_s"]]]


def _merge(batch_recs: Sequence[dict], repeat: int = 0) -> tuple[SpecMetrics, float]:
    m, wall = None, 0.0
    for r in batch_recs:
        raw, w = _repeats(r)[repeat]
        bm = SpecMetrics.from_raw(raw)
        m = bm if m is None else m.merge(bm)
        wall += w
    return m, wall


# An output this long made of one token id is flagged: NaN logits (every argmax 0) look like this, with every
# draft "accepted". Shorter outputs (a lone EOS, "ok") say too little to flag.
DEGENERATE_MIN_TOKENS = 4


def is_degenerate(tokens: Sequence[int]) -> bool:
    """One token repeated for the whole output."""
    return len(tokens) >= DEGENERATE_MIN_TOKENS and len(set(tokens)) == 1


def degenerate(records: Sequence[dict]) -> dict:
    """Outputs that report a broken model rather than acceptance: ids of those that are one token repeated, and
    whether every row (two or more) produced the very same output. Flagged, never a failure."""
    ids = [r["id"] for r in records if is_degenerate(r["tokens"])]
    same = len(records) >= 2 and len({tuple(r["tokens"]) for r in records}) == 1
    return {"count": len(ids), "ids": ids, "all_rows_identical": same}


def flat(m: SpecMetrics, wall_s: float, n_prompts: int) -> dict:
    """The engine's namespaced metrics plus end-to-end wall time (prefill + decode + host work)."""
    d = m.to_dict()
    d["count/prompts"] = n_prompts
    d["time/wall_s"] = wall_s
    d["speed/e2e_tok_s"] = m.new_tokens / wall_s if wall_s > 0 else 0.0
    # Accepted drafts that were not the target's argmax (relaxed rule, or a sampled accept): their share
    # of all accepted drafts is what the lossy verifier added to the acceptance.
    drafts = sum(a * c for a, c in enumerate(m.accepted_hist))
    d["count/accepted_drafts"] = drafts
    d["accept/relaxed_only_share"] = m.relaxed_only_accepts / drafts if drafts else 0.0
    return d


def spread(values: Sequence[float]) -> dict:
    return {"median": median(values), "min": min(values), "max": max(values), "n": len(values)}


def _timed(batch_recs: Sequence[dict], n_prompts: int) -> tuple[dict, list[dict]]:
    """Flat metrics of a set of batches (speed and time: medians over repeats, tok/s with min / max) and the
    speed of each repeat. Counts and acceptance are those of the first repeat (every repeat makes the same
    tokens). A resumed run whose batches ran different numbers of repeats uses the repeats all of them have."""
    n = min(len(_repeats(r)) for r in batch_recs)
    runs = [flat(*_merge(batch_recs, i), n_prompts) for i in range(n)]
    out = dict(runs[0])
    for key in out:
        if key.startswith(("speed/", "time/")):
            vals = [run[key] for run in runs if run[key] is not None]  # latency percentiles: None without samples
            out[key] = median(vals) if vals else None
    for key in SPREAD:
        out[f"{key}_min"] = min(run[key] for run in runs)
        out[f"{key}_max"] = max(run[key] for run in runs)
    out["timing/repeats"] = n
    return out, [{key: run[key] for key in (*SPREAD, "time/wall_s")} for run in runs]


def _by_category(records: Sequence[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in records:
        out.setdefault(r["category"], []).append(r)
    return out


def _row_stats(records: Sequence[dict]) -> AcceptanceStats:
    hists = [r["row_accepted_hist"] for r in records]
    return AcceptanceStats.from_rows(hists, len(hists[0]) - 1)


def _acceptance_extra(records: Sequence[dict], flagged: set[str]) -> dict:
    """Intervals and prompt / step counts of the records' acceptance, the flagged-row count and the acceptance
    of the unflagged rows (`accept_unflagged/*`, `count/unflagged_*`)."""
    st = _row_stats(records)
    out = {**st.intervals(), "count/prompts_with_steps": st.prompts}
    out["quality/flagged_rows"] = sum(r["id"] in flagged for r in records)
    clean = [r for r in records if r["id"] not in flagged]
    if clean:
        for key, v in _row_stats(clean).to_dict().items():
            out[key.replace("accept/", "accept_unflagged/").replace("count/", "count/unflagged_")] = v
    return out


def flagged(records: Sequence[dict], verify: str) -> dict:
    """The rows whose acceptance says nothing about the drafts (eval/quality.py `flags`): count, ids, reasons."""
    reasons = {r["id"]: f for r in records if (f := quality.flags(r, verify))}
    return {"count": len(reasons), "ids": list(reasons), "reasons": reasons}


def summarize(records: Sequence[dict], verify: str = "strict") -> dict:
    """overall / per_category / per_position / accepted_hist / finish_reasons / per_repeat (the speed of each
    timing repeat, overall and per category) / flagged of one set of records."""
    batches = _batches(records)
    overall, runs = _timed(list(batches.values()), len(records))
    hist = _merge(list(batches.values()))[0]
    cats = _by_category(list(batches.values()))
    by_cat = _by_category(records)
    flags = flagged(records, verify)
    per_cat, cat_runs = {}, {}
    for c, recs in cats.items():
        per_cat[c], cat_runs[c] = _timed(recs, len(by_cat[c]))
        per_cat[c].update(quality.accuracy(by_cat[c]))
        per_cat[c]["quality/degenerate_rows"] = sum(is_degenerate(r["tokens"]) for r in by_cat[c])
        per_cat[c].update(_acceptance_extra(by_cat[c], set(flags["ids"])))
    if "batch_tree_metrics" in records[0]:  # a tree run: acceptance per depth and sibling rank, nodes
        overall.update(trees.flat(list(batches.values())))
        for c, recs in cats.items():
            per_cat[c].update(trees.flat(recs))
    overall.update(quality.accuracy(records))
    overall["quality/degenerate_rows"] = sum(is_degenerate(r["tokens"]) for r in records)
    overall.update(_acceptance_extra(records, set(flags["ids"])))
    o = overall
    return {
        "overall": overall,
        "per_category": per_cat,
        "per_repeat": {"overall": runs, "per_category": cat_runs},
        "per_position": [{"pos": j, "accept": cum, "accept_cond": cond,
                          "accept_lo": o[f"accept/pos_{j}_lo"], "accept_hi": o[f"accept/pos_{j}_hi"],
                          "accept_cond_lo": o[f"accept/cond_pos_{j}_lo"],
                          "accept_cond_hi": o[f"accept/cond_pos_{j}_hi"],
                          "prompts": o["count/prompts_with_steps"], "steps": o["count/row_steps"]}
                         for j, (cum, cond) in enumerate(zip(hist.accept_cum, hist.accept_cond), start=1)],
        "flagged": flags,
        "accepted_hist": list(hist.accepted_hist),
        "finish_reasons": dict(Counter(r["finish_reason"] for r in records)),
    }


def _paired(spec_runs: Sequence[dict], base_runs: Sequence[dict]) -> dict:
    """Speedups of the pairs (repeat r of the spec run, repeat r of the baseline): median, min, max."""
    pairs = list(zip(spec_runs, base_runs))
    dec = [s["speed/decode_tok_s"] / b["speed/decode_tok_s"] for s, b in pairs if b["speed/decode_tok_s"]]
    e2e = [b["time/wall_s"] / s["time/wall_s"] for s, b in pairs if s["time/wall_s"]]
    out: dict = {"pairs": len(pairs)}
    for name, vals in (("decode", dec), ("e2e", e2e)):
        sp = spread(vals) if vals else {"median": None, "min": None, "max": None}
        out.update({name: sp["median"], f"{name}_min": sp["min"], f"{name}_max": sp["max"]})
    return out


def speedup(spec: dict, base: dict) -> dict:
    """Spec over baseline, overall and per category: decode tokens/s ratio and end-to-end wall-time ratio,
    each the median of the paired repeats with their min and max."""
    s, b = spec["per_repeat"], base["per_repeat"]
    return {"overall": _paired(s["overall"], b["overall"]),
            "per_category": {c: _paired(runs, b["per_category"][c]) for c, runs in s["per_category"].items()
                             if c in b["per_category"]}}


def mismatches(spec_records: Sequence[dict], base_records: Sequence[dict]) -> list[str]:
    """Ids whose generated tokens differ from the baseline's (in the spec file's order)."""
    base = {r["id"]: r["tokens"] for r in base_records}
    return [r["id"] for r in spec_records if r["id"] in base and r["tokens"] != base[r["id"]]]


def metrics_json(run: dict, spec_records: Sequence[dict], base_records: Sequence[dict] | None,
                 compare_tokens: bool, strict_records: Sequence[dict] | None = None,
                 strict_source: str | None = None) -> dict:
    """The content of metrics.json (without the config): run info, the spec run's summary, and with a
    baseline its summary, the speedups and (when `compare_tokens`) the ids whose outputs differ. With
    `strict_records` (plain greedy outputs of the same prompts, read from `strict_source`) the spec run's
    agreement with them, overall and per category (`quality/strict_*`)."""
    verify = run.get("verify", "strict")
    spec = summarize(spec_records, verify)
    relaxed = spec["overall"]["accept/relaxed_only"] if verifier(verify).needs_think_ids else None
    out = {"run": run, **spec, "breakdown": breakdown.breakdown(spec_records, relaxed), "baseline": None,
           "speedup": None, "strict_mismatch": None,
           "strict_reference": strict_source if strict_records is not None else None,
           "degenerate": degenerate(spec_records),
           "tree": trees.section(list(_batches(spec_records).values()), run)
           if "batch_tree_metrics" in spec_records[0] else None}
    if strict_records is not None:
        out["overall"].update(quality.agreement(spec_records, strict_records))
        strict_by_cat = _by_category(strict_records)
        for c, recs in _by_category(spec_records).items():
            out["per_category"][c].update(quality.agreement(recs, strict_by_cat.get(c, [])))
    out["timing"] = {
        "repeats": spec["overall"]["timing/repeats"], "interleaved_with_baseline": base_records is not None,
        "batches_with_differing_repeats": sorted({r["batch"] for r in [*spec_records, *(base_records or [])]
                                                  if r.get("repeats_differ")}),
    }
    if base_records is not None:
        base = summarize(base_records, verify)
        sp = speedup(spec, base)
        out.update(baseline={key: base[key] for key in ("overall", "per_category", "per_repeat")}, speedup=sp)
        for name in ("decode", "e2e"):
            for tail in ("", "_min", "_max"):
                out["overall"][f"speed/speedup_{name}{tail}"] = sp["overall"][name + tail]
        if compare_tokens:
            ids = mismatches(spec_records, base_records)
            out["strict_mismatch"] = {"count": len(ids), "ids": ids}
            out["overall"]["quality/strict_mismatch"] = len(ids)
    return out
