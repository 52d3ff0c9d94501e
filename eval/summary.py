"""Sweep summary: one row per finished job of a multirun, and one (job, error) per refused or failed job, written
next to the jobs' folders.

Runs by itself at the end of every `mtp-eval -m ...` (Hydra callback `SweepSummaryCallback`, configured in
conf/eval.yaml), or by hand: `python -m mtp_eval.summary outputs/eval/multiruns/<date>`. Writes
sweep_summary.{json,csv,png} (AL, decode tok/s and speedup against k, one line per series, tok/s and
speedup with min-max error bars and the baseline's tok/s beside them; with tree runs also AL against the
verified nodes) and prints a table. A series is the combination of the settings that vary across the sweep,
k aside (e.g. draft x verify, or tree x min_draft_prob).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import sys
from pathlib import Path

from hydra.experimental.callback import Callback

from mtp.utils import write_atomic
from mtp.verify.registry import verifier

from .rundir import FAILED_NAME

log = logging.getLogger(__name__)

SERIES_KEYS = ("draft", "verify", "runtime_mode", "target_hidden", "chain_hidden", "numerics", "model", "dataset",
               "thinking", "tree", "min_draft_prob")
# row key -> table header; keys with `_min` / `_max` companions print as `median (min-max)`
COLUMNS = {"job": "job", "series": "series", "k": "k", "prompts": "prompts", "accept/mean_len": "AL",
           "accept/pos_1": "acc@1", "accept/rate": "rate", "flagged": "flagged",
           "accept_unflagged/mean_len": "AL unflagged", "ttft_ms": "TTFT ms mean p50/p90/p99",
           "tpot_ms": "TPOT ms mean p50/p90/p99", "tree/nodes": "nodes", "tree/tokens_per_node": "tok/node",
           "tree/tokens_per_live_node": "tok/live node", "speed/decode_tok_s": "decode tok/s", "base/decode_tok_s": "base tok/s",
           "speedup_decode": "speedup", "speed/e2e_tok_s": "e2e tok/s", "strict_mismatch": "mismatch",
           "relaxed_only_share": "relaxed-only", "strict_token_agreement": "= strict", "accuracy": "accuracy",
           "base_accuracy": "base acc.", "strict_accuracy": "strict acc."}
SPREAD_COLUMNS = ("speed/decode_tok_s", "base/decode_tok_s", "speedup_decode")
CI_COLUMNS = ("accept/mean_len", "accept/pos_1", "accept/rate", "accept_unflagged/mean_len")  # with _lo / _hi
LATENCY = {"ttft_ms": "ttft", "tpot_ms": "tpot"}  # column -> metric of `speed/{metric}_{q}_s`


def _with_ci(m: dict, key: str) -> dict:
    """{key, key_lo, key_hi}: a figure with its 95% interval (None each without one)."""
    return {f"{key}{tail}": m.get(f"{key}{tail}") for tail in ("", "_lo", "_hi")}


def _latency(m: dict) -> dict:
    """`ttft_{q}_s` / `tpot_{q}_s` (q: mean, p50, p90, p99) of per-request latency."""
    return {f"{name}_{q}_s": m.get(f"speed/{name}_{q}_s") for name in LATENCY.values()
            for q in ("mean", "p50", "p90", "p99")}


def _with_spread(name: str, m: dict | None, key: str) -> dict:
    """{name, name_min, name_max} from a metrics dict holding key, key_min, key_max (None without it)."""
    return {f"{name}{tail}": m.get(f"{key}{tail}") if m else None for tail in ("", "_min", "_max")}


def collect(sweep_dir: Path) -> list[dict]:
    rows = []
    for path in sorted(sweep_dir.glob("**/metrics.json")):
        m = json.loads(path.read_text())
        o, run = m["overall"], m["run"]
        sp, mm, base = m.get("speedup"), m.get("strict_mismatch"), m.get("baseline")
        code, ckpt = (m.get("provenance") or {}).get("code", {}), (m.get("provenance") or {}).get("checkpoint", {})
        rows.append({"job": str(path.parent.relative_to(sweep_dir)), **{k: run.get(k) for k in SERIES_KEYS},
                     "k": run["k"], "prompts": o["count/prompts"], "steps": o.get("count/row_steps"),
                     **_with_ci(o, "accept/mean_len"), **_with_ci(o, "accept/pos_1"), **_with_ci(o, "accept/rate"),
                     # rows whose acceptance reports a loop (eval/quality.py) and the acceptance without them
                     "flagged": o.get("quality/flagged_rows"), **_with_ci(o, "accept_unflagged/mean_len"),
                     **_latency(o),
                     # tree runs: verify width and what a verified (live: not pruned by min_draft_prob) node bought
                     "tree/nodes": o.get("tree/nodes"), "tree/tokens_per_node": o.get("tree/tokens_per_node"),
                     "tree/tokens_per_live_node": o.get("tree/tokens_per_live_node") if run.get("min_draft_prob")
                     else None,
                     **_with_spread("speed/decode_tok_s", o, "speed/decode_tok_s"),
                     **_with_spread("base/decode_tok_s", base and base["overall"], "speed/decode_tok_s"),
                     **_with_spread("speedup_decode", sp and sp["overall"], "decode"),
                     "speed/e2e_tok_s": o["speed/e2e_tok_s"], "repeats": o.get("timing/repeats", 1),
                     "strict_mismatch": mm["count"] if mm else None,
                     # what relaxed / sampled verification cost: accepts strict would reject, agreement with
                     # strict greedy outputs, task accuracy (prompts with answers)
                     "relaxed_only_share": o.get("accept/relaxed_only_share")
                     if not verifier(run["verify"]).greedy_output else None,
                     "strict_token_agreement": o.get("quality/strict_token_agreement"),
                     "strict_identical": o.get("quality/strict_identical"), "accuracy": o.get("quality/accuracy"),
                     "base_accuracy": base["overall"].get("quality/accuracy") if base else None,
                     "strict_accuracy": o.get("quality/strict_accuracy"), "device_note": run.get("device_note"),
                     "commit": _commit(code), "checkpoint": f"{ckpt['name']}@{ckpt['fingerprint']}" if ckpt else None})
    varying = [k for k in SERIES_KEYS if len({str(r[k]) for r in rows}) > 1]
    for r in rows:
        r["series"] = " ".join(f"{k}={r[k]}" for k in varying) if varying else str(r["draft"])
    return rows


def failures(sweep_dir: Path) -> list[dict]:
    """{job, error, exit} of every job that was refused or failed (eval/run.py `sweep_job`)."""
    return [{"job": str(p.parent.relative_to(sweep_dir)), **json.loads(p.read_text())}
            for p in sorted(sweep_dir.glob(f"**/{FAILED_NAME}"))]


def _cell(r: dict, c: str) -> str:
    from .report import ci_text, latency_text, spread_text

    if c in SPREAD_COLUMNS:
        return spread_text(r, c, 1 if "tok_s" in c else 2, "x" if c == "speedup_decode" else "")
    if c in CI_COLUMNS:
        return ci_text(r, c)
    if c in LATENCY:
        return latency_text({f"speed/{key}": v for key, v in r.items()}, LATENCY[c])
    return "-" if r[c] is None else f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c])


def _commit(code: dict) -> str | None:
    """Short commit, '+dirty' when the checkout had changes; None for results without provenance."""
    c = code.get("git_commit")
    return None if c is None else c[:12] + ("+dirty" if code.get("git_dirty") else "")


def write(sweep_dir: Path, rows: list[dict]) -> dict[str, Path]:
    from .plots import sweep_summary

    out = {"json": sweep_dir / "sweep_summary.json", "csv": sweep_dir / "sweep_summary.csv",
           "png": sweep_dir / "sweep_summary.png"}
    write_atomic(out["json"], json.dumps(rows, indent=2) + "\n")
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))  # failed rows: job, error
    w.writeheader()
    w.writerows(rows)
    write_atomic(out["csv"], buf.getvalue())
    done = [r for r in rows if not r["error"]]
    if not done:
        del out["png"]
        return out
    sweep_summary(done, out["png"])
    return out


def print_table(rows: list[dict], title: str) -> None:
    from rich.table import Table

    from .report import console

    notes = sorted({r["device_note"] for r in rows if r.get("device_note")})
    repeats = sorted({r["repeats"] for r in rows})
    title += f"\ntok/s, speedup: median (min-max) of {'/'.join(map(str, repeats))} repeats"
    t = Table(title="; ".join([title, *notes]), title_justify="left")
    columns = [c for c in COLUMNS if c in LATENCY or any(r[c] is not None for r in rows)]  # no accuracy...
    for c in columns:
        t.add_column(COLUMNS[c], justify="left" if c in ("job", "series") else "right")
    for r in sorted(rows, key=lambda r: (r["series"], r["k"])):
        t.add_row(*(_cell(r, c) for c in columns))
    console().print(t)
    made_by = sorted({f"commit {r['commit']}, checkpoint {r['checkpoint']}" for r in rows})
    console().print("produced by: " + ("; ".join(made_by) if made_by else "(no provenance recorded)"))


def summarize(sweep_dir: Path) -> list[dict]:
    """Rows of the finished jobs (`error` None), then {job, error, exit} of each failed one."""
    rows = [{**r, "error": None} for r in collect(sweep_dir)]
    failed = failures(sweep_dir)
    if not rows and not failed:
        log.warning("sweep summary: no metrics.json under %s", sweep_dir)
        return rows
    paths = write(sweep_dir, rows + failed)
    if rows:
        print_table(rows, f"sweep {sweep_dir} ({len(rows)} runs)")
    for f in failed:
        log.error("sweep job %s failed: %s", f["job"], f["error"])
    log.info("sweep summary: %s", ", ".join(str(p) for p in paths.values()))
    return rows + failed


class SweepSummaryCallback(Callback):
    def on_multirun_end(self, config, **kwargs) -> None:
        """The summary, then exit 1 when a job was refused or failed (its jobs ran on; see eval/run.py `sweep_job`)."""
        rows = summarize(Path(config.hydra.sweep.dir))
        failed = [r for r in rows if r["error"]]
        if failed:
            raise SystemExit(f"mtp-eval: {len(failed)} of {len(rows)} sweep jobs failed (listed in sweep_summary.json): "
                             + "; ".join(f"job {r['job']}: {r['error']}" for r in failed))


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: python -m mtp_eval.summary SWEEP_DIR")
    found = summarize(Path(sys.argv[1]))
    sys.exit(0 if found and not any(r["error"] for r in found) else 1)
