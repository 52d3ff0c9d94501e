"""Per-rank modules of the parallel model and `shard_model`, which swaps them into a `DeepseekV32`.

Shape legend: B batch, T tokens, N = B*T, D width, Vl local vocabulary, E routed experts, K experts per token.

The parallel model is the ordinary `DeepseekV32` (its forward, caches, `mtp_forward`, the engine: unchanged)
whose heads-, expert-, column- and vocab-split submodules are replaced by the classes below: the same module
classes with per-rank dims, plus the reduction where the math needs it. Parameter names stay the checkpoint
names (local experts keep their global index), so loading, `state_dict` and `named_parameters` line up.
Collectives per decoder block: one all-reduce after o_proj, one after the FFN (MoE: routed + shared partials
summed into one fp32 buffer first). Per forward: one all-reduce at the embedding, one all-gather at lm_head.
Partial sums are reduced in the accumulation dtype (fp8.acc_dtype: fp32, or fp64 for a float64 model) and cast
to the model dtype once, as the single-rank path casts once. `mtp.fastpath.enable_fast_path` works on the
parallel model for the FP8 linears (kernel output straight in fp32 for the partials), MLA (per-rank heads) and
the expert-parallel MoE (`ExpertParallelMoE.enable_fast_path`: the Triton expert kernels on the local experts).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from .. import fp8
from ..attention import MLA
from ..config import ModelConfig
from ..layers import MLP, Linear
from ..model import DeepseekV32
from ..moe import Gate
from .comm import Comm
from .layout import RankLayout


def linear_acc(lin: Linear, x: torch.Tensor) -> torch.Tensor:
    """`Linear.forward` in the accumulation dtype a = fp8.acc_dtype(x.dtype) (fp32; fp64 for a float64 model):
    the value before the cast to x.dtype a plain Linear ends with, so a partial sum keeps its bits until the
    reduction. Reference path: x.to(a) quantizes exactly as x does (act_quant widens to a first). Triton path:
    the GEMV/GEMM kernel writes its output in a directly."""
    a = fp8.acc_dtype(x.dtype)
    if lin.in_features == 0:
        return x.new_zeros((*x.shape[:-1], lin.out_features), dtype=a)
    if lin.backend == "triton" and lin.is_fp8:
        from ..kernels.fp8_gemm import fp8_linear

        return fp8_linear(x, lin.weight, lin.weight_scale_inv, out_dtype=a)
    return Linear.forward(lin, x.to(a)).to(a)  # unbound: subclasses that reduce in forward use it too


class RowParallelLinear(Linear):
    """Input columns split across ranks (o_proj): y = all_reduce(x_local W_local^T)."""

    def __init__(self, in_features: int, out_features: int, fp8_weight: bool, dtype: torch.dtype, comm: Comm):
        super().__init__(in_features, out_features, fp8_weight, dtype)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(linear_acc(self, x)).to(x.dtype)


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
        return linear_acc(self.down_proj, h.to(x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.partial(x)).to(x.dtype)


class ExpertParallelMoE(nn.Module):
    """The MoE with only this rank's experts: routing on every rank (replicated gate, identical inputs, so
    identical choices), each rank adds its local experts' weighted outputs and its shared-expert share into
    one fp32 buffer, one all-reduce sums the ranks.

    Reference backend, like `mtp.moe.MoE`'s reference path: on CPU (unless `static`) a loop over the local
    experts some token chose (a host sync); on CUDA, or with `static=True`, every local expert on every token
    with its routing weight (0 when not chosen): no host sync, fixed shapes, CUDA-graph capturable, but it
    reads all local experts. Both give each token the same per-expert terms, added in ascending expert order
    like `MoE`.
    Triton backend (`enable_fast_path`, for <= 64 tokens as `MoE`'s): `moe_route` as in
    `fastpath.moe_forward_fast`, ids outside [e0, e1) mapped to -1, and `moe_experts` on the stacked local
    experts, which skips the -1 slots: reads only the chosen local experts, no host sync, capturable."""

    backend: str = "reference"  # 'triton': enable_fast_path
    expert_layout: str | None = None  # Triton expert kernels: None (by size: persistent for T * J <= 64) or 'pairs'

    def __init__(self, cfg: ModelConfig, layout: RankLayout, dtype: torch.dtype, comm: Comm, static: bool = False):
        super().__init__()
        q8 = cfg.is_fp8
        self.gate = Gate(cfg, dtype)
        self.e0, self.e1 = layout.experts
        self.experts = nn.ModuleDict(
            {str(e): MLP(cfg.hidden_size, cfg.moe_intermediate_size, q8, dtype) for e in range(self.e0, self.e1)})
        lo, hi = layout.shared
        self.shared_experts = (ParallelMLP(cfg.hidden_size, hi - lo, q8, dtype, comm)
                               if cfg.n_shared_experts else None)
        self.comm, self.static = comm, static
        self.stacked: dict[str, torch.Tensor] | None = None

    def enable_fast_path(self) -> None:
        """Stack the local experts per projection into [E_local, N, K] weights / scales (local index e - e0)
        for `moe_experts`, re-point each expert's parameters at its slice (memory is not doubled; names and
        `state_dict` are unchanged), and switch to the Triton backend. Idempotent; FP8 experts only."""
        if self.stacked is None:
            experts = [self.experts[str(e)] for e in range(self.e0, self.e1)]
            if not all(getattr(ex, p).is_fp8 for ex in experts for p in ("gate_proj", "up_proj", "down_proj")):
                raise ValueError("ExpertParallelMoE.enable_fast_path: the Triton expert kernels need FP8 experts")
            stacked = {}
            for proj in ("gate_proj", "up_proj", "down_proj"):
                for attr in ("weight", "weight_scale_inv"):
                    parts = [getattr(ex, proj) for ex in experts]
                    big = torch.stack([getattr(p, attr).data for p in parts])
                    for i, p in enumerate(parts):  # the old tensor is freed: peak is one projection
                        setattr(p, attr, nn.Parameter(big[i], requires_grad=False))
                    stacked[f"{proj}.{attr}"] = big
            self.stacked = stacked
        self.backend = "triton"

    def _routed_fast(self, x_ND: torch.Tensor) -> torch.Tensor:
        """This rank's routed-expert partial [N, D] fp32 through the Triton kernels (no host sync)."""
        from ..kernels.moe import moe_experts, moe_route

        g = self.gate
        w_NK, ids_NK = moe_route(x_ND, g.weight, g.e_score_correction_bias, n_group=g.n_groups,
                                 topk_group=g.topk_groups, topk=g.topk, route_scale=g.route_scale)
        local_NK = ids_NK - self.e0
        local_NK = torch.where((local_NK >= 0) & (local_NK < self.e1 - self.e0), local_NK, -1)  # -1: skipped
        s = self.stacked
        return moe_experts(x_ND, local_NK, w_NK, s["gate_proj.weight"], s["gate_proj.weight_scale_inv"],
                           s["up_proj.weight"], s["up_proj.weight_scale_inv"], s["down_proj.weight"],
                           s["down_proj.weight_scale_inv"], out_dtype=torch.float32, layout=self.expert_layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x_ND = x.reshape(-1, shape[-1])
        if self.backend == "triton" and x_ND.shape[0] <= 64:  # the expert kernels take <= 64 tokens, as in MoE
            out = self._routed_fast(x_ND)
            if self.shared_experts is not None:
                out += self.shared_experts.partial(x_ND).float()
            return self.comm.all_reduce(out).to(x.dtype).view(shape)
        w_NK, ids_NK = self.gate(x_ND)
        a = fp8.acc_dtype(x.dtype)
        out = torch.zeros(x_ND.shape, dtype=a, device=x.device)
        if self.static or x.is_cuda:
            w_NE = torch.zeros(x_ND.shape[0], self.gate.n_experts, dtype=a, device=x.device)
            w_NE.scatter_(1, ids_NK, w_NK.to(a))  # one chosen slot per expert at most: its weight, else 0
            for e in range(self.e0, self.e1):
                out += self.experts[str(e)](x_ND).to(a) * w_NE[:, e:e + 1]
        else:
            local_NK = (ids_NK >= self.e0) & (ids_NK < self.e1)
            for e in torch.unique(ids_NK[local_NK]).tolist():  # host sync: CPU eager path only
                tok, slot = (ids_NK == e).nonzero(as_tuple=True)
                y = self.experts[str(e)](x_ND[tok]).to(a) * w_NK[tok, slot].unsqueeze(-1)
                out.index_add_(0, tok, y)
        if self.shared_experts is not None:
            out += self.shared_experts.partial(x_ND)
        return self.comm.all_reduce(out).to(x.dtype).view(shape)


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + Vl) of the embedding: ids outside look up zeros, the all-reduce adds the one
    rank that owns each id (x + 0 + ... + 0: exact in any dtype)."""

    def __init__(self, vocab_local: int, dim: int, start: int, dtype: torch.dtype, comm: Comm):
        super().__init__(vocab_local, dim, dtype=dtype)
        self.vocab_start, self.comm = start, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return self.comm.all_reduce(out.masked_fill(~inside.unsqueeze(-1), 0))


class VocabParallelHead(Linear):
    """lm_head rows [start, start + Vl): local logits, all-gathered in rank order into the full vocabulary."""

    def __init__(self, dim: int, vocab_local: int, dtype: torch.dtype, comm: Comm):
        super().__init__(dim, vocab_local, False, dtype)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather_last(super().forward(x))


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
            attn.o_proj = RowParallelLinear(Hl * cfg.v_head_dim, D, q8, dt, comm)
            block.self_attn = attn
            if cfg.is_moe_layer(layer_id):
                block.mlp = ExpertParallelMoE(cfg, layout, dt, comm, static=static_moe)
            else:
                lo, hi = layout.dense
                block.mlp = ParallelMLP(D, hi - lo, q8, dt, comm)
        model.model.embed_tokens = VocabParallelEmbedding(v1 - v0, D, v0, dt, comm)
        model.lm_head = VocabParallelHead(D, v1 - v0, dt, comm)
        for layer in model.mtp:
            layer.embed_tokens = VocabParallelEmbedding(v1 - v0, D, v0, dt, comm)
            layer.shared_head.head = VocabParallelHead(D, v1 - v0, dt, comm)
    model.set_runtime(model.runtime)
    return model


def set_static_moe(model: DeepseekV32, static: bool) -> None:
    """Switch every expert-parallel MoE between the eager (host-synced) and the static (sync-free) path."""
    for m in model.modules():
        if isinstance(m, ExpertParallelMoE):
            m.static = static
