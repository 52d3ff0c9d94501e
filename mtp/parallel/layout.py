"""Which slice of every checkpoint tensor each rank holds: the single source of the parallel layout.

Shape legend: H attention heads, E routed experts, V vocabulary, I an MLP's intermediate width, W world size.

One group of W ranks runs everything (as DeepSeek's reference inference does with its world_size):
- attention: heads split, H / W per rank. q_b_proj and kv_b_proj are sliced by rows per head (column
  parallel), o_proj by columns (row parallel, partial sums all-reduced). q_a / kv_a projections, their norms
  and the lightning indexer are replicated: every rank needs the full latent and the full top-k selection.
- MoE: routed experts split E / W per rank (expert parallel; which experts a rank holds is
  `plan.expert_layout`, `mtp.placement`: contiguous ranges, interleaved, a seeded permutation, or 'split': every
  expert cut along its I like the shared expert); the router is replicated, so every rank routes identically.
  The shared expert and the dense MLPs are split along I (gate/up by rows, down by columns).
- embedding and lm_head (and the MTP copies): vocabulary parallel, V / W rows per rank.
- the MTP module's eh_proj [D, 2D] (bf16, no scale): column parallel, D / W output rows per rank; each rank computes
  its D / W channels of u over all 2D inputs and one all-gather along the last dim gives every rank the whole u
  the module's decoder block reads (`modules.ColumnParallelLinear`). Each channel is still one whole dot product
  on one rank (fp32 on the CPU: u equals the single-rank u bit for bit). Replicated, it cost every rank all 205 MB
  per draft forward (54 us measured at TP = 8 on an H200, issue 25); split, 25.6 MB plus one all-gather of [T, D]
  bf16 (mtp/parallel/DESIGN.md).
- everything else (norms, router bias) is replicated.

MLP split ('mlp_split'):
- 'blocks' (default): I is cut only at 128-channel boundaries, ranks get floor/ceil(ceil(I/128) / W) blocks.
  With fp8 numerics this is the only exact choice when I / W is not a multiple of 128: the down projection
  quantizes its input per 128 channels, and a group split across ranks would get a different amax. When
  I / W is a multiple of 128 it equals the even split. A rank may get no block (e.g. the real shared expert,
  16 blocks, at W = 32: half the ranks hold 128 channels, half none); it then contributes zeros.
- 'even': I / W channels each, which may cut a 128x128 weight block (e.g. 2048 / 32 = 64 rows); the loader
  re-blocks the scales exactly (see `mtp.parallel.reblock`). The down projection then runs on a K slice that
  is not a multiple of 128, which only 'dequant' numerics accept (fp8 numerics raise in act_quant).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from ..spec.options import MLP_SPLITS
from ..model.config import BLOCK, ConfigError, ModelConfig
from ..placement import LAYOUT_CHOICES, choose_layout, local_experts


@dataclass(frozen=True)
class ParallelPlan:
    world: int = 1
    mlp_split: str = "blocks"
    expert_layout: str = "contiguous"  # which routed experts each rank holds (mtp.placement; 'auto': RankLayout picks)
    expert_seed: int = 0  # the permutation of expert_layout='permuted'

    def __post_init__(self) -> None:
        if not isinstance(self.world, int) or self.world < 1:
            raise ConfigError(f"parallel world size must be an integer >= 1, got {self.world!r}")
        if self.mlp_split not in MLP_SPLITS:
            raise ConfigError(f"mlp_split must be one of {MLP_SPLITS}, got {self.mlp_split!r}")
        if self.expert_layout not in LAYOUT_CHOICES:
            raise ConfigError(f"expert_layout must be one of {LAYOUT_CHOICES}, got {self.expert_layout!r}")

    def resolved(self, cfg: ModelConfig) -> ParallelPlan:
        """This plan with 'auto' replaced by the layout `mtp.placement.choose_layout` picks for `cfg`."""
        layout = choose_layout(self.expert_layout, cfg.moe_intermediate_size, self.world)
        return self if layout == self.expert_layout else replace(self, expert_layout=layout)


@dataclass(frozen=True)
class Shard:
    """This rank's part of a tensor: rows (dim 0) or columns (dim 1) [start, stop), or all of it (dim None)."""

    dim: int | None = None
    start: int = 0
    stop: int = 0

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.dim is None:
            return tuple(shape)
        out = list(shape)
        out[self.dim] = self.stop - self.start
        return tuple(out)


FULL = Shard()


def split_range(n: int, world: int, rank: int, mode: str, what: str) -> tuple[int, int]:
    """[start, stop) of rank's part of n channels: equal parts ('even') or whole 128-blocks ('blocks')."""
    if mode == "even":
        if n % world:
            raise ConfigError(f"{what} = {n} does not split evenly over {world} ranks (mlp_split='even')")
        return n // world * rank, n // world * (rank + 1)
    nb = math.ceil(n / BLOCK)
    b0, b1 = rank * nb // world, (rank + 1) * nb // world
    return min(b0 * BLOCK, n), min(b1 * BLOCK, n)


def _even(n: int, world: int, rank: int, what: str) -> tuple[int, int]:
    if n % world:
        raise ConfigError(f"{what} = {n} is not divisible by the parallel world size {world}")
    return n // world * rank, n // world * (rank + 1)


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)")


class RankLayout:
    """The ranges one rank owns, and `shard(name)` for any checkpoint tensor name (None: not on this rank)."""

    def __init__(self, cfg: ModelConfig, plan: ParallelPlan, rank: int):
        W = plan.world
        if not 0 <= rank < W:
            raise ConfigError(f"rank must be in [0, {W}), got {rank}")
        plan = plan.resolved(cfg)  # everything below (and every module built from it) sees a concrete layout
        self.cfg, self.plan, self.rank = cfg, plan, rank
        self.heads = _even(cfg.num_attention_heads, W, rank, "num_attention_heads")
        E, layout = cfg.n_routed_experts, plan.expert_layout
        if layout != "split":
            _even(E, W, rank, "n_routed_experts")
        # expert_ids: the routed experts this rank holds (global ids, ascending); expert_inter: the slice of each
        # one's intermediate dimension it holds (all of it unless 'split'); experts: [e0, e1) when contiguous
        self.expert_ids = local_experts(layout, E, W, rank, plan.expert_seed)
        self._expert_set = frozenset(self.expert_ids)
        self.experts = (self.expert_ids[0], self.expert_ids[-1] + 1) if layout == "contiguous" else None
        self.expert_inter = (split_range(cfg.moe_intermediate_size, W, rank, plan.mlp_split, "moe_intermediate_size")
                             if layout == "split" else (0, cfg.moe_intermediate_size))
        self.vocab = _even(cfg.vocab_size, W, rank, "vocab_size")
        # eh_proj's output rows; a config without MTP modules has no eh_proj, so no reason to refuse its width
        self.eh_rows = (_even(cfg.hidden_size, W, rank, "hidden_size (the MTP eh_proj's output rows)")
                        if cfg.num_nextn_predict_layers else (0, cfg.hidden_size))
        self.dense = split_range(cfg.intermediate_size, W, rank, plan.mlp_split, "intermediate_size")
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.shared = split_range(shared, W, rank, plan.mlp_split, "moe_intermediate_size * n_shared_experts")

    @property
    def n_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    def is_local_expert(self, e: int) -> bool:
        """Whether this rank holds expert e (whole, or its slice of it under 'split')."""
        return e in self._expert_set

    def shard(self, name: str) -> Shard | None:
        """Slice of checkpoint tensor `name` on this rank. A `weight_scale_inv` gets its weight's shard: the
        loader turns it into the re-blocked scale (`reblock.reblock_scale`)."""
        cfg = self.cfg
        base = name.replace(".weight_scale_inv", ".weight")
        if base in ("model.embed_tokens.weight", "lm_head.weight"):
            return Shard(0, *self.vocab)
        m = _LAYER.fullmatch(base)
        if m is None:
            return FULL
        rest = m.group(2)
        if rest in ("embed_tokens.weight", "shared_head.head.weight"):
            return Shard(0, *self.vocab)
        if rest == "eh_proj.weight":
            return Shard(0, *self.eh_rows)
        h0, h1 = self.heads
        if rest == "self_attn.q_b_proj.weight":
            return Shard(0, h0 * cfg.qk_head_dim, h1 * cfg.qk_head_dim)
        if rest == "self_attn.kv_b_proj.weight":
            per = cfg.qk_nope_head_dim + cfg.v_head_dim
            return Shard(0, h0 * per, h1 * per)
        if rest == "self_attn.o_proj.weight":
            return Shard(1, h0 * cfg.v_head_dim, h1 * cfg.v_head_dim)
        e = re.fullmatch(r"mlp\.experts\.(\d+)\.(.*)", rest)
        if e is not None:
            if not self.is_local_expert(int(e.group(1))):
                return None
            proj = re.fullmatch(r"(gate_proj|up_proj|down_proj)\.weight", e.group(2))
            if self.plan.expert_layout != "split" or proj is None:
                return FULL
            return Shard(1 if proj.group(1) == "down_proj" else 0, *self.expert_inter)
        mlp = re.fullmatch(r"mlp\.(shared_experts\.)?(gate_proj|up_proj|down_proj)\.weight", rest)
        if mlp is not None:
            lo, hi = self.shared if mlp.group(1) else self.dense
            return Shard(1 if mlp.group(2) == "down_proj" else 0, lo, hi)
        return FULL
