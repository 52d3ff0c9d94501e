"""The real-vs-simulated overhead that `mtp-bench --tp N`'s projection multiplies by (`--real-overhead`), measured:
a real TP=N step over NCCL (`mtp.bench.parallel --out`, slowest rank, graph) divided by the simulated rank of the
same layers (`mtp-bench --tp N --json`) plus the collectives that step runs, priced from a measured latency file
exactly as the projection prices them (`rank_model.comm_ms`: block-boundary all-reduces at their fused price
under oneshot).

    python -m mtp.bench.overhead REAL.json SIM.json --collectives allreduce_4gpu.json [--gather-us 16.3]

Both runs must describe the same step (world, layers, dense layers, context 1024 in the simulated run): checked,
an error names the field that differs. The all-gather price, where the latency file holds none (an
`mtp.bench.allreduce` file), is `--gather-us` (say where it was measured).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

from .rank_model import collective_latency, comm_ms


def _load(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"mtp.bench.overhead: cannot read {path}: {e}") from None


def check_same_step(real: dict, sim: dict, real_path: str, sim_path: str) -> None:
    """Refuse two runs of different steps (world, layers, dense layers), naming the field."""
    rc, sc = real["config"], sim["config"]
    pairs = {"world": (real["world"], sim["tp"]),
             "num_hidden_layers": (rc["num_hidden_layers"], sc["num_hidden_layers"]),
             "first_k_dense_replace": (rc["first_k_dense_replace"], sc["first_k_dense_replace"])}
    for name, (a, b) in pairs.items():
        if a != b:
            raise SystemExit(f"mtp.bench.overhead: {name} differs: {a} in {real_path}, {b} in {sim_path}")


def overhead(real: dict, sim: dict, collectives: str, gather_us: float, context: str = "1024") -> dict:
    """{impl: {w: {real_ms, sim_ms, collectives_ms, ratio}}} for every all-reduce the real run timed."""
    if context not in sim["contexts"]:
        raise SystemExit(f"mtp.bench.overhead: the simulated run has no context {context} "
                         f"(has {sorted(sim['contexts'])})")
    widths = sim["contexts"][context]["widths"]
    out: dict = {}
    # back-to-back replays on both sides where both timed them (the projection reads the simulated rank's so), else
    # one replay per event pair on both
    both = all(step.get("graph_ms_b2b") is not None for r in real["allreduce"].values()
               for step in r["target_step"].values()) and all("graph_ms_b2b" in v for v in widths.values())
    key = "graph_ms_b2b" if both else "graph_ms"
    out["timing"] = key
    for impl, r in real["allreduce"].items():
        lat = collective_latency(SimpleNamespace(collective_json=collectives, tp=real["world"], allreduce=impl,
                                                 collective_growth=1.0, allreduce_us=gather_us))
        rows = {}
        for w, step in r["target_step"].items():
            real_ms = step.get(key)
            if real_ms is None or w not in widths:
                continue
            sim_ms = widths[w][key]
            c = comm_ms(lat, widths[w]["collectives"])
            rows[w] = {"real_ms": real_ms, "sim_ms": sim_ms, "collectives_ms": c, "ratio": real_ms / (sim_ms + c)}
        out[impl] = rows
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mtp.bench.overhead", description=__doc__.splitlines()[0])
    ap.add_argument("real", help="mtp.bench.parallel --out JSON (graph mode)")
    ap.add_argument("sim", help="mtp-bench --tp N --json of the same layers")
    ap.add_argument("--collectives", required=True, help="mtp.bench.allreduce / mtp.bench.collectives JSON")
    ap.add_argument("--gather-us", type=float, required=True,
                    help="us per logits all-gather where the latency file has none (state its source)")
    ap.add_argument("--json", default=None, help="write the ratios here")
    args = ap.parse_args(argv)
    real, sim = _load(args.real), _load(args.sim)
    check_same_step(real, sim, args.real, args.sim)
    res = overhead(real, sim, args.collectives, args.gather_us)
    print(f"timing: {res['timing']}")
    for impl, rows in res.items():
        if impl == "timing":
            continue
        line = "  ".join(f"w={w}: {r['real_ms']:.3f} / ({r['sim_ms']:.3f} + {r['collectives_ms']:.3f}) = "
                         f"{r['ratio']:.3f}" for w, r in rows.items())
        print(f"{impl:8s} {line}")
    if args.json:
        Path(args.json).write_text(json.dumps({"real": args.real, "sim": args.sim, "collectives": args.collectives,
                                               "gather_us": args.gather_us, "overhead": res}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
