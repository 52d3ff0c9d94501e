"""The persistent experts' work items without a dependent load in their way: `moe.moe_experts(item_regs=True)`
(switch `FastPathOptions.moe_item_regs`).

Names and shapes as in `mtp.kernels.moe` (P pairs padded to PPAD, BM token rows of the dot, G K groups of 128 in a
work item's projection, KS K slices, NB N-blocks). What a work item of `moe._moe_gate_up_persistent` /
`moe._moe_down_persistent` waits on, in program order, as compiled for sm_90 by triton 3.6 (TTGIR and PTX at a TP=8
split rank's shapes, one token: 8 routed + the shared slot):
1. `moe._work_item` loads the router's ids again (`moe._slot_info`: the leading pair's id, then the [BM, KPAD] id
   table) although `moe._leader_pairs` holds every pair's id in registers: the item's tile addresses wait for an L2
   round trip before its first cp.async is issued.
2. The per-group weight scales are no dot operand, so the pipeliner leaves their loads in their iteration: gate/up
   loads s1 after the gate wgmma's wait and s3 after the up one's (`ld.global.b32`, each used at once), down loads
   h's scales after the tiles' wait and s2 after its wgmma's. At an item's first group they are another expert's
   lines: two DRAM round trips one after the other (gate/up) on top of the tiles'. Down's route weight is loaded
   after its loop, one more round trip before the store.
3. Gate/up's last-arriving slice sums the KS fp32 partials in a loop whose every trip waits for its own 32 loads
   (the next trip's are issued after the adds): KS L2 round trips (7 at one token) at the end of an (expert,
   N-block), on [128, BM = 16] tiles of which T columns are real.
4. A program's next item issues its first load after this item's stores (gate/up: and its atomic, maybe the fix-up).
Here, each work item's tiles and sums are the same, in the same order (bit-identical):
1. `_item_regs`: the expert from `_leader_pairs`' registers, its rows and slots from [BM, PPAD] compares with the
   pairs' ids (ids are distinct within a token: at most one of a row's pairs names the expert), no load;
2. the scales loaded one group ahead, the first group's before the loop (issued with the pipeline's first tiles), so
   each has a whole iteration to arrive (in the SASS ptxas issues the next group's right after the tiles' wait,
   before the wgmma); not further ahead: triton 3.6's pipeliner drops a loop (no cp.async at all)
   whose loads feed values carried over 2 or more iterations (seen on helper branch `downflat`, session 14). Down's
   route weights are loaded before its loop;
3. the fix-up's KS slices unrolled (KSU = KS, a constexpr) on [128, TP] tiles (TP = next_pow2(T)) stored with a
   constexpr row stride TP (`_partial_tile`), so that every load is issued before the first add (one L2 round trip;
   in the SASS at one token 14 loads, at four tokens 4 16-byte vectors; unrolled over T-wide rows of a runtime
   stride, ptxas still interleaved 16 scalar loads with the epilogue in ~5 waits at four tokens). At one token 7
   slices x 2 tiles are 14 registers a thread, not the dot's [128, BM = 16] 224. Its quantization
   (`moe._gate_up_store`) is per token column: max over the 128 rows, elementwise otherwise, the same bits at any
   column count;
4. the program's next item's weight lines asked of L2 (`prefetch_l2`, 128 rows x its groups, one 128-byte line per
   row and group; 2 instructions a thread per group in gate/up, 16 at one token's 8 groups; 2 in down) before this
   item's loop, so that its tiles come from L2 (NEXT_PF: `moe_experts(item_prefetch=True)`, where inline PTX runs,
   `_triton.asm_ok`). Off by default: measured slower alone on a TP=8 split rank (H200, session 17: 27.4 / 53.3 /
   58.9 / 75.2 us at T = 1..4 with it, 26.0 / 48.6 / 54.8 / 72.9 without; the default item loop 29.8 / 55.5 / 61.4 /
   75.1).
Both item loops' gate/up take x either as bf16, quantized per K group in the loop (`_x_quant`), or pre-quantized (X8,
`moe.moe_experts(xq=)`: x8's tile a dot operand straight from its cp.async buffer, its row scales loaded as the
weights' are): the K loop's SASS at a split rank's shapes (triton 3.6) 360 instructions per K group against 230.
Both item loops take their weight tiles either as pointer tensors (cp.async) or, with TMA (`moe.moe_experts(tma=True)`),
through host tensor descriptors (`_w_tma`: one bulk tensor copy per tile, issued by one thread, done on an mbarrier),
the same tiles in the same buffers: the pipeliner multi-buffers both alike.
The flat pairs' ids and route weights, with the implicit shared slot (`_ids`, `_slot_weights`), are read by every
experts' kernel: `moe`'s and `moe_down_nb`'s (which `moe` imports, so they live here).
"""

from __future__ import annotations

from mtp.kernels._triton import prefetch_rows_l2, tl, triton
from mtp.kernels.act_quant import quant_e4m3, ue8m0_scale

__all__: list[str] = []  # device functions only: called by `moe`'s and `moe_down_nb`'s kernels


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
def _item_rows(e, q, iq, TOPK: tl.constexpr, BM: tl.constexpr):
    """Which of BM token rows expert e serves (active) and at which flat slot, from the pairs' ids iq [PPAD] (-2 past
    the P pairs): row m's pairs are q in [m * TOPK, (m + 1) * TOPK). `moe._slot_info`'s, without its loads; a row
    without e keeps its slot m * TOPK (never read: every use is masked by active)."""
    m = tl.arange(0, BM)
    hit = (iq[None, :] == e) & ((q // TOPK)[None, :] == m[:, None])
    active = tl.sum(hit.to(tl.int32), 1) > 0
    slot = tl.where(active, tl.sum(tl.where(hit, q[None, :], 0), 1), m * TOPK)
    return active, slot


@triton.jit
def _item_expert(w, iq, lead, rank, NB, KS, G):
    """Work item w = (a, nb, ks) as `moe._work_item` numbers them: the a-th distinct expert e (the id of the pair
    leading it, from registers), N-block nb, K slice ks and its groups [g0, g1) of G."""
    a = w // (NB * KS)
    nb = (w // KS) % NB
    ks = w % KS
    e = tl.sum(tl.where(lead & (rank == a), iq, 0), 0)
    gps = tl.cdiv(G, KS)
    g0 = ks * gps
    return a, nb, ks, e, g0, tl.minimum(g0 + gps, G)


@triton.jit
def _item_regs(w, q, iq, lead, rank, NB, KS, G, TOPK: tl.constexpr, BM: tl.constexpr):
    """`moe._work_item`'s (a, nb, ks, e, active, slot, g0, g1) from registers only."""
    a, nb, ks, e, g0, g1 = _item_expert(w, iq, lead, rank, NB, KS, G)
    active, slot = _item_rows(e, q, iq, TOPK, BM)
    return a, nb, ks, e, active, slot, g0, g1


@triton.jit
def _prefetch_item(w, n_items, iq, lead, rank, NB, KS, G, wa_ptr, wb_ptr, stride_we, K, TWO: tl.constexpr):
    """Ask L2 for work item w's weight rows (if w < n_items): 128 rows of K fp8 from N-block nb of expert e, its K
    groups [g0, g1), one line (128 elements) per row and group; wb_ptr too where TWO (gate/up: gate and up)."""
    if w < n_items:
        a, nb, ks, e, g0, g1 = _item_expert(w, iq, lead, rank, NB, KS, G)
        rows = e.to(tl.int64) * stride_we + (nb * 128 + tl.arange(0, 128)).to(tl.int64) * K + g0 * 128
        prefetch_rows_l2(wa_ptr + rows, (g1 - g0) * 128, 128)
        if TWO:
            prefetch_rows_l2(wb_ptr + rows, (g1 - g0) * 128, 128)


@triton.jit
def _w_tma(w_desc, e, nb, g, N):
    """Weight tile [128, 128] (fp8) of expert e, N-block nb, K group g as one bulk tensor copy (TMA) through the
    descriptor of the [E, N, K] stack seen as [E * N, K] (`moe.weight_desc`). N is a multiple of 128
    (`moe_experts` checks D and I), so an N-block never reaches the next expert's rows: the same tile as the
    pointer load of `_gate_up_ptrs` / `_down_ptrs`, whose row mask is then all true."""
    return w_desc.load([e * N + nb * 128, g * 128])


@triton.jit
def _gate_up_weights(w1_desc, w3_desc, w1_ptrs, w3_ptrs, e, nb, g, I, TMA: tl.constexpr):
    """Expert e's gate and up tiles of N-block nb at K group g: by TMA (`_w_tma`) or from the pointers of
    `_gate_up_ptrs` (both item loops' K loop)."""
    if TMA:
        w1 = _w_tma(w1_desc, e, nb, g, I)
        w3 = _w_tma(w3_desc, e, nb, g, I)
    else:
        w1 = tl.load(w1_ptrs + g * 128)
        w3 = tl.load(w3_ptrs + g * 128)
    return w1, w3


@triton.jit
def _down_weights(w2_desc, w_ptrs, nmask, e, nb, g, D, TMA: tl.constexpr):
    """Expert e's down tile of output block nb at K group g: by TMA (`_w_tma`) or from `_down_ptrs`' pointers, rows
    past D masked (both item loops' K loop)."""
    if TMA:
        w = _w_tma(w2_desc, e, nb, g, D)
    else:
        w = tl.load(w_ptrs + g * 128, mask=nmask[:, None], other=0.0)
    return w


@triton.jit
def _gate_up_ptrs(x_ptr, sx_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, e, nb, D, stride_xm, stride_sxm, stride_we,
                  stride_se, stride_sn, BM: tl.constexpr):
    """Expert e's gate and up tiles of N-block nb at K group 0 ([128, 128] pointers), their scale rows, x's [BM, 128]
    tile and its [BM] row scales at group 0 (the pre-quantized x's, `moe.moe_experts(xq=)`; unused for a bf16 x):
    `moe._gate_up_tile`'s and `_gate_up_tile_ahead`'s."""
    offs_n = nb * 128 + tl.arange(0, 128)
    offs_k = tl.arange(0, 128)
    m = tl.arange(0, BM)
    e64 = e.to(tl.int64)
    w_off = e64 * stride_we + offs_n.to(tl.int64)[:, None] * D + offs_k[None, :]
    return (w1_ptr + w_off, w3_ptr + w_off, s1_ptr + e64 * stride_se + nb * stride_sn,
            s3_ptr + e64 * stride_se + nb * stride_sn, x_ptr + m[:, None] * stride_xm + offs_k[None, :],
            sx_ptr + m * stride_sxm)


@triton.jit
def _x_quant(x_ptrs, g, active):
    """x's K group g quantized here, per token row: its [BM, 128] tile (bf16) loaded, the row absmax (a reduction
    across the threads that hold a row), the ue8m0 scale, the e4m3 convert; returned transposed for the dots
    ([128, BM] e4m3) with the [BM] scales. Rows not active read as 0."""
    xf = tl.load(x_ptrs + g * 128, mask=active[:, None], other=0.0).to(tl.float32)
    sx, inv = ue8m0_scale(tl.max(tl.abs(xf), axis=1))
    return tl.trans(quant_e4m3(xf, inv[:, None])), sx


@triton.jit
def _down_ptrs(h8_ptr, w2_ptr, s2_ptr, e, nb, slot, D, I, stride_we, stride_se, stride_sn):
    """Expert e's down tile of output block nb at K group 0 ([128, 128] pointers, rows past D masked by nmask), its
    scale row, and the routed rows' h tile: `moe._down_tile`'s and `_down_tile_ahead`'s."""
    offs_n = nb * 128 + tl.arange(0, 128)
    offs_k = tl.arange(0, 128)
    e64 = e.to(tl.int64)
    w_ptrs = w2_ptr + e64 * stride_we + offs_n.to(tl.int64)[:, None] * I + offs_k[None, :]
    h_ptrs = h8_ptr + slot.to(tl.int64)[:, None] * I + offs_k[None, :]
    return w_ptrs, s2_ptr + e64 * stride_se + nb * stride_sn, h_ptrs, offs_n < D


@triton.jit
def _gate_up_tile_ahead(x_ptr, sx_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, e, nb, active, g0, g1, D, stride_xm,
                        stride_sxm, stride_we, stride_se, stride_sn, w1_desc, w3_desc, I, BM: tl.constexpr,
                        X8: tl.constexpr, TMA: tl.constexpr):
    """`moe._gate_up_tile` (the same tiles, the same fp32 sums in the same order) with the weight scales of group
    g + 1 loaded in iteration g, the first group's before the loop; with X8 x's row scales too (x8's tile is a dot
    operand, so the pipeliner issues it ahead with the weights' by itself). TMA: the weight tiles by `_w_tma`."""
    w1_ptrs, w3_ptrs, s1_row, s3_row, x_ptrs, sx_rows = _gate_up_ptrs(
        x_ptr, sx_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, e, nb, D, stride_xm, stride_sxm, stride_we, stride_se,
        stride_sn, BM)
    s1n = tl.load(s1_row + g0, mask=g0 < g1, other=0.0)
    s3n = tl.load(s3_row + g0, mask=g0 < g1, other=0.0)
    if X8:
        sxn = tl.load(sx_rows + g0, mask=active & (g0 < g1), other=0.0)
    acc1 = tl.zeros((128, BM), dtype=tl.float32)
    acc3 = tl.zeros((128, BM), dtype=tl.float32)
    for g in range(g0, g1):
        s1 = s1n
        s3 = s3n
        s1n = tl.load(s1_row + g + 1, mask=g + 1 < g1, other=0.0)
        s3n = tl.load(s3_row + g + 1, mask=g + 1 < g1, other=0.0)
        w1, w3 = _gate_up_weights(w1_desc, w3_desc, w1_ptrs, w3_ptrs, e, nb, g, I, TMA)
        if X8:
            sx = sxn
            sxn = tl.load(sx_rows + g + 1, mask=active & (g + 1 < g1), other=0.0)
            xt = tl.trans(tl.load(x_ptrs + g * 128, mask=active[:, None], other=0.0))
        else:
            xt, sx = _x_quant(x_ptrs, g, active)
        acc1 += tl.dot(w1, xt) * (sx * s1)[None, :]
        acc3 += tl.dot(w3, xt) * (sx * s3)[None, :]
    return acc1, acc3


@triton.jit
def _down_tile_ahead(h8_ptr, hs_ptr, w2_ptr, s2_ptr, e, nb, active, slot, g0, g1, D, I, stride_we, stride_se,
                     stride_sn, w2_desc, BM: tl.constexpr, TMA: tl.constexpr):
    """`moe._down_tile` (the same tiles and sums) with h's and the weight's scales of group g + 1 loaded in
    iteration g, the first group's before the loop. TMA: the weight tiles by `_w_tma`."""
    GI = I // 128
    w_ptrs, s_row, h_ptrs, nmask = _down_ptrs(h8_ptr, w2_ptr, s2_ptr, e, nb, slot, D, I, stride_we, stride_se,
                                              stride_sn)
    hs_row = hs_ptr + slot * GI
    hsn = tl.load(hs_row + g0, mask=active & (g0 < g1), other=0.0)
    sn = tl.load(s_row + g0, mask=g0 < g1, other=0.0)
    acc = tl.zeros((128, BM), dtype=tl.float32)
    for g in range(g0, g1):
        hs = hsn
        s = sn
        hsn = tl.load(hs_row + g + 1, mask=active & (g + 1 < g1), other=0.0)
        sn = tl.load(s_row + g + 1, mask=g + 1 < g1, other=0.0)
        w = _down_weights(w2_desc, w_ptrs, nmask, e, nb, g, D, TMA)
        h = tl.load(h_ptrs + g * 128, mask=active[:, None], other=0.0)
        acc += tl.dot(w, tl.trans(h)) * (hs * s)[None, :]
    return acc


@triton.jit
def _fixup_sums(base, KS, KSU: tl.constexpr, TP: tl.constexpr):
    """The KS slices' fp32 partials of one (expert, N-block), gate and up [128, TP] each (`_partial_tile`'s layout),
    summed in slice order from +0 as `moe._moe_gate_up_persistent`'s fix-up loop sums them; unrolled over KSU (= KS)
    slices so that every load is issued before the first add. A slice s >= KS (none where KSU = KS) would add +0:
    the same bits (a sum that starts at +0 is never -0)."""
    tile, _ = _partial_tile(TP, TP)
    acc1 = tl.zeros((128, TP), dtype=tl.float32)
    acc3 = tl.zeros((128, TP), dtype=tl.float32)
    for s in tl.static_range(KSU):
        acc1 += tl.load(base + s * (2 * 128 * TP) + tile, mask=s < KS, other=0.0, cache_modifier=".cg")
        acc3 += tl.load(base + s * (2 * 128 * TP) + 128 * TP + tile, mask=s < KS, other=0.0, cache_modifier=".cg")
    return acc1, acc3


@triton.jit
def _partial_tile(TP: tl.constexpr, BM: tl.constexpr):
    """Offsets and mask of a slice's [128, BM] gate (or up) partial in its [128, TP] block (TP = next_pow2(T), a
    constexpr row stride: the fix-up's loads are vectors, 16 bytes a row at TP = 4, where `moe`'s T-wide rows of a
    runtime stride are single floats). Columns T..TP-1 hold the dot's zero columns (token rows not routed), never
    stored as h."""
    m = tl.arange(0, BM)
    return tl.arange(0, 128)[:, None] * TP + m[None, :], (m < TP)[None, :]
