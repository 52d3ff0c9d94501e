"""Per-rank modules of the parallel model and `shard_model`, which swaps them into a `DeepseekV32`.

Shape legend: B batch, T tokens, N = B*T, D width, Vl local vocabulary, E routed experts, K experts per token.

The parallel model is the ordinary `DeepseekV32` (its forward, caches, `mtp_forward`, the engine: unchanged)
whose heads-, expert-, column- and vocab-split submodules are replaced by the classes below: the same module
classes with per-rank dims, plus the reduction where the math needs it. Parameter names stay the checkpoint
names (local experts keep their global index), so loading, `state_dict` and `named_parameters` line up.
Collectives per decoder block: one all-reduce after o_proj, one after the FFN (MoE: routed + shared partials
summed into one fp32 buffer first); the fast path under allreduce='oneshot' issues each of them fused with the
residual add + norm that follows it (mtp/parallel/DESIGN.md). Per forward: one all-reduce at the embedding, one
all-gather at lm_head; an MTP module's forward (a draft forward) also one all-gather of its eh_proj output ([.., D]
in the model dtype) before its decoder block.
Partial sums are reduced in the accumulation dtype (fp8.acc_dtype: fp32, or fp64 for a float64 model) and cast
to the model dtype once, as the single-rank path casts once. These classes only build on the reference
modules' hooks (`Linear.matmul` / `matmul_acc`, `MoE.routed` / `shared` / `reduce`), so the fast path's swap
(`mtp.backends.fast_path`) applies to them as to the single-process model: fast subclasses of these classes.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ..model import fp8
from ..model.attention import MLA
from ..model.config import ModelConfig
from ..model.layers import MLP, Embedding, Linear
from ..model.deepseek import DeepseekV32
from ..model.moe import Gate, MoE
from .comm import Comm
from .layout import RankLayout
from .reblock import scale_rows


class RowParallelLinear(Linear):
    """Input columns split across ranks (o_proj): y = all_reduce(x_local W_local^T).

    With fewer than 128 input channels per rank (small models: 4 heads of 32 value channels at W = 2), one FP8
    activation group spans `128 / in_features` neighbouring ranks. Quantizing each part on its own amax would
    not be the single-rank model, so the ranks first all-gather their parts' amax (one [N, W] gather) and each
    quantizes with its group's maximum: the same scales, hence the same products, as one rank computes."""

    def __init__(self, in_features: int, out_features: int, fp8_weight: bool, dtype: torch.dtype, comm: Comm):
        super().__init__(in_features, out_features, fp8_weight, dtype)
        self.comm = comm
        self.shared_group = bool(fp8_weight and in_features and in_features % fp8.BLOCK)

    # True while a caller reduces the output itself (the fast path's block: one all-reduce fused with its
    # residual add + norm, `Comm.all_reduce_add_norm`): forward then returns this rank's partial sums
    defer_reduce = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.partial(x)
        return y if self.defer_reduce else self.comm.all_reduce(y).to(x.dtype)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, in the accumulation dtype, before the all-reduce."""
        if self.shared_group and self.numerics == "fp8":
            return self.shared_group_matmul(x)
        return self.matmul_acc(x)

    def shared_group_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sums (accumulation dtype) when its input is part of a 128-channel group."""
        a = fp8.acc_dtype(x.dtype)
        lead, K = x.shape[:-1], self.in_features
        xa = x.to(a).reshape(-1, K)
        amax = self.comm.all_gather_last(xa.abs().amax(-1, keepdim=True).contiguous())  # [N, W]
        per = fp8.BLOCK // K  # ranks per group; rank r's group holds ranks [r - r % per, ... + per)
        g0 = self.comm.rank - self.comm.rank % per
        x8, sx = fp8.quant_groups(xa.unsqueeze(1), amax[:, g0:g0 + per].amax(-1, keepdim=True))
        sw = self.weight_scale_inv.to(a).repeat_interleave(self.scale_rows, 0)[: self.out_features, 0]
        y = (x8[:, 0].to(a) @ self.weight.to(a).t()) * sx.to(a) * sw
        return y.view(*lead, self.out_features)


class ParallelMLP(MLP):
    """Dense MLP / shared expert with the intermediate split: gate/up rows and down columns of this rank.
    `partial` is this rank's fp32 share of the output; `forward` all-reduces it (dense layers)."""

    def __init__(self, dim: int, inter_local: int, fp8_weight: bool, dtype: torch.dtype, comm: Comm):
        super().__init__(dim, inter_local, fp8_weight, dtype)
        self.comm = comm

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        a = fp8.acc_dtype(x.dtype)
        if self.gate_proj.out_features == 0:  # a rank without a block of this MLP ('blocks' split)
            return x.new_zeros((*x.shape[:-1], self.down_proj.out_features), dtype=a)
        h = F.silu(self.gate_proj(x).to(a)) * self.up_proj(x).to(a)
        return self.down_proj.matmul_acc(h.to(x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.partial(x)).to(x.dtype)


class ExpertSlice(ParallelMLP):
    """Rank r's slice of one routed expert's intermediate dimension (expert_layout='split'): forward is this
    rank's partial in the accumulation dtype, which `ExpertParallelMoE`'s one all-reduce sums with the other
    ranks' (no all-reduce per expert; no rounding of a partial to the model dtype)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.partial(x)


class ExpertParallelMoE(MoE):
    """The MoE with only this rank's routed experts (`layout.expert_ids`, placed by `plan.expert_layout`; the
    reference `MoE.routed` over them): routing on every rank (replicated gate, identical inputs, so identical
    choices), each rank adds its local experts' weighted outputs and its shared-expert share into one buffer in
    the accumulation dtype, one all-reduce sums the ranks. Local experts keep their global index as name
    (`experts.{e}`). Under 'split' every expert is local and is an `ExpertSlice` (this rank's intermediate
    channels), so the same sum is of partials.

    The fast path (`mtp.backends.fast_path.FastMoE`) stacks `local_ids()` in that order, whatever the layout, and
    maps global ids to stack indices by `kernels.dispatch.expert_map`: a global -> local table, and the range e0, e1
    for 'contiguous' (for 'interleaved' / 'permuted' e0, e1 span all E: only `local_ids()` says what is here); no
    map for 'split' (every expert, sliced). What each costs per rank: `FastMoE`, mtp/parallel/DESIGN.md."""

    def __init__(self, cfg: ModelConfig, layout: RankLayout, dtype: torch.dtype, comm: Comm, static: bool = False):
        nn.Module.__init__(self)
        q8 = cfg.is_fp8
        self.gate = Gate(cfg, dtype)
        self.layout_name = layout.plan.expert_layout
        ids = layout.expert_ids
        self.e0, self.e1 = layout.experts or (0, cfg.n_routed_experts)
        i0, i1 = layout.expert_inter
        if self.layout_name == "split":
            experts = {str(e): ExpertSlice(cfg.hidden_size, i1 - i0, q8, dtype, comm) for e in ids}
        else:
            experts = {str(e): MLP(cfg.hidden_size, cfg.moe_intermediate_size, q8, dtype) for e in ids}
        self.experts = nn.ModuleDict(experts)
        self._ids = ids
        lo, hi = layout.shared
        self.shared_experts = (ParallelMLP(cfg.hidden_size, hi - lo, q8, dtype, comm)
                               if cfg.n_shared_experts else None)
        self.comm, self.static = comm, static

    def expert(self, e: int) -> MLP:
        if str(e) not in self.experts:
            raise KeyError(f"expert {e} is not on rank {self.comm.rank} (expert_layout={self.layout_name!r}: it "
                           f"holds {list(self._ids)})")
        return self.experts[str(e)]

    def local_ids(self) -> tuple[int, ...]:
        return self._ids

    def is_local(self, ids: torch.Tensor) -> torch.Tensor:
        if self.layout_name in ("contiguous", "split"):
            return super().is_local(ids)
        return torch.isin(ids, torch.tensor(self._ids, device=ids.device))  # eager CPU path only

    def shared(self, x_ND: torch.Tensor) -> torch.Tensor:
        return self.shared_experts.partial(x_ND)

    def reduce(self, out_ND: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(out_ND)


class VocabParallelEmbedding(Embedding):
    """Rows [start, start + Vl) of the embedding: ids outside look up zeros, the all-reduce adds the one
    rank that owns each id (x + 0 + ... + 0: exact in any dtype)."""

    def __init__(self, vocab_local: int, dim: int, start: int, dtype: torch.dtype, comm: Comm):
        super().__init__(vocab_local, dim, dtype)
        self.vocab_start, self.comm = start, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return self.comm.all_reduce(out.masked_fill(~inside.unsqueeze(-1), 0))


class ColumnParallelLinear(Linear):
    """Output rows split across ranks, a float (bf16) weight: this rank's rows [start, start + out_local) give its
    slice of y, all-gathered in rank order into the whole y = x W^T. Every output channel is one rank's whole dot
    product over all in_features, so y equals the single-rank product bit for bit wherever the GEMM of a row slice
    sums each channel as the whole product does: fp32 on the CPU at the same thread count (tests/parallel/
    test_parallel.py); cuBLAS may pick another kernel (split-K) for fewer rows, so bf16 on a GPU is close, not
    bitwise. The MTP module's eh_proj is one; the vocabulary-parallel heads are the other (`VocabParallelHead`)."""

    def __init__(self, in_features: int, out_local: int, dtype: torch.dtype, comm: Comm):
        super().__init__(in_features, out_local, False, dtype)
        self.comm = comm

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """`Linear.forward`'s: y gathered, then cast to `out_dtype` (the fast path's `FastColumnParallelLinear` casts
        in the gathered slices' copy)."""
        y = self.comm.all_gather_last(self.matmul(x))
        return y if out_dtype is None else y.to(out_dtype)


class VocabParallelHead(ColumnParallelLinear):
    """lm_head rows [start, start + Vl): local logits, all-gathered in rank order into the full vocabulary
    (`mtp.draft.vocab.SubHead` reads its rows and `comm` for a draft vocabulary). Built as
    VocabParallelHead(dim, vocab_local, dtype, comm)."""

    # a draft vocabulary's rows by shard instead of balanced (`SubHead`): `set_draft_vocab_by_shard`
    draft_vocab_by_shard = False


def shard_model(model: DeepseekV32, layout: RankLayout, comm: Comm, static_moe: bool = False) -> DeepseekV32:
    """Replace the split submodules of `model` (built for the full config, typically on the meta device)
    by this rank's versions, in place. `model.cfg` stays the full config: the engine, caches and MTP code
    see the same model as on one rank."""
    if comm.world != layout.plan.world or comm.rank != layout.rank:
        raise ValueError(f"{comm} does not match the layout (rank {layout.rank} of {layout.plan.world})")
    cfg, dt = model.cfg, model.dtype
    dev = model.model.norm.weight.device
    q8 = cfg.is_fp8
    D, Hl = cfg.hidden_size, layout.n_heads
    attn_cfg = dataclasses.replace(cfg, num_attention_heads=Hl)
    v0, v1 = layout.vocab
    with torch.device(dev):
        blocks = [(i, b) for i, b in enumerate(model.model.layers)]
        blocks += [(cfg.num_hidden_layers + j, b) for j, b in enumerate(model.mtp)]
        for layer_id, block in blocks:
            attn = MLA(attn_cfg, dt)
            for proj in ("q_b_proj", "kv_b_proj"):  # per-head rows: a slice may need finer scale blocks
                lin = getattr(attn, proj)
                rows = scale_rows(layout, f"model.layers.{layer_id}.self_attn.{proj}.weight")
                if q8 and rows != lin.scale_rows:
                    setattr(attn, proj, Linear(lin.in_features, lin.out_features, q8, dt, scale_rows=rows))
            attn.o_proj = RowParallelLinear(Hl * cfg.v_head_dim, D, q8, dt, comm)
            block.self_attn = attn
            if cfg.is_moe_layer(layer_id):
                block.mlp = ExpertParallelMoE(cfg, layout, dt, comm, static=static_moe)
            else:
                lo, hi = layout.dense
                block.mlp = ParallelMLP(D, hi - lo, q8, dt, comm)
        model.model.embed_tokens = VocabParallelEmbedding(v1 - v0, D, v0, dt, comm)
        model.lm_head = VocabParallelHead(D, v1 - v0, dt, comm)
        e0, e1 = layout.eh_rows
        for layer in model.mtp:
            layer.embed_tokens = VocabParallelEmbedding(v1 - v0, D, v0, dt, comm)
            layer.eh_proj = ColumnParallelLinear(2 * D, e1 - e0, dt, comm)
            layer.shared_head.head = VocabParallelHead(D, v1 - v0, dt, comm)
    model.set_runtime(model.runtime)  # also bumps model.version: graphs of the unsharded model are stale
    return model


def set_static_moe(model: DeepseekV32, static: bool) -> None:
    """Switch every expert-parallel MoE between the eager (host-synced) and the static (sync-free) path."""
    for m in model.modules():
        if isinstance(m, ExpertParallelMoE):
            m.static = static


def set_draft_vocab_by_shard(model: DeepseekV32, on: bool) -> None:
    """Switch the layout of draft vocabularies on the MTP modules' vocabulary-parallel heads (`mtp.draft.vocab.SubHead`)
    between balanced (off, the default: ceil(N / W) rows a rank) and by shard (on: each rank the ids of its own shard,
    the layout before balanced; rank 0 then keeps nearly its whole shard for a frequency list), so that one process
    can time both (`mtp-bench --tp N --draft-vocab N`). The heads built with either are kept apart; bumps
    `model.version`, so engines kept with the other layout's proposers are built again."""
    heads = [layer.shared_head.head for layer in model.mtp if isinstance(layer.shared_head.head, VocabParallelHead)]
    if not heads:
        raise ValueError("set_draft_vocab_by_shard: the model's MTP heads are not vocabulary-parallel (not sharded), "
                         "so a draft vocabulary has one layout")
    for head in heads:
        head.draft_vocab_by_shard = bool(on)
    model.bump_version()


def set_allreduce(model: DeepseekV32, impl: str) -> None:
    """Switch the all-reduce of a sharded model's group: 'nccl' or 'oneshot' (`Comm.set_allreduce`; a collective
    when it builds the one-shot buffers). Bumps `model.version`, so CUDA graphs captured before are captured again."""
    comms = {id(m.comm): m.comm for m in model.modules() if isinstance(m, RowParallelLinear)}
    if not comms:
        raise ValueError(f"set_allreduce: the model is not sharded (no RowParallelLinear), so it has no all-reduce "
                         f"to switch to {impl!r}")
    for comm in comms.values():
        comm.set_allreduce(impl, model.model.norm.weight.device)
    model.bump_version()  # graphs captured with the other all-reduce must not be replayed
