"""metrics.json from sample records: overall, per category, per draft position, speedup, strict mismatches.

Acceptance and speed are exact merges of the engine's own `SpecMetrics` per batch (each record carries its
batch's metrics; batches never mix categories, so per-category merges are exact too). Row-level numbers in
the records (accepted lengths per prompt) are for browsing samples, not for these aggregates.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from mtp.metrics import SpecMetrics


def _batches(records: Sequence[dict]) -> dict[str, dict]:
    """First record of each batch (it carries the batch metrics), in file order."""
    out: dict[str, dict] = {}
    for r in records:
        out.setdefault(r["batch"], r)
    return out


def _merge(batch_recs: Sequence[dict]) -> tuple[SpecMetrics, float]:
    m, wall = None, 0.0
    for r in batch_recs:
        bm = SpecMetrics(**r["batch_metrics"])
        m = bm if m is None else m.merge(bm)
        wall += r["batch_wall_s"]
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


def flat(m: SpecMetrics, wall_s: float, n_prompts: int, degenerate_rows: int = 0) -> dict:
    """The engine's namespaced metrics plus end-to-end wall time (prefill + decode + host work)."""
    d = m.to_dict()
    d["count/prompts"] = n_prompts
    d["quality/degenerate_rows"] = degenerate_rows
    d["time/wall_s"] = wall_s
    d["speed/e2e_tok_s"] = m.new_tokens / wall_s if wall_s > 0 else 0.0
    return d


def summarize(records: Sequence[dict]) -> dict:
    """overall / per_category / per_position / accepted_hist / finish_reasons of one set of records."""
    batches = _batches(records)
    overall, wall = _merge(list(batches.values()))
    cats: dict[str, list[dict]] = {}
    for r in batches.values():
        cats.setdefault(r["category"], []).append(r)
    n_by_cat = Counter(r["category"] for r in records)
    degen_by_cat = Counter(r["category"] for r in records if is_degenerate(r["tokens"]))
    per_cat = {}
    for c, recs in cats.items():
        m, w = _merge(recs)
        per_cat[c] = flat(m, w, n_by_cat[c], degen_by_cat[c])
    return {
        "overall": flat(overall, wall, len(records), sum(degen_by_cat.values())),
        "per_category": per_cat,
        "per_position": [{"pos": j, "accept": cum, "accept_cond": cond}
                         for j, (cum, cond) in enumerate(zip(overall.accept_cum, overall.accept_cond), start=1)],
        "accepted_hist": list(overall.accepted_hist),
        "finish_reasons": dict(Counter(r["finish_reason"] for r in records)),
    }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def speedup(spec: dict, base: dict) -> dict:
    """Spec over baseline: decode tokens/s ratio and end-to-end wall-time ratio, overall and per category."""
    def one(s: dict, b: dict) -> dict:
        return {"decode": _ratio(s["speed/decode_tok_s"], b["speed/decode_tok_s"]),
                "e2e": _ratio(b["time/wall_s"], s["time/wall_s"])}

    return {"overall": one(spec["overall"], base["overall"]),
            "per_category": {c: one(m, base["per_category"][c]) for c, m in spec["per_category"].items()
                             if c in base["per_category"]}}


def mismatches(spec_records: Sequence[dict], base_records: Sequence[dict]) -> list[str]:
    """Ids whose generated tokens differ from the baseline's (in the spec file's order)."""
    base = {r["id"]: r["tokens"] for r in base_records}
    return [r["id"] for r in spec_records if r["id"] in base and r["tokens"] != base[r["id"]]]


def metrics_json(run: dict, spec_records: Sequence[dict], base_records: Sequence[dict] | None,
                 compare_tokens: bool) -> dict:
    """The content of metrics.json (without the config): run info, the spec run's summary, and with a
    baseline its summary, the speedups and (when `compare_tokens`) the ids whose outputs differ."""
    spec = summarize(spec_records)
    out = {"run": run, **spec, "baseline": None, "speedup": None, "strict_mismatch": None,
           "degenerate": degenerate(spec_records)}
    if base_records is not None:
        base = summarize(base_records)
        sp = speedup(spec, base)
        out.update(baseline={"overall": base["overall"], "per_category": base["per_category"]}, speedup=sp)
        out["overall"]["speed/speedup_decode"] = sp["overall"]["decode"]
        out["overall"]["speed/speedup_e2e"] = sp["overall"]["e2e"]
        if compare_tokens:
            ids = mismatches(spec_records, base_records)
            out["strict_mismatch"] = {"count": len(ids), "ids": ids}
            out["overall"]["quality/strict_mismatch"] = len(ids)
    return out
