"""Draft trees vs chains vs adaptive length on the bundled model (BENCHMARKS.md's table), on the CPU.

    python -m mtp_eval.tree_acceptance --out eval/results/tree_acceptance_cpu.json

Every point runs through mtp-eval's tree path (eval/trees.py: the config composed from conf/ with draft.tree /
draft.min_draft_prob / verify overrides, then mtp.decode.tree.run_tree), on the prompts of mtp-eval's default
dataset (the built-in chat, code, math and reasoning suites) with thinking on, so relaxed verification has
spans to act in. All prompts go in one batch per point. Strict points must reproduce plain greedy decoding token
for token (checked; exit status 1 otherwise); chain points are also run through the chain engine
(mtp.generate), whose AL the tree decoder's chain must reproduce. Prints the tables of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

CHAINS = ("1", "1x1", "1x1x1")
# 2 candidates at depth 1 then chains; 3 then chains; top-2 twice; 4 nodes as the chain of 3 (two candidates at
# depth 1, the top one extended); the chain of 3 plus a second candidate at depth 1 (5 nodes)
TREES = ("2x1x1", "3x1x1", "2x2", "0/1/0.0", "0/1/0.0/0.0.0")
ADAPTIVE = (("1x1x1", (0.2, 0.4, 0.6)), ("2x1x1", (0.2, 0.4)))


def points(drafts, verifies) -> list[tuple[str, str, str, float]]:
    """(draft, verify, tree, min_draft_prob) of the table, in print order."""
    shapes = [(t, 0.0) for t in CHAINS + TREES] + [(t, p) for t, ps in ADAPTIVE for p in ps]
    return [(d, v, t, p) for d in drafts for t, p in shapes for v in verifies]


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from . import conf_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose("eval", overrides=overrides + ["output_dir=unused"])


def run(drafts=("eagle", "vanilla"), verifies=("strict", "relaxed"), max_new_tokens: int = 32,
        per_category: int | None = None, threads: int = 1, log=print) -> dict:
    import torch

    import mtp
    from mtp.text.prompt import encode_chat
    from mtp.provenance import provenance

    from . import trees
    from .common import build, generate_kwargs, model_path
    from .data import load_prompts
    from .schema import validate

    torch.set_num_threads(threads)
    data = ["thinking=true", f"dataset.per_category={'null' if per_category is None else per_category}",
            f"max_new_tokens={max_new_tokens}"]
    base_cfg = validate(_compose(data))
    model, tok = build(base_cfg)
    torch.set_num_threads(threads)
    prompts = load_prompts(base_cfg.dataset, base_cfg.thinking, base_cfg.system_prompt)
    ids = [encode_chat(p.messages, tok, p.thinking) for p in prompts]
    t0 = time.perf_counter()
    greedy = mtp.generate(model, ids, max_new_tokens).tokens
    log(f"{len(ids)} prompts, greedy {time.perf_counter() - t0:.1f} s")
    rows = []
    for draft, verify, tree, p in points(drafts, verifies):
        kw = generate_kwargs(_compose(data + [f"draft={draft}", f"draft.tree={tree}", f"draft.min_draft_prob={p}",
                                              f"verify={verify}"]), tok)
        t0 = time.perf_counter()
        res, _ = trees.generate(model, ids, max_new_tokens, kw)
        seconds = time.perf_counter() - t0
        t = res.tree
        n = max(t.row_steps, 1)
        row = {"draft": draft, "verify": verify, "tree": tree, "min_draft_prob": p, "nodes": t.n_nodes,
               "depth": t.max_depth, "AL": t.mean_accepted_len, "tokens_per_node": t.tokens_per_node,
               "live_nodes_per_step": t.live_nodes / n, "tokens_per_live_node": t.tokens_per_live_node,
               "accept_depth": t.accept_depth, "accept_depth_rank": [[c / n for c in r] for r in t.accepted_rank],
               "accepted_hist": t.accepted_hist, "accepted_rank": t.accepted_rank, "row_steps": t.row_steps,
               "target_forwards": t.target_forwards, "relaxed_only_accepts": t.relaxed_only_accepts,
               "identical_to_greedy": sum(a == b for a, b in zip(res.tokens, greedy)), "seconds": seconds}
        if tree in CHAINS and p == 0.0:  # the chain engine on the same prompts: the same acceptance
            chain = {key: v for key, v in kw.items() if key not in trees.TREE_KWARGS}
            row["engine_AL"] = mtp.generate(model, ids, max_new_tokens, **chain).metrics.mean_accepted_len
        rows.append(row)
        log(f"{draft:7s} {verify:7s} {tree:14s} p>={p:<4g} nodes {t.n_nodes:2d}  AL {t.mean_accepted_len:.3f}  "
            f"tok/node {t.tokens_per_node:.3f}  tok/live {t.tokens_per_live_node:.3f}  "
            f"= greedy {row['identical_to_greedy']}/{len(ids)}  {seconds:.1f} s")
    prov = provenance(model_path(base_cfg.model), "cpu")
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "device": "cpu", "threads": threads,
            "provenance": prov, "dataset": {"name": base_cfg.dataset.name, "suites": list(base_cfg.dataset.suites),
                                            "per_category": per_category, "ids": [p.id for p in prompts]},
            "prompts": len(ids), "max_new_tokens": max_new_tokens, "thinking": True, "batch": len(ids),
            "numerics": base_cfg.model.numerics.value, "rows": rows}


def _cell(x, digits: int = 3) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def markdown(result: dict) -> str:
    """One table per draft mode: a row per shape (and threshold), strict and relaxed side by side."""
    rows = result["rows"]
    by = {(r["draft"], r["tree"], r["min_draft_prob"], r["verify"]): r for r in rows}
    out = []
    for draft in dict.fromkeys(r["draft"] for r in rows):
        out += [f"**{draft}**", "",
                "| shape | nodes | min p | AL strict | tok/node strict | AL relaxed | tok/node relaxed | "
                "P(depth >= 1 / 2 / 3) strict | depth 1 by rank (strict) | depth 2 by rank (strict) | "
                "live nodes/step, tok/live node (strict) | strict = greedy | chain engine AL strict / relaxed |",
                "|---|---:|---:|---:|---:|---:|---:|---|---|---|---|---:|---|"]
        for tree, p in dict.fromkeys((r["tree"], r["min_draft_prob"]) for r in rows if r["draft"] == draft):
            s, x = by.get((draft, tree, p, "strict")), by.get((draft, tree, p, "relaxed"))
            first = s or x
            depth = " / ".join(_cell(v) for v in s["accept_depth"]) if s else ""
            ranks = [" / ".join(_cell(v) for v in s["accept_depth_rank"][d]) if s and d < s["depth"] else ""
                     for d in (0, 1)]
            live = f"{s['live_nodes_per_step']:.2f}, {s['tokens_per_live_node']:.3f}" if s and p else ""
            engine = " / ".join(_cell(r.get("engine_AL")) for r in (s, x) if r and "engine_AL" in r)
            same = f"{s['identical_to_greedy']}/{result['prompts']}" if s else ""
            out.append(f"| {tree} | {first['nodes']} | {p:g} | {_cell(s and s['AL'])} | "
                       f"{_cell(s and s['tokens_per_node'])} | {_cell(x and x['AL'])} | "
                       f"{_cell(x and x['tokens_per_node'])} | {depth} | {ranks[0]} | {ranks[1]} | {live} | "
                       f"{same} | {engine} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="raw JSON (eval/results/tree_acceptance_cpu.json)")
    ap.add_argument("--drafts", default="eagle,vanilla")
    ap.add_argument("--verifies", default="strict,relaxed")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--per-category", type=int, default=None, help="prompts per suite (default: all of them)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    from mtp.utils import write_json_atomic

    t0 = time.perf_counter()
    result = run(tuple(a.drafts.split(",")), tuple(a.verifies.split(",")), a.max_new_tokens, a.per_category,
                 a.threads)
    result["command"] = "python -m mtp_eval.tree_acceptance " + " ".join(argv if argv is not None else sys.argv[1:])
    result["seconds"] = time.perf_counter() - t0
    write_json_atomic(Path(a.out), result)
    print(markdown(result))
    bad = [f"{r['draft']} {r['tree']} p>={r['min_draft_prob']:g}" for r in result["rows"]
           if r["verify"] == "strict" and r["identical_to_greedy"] != result["prompts"]]
    if bad:
        print(f"strict tree decoding differs from plain greedy for: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
