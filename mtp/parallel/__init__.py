"""Multi-GPU DeepSeek-V3.2: tensor-parallel attention, expert-parallel MoE, vocabulary-parallel embedding/head.

    comm = Comm()                                   # after dist.init_process_group(...)
    model = load_parallel(ckpt, comm, device=f"cuda:{local_rank}", dtype=torch.bfloat16)
    out = mtp.generate(model, prompts, draft="eagle", k=2)   # on every rank; same tokens everywhere

Files: layout (who holds which slice), reblock (exact FP8 scales of a slice), comm (the collectives),
modules (per-rank modules + `shard_model`), load (sharded loading), synthetic (the
random FP8 model built sharded, no checkpoint), simulate (one rank of a group in one process: torch's fake
process group). The multi-rank runtime that runs a sharded model (rank 0 drives, the launcher) is
`mtp.distributed`. Their benchmarks live in `mtp.bench` (rank: `mtp-bench --tp N`; parallel: TP=N vs TP=1;
collectives: NCCL latencies).
DESIGN.md holds the numerics argument, the CUDA-graph note and the GPU benchmark command.
"""

from .comm import Comm, CountingComm
from .layout import ParallelPlan, RankLayout, Shard
from .load import load_parallel, param_bytes
from .modules import set_allreduce, shard_model, set_static_moe
from .reblock import ReblockError, reblock_scale, shard_fp8
from .simulate import simulated_rank
from .synthetic import random_parallel_model

__all__ = ["Comm", "CountingComm", "ParallelPlan", "RankLayout", "ReblockError", "Shard", "load_parallel",
           "param_bytes", "random_parallel_model", "reblock_scale", "set_allreduce", "set_static_moe", "shard_fp8", "shard_model",
           "simulated_rank"]
