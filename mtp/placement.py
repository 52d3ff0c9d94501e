"""Where the routed experts of an expert-parallel MoE live: a loader-side choice, the router unchanged.

Torch-free (the config schemas read `EXPERT_LAYOUTS`; `mtp.parallel.layout` and the busiest-rank analysis
`mtp.bench.experts` read the maps). DeepSeek-V3.2 routes each token to the top 4 of 8 groups of 32 experts, then
its 8 experts among those 128. Layouts (`runtime.expert_layout`, `ParallelPlan.expert_layout`):
- 'contiguous' (the default, as DeepSeek's reference inference): rank r holds experts [rE/W, (r+1)E/W). At
  EP = 8 that is exactly routing group r, so a token's 8 experts sit on at most 4 ranks and the busiest rank
  of a batch-1 step holds 2-4 of them (the others idle).
- 'interleaved': expert e on rank e mod W; each group of 32 spreads over all 8 ranks (4 each).
- 'permuted': a seeded random permutation of the experts, then contiguous slices of it (seed
  `ParallelPlan.expert_seed`, 0 by default): no structure for a router to line up with.
- 'split': no expert parallelism for the routed experts; every rank holds every expert's 1/W slice of the
  intermediate dimension (gate / up rows, down columns, in whole 128-blocks with mlp_split='blocks'), so every
  rank reads the same bytes for any routing (balanced), in W-times-smaller GEMVs.
- 'auto' (the runtime's default, `choose_layout`): 'split' where every rank gets the same whole 128-blocks of
  every expert (DeepSeek-V3.2's 2048 at W = 2..16), else 'contiguous'. Measured on the busiest rank of a TP=8
  step at batch 1 (BENCHMARKS.md, session 10): split is the fastest from 2 tokens per step on (a speculative
  verify), 0.9-2.3 ms per step ahead of contiguous; at 1 token interleaved leads split by 0.18 ms. Batch > 1 is
  not measured.
"""

from __future__ import annotations

import random

from .model.config import BLOCK  # torch-free, as this module

EXPERT_LAYOUTS = ("contiguous", "interleaved", "permuted", "split")
AUTO = "auto"
LAYOUT_CHOICES = (AUTO,) + EXPERT_LAYOUTS  # what the options take; `choose_layout` resolves 'auto'


def choose_layout(layout: str, moe_intermediate_size: int, world: int) -> str:
    """The layout to load: `layout` itself, or for 'auto' 'split' where each of `world` > 1 ranks gets the same
    whole 128-blocks of every expert's intermediate dimension, else 'contiguous' (module docstring)."""
    if layout not in LAYOUT_CHOICES:
        raise ValueError(f"expert_layout must be one of {LAYOUT_CHOICES}, got {layout!r}")
    if layout != AUTO:
        return layout
    return "split" if world > 1 and moe_intermediate_size % (BLOCK * world) == 0 else "contiguous"


def expert_owners(layout: str, n_experts: int, world: int, seed: int = 0) -> list[int] | None:
    """The rank holding each expert (index = global expert id), or None for 'split' (every rank holds a slice
    of every expert). ValueError naming the value for an unknown layout or experts that do not divide."""
    if layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {layout!r}")
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world size must be an integer >= 1, got {world!r}")
    if layout == "split":
        return None
    if n_experts % world:
        raise ValueError(f"n_routed_experts = {n_experts} is not divisible by the parallel world size {world}")
    per = n_experts // world
    if layout == "contiguous":
        return [e // per for e in range(n_experts)]
    if layout == "interleaved":
        return [e % world for e in range(n_experts)]
    order = list(range(n_experts))
    random.Random(seed).shuffle(order)  # stable across Python versions for an int seed
    owners = [0] * n_experts
    for pos, e in enumerate(order):
        owners[e] = pos // per
    return owners


def local_experts(layout: str, n_experts: int, world: int, rank: int, seed: int = 0) -> tuple[int, ...]:
    """The global ids of the experts rank `rank` holds (whole, or a slice of each for 'split'), ascending."""
    owners = expert_owners(layout, n_experts, world, seed)
    if owners is None:
        return tuple(range(n_experts))
    return tuple(e for e in range(n_experts) if owners[e] == rank)
