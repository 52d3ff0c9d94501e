"""The @triton.jit pieces the routed experts' kernels share (`mtp.kernels.moe`: the pair and persistent grids,
its combine; `mtp.kernels.moe_one_launch`: the persistent layout as one launch).

Both kernel modules import them from here, so that neither imports the other (the import graph has no cycle,
tests/test_architecture.py) and each order of operations that the outputs' bits depend on is written once: a gate / up
work item and its slice sum (`_gate_up_item`), a down work item's weighted partial (`_down_item`), and the combine's
sum of the partials (`_combine_sum`: slot order, then K-slice order; the shared slot's slices apart, then `add`).
Shape legend and the layouts: `mtp.kernels.moe`'s docstring.
"""

from __future__ import annotations

from mtp.kernels._triton import prefetch_span_l2, tl, triton
from mtp.kernels.act_quant import quant_e4m3, ue8m0_scale


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
def _slot_info(idx_ptr, p, T, S, TOPK: tl.constexpr, J: tl.constexpr, BM: tl.constexpr, PPAD: tl.constexpr,
               KPAD: tl.constexpr):
    """For pair p: its expert e, whether p is the first pair naming e, and per token row m whether it is
    routed to e and at which flat slot m * TOPK + j. A pair with e < 0 (skipped slot) is never a leader and
    has no active rows: a token may hold several -1 slots, which must not count as one shared expert.
    Slots per token TOPK: the router's J, + 1 for the implicit shared slot (`_ids`)."""
    e = _ids(idx_ptr, p, p >= 0, S, TOPK, J)
    valid = e >= 0
    q = tl.arange(0, PPAD)
    # padding loads -2: never an expert, nor the -1 of a skipped slot
    all_idx = _ids(idx_ptr, q, q < T * TOPK, S, TOPK, J)
    is_leader = valid & (tl.sum(((all_idx == e) & (q < p)).to(tl.int32), 0) == 0)
    m = tl.arange(0, BM)
    j = tl.arange(0, KPAD)
    idx2 = _ids(idx_ptr, m[:, None] * TOPK + j[None, :], (m[:, None] < T) & (j[None, :] < TOPK), S, TOPK, J)
    eq = (idx2 == e) & valid  # e < 0: no row is active, so `slot` is never used to load or store
    active = tl.sum(eq.to(tl.int32), 1) > 0
    slot = m * TOPK + tl.sum(tl.where(eq, j[None, :], 0), 1)
    return e, is_leader, active, slot


@triton.jit
def _gate_up_tile(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, e, nb, active, g0, g1, D, stride_xm, stride_we, stride_se,
                  stride_sn, BM: tl.constexpr):
    """gate and up of expert e, N-block nb, over K groups [g0, g1): fp32 accumulators [128, BM] (x quantized
    per 128 in registers; rows of tokens not routed to e read as 0)."""
    offs_n = nb * 128 + tl.arange(0, 128)
    offs_k = tl.arange(0, 128)
    m = tl.arange(0, BM)
    e64 = e.to(tl.int64)
    w_off = e64 * stride_we + offs_n.to(tl.int64)[:, None] * D + offs_k[None, :]
    w1_ptrs = w1_ptr + w_off
    w3_ptrs = w3_ptr + w_off
    s1_row = s1_ptr + e64 * stride_se + nb * stride_sn
    s3_row = s3_ptr + e64 * stride_se + nb * stride_sn
    x_ptrs = x_ptr + m[:, None] * stride_xm + offs_k[None, :]
    acc1 = tl.zeros((128, BM), dtype=tl.float32)
    acc3 = tl.zeros((128, BM), dtype=tl.float32)
    for g in range(g0, g1):
        w1 = tl.load(w1_ptrs + g * 128)
        w3 = tl.load(w3_ptrs + g * 128)
        xf = tl.load(x_ptrs + g * 128, mask=active[:, None], other=0.0).to(tl.float32)
        sx, inv = ue8m0_scale(tl.max(tl.abs(xf), axis=1))
        xt = tl.trans(quant_e4m3(xf, inv[:, None]))
        acc1 += tl.dot(w1, xt) * (sx * tl.load(s1_row + g))[None, :]
        acc3 += tl.dot(w3, xt) * (sx * tl.load(s3_row + g))[None, :]
    return acc1, acc3


@triton.jit
def _gate_up_store(acc1, acc3, nb, slot, smask, h8_ptr, hs_ptr, I):
    """h = silu(gate) * up, quantized per 128 (the N-block is one K group of the down projection), stored
    as fp8 + scale at each routed token's (token, slot) row."""
    offs_n = nb * 128 + tl.arange(0, 128)
    h = acc1 / (1.0 + tl.exp(-acc1)) * acc3  # [128, BM]
    sh, inv_h = ue8m0_scale(tl.max(tl.abs(h), axis=0))
    h8 = quant_e4m3(h, inv_h[None, :])
    tl.store(h8_ptr + slot.to(tl.int64)[None, :] * I + offs_n[:, None], h8, mask=smask[None, :])
    tl.store(hs_ptr + slot * (I // 128) + nb, sh, mask=smask)


@triton.jit
def _down_tile(h8_ptr, hs_ptr, w2_ptr, s2_ptr, e, nb, active, slot, g0, g1, D, I, stride_we, stride_se, stride_sn,
               BM: tl.constexpr, H_CACHE: tl.constexpr):
    """Down projection of expert e, output block nb, over K groups [g0, g1): fp32 [128, BM]. H_CACHE: h's loads'
    cache modifier: "" (h written by an earlier launch), ".cg" (past L1: h written by other programs of this one,
    `moe_one_launch`; the same bytes either way)."""
    GI = I // 128
    offs_n = nb * 128 + tl.arange(0, 128)
    offs_k = tl.arange(0, 128)
    nmask = offs_n < D
    e64 = e.to(tl.int64)
    w_ptrs = w2_ptr + e64 * stride_we + offs_n.to(tl.int64)[:, None] * I + offs_k[None, :]
    s_row = s2_ptr + e64 * stride_se + nb * stride_sn
    h_ptrs = h8_ptr + slot.to(tl.int64)[:, None] * I + offs_k[None, :]
    acc = tl.zeros((128, BM), dtype=tl.float32)
    for g in range(g0, g1):
        w = tl.load(w_ptrs + g * 128, mask=nmask[:, None], other=0.0)
        h = tl.load(h_ptrs + g * 128, mask=active[:, None], other=0.0, cache_modifier=H_CACHE)
        hs = tl.load(hs_ptr + slot * GI + g, mask=active, other=0.0, cache_modifier=H_CACHE)
        acc += tl.dot(w, tl.trans(h)) * (hs * tl.load(s_row + g))[None, :]
    return acc



@triton.jit
def _leader_pairs(idx_ptr, P, S, TOPK: tl.constexpr, J: tl.constexpr, PPAD: tl.constexpr):
    """Pairs q in [0, PPAD), which of them lead (a valid expert no earlier pair names), each leader's rank
    among the leaders, and the number of leaders (distinct experts to compute). [PPAD, PPAD] compares: small P."""
    q = tl.arange(0, PPAD)
    iq = _ids(idx_ptr, q, q < P, S, TOPK, J)
    earlier = (iq[:, None] == iq[None, :]) & (q[None, :] < q[:, None])
    lead = (iq >= 0) & (tl.sum(earlier.to(tl.int32), 1) == 0)
    rank = tl.cumsum(lead.to(tl.int32), 0) - 1
    return q, lead, rank, tl.sum(lead.to(tl.int32), 0)


@triton.jit
def _work_item(w, q, lead, rank, idx_ptr, T, NB, KS, G, S, TOPK: tl.constexpr, J: tl.constexpr, BM: tl.constexpr,
               PPAD: tl.constexpr, KPAD: tl.constexpr):
    """Work item w = (a, nb, ks): the a-th distinct expert e (its routed token rows and their slots), N-block
    nb, and the K groups [g0, g1) of slice ks of G groups."""
    a = w // (NB * KS)
    nb = (w // KS) % NB
    ks = w % KS
    p = tl.sum(tl.where(lead & (rank == a), q, 0), 0)  # the pair that leads expert a
    e, _, active, slot = _slot_info(idx_ptr, p, T, S, TOPK, J, BM, PPAD, KPAD)
    gps = tl.cdiv(G, KS)
    g0 = ks * gps
    return a, nb, ks, e, active, slot, g0, tl.minimum(g0 + gps, G)




@triton.jit
def _gate_up_item(w, q, lead, rank, x_ptr, idx_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, h8_ptr, hs_ptr, part_ptr,
                  cnt_ptr, T, D, I, stride_xm, stride_we, stride_se, stride_sn, KS, S, TOPK: tl.constexpr,
                  J: tl.constexpr, BM: tl.constexpr, PPAD: tl.constexpr, KPAD: tl.constexpr):
    """Gate / up work item w = (a, nb, ks) of the persistent layout: its fp32 partials [2, 128, T] (the T token
    columns only) to the workspace; the last slice of (a, nb) to arrive (atomic counter) sums them in slice order
    (deterministic), writes h and re-arms the counter. Returns (a, whether this item wrote h)."""
    NB = I // 128
    a, nb, ks, e, active, slot, g0, g1 = _work_item(w, q, lead, rank, idx_ptr, T, NB, KS, D // 128, S,
                                                    TOPK, J, BM, PPAD, KPAD)
    acc1, acc3 = _gate_up_tile(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, e, nb, active, g0, g1,
                               D, stride_xm, stride_we, stride_se, stride_sn, BM)
    m = tl.arange(0, BM)
    tile = tl.arange(0, 128)[:, None] * T + m[None, :]
    tmask = (m < T)[None, :]
    base = part_ptr + ((a * NB + nb) * KS).to(tl.int64) * (2 * 128 * T)
    tl.store(base + ks * (2 * 128 * T) + tile, acc1, mask=tmask)
    tl.store(base + ks * (2 * 128 * T) + 128 * T + tile, acc3, mask=tmask)
    tl.debug_barrier()
    last = tl.atomic_add(cnt_ptr + a * NB + nb, 1, sem="acq_rel", scope="gpu") == KS - 1
    if last:
        acc1 = tl.zeros((128, BM), dtype=tl.float32)
        acc3 = tl.zeros((128, BM), dtype=tl.float32)
        for s in range(KS):
            acc1 += tl.load(base + s * (2 * 128 * T) + tile, mask=tmask, other=0.0, cache_modifier=".cg")
            acc3 += tl.load(base + s * (2 * 128 * T) + 128 * T + tile, mask=tmask, other=0.0,
                            cache_modifier=".cg")
        _gate_up_store(acc1, acc3, nb, slot, active, h8_ptr, hs_ptr, I)
        tl.atomic_xchg(cnt_ptr + a * NB + nb, 0, sem="relaxed", scope="gpu")
    return a, last


@triton.jit
def _down_item(w, q, lead, rank, h8_ptr, hs_ptr, idx_ptr, rw_ptr, w2_ptr, s2_ptr, out_ptr, T, D, I, stride_we,
               stride_se, stride_sn, KS, S, TOPK: tl.constexpr, J: tl.constexpr, BM: tl.constexpr,
               PPAD: tl.constexpr, KPAD: tl.constexpr, H_CACHE: tl.constexpr):
    """Down work item w = (a, nb, ks) of the persistent layout: slice ks's partial times the routing weights, to
    out[ks, slot] ([KS, T * TOPK, D] fp32: no other item writes it). Returns the output block nb."""
    a, nb, ks, e, active, slot, g0, g1 = _work_item(w, q, lead, rank, idx_ptr, T, tl.cdiv(D, 128), KS, I // 128,
                                                    S, TOPK, J, BM, PPAD, KPAD)
    acc = _down_tile(h8_ptr, hs_ptr, w2_ptr, s2_ptr, e, nb, active, slot, g0, g1, D, I,
                     stride_we, stride_se, stride_sn, BM, H_CACHE)
    acc = acc * _slot_weights(rw_ptr, slot, active, TOPK, J)[None, :]
    offs_n = nb * 128 + tl.arange(0, 128)
    dst = out_ptr + (ks * (T * TOPK) + slot).to(tl.int64)[None, :] * D + offs_n[:, None]
    tl.store(dst, acc, mask=active[None, :] & (offs_n < D)[:, None])
    return nb


@triton.jit
def _combine_sum(part_ptr, idx_ptr, add_ptr, t, tmask, offs, mask, D, P, KS: tl.constexpr, TOPK: tl.constexpr,
                 J: tl.constexpr, ADD: tl.constexpr, CACHE: tl.constexpr):
    """fp32 y at tokens t and columns offs (broadcast against each other; tmask: the tokens in range, None where t
    is one valid token; mask: where both are in range) = the
    per-pair partials part [KS, P, D] summed in slot order, then K-slice order, skipping the -1 slots (their rows
    were never written); the implicit shared slot (TOPK == J + 1) its K slices summed apart, then added (routed +
    shared); then add [T, D] (the shared expert's output, as the reference's `out + shared`). The one order of
    `moe._moe_combine_kernel` and of `moe_one_launch`'s last down item of a block: their outputs are the same bits.
    CACHE: the loads' cache modifier (".cg" where other programs of the same launch wrote the partials)."""
    acc = tl.zeros(mask.shape, dtype=tl.float32)
    for j in tl.static_range(J):  # slot order, then K-slice order: deterministic
        if tmask is None:  # a program per token: t is one
            used = tl.load(idx_ptr + t * J + j) >= 0  # a -1 slot's rows were never written
        else:
            used = tl.load(idx_ptr + t * J + j, mask=tmask, other=-1) >= 0
        for s in tl.static_range(KS):
            acc += tl.load(part_ptr + (s * P + t * TOPK + j).to(tl.int64) * D + offs, mask=mask & used, other=0.0,
                           cache_modifier=CACHE)
    if TOPK > J:  # the implicit shared slot: its K slices summed apart, then added (routed + shared, as `add`)
        sh = tl.zeros(mask.shape, dtype=tl.float32)
        for s in tl.static_range(KS):
            sh += tl.load(part_ptr + (s * P + t * TOPK + J).to(tl.int64) * D + offs, mask=mask, other=0.0,
                          cache_modifier=CACHE)
        acc += sh
    if ADD:  # the shared expert's output, after the routed sum (the reference's routed + shared)
        acc += tl.load(add_ptr + t.to(tl.int64) * D + offs, mask=mask, other=0.0)
    return acc
