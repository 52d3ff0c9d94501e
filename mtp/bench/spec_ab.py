"""Whole speculative steps with fast-path switches on and off, alternated in one process on one simulated TP=N rank:
`python -m mtp.bench.spec_ab --tp 8 --switches tree_glue,tree_fwd_glue --tree 2x1x1 --reps 3 --json ab.json`.

Why: `mtp-bench --kernel-variants` alternates switches for the target steps only; a switch of the decode step's glue
(the commit, the tree's compaction, its forwards' slots) shows in the speculative step, which `mtp-bench --kernels`
times once per process. Two processes differ by more than such a switch saves: session 23's 2x1x1 tree step, both
tree glue switches on / off in two processes (one H200, same call), 10.968 / 11.170 ms GPU, while the eagle k = 1
chain, which those switches do not touch, read 6.176 / 6.422. Here the rank is built once and each rep times the
steps with the switches on, then off (`set_kernels`: the model's version moves, the engine captures its step again),
an eagle k = K chain beside them as the control: it must not move.
Reads `gpu_step_ms` (`timing.spec_step_times`: CUDA-graph replays' GPU time per step) of a graph-mode `generate` /
`generate_tree` after a warm-up call that captures. GPU only (the switches are the fast path's).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from .rank_report import log, save

__all__ = ["main", "parse_args"]


def parse_args(argv=None) -> argparse.Namespace:
    from ..kernels.dispatch import FastPathOptions
    from ..spec.tree_shape import TreeShape

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=8, help="the simulated rank's group size (default 8)")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--k", type=int, default=3, help="the eagle chain's drafts (and the control's)")
    ap.add_argument("--tree", default=None, help="also an eagle tree of this shape (TreeShape.parse: e.g. 2x1x1)")
    ap.add_argument("--switches", required=True,
                    help="comma list of FastPathOptions switches flipped together (on, then off, each rep)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", dest="out", default=None, help="result file (written atomically)")
    args = ap.parse_args(argv)
    fields = {f for f, v in vars(FastPathOptions()).items() if isinstance(v, bool)}
    args.switches = [s.strip() for s in args.switches.split(",") if s.strip()]
    bad = [s for s in args.switches if s not in fields]
    if not args.switches or bad:
        ap.error(f"--switches: FastPathOptions switches (on / off), got {bad or args.switches}; known: "
                 f"{', '.join(sorted(fields))}")
    if args.tree:
        try:
            args.tree = TreeShape.parse(args.tree).name
        except ValueError as e:
            ap.error(f"--tree: {e}")
    if args.tp < 2 or args.reps < 1 or args.k < 1 or args.layers < 2 or args.prompt_len < 1:
        ap.error(f"--tp >= 2, --reps, --k, --prompt-len >= 1 and --layers >= 2; got {args.tp}, {args.reps}, "
                 f"{args.k}, {args.prompt_len}, {args.layers}")
    return args


def _runs(model, prompts, args) -> dict:
    """GPU ms per step of the eagle chain (the control) and the tree, graph mode, the second call timed."""
    from ..decode.engine import generate, release
    from ..decode.tree import generate_tree
    from ..spec.tree_shape import TreeShape
    from .timing import spec_step_times

    out = {}
    calls = {f"eagle_k{args.k}": lambda n: generate(model, prompts, n, draft="eagle", k=args.k, mode="graph")}
    if args.tree:
        shape = TreeShape.parse(args.tree)
        calls[f"tree_{args.tree}"] = lambda n: generate_tree(model, prompts, shape, n, draft="eagle", mode="graph")
    for name, call in calls.items():
        call(4)  # captures the step (kept per model version and settings)
        out[name] = spec_step_times(call(args.new_tokens).metrics)["gpu_step_ms"]
        release(model)
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("spec_ab: needs a CUDA GPU (the switches are the fast path's)")
    from ..backends.fast_path import enable_fast_path, set_kernels
    from ..kernels.dispatch import FastPathOptions
    from ..parallel.layout import ParallelPlan
    from ..parallel.simulate import simulated_rank
    from ..parallel.synthetic import random_parallel_model
    from ..placement import choose_layout
    from .rank import default_rank, rank_config
    from .rank_steps import rank_token_ids

    world = args.tp
    rank_args = argparse.Namespace(tp=world, layers=args.layers, dense_layers=min(3, args.layers - 1), k=args.k)
    cfg = rank_config(rank_args, world, True, args.layers)
    layout = choose_layout("auto", cfg.moe_intermediate_size, world)
    rank = default_rank(cfg, world, torch.bfloat16)
    res = {"tool": "mtp.bench.spec_ab", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "tp": world, "rank": rank, "layers": args.layers, "layout": layout, "prompt_len": args.prompt_len,
           "switches": args.switches, "reps": []}
    with simulated_rank(world, rank) as comm:
        log(f"building rank {rank} of TP={world} ({args.layers} layers, layout {layout!r})")
        model = random_parallel_model(cfg, comm, ParallelPlan(world, expert_layout=layout), device="cuda",
                                      dtype=torch.bfloat16, seed=args.seed)
        enable_fast_path(model, options=FastPathOptions.for_world(world))
        prompts = rank_token_ids(model, (1, args.prompt_len), torch.Generator().manual_seed(args.seed + 2)).tolist()
        for rep in range(args.reps):
            for on in (True, False):
                set_kernels(model, **{s: on for s in args.switches})
                row = {"rep": rep, "on": on, **_runs(model, prompts, args)}
                res["reps"].append(row)
                log(f"  rep {rep} switches {'on ' if on else 'off'}: " + ", ".join(
                    f"{k} {v:.3f} ms" for k, v in row.items() if k not in ("rep", "on")))
                save(res, args.out)
    names = [k for k in res["reps"][0] if k not in ("rep", "on")]
    res["mean_ms"] = {s: {n: statistics.mean(r[n] for r in res["reps"] if r["on"] == (s == "on")) for n in names}
                      for s in ("on", "off")}
    for n in names:
        on, off = res["mean_ms"]["on"][n], res["mean_ms"]["off"][n]
        print(f"{n}: on {on:.3f} ms, off {off:.3f} ms, on - off {on - off:+.3f} ms ({args.reps} reps each, GPU per "
              "step)")
    save(res, args.out)
    return res


if __name__ == "__main__":
    main()
