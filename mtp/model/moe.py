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
    """Group-limited top-k on biased scores; the weights use the unbiased scores of the chosen experts.

    Group score = the sum of the group's two largest biased scores (a repeated maximum counts twice). Ties (equal
    biased or group scores) go to the lower index, at every step: the routing kernels (`mtp.kernels.moe`,
    `mtp.kernels.router`) break them that way and their tests hold them to this function
    (`mtp.kernels.moe.route_from_logits_ref` calls it)."""
    N, E = scores_NE.shape
    biased = scores_NE + bias_E.to(scores_NE.dtype)
    if n_groups > 1:
        grouped = biased.view(N, n_groups, E // n_groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep_groups = _largest(group_scores, topk_groups)
        dropped = torch.ones(N, n_groups, dtype=torch.bool, device=scores_NE.device).scatter_(1, keep_groups, False)
        biased = grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(N, E)
    ids = _largest(biased, topk)
    w = scores_NE.gather(1, ids)
    if normalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w * route_scale, ids


def _largest(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values along the last dim, largest first, equal values in index order (a stable
    sort: `torch.topk` promises no order among equals, and on CPU picks a different one of tied experts)."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


class MoE(nn.Module):
    """Routed experts `local_ids()` of E (all of them here, [e0, e1) = [0, E);
    `mtp.parallel.modules.ExpertParallelMoE` holds one rank's, placed by its expert layout) plus the shared expert.
    forward = reduce(routed + shared): the hooks are what the expert-parallel module (a share per rank, then an
    all-reduce) and the fast path (`routed` on the Triton kernels) replace.

    `routed`, reference: on CPU (unless `static`) a loop over the experts some token chose (a host sync); on
    CUDA, or with `static=True`, every expert on every token with its routing weight (0 when not chosen): no
    host sync, fixed shapes, CUDA-graph capturable, but it reads every expert. Either way each token gets the
    same per-expert terms, added in ascending expert order."""

    static: bool = False

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        q8 = cfg.is_fp8
        self.gate = Gate(cfg, dtype)
        self.e0, self.e1 = 0, cfg.n_routed_experts
        self.experts = nn.ModuleList(
            [MLP(cfg.hidden_size, cfg.moe_intermediate_size, q8, dtype) for _ in range(cfg.n_routed_experts)])
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, q8, dtype)
                               if cfg.n_shared_experts else None)

    def expert(self, e: int) -> MLP:
        """Routed expert e (global index)."""
        return self.experts[e]

    def local_ids(self) -> range:
        """The global ids of the routed experts this module holds, ascending: [e0, e1) (an expert-parallel
        module may hold another set: `mtp.parallel.modules.ExpertParallelMoE`)."""
        return range(self.e0, self.e1)

    def is_local(self, ids: torch.Tensor) -> torch.Tensor:
        """Which of the expert ids `ids` this module holds (a bool tensor of ids' shape)."""
        return (ids >= self.e0) & (ids < self.e1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x_ND = x.reshape(-1, shape[-1])
        out = self.routed(x_ND)
        if self.shared_experts is not None:
            out = out + self.shared(x_ND)
        return self.reduce(out).to(x.dtype).view(shape)

    def routed(self, x_ND: torch.Tensor) -> torch.Tensor:
        """The weighted sum of this module's experts (`local_ids()`) per token, [N, D] in the accumulation dtype."""
        w_NK, ids_NK = self.gate(x_ND)
        a = fp8.acc_dtype(x_ND.dtype)
        out = torch.zeros(x_ND.shape, dtype=a, device=x_ND.device)
        if self.static or x_ND.is_cuda:
            w_NE = torch.zeros(x_ND.shape[0], self.gate.n_experts, dtype=a, device=x_ND.device)
            w_NE.scatter_(1, ids_NK, w_NK.to(a))  # one chosen slot per expert at most: its weight, else 0
            for e in self.local_ids():
                out += self.expert(e)(x_ND).to(a) * w_NE[:, e:e + 1]
        else:
            for e in torch.unique(ids_NK[self.is_local(ids_NK)]).tolist():  # host sync: CPU eager path only
                tok, slot = (ids_NK == e).nonzero(as_tuple=True)
                y = self.expert(e)(x_ND[tok]).to(a) * w_NK[tok, slot].unsqueeze(-1)
                out.index_add_(0, tok, y)
        return out

    def shared(self, x_ND: torch.Tensor) -> torch.Tensor:
        """The shared expert's output, in the accumulation dtype."""
        return self.shared_experts(x_ND).to(fp8.acc_dtype(x_ND.dtype))

    def reduce(self, out_ND: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks holding other experts (none on one process)."""
        return out_ND
