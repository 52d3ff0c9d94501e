"""Price a saved `mtp-bench --tp N` result again under other projection assumptions, without a GPU:
`python -m mtp.bench.reproject RESULT.json --collective-json FILE --allreduce oneshot [--out NEW.json]`.

Why: the projection (`rank_model.project`) is arithmetic on what the run measured (target steps, speculative steps,
collective counts); its assumptions (collective latencies, acceptance, the real-vs-simulated overhead) are arguments.
A run made with one assumption (e.g. `--allreduce-us 10`, the default) can be priced with a measured collective file
(`python -m mtp.bench.allreduce` / `mtp.bench.collectives` on 2 or 4 GPUs) side by side, from the same measurement,
instead of a second 200-second GPU run. Every projection flag not given keeps the value the run was made with (its
JSON's `args`); the flags are mtp-bench's own (`cli.add_projection_args`), checked the same way.

The result's measured parts are not touched: `--out` writes a copy of the whole result with `projection` replaced and
`reprojected` saying from which file and with which flags (atomically; never over RESULT.json itself).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .cli import _tree_al, add_projection_args, check_projection_args
from .rank_model import project
from .rank_report import print_projection, save

__all__ = ["load_result", "main", "reproject"]

# the levels of a --tp N result whose keys are integers in memory (contexts, widths, indexer rows) and strings in JSON
_INT_KEYED = ("contexts", "widths", "indexer", "batches")


def _int_keys(d):
    """The saved result with its integer-keyed levels (`_INT_KEYED`) as integers again, as `rank.run` built it."""
    if isinstance(d, list):
        return [_int_keys(v) for v in d]
    if not isinstance(d, dict):
        return d
    out = {}
    for k, v in d.items():
        v = _int_keys(v)
        if k in _INT_KEYED and isinstance(v, dict):
            v = {int(i) if isinstance(i, str) and i.isdigit() else i: x for i, x in v.items()}
        out[k] = v
    return out


def load_result(path: str) -> dict:
    """A saved `mtp-bench --tp N` result (its JSON), checked for what `project` reads; the error names the file and
    what is missing."""
    p = Path(path)
    try:
        res = json.loads(p.read_text())
    except FileNotFoundError:
        raise SystemExit(f"reproject: {path}: no such file") from None
    except json.JSONDecodeError as e:
        raise SystemExit(f"reproject: {path}: not JSON ({e})") from None
    need = ("tp", "device", "args", "contexts", "draft_collectives_per_forward")
    missing = [k for k in need if not isinstance(res, dict) or k not in res]
    if missing:
        raise SystemExit(f"reproject: {path}: not an `mtp-bench --tp N` result (missing {', '.join(missing)})")
    if res["device"] == "cpu":
        raise SystemExit(f"reproject: {path}: a CPU run (its times are a small simulated rank's, not a GPU's: "
                         "nothing to project)")
    return _int_keys(res)


def reproject(res: dict, overrides: dict) -> dict:
    """`project(res, args)` with the run's own arguments, `overrides` (flag dest -> value) replacing some."""
    args = argparse.Namespace(**{**res["args"], **overrides})
    return project(res, args)


def parse_args(argv=None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", help="a JSON written by `mtp-bench --tp N --json`")
    ap.add_argument("--out", default=None, help="write the result with the new projection here (default: print only)")
    add_projection_args(ap, defaults=False)  # not given: the run's own value
    return ap.parse_args(argv), ap


def main(argv=None) -> dict:
    args, ap = parse_args(argv)
    res = load_result(args.result)
    given = {k: v for k, v in vars(args).items() if k not in ("result", "out") and v is not None}
    if "tree_al" in given:  # shapes the run timed (--trees) only
        given["tree_al"] = _tree_al(ap, given["tree_al"], list(res["args"].get("trees") or []))
    merged = argparse.Namespace(**{**res["args"], **given})
    check_projection_args(ap, merged)
    if args.out and Path(args.out).resolve() == Path(args.result).resolve():
        ap.error("--out must not be the result it reads (its projection is part of the measurement's record)")
    pj = reproject(res, {k: getattr(merged, k) for k in given})
    res["projection"] = pj
    res["reprojected"] = {"from": args.result, "flags": {k: str(v) for k, v in given.items()}}
    print(f"reprojected {args.result} with " + (", ".join(f"--{k.replace('_', '-')} {v}" for k, v in given.items())
                                                 or "the run's own arguments"))
    print_projection(res)
    save(res, args.out)
    sys.stdout.flush()
    return res


if __name__ == "__main__":
    main()
