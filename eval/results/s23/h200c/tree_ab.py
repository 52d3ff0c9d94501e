"""Session 23: the 2x1x1 eagle tree step on one TP=8 rank (61 layers, 1k) with both tree glue switches on / off,
alternated in ONE process (graph mode: each flip bumps the model's version, so the step is captured again)."""
import json
import os
import sys

import torch

from mtp.backends.fast_path import enable_fast_path, set_kernels
from mtp.bench.cli import parse_args
from mtp.bench.rank import default_rank, rank_config
from mtp.bench.rank_steps import rank_token_ids
from mtp.bench.timing import spec_step_times
from mtp.decode.engine import generate, release
from mtp.decode.tree import generate_tree
from mtp.kernels.dispatch import FastPathOptions
from mtp.parallel.layout import ParallelPlan
from mtp.parallel.simulate import simulated_rank
from mtp.parallel.synthetic import random_parallel_model
from mtp.spec.tree_shape import TreeShape

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 61
args = parse_args(["--tp", "8", "--layers", str(layers), "--prompt-len", "1024", "--k", "3"])
world = 8
cuda = torch.cuda.is_available()
cfg = rank_config(args, world, cuda, layers)
dtype = torch.bfloat16 if cuda else torch.float32
rank = default_rank(cfg, world, dtype)
out = []
with simulated_rank(world, rank) as comm:
    model = random_parallel_model(cfg, comm, ParallelPlan(world, expert_layout="split"),
                                  device="cuda" if cuda else "cpu", dtype=dtype, seed=0)
    if cuda:
        enable_fast_path(model, elementwise="triton", options=FastPathOptions.for_world(world))
    prompts = rank_token_ids(model, (1, 1024 if cuda else 24), torch.Generator().manual_seed(2)).tolist()
    shape = TreeShape.parse("2x1x1")
    mode = "graph" if cuda else "eager"
    for rep in range(3):
        for on in (True, False):
            if cuda:
                set_kernels(model, tree_glue=on, tree_fwd_glue=on)
            generate_tree(model, prompts, shape, 4, draft="eagle", mode=mode)
            t = spec_step_times(generate_tree(model, prompts, shape, 48, draft="eagle", mode=mode).metrics)
            release(model)
            generate(model, prompts, 4, draft="eagle", k=3, mode=mode)  # a control: the chain the switches miss
            c = spec_step_times(generate(model, prompts, 48, draft="eagle", k=3, mode=mode).metrics)
            release(model)
            row = {"rep": rep, "tree_glue": on, "tree_gpu_ms": t["gpu_step_ms"], "tree_wall_ms": t["step_ms_wall"],
                   "chain_k3_gpu_ms": c["gpu_step_ms"], "chain_k3_wall_ms": c["step_ms_wall"]}
            out.append(row)
            print(json.dumps(row), flush=True)
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "tree_ab.json"), "w") as f:
        json.dump(out, f, indent=1)
