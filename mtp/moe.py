"""DeepSeek-V3/V3.2 mixture of experts: sigmoid router with bias, group-limited top-k, shared expert.

Shape legend: N tokens (flattened B*T), D width, E routed experts, G groups, K experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import fp8
from .config import ModelConfig
from .layers import MLP


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.n_experts, self.n_groups, self.topk_groups, self.topk = (
            cfg.n_routed_experts, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok)
        self.route_scale, self.norm = cfg.routed_scaling_factor, cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (weights [N, K] fp32, expert ids [N, K] int64)."""
        a = fp8.acc_dtype(x_ND.dtype)
        scores = F.linear(x_ND.to(a), self.weight.to(a)).sigmoid()
        return route(scores, self.e_score_correction_bias, self.n_groups, self.topk_groups, self.topk,
                     self.norm, self.route_scale)


def route(scores_NE: torch.Tensor, bias_E: torch.Tensor, n_groups: int, topk_groups: int, topk: int,
          normalize: bool, route_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited top-k on biased scores; the weights use the unbiased scores of the chosen experts."""
    N, E = scores_NE.shape
    biased = scores_NE + bias_E.to(scores_NE.dtype)
    if n_groups > 1:
        grouped = biased.view(N, n_groups, E // n_groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep_groups = group_scores.topk(topk_groups, dim=-1).indices
        dropped = torch.ones(N, n_groups, dtype=torch.bool, device=scores_NE.device).scatter_(1, keep_groups, False)
        biased = grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(N, E)
    ids = biased.topk(topk, dim=-1).indices
    w = scores_NE.gather(1, ids)
    if normalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w * route_scale, ids


class MoE(nn.Module):
    backend: str = "reference"  # 'triton': mtp/fastpath.py
    # Triton expert kernels (kernels.moe): 'pairs' or None (by size). One rank picks 8 of its own experts per
    # token, which the pair grid already spreads over the GPU (79-94% of copy bandwidth); the persistent layout
    # is for the few local experts of an expert-parallel rank (ExpertParallelMoE) until measured here too.
    expert_layout: str | None = "pairs"

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        q8 = cfg.is_fp8
        self.gate = Gate(cfg, dtype)
        self.experts = nn.ModuleList(
            [MLP(cfg.hidden_size, cfg.moe_intermediate_size, q8, dtype) for _ in range(cfg.n_routed_experts)])
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, q8, dtype)
                               if cfg.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x_ND = x.reshape(-1, shape[-1])
        if self.backend == "triton" and x_ND.shape[0] <= 64:  # the expert kernels take <= 64 tokens (decode)
            from .fastpath import moe_forward_fast

            out = moe_forward_fast(self, x_ND)
            if self.shared_experts is not None:
                out = out + self.shared_experts(x_ND).float()
            return out.to(x.dtype).view(shape)
        w_NK, ids_NK = self.gate(x_ND)
        a = fp8.acc_dtype(x.dtype)
        out = torch.zeros(x_ND.shape, dtype=a, device=x.device)
        if x.is_cuda:
            # Sync-free (CUDA-graph capturable) reference: every expert on every token, weight 0 where not
            # routed, added in expert order. Exact, but reads all experts: the Triton path reads only the chosen.
            w_NE = torch.zeros(x_ND.shape[0], len(self.experts), dtype=a, device=x.device)
            w_NE.scatter_(1, ids_NK, w_NK)
            for e, expert in enumerate(self.experts):
                out += expert(x_ND).to(a) * w_NE[:, e:e + 1]
        else:
            # CPU reference: loop over the experts some token chose.
            for e in torch.unique(ids_NK).tolist():  # host sync: fine on CPU
                tok, slot = (ids_NK == e).nonzero(as_tuple=True)
                y = self.experts[e](x_ND[tok]).to(a) * w_NK[tok, slot].unsqueeze(-1)
                out.index_add_(0, tok, y)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x_ND).to(a)
        return out.to(x.dtype).view(shape)
