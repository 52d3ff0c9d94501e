"""The random FP8 model of `mtp.checkpoint.synthetic`, built sharded: each rank holds exactly the slices `load_parallel`
would give it from a checkpoint holding `mtp.checkpoint.random_weights.random_state(cfg, seed)`, with nothing
written to disk.

Every rank draws each tensor it needs whole, on its own device, from that tensor's own generator
(`mtp.checkpoint.random_weights.tensor_seed`: a hash of the seed and the checkpoint name), cuts its part with the
loader's `rank_part` (slices + exactly re-blocked FP8 scales), and frees the whole tensor before drawing the next one:
peak memory is this rank's model plus one full tensor (the 129280 x 7168 embedding: 3.7 GB in fp32 at real
width), and no communication is needed to agree. Non-local experts are never drawn. `random_model(cfg, seed)`
on one device holds the same weights (same draws, same device type), so TP=N can be compared with TP=1.

    comm = Comm()
    model = random_parallel_model(real_config(layers=3), comm, device=f"cuda:{local_rank}")
"""

from __future__ import annotations

import torch

from ..model.config import ModelConfig, RuntimeOptions
from ..model.deepseek import DeepseekV32
from ..checkpoint.inventory import checkpoint_spec
from ..checkpoint.synthetic import fill_random
from .comm import Comm
from .layout import ParallelPlan
from .load import SCALE_SUFFIX, parallel_skeleton, rank_part


@torch.no_grad()
def random_parallel_model(cfg: ModelConfig, comm: Comm | None = None, plan: ParallelPlan | None = None, *,
                          device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                          numerics: str = "fp8", runtime: RuntimeOptions | None = None,
                          static_moe: bool = False) -> DeepseekV32:
    """This rank's part of `mtp.checkpoint.synthetic.random_model(cfg, device, dtype, seed)`, as `load_parallel` would load
    it (same checks, same module tree, same slices). Every rank of the group calls it with the same arguments."""
    comm = comm or Comm()
    model, layout = parallel_skeleton(cfg, comm, plan=plan, dtype=dtype, numerics=numerics, runtime=runtime,
                                      static_moe=static_moe)
    spec = checkpoint_spec(cfg)

    def part(name: str, full: torch.Tensor) -> torch.Tensor:
        wshape = spec[name[: -len(SCALE_SUFFIX)] + ".weight"].shape if name.endswith(SCALE_SUFFIX) else None
        return rank_part(layout, name, full, wshape)

    return fill_random(model, seed, device, part=part)
