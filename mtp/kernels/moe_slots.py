"""Which (token, slot) pairs name which expert: the Triton pieces the expert kernels of `mtp.kernels.moe` (pair and
persistent grids) and `mtp.kernels.moe_down_flat` share. A leaf module (it imports no kernel file), so that both
kernel files can use them without an import cycle. Names and shapes as in `mtp.kernels.moe`.
"""

from __future__ import annotations

from mtp.kernels._triton import prefetch_span_l2, tl, triton


@triton.jit
def _ids(idx_ptr, q, mask, S, TOPK: tl.constexpr, J: tl.constexpr):
    """Expert ids of flat pairs q (token q // TOPK, slot q % TOPK), -2 where not mask. TOPK == J: idx_TJ's own.
    TOPK == J + 1: slot J is the implicit shared slot, stack entry S for every token (`moe_experts(shared=)`),
    read from no tensor: the ids stay the router's [T, J], so no launch builds a [T, J + 1] copy."""
    if TOPK == J:
        return tl.load(idx_ptr + q, mask=mask, other=-2)
    j = q % TOPK
    e = tl.load(idx_ptr + (q // TOPK) * J + j, mask=mask & (j < J), other=-2)
    return tl.where(mask & (j == J), S, e)


@triton.jit
def _slot_weights(rw_ptr, slot, active, TOPK: tl.constexpr, J: tl.constexpr):
    """Routing weights of flat slots (0 where not active); the implicit shared slot (TOPK == J + 1) weighs 1.0,
    so its product is the expert's output exactly."""
    if TOPK == J:
        return tl.load(rw_ptr + slot, mask=active, other=0.0)
    j = slot % TOPK
    w = tl.load(rw_ptr + (slot // TOPK) * J + j, mask=active & (j < J), other=0.0)
    return tl.where(active & (j == J), 1.0, w)


@triton.jit
def _shared_prefetch(w_ptr, S, stride_we, n, TOPK: tl.constexpr, J: tl.constexpr, PDL: tl.constexpr,
                     PREFETCH: tl.constexpr):
    """With PDL, PREFETCH and the implicit shared slot (TOPK == J + 1): the shared expert's n-element weight (stack
    entry S, contiguous; 1-byte fp8: 128 per line) asked of L2 before the wait, each program a share. Which routed
    experts run is the router's output, read after the wait; the shared one is every token's, known before it."""
    if PDL and PREFETCH:
        if TOPK > J:
            prefetch_span_l2(w_ptr + tl.cast(S, tl.int64) * stride_we, n, 128, 32)


@triton.jit
def _leader_ids(idx_ptr, P, S, TOPK: tl.constexpr, J: tl.constexpr, PPAD: tl.constexpr):
    """Pairs q in [0, PPAD), their expert ids iq (-2 past P), which of them lead (a valid expert no earlier pair
    names), each leader's rank among the leaders, and the number of leaders (distinct experts to compute).
    [PPAD, PPAD] compares: small P."""
    q = tl.arange(0, PPAD)
    iq = _ids(idx_ptr, q, q < P, S, TOPK, J)
    earlier = (iq[:, None] == iq[None, :]) & (q[None, :] < q[:, None])
    lead = (iq >= 0) & (tl.sum(earlier.to(tl.int32), 1) == 0)
    rank = tl.cumsum(lead.to(tl.int32), 0) - 1
    return q, iq, lead, rank, tl.sum(lead.to(tl.int32), 0)


@triton.jit
def _leader_pairs(idx_ptr, P, S, TOPK: tl.constexpr, J: tl.constexpr, PPAD: tl.constexpr):
    """`_leader_ids` without the ids: (q, lead, rank, number of leaders)."""
    q, _, lead, rank, n_act = _leader_ids(idx_ptr, P, S, TOPK, J, PPAD)
    return q, lead, rank, n_act
