"""Count the launches of one whole speculative chain step (draft, verify, accept, commit) on the CPU: the fast path of a
tiny simulated tensor-parallel rank under the Triton interpreter, every Triton kernel and torch op of the engine's
step booked to a layer kind and, for what runs outside the blocks (the glue), to the code that issued it.

    python -m mtp.bench.step_launches [--draft eagle] [--k 3] [--tree 2x1x1] [--world 2] [--kernels step_commit=0 ...]
                                      [--compare]

What it runs: `mtp.plan.launches.counting` (Triton launches by kernel, aten ops that launch on a GPU) over one
`ChainStep` of an eager `Engine` with a static bound (the step a CUDA graph captures) after the prefill, the draft
prefill and one warm-up step, on a rank of `tiny_rank(world)` (1 dense + 1 MoE layer, one MTP module; latent 512,
rope 64, 16 indexer heads: the MLA kernels run) with bf16 weights, FP8 numerics and the Triton elementwise ops.
Kinds: 'dense' / 'moe' (the target's blocks), 'mtp' (the MTP module's block), 'head' (final norm, lm_head), 'glue'
(the rest: positions, embeddings, the MTP modules' norms / eh_proj / heads, the drafts' argmaxes, the verifier,
accept / commit / count, cache lengths). The blocks' launches are what `mtp.plan.kernels` counts per layer; the glue
does not grow with the layers, so the tiny rank's glue is the real rank's, but for batch-shaped differences (a
batch of 2 rows here: the all-gathered logits of 2 rows need a reordering copy, one row's are a view).
`--compare` also runs the step with the glue switches off (`GLUE_SWITCHES`) from the same state and reports whether
every decode buffer and cache is torch.equal after it (the switches change launches, never bits). Prints JSON.
tests/bench/test_step_launches.py holds the eagle k = 3 counts.
`--tree SHAPE`: a tree step (`TreeStep`, greedy top-k children) of that shape instead (k its depth). Counted (session
23, eagle 2x1x1, 7 nodes): 230 launches, glue 122 (blocks: dense 20, moe 21, mtp 64, head 3); after the verify the
drafts' path gather, the commit kernel (switch step_commit; accept / commit / count were 44 torch ops) and the tree
glue kernel (switch tree_glue: the path's cache compaction, its hidden rows and the tree's counters, 37 torch
launches: glue 173 with `--kernels tree_glue=0`); before the verify the proposer's windows, children, each tree
forward's slots, angles and visibility in one launch (3 forwards: switch tree_fwd_glue, `kernels.lookup.tree_slots`;
18 torch launches each: glue 173 with `--kernels tree_fwd_glue=0`, 289 with every glue switch off) and the tree
verdict (25). Session 25: the strict tree verdict in one launch (switch tree_verdict, `kernels.tree_verdict`): glue
98 (122 with `--kernels tree_verdict=0`; 289 with every glue switch off, the same bits: `--compare`). The tree
proposer's per-shape constants and one cat per output (torch only): 59; its first window in one launch (switch
tree_window, `kernels.draft_window.tree_window`): 54 (65 with `--kernels tree_window=0`; 256 with every glue switch
off). Not held by a test (~30 s of CPU a count).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import torch

# the switches of the decode step's glue (session 21; tree_glue, tree_fwd_glue: session 23; tree_verdict, strict_commit,
# draft_window, tree_window, gather_cast: session 25): each one launch where the torch ops were several
GLUE_SWITCHES = ("step_commit", "rope_table", "vocab_embed", "mtp_norms", "tree_glue", "tree_fwd_glue", "tree_verdict",
                 "strict_commit", "draft_window", "tree_window", "gather_cast")
PROMPT_LENS = (5, 7)  # two rows of random tokens: the prefill and the steps stay below the indexer's top-k (16)


def tiny_rank(world: int):
    """The smallest rank config whose MLA takes the kernels (as tests/plan/test_kernel_count.py's)."""
    from mtp.model.presets import tiny_parallel_config

    return dataclasses.replace(tiny_parallel_config(max(world, 2), layers=2, dense_layers=1, index_topk=16),
                               kv_lora_rank=512, index_n_heads=16, moe_intermediate_size=128 * max(world, 2))


def state_snapshot(st) -> dict:
    """Copies of a decode state's tensors and of every cache's buffers (the target's, then the proposer's), FP8 ones as
    bytes: what torch.equal compares bit for bit between two runs (also the tree glue GPU tests', tests/decode)."""
    caches = [st.cache, *getattr(st.proposer, "caches", ())]
    out = {k: v.clone() for k, v in vars(st).items() if isinstance(v, torch.Tensor)}
    for i, c in enumerate(caches):
        for name in ("seq_lens", "kv", "kv_scale", "pe", "idx_k", "idx_k_scale"):
            t = getattr(c, name)
            out[f"cache{i}.{name}"] = (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).clone()
    return out


def count_step(model, draft: str, k: int, flags: dict, tree: str | None = None) -> tuple[dict, dict]:
    """(counts, decode state after the counted step) of one chain step of `model` with the switches `flags` set; a
    tree step (`TreeStep`) of that shape (`TreeShape.parse`'s text) where `tree` is given."""
    from mtp.backends.fast_path import set_kernels
    from mtp.decode.config import GenerationConfig
    from mtp.decode.engine import Engine
    from mtp.plan.launches import LAYER_KINDS, counting

    old = set_kernels(model, **flags)
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
        opts = {} if tree is None else {"tree": tree}
        engine = Engine(model, GenerationConfig.from_options(16, draft, k or None, "strict", **opts),
                        static_bound=True)
        st = engine.pool.get(prompts, 16, list(range(len(prompts))))
        engine.step.seed(list(range(len(prompts))))
        with torch.no_grad():
            engine._prefill(st)
            host = engine._sync(st, "the prefill")
            bound = engine.bound(st, host)
            engine.step.draft_prefill(st, bound)
            engine.step(st, engine.step.W, bound)  # one step first: the kernels' lazily kept buffers are made
            with counting(model, sites=True) as c:
                engine.step(st, engine.step.W, bound)
    finally:
        set_kernels(model, **vars(old))
    counts = {"per_kind": {kind: c.total(kind) for kind in LAYER_KINDS}, "total": c.total(),
              "glue_by_site": c.at_sites("glue"), "glue_by_name": c.names("glue")}
    return counts, state_snapshot(st)


def run(args) -> dict:
    from contextlib import nullcontext

    from mtp.backends import fast_path as fp
    from mtp.checkpoint.synthetic import random_model
    from mtp.parallel.layout import ParallelPlan
    from mtp.parallel.simulate import simulated_rank
    from mtp.parallel.synthetic import random_parallel_model

    torch.set_num_threads(1)
    cfg = tiny_rank(args.world)
    out = {"draft": args.draft, "k": args.k, "tree": args.tree, "world": args.world, "rows": len(PROMPT_LENS),
           "note": "launches of one chain step on a tiny simulated rank, the fast path under the Triton interpreter"}
    with (simulated_rank(args.world, 0) if args.world > 1 else nullcontext()) as comm:
        if args.world > 1:
            model = random_parallel_model(cfg, comm, ParallelPlan(args.world, expert_layout="split"), device="cpu",
                                          dtype=torch.bfloat16)
        else:
            model = random_model(cfg, "cpu", torch.bfloat16, seed=0)
        fp.install_fast_modules(model)
        fp.set_elementwise(model, "triton")
        out["switches"] = dict(args.kernels)
        out["step"], state = count_step(model, args.draft, args.k, dict(args.kernels), args.tree)
        if args.compare:
            off = {name: False for name in GLUE_SWITCHES}
            out["glue_off"], state_off = count_step(model, args.draft, args.k, {**dict(args.kernels), **off},
                                                    args.tree)
            out["glue_off"]["switches"] = off
            out["state_equal"] = {k: torch.equal(v, state_off[k]) for k, v in state.items()}
            out["all_equal"] = all(out["state_equal"].values())
    return out


def _switch(text: str) -> tuple[str, int | bool]:
    name, _, value = text.partition("=")
    if not value.lstrip("-").isdigit():
        raise argparse.ArgumentTypeError(f"--kernels takes name=integer (0 / 1 for a switch), got {text!r}")
    return name, int(value)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m mtp.bench.step_launches", description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default="eagle", choices=("none", "eagle", "vanilla"))
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--tree", help="count a tree step of this shape instead (`TreeShape.parse`: '2x1x1', 'chain3'; "
                                   "k is its depth)")
    ap.add_argument("--world", type=int, default=2, help="tensor-parallel ranks simulated (1: one process)")
    ap.add_argument("--kernels", type=_switch, nargs="*", default=[], metavar="NAME=V",
                    help="fast-path switches (FastPathOptions) for the counted step")
    ap.add_argument("--compare", action="store_true", help="also count with the glue switches off and compare states")
    ap.add_argument("--json", help="write the result here too")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":  # the interpreter is chosen when the kernels are decorated
        env = dict(os.environ, TRITON_INTERPRET="1")
        sys.exit(subprocess.run([sys.executable, "-m", "mtp.bench.step_launches", *(argv or sys.argv[1:])],
                                env=env).returncode)
    if args.draft == "none":
        args.k = 0
    if args.tree is not None:
        from mtp.spec.tree_shape import TreeShape

        args.k = TreeShape.parse(args.tree).max_depth
    try:  # the checkout's fixes of triton 3.6's interpreter (numpy 2's int() of a loop bound; its re-patching cost)
        from tests.interp import patch_interpreter_loop_bounds
    except ImportError:  # an installed mtp without its tests: the interpreter as it is
        patch_interpreter_loop_bounds = None
    if patch_interpreter_loop_bounds is not None:
        patch_interpreter_loop_bounds()
    res = run(args)
    text = json.dumps(res, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
