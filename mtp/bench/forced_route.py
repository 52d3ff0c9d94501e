"""Forced routes (bench only): an MoE's router output replaced by a table of per-token (expert id, weight).

`mtp-bench --tp N --route busiest` times the simulated rank as the busiest rank of a real expert-parallel step
(`rank_steps.force_busiest`): each MoE layer's tokens must go to a drawn set of experts, spread over them as a
real router spreads them (`experts.busiest_routes`), whatever the rank's random weights would route. A module
swap, as the backends' are: `force_routes(moe, w_TK, ids_TK)` makes `moe.gate` a `ForcedGate`, the `Gate`
subclass whose forward returns rows of the table instead of computing scores. Every consumer of the router
reads the gate's output, so the override holds on every path:
- the reference `MoE.routed` (and `ExpertParallelMoE`, which keeps the ids on its rank) calls `self.gate(x)`;
- `FastMoE.routed` (`mtp.backends.fast_path`) runs its router kernels only for a gate whose forward is
  `Gate.forward` (they compute that forward from the gate's weights); another gate it calls as a module and maps
  the ids to the rank's local ones (`kernels.dispatch.local_ids`: its stack index, -1 for another rank's expert) for
  the expert kernels (pairs / persistent / grouped), as it does for a prefill;
- the bench's expert counter (`rank_steps.count_local_experts`) re-runs the gate, so it counts the forced ids.
Nothing outside this file knows a table exists; `clear_routes` swaps the plain `Gate` back, and with no gate
forced no line of the reference or fast path runs differently.

Graph capture: the table lives in buffers of fixed rows R (non-persistent: not in the state dict) that
`force_routes` rewrites in place when the new table fits, so a graph captured earlier replays the new table
(no Python runs at replay). A forward of N <= R tokens takes rows [0, N) (a table of T rows is tiled over the
R rows, row i = table row i mod T, so N = T takes the table itself); a longer one (a prefill) takes rows
i mod R. `force_routes` says when it had to allocate (first call, or a table longer than R): graphs captured
before read the old buffers, so the caller bumps the model's version (`rank_steps.force_busiest`).

Shape legend: T table rows (tokens), R buffer rows, N tokens of a forward, K experts per token, E experts.
"""

from __future__ import annotations

import torch

from ..model import fp8
from ..model.moe import Gate


class ForcedGate(Gate):
    """A `Gate` that returns its table (`w_RK` in the accumulation dtype, `ids_RK` int64 global expert ids)."""

    w_RK: torch.Tensor
    ids_RK: torch.Tensor

    def forward(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        N, R = x_ND.shape[0], self.ids_RK.shape[0]
        if N <= R:
            w_NK, ids_NK = self.w_RK[:N], self.ids_RK[:N]
        else:
            rows = torch.arange(N, device=self.ids_RK.device) % R
            w_NK, ids_NK = self.w_RK[rows], self.ids_RK[rows]
        return w_NK.to(fp8.acc_dtype(x_ND.dtype)), ids_NK


def force_routes(moe: torch.nn.Module, w_TK: torch.Tensor, ids_TK: torch.Tensor) -> bool:
    """Replace `moe`'s router output with the table (weights [T, K], global expert ids [T, K], each row K
    distinct ids in [0, E)). Returns True when it allocated the buffers (first call, or T above their rows):
    graphs captured before do not see this table; False when it rewrote them in place."""
    gate = moe.gate
    if type(gate) not in (Gate, ForcedGate):
        raise TypeError(f"force_routes: {type(moe).__name__}.gate must be a Gate, got {type(gate).__name__}")
    T, K = ids_TK.shape if ids_TK.dim() == 2 else (None, None)
    if K != gate.topk or tuple(w_TK.shape) != tuple(ids_TK.shape) or T == 0:
        raise ValueError(f"force_routes: w_TK and ids_TK must both be [T >= 1, K = {gate.topk}], got "
                         f"{tuple(w_TK.shape)} and {tuple(ids_TK.shape)}")
    ids = ids_TK.detach().to("cpu", torch.long)
    if ids.min() < 0 or ids.max() >= gate.n_experts or (ids.sort(1).values.diff(dim=1) == 0).any():
        raise ValueError(f"force_routes: each row of ids_TK must hold {K} distinct expert ids in "
                         f"[0, {gate.n_experts}), got {ids.tolist()}")
    dev, acc = gate.weight.device, fp8.acc_dtype(gate.weight.dtype)
    fresh = type(gate) is Gate or gate.ids_RK.shape[0] < T
    if fresh:
        gate.register_buffer("w_RK", torch.empty(T, K, dtype=acc, device=dev), persistent=False)
        gate.register_buffer("ids_RK", torch.empty(T, K, dtype=torch.long, device=dev), persistent=False)
        gate.__class__ = ForcedGate
    rows = torch.arange(gate.ids_RK.shape[0]) % T
    gate.w_RK.copy_(w_TK.detach().to("cpu", acc)[rows])
    gate.ids_RK.copy_(ids[rows])
    return fresh


def clear_routes(moe: torch.nn.Module) -> bool:
    """The plain `Gate` back (its weights were never touched). Returns whether a table was set."""
    gate = moe.gate
    if type(gate) is not ForcedGate:
        return False
    del gate.w_RK, gate.ids_RK
    gate.__class__ = Gate
    return True
