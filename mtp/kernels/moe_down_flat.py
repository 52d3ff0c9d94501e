"""The persistent MoE down projection as one flattened loop per program: `moe_experts(down_flat=True)`.

Names and shapes as in `mtp.kernels.moe` (P pairs, BM token rows, KPAD slots padded, GI = I / 128 K groups).
`moe._moe_down_persistent` loops over work items (a-th distinct expert, N-block nb, K slice ks) and, per item, over
its K groups in `_down_tile`. On a TP=8 'split' rank (I = 256: GI = 2) an item is two 16 KB weight tiles, so the
software pipeliner (num_stages) has nothing to overlap: each item waits for its own tiles from DRAM, then stores,
then the next item's loads start. Measured (H200, one rank, 61 layers): 10.4 us a layer at w = 1 for 16.5 MB of
weights (~3.4 us at HBM speed), 23.5 us at w = 4 for ~55 MB (~11.5 us).

Here a program runs one loop over its (item, K group) iterations, item-major, as the persistent matmul of Triton's
tutorials does: the epilogue (x route weight, store) under `if gl == GPS - 1` inside the loop, the accumulator reset
after it. For the pipeliner to issue an iteration's tiles stages ahead, their addresses must not depend on a load
issued in the loop: the router's ids (each pair's expert iq, the [BM, KPAD] id table of the rows' slots) and the
route weights are loaded once, before the loop, and each iteration derives its expert, active rows and slots from
registers (`_flat_step`). The per-group scales (hs of h, s2 of the weight) are not operands of the dot, and the
pipeliner leaves such loads in their iteration (checked on the sm_90 TTGIR): they are loaded one iteration ahead by
hand, so their latency hides behind the previous iteration instead of stalling the next tile's issue.

Bit-identical to `_moe_down_persistent` (tested with torch.equal under the interpreter and on the GPU): the same
work items on the same programs, and each output tile the same fp32 sum in the same order: acc from +0 over the
item's groups in order, each dot scaled by (hs * s2), then x the slot's route weight. A slice shorter than the others
(GI % KS != 0) runs its missing groups masked: dot(0, 0) * 0 adds +0, which leaves an fp32 sum that started at +0
unchanged (it is never -0). The route weight is picked from the preloaded [BM, KPAD] table by a sum over the row's
slots, of which at most one names the expert (ids are distinct within a token): x + 0 = x.
"""

from __future__ import annotations

from mtp.kernels._triton import pdl_launch, pdl_wait, tl, triton
from mtp.kernels.moe_slots import _ids, _leader_ids, _shared_prefetch, _slot_weights

__all__: list[str] = []  # kernels only: launched by `moe.moe_experts(down_flat=True)`


@triton.jit
def _flat_step(it, pid, nprog, GPS, NB, KS, iq, lead, rank, id_tab, TOPK: tl.constexpr, BM: tl.constexpr,
               KPAD: tl.constexpr):
    """Iteration `it` of program pid: K group gl of its (it // GPS)-th item w = (a, nb, ks) (the items of
    `moe._work_item`, handed out round-robin), g = ks * GPS + gl the group in [0, GI) (or past it, in a short last
    slice), the a-th distinct expert e = the id of the pair that leads it, and which token rows are routed to e (eq
    [BM, KPAD] over the rows' slots, active [BM]) at which flat slots. Registers only, no load."""
    i = it // GPS
    gl = it - i * GPS
    w = pid + i * nprog
    a = w // (NB * KS)
    nb = (w // KS) % NB
    ks = w % KS
    e = tl.sum(tl.where(lead & (rank == a), iq, 0), 0)
    eq = id_tab == e
    active = tl.sum(eq.to(tl.int32), 1) > 0
    slot = tl.arange(0, BM) * TOPK + tl.sum(tl.where(eq, tl.arange(0, KPAD)[None, :], 0), 1)
    return gl, nb, ks, ks * GPS + gl, e, eq, active, slot


@triton.jit
def _group_scales(hs_ptr, s2_ptr, e, nb, g, slot, active, ok, GI, stride_se, stride_sn):
    """hs * s2 of group g [BM]: h's scale per active row times the weight's (expert e, N-block nb) scale, as
    `moe._down_tile` multiplies them; 0 where not ok (a masked iteration) or the row is not active."""
    hs = tl.load(hs_ptr + slot * GI + g, mask=active & ok, other=0.0)
    s2 = tl.load(s2_ptr + e.to(tl.int64) * stride_se + nb * stride_sn + g, mask=ok, other=0.0)
    return hs * s2


@triton.jit
def _moe_down_flat(h8_ptr, hs_ptr, idx_ptr, rw_ptr, w2_ptr, s2_ptr, out_ptr,
                   T, D, I, stride_we, stride_se, stride_sn, KS, S,
                   TOPK: tl.constexpr, J: tl.constexpr, BM: tl.constexpr, PPAD: tl.constexpr,
                   KPAD: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr):
    """`moe._moe_down_persistent`'s arguments and outputs (slice ks of slot s in out[ks, s]); one flattened loop
    over this program's (item, K group) iterations (module docstring)."""
    pdl_launch(PDL)
    _shared_prefetch(w2_ptr, S, stride_we, D * I, TOPK, J, PDL, PREFETCH)
    pdl_wait(PDL)  # the router's ids and weights, gate / up's h
    P = T * TOPK
    _, iq, lead, rank, n_act = _leader_ids(idx_ptr, P, S, TOPK, J, PPAD)
    m = tl.arange(0, BM)
    slot_tab = m[:, None] * TOPK + tl.arange(0, KPAD)[None, :]
    in_tab = (m[:, None] < T) & (tl.arange(0, KPAD)[None, :] < TOPK)
    id_tab = _ids(idx_ptr, slot_tab, in_tab, S, TOPK, J)  # [BM, KPAD], -2 where not a slot
    rw_tab = _slot_weights(rw_ptr, slot_tab, in_tab, TOPK, J)
    GI = I // 128
    NB = tl.cdiv(D, 128)
    GPS = tl.cdiv(GI, KS)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_it = tl.cdiv(tl.maximum(n_act * NB * KS - pid, 0), nprog) * GPS
    offs_r = tl.arange(0, 128)
    offs_k = tl.arange(0, 128)
    _, nb, _, g, e, _, active, slot = _flat_step(0, pid, nprog, GPS, NB, KS, iq, lead, rank, id_tab, TOPK, BM, KPAD)
    sc = _group_scales(hs_ptr, s2_ptr, e, nb, g, slot, active, (g < GI) & (n_it > 0), GI, stride_se, stride_sn)
    acc = tl.zeros((128, BM), dtype=tl.float32)
    for it in range(0, n_it):
        gl, nb, ks, g, e, eq, active, slot = _flat_step(it, pid, nprog, GPS, NB, KS, iq, lead, rank, id_tab, TOPK,
                                                        BM, KPAD)
        in_k = g < GI
        offs_n = nb * 128 + offs_r
        nmask = offs_n < D
        w = tl.load(w2_ptr + e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * I + g * 128 + offs_k[None, :],
                    mask=nmask[:, None] & in_k, other=0.0)
        h = tl.load(h8_ptr + slot.to(tl.int64)[:, None] * I + g * 128 + offs_k[None, :], mask=active[:, None] & in_k,
                    other=0.0)
        # the next iteration's scales, loaded now and used there
        _, nb1, _, g1, e1, _, active1, slot1 = _flat_step(it + 1, pid, nprog, GPS, NB, KS, iq, lead, rank, id_tab,
                                                          TOPK, BM, KPAD)
        sc1 = _group_scales(hs_ptr, s2_ptr, e1, nb1, g1, slot1, active1, (g1 < GI) & (it + 1 < n_it), GI,
                            stride_se, stride_sn)
        acc += tl.dot(w, tl.trans(h)) * sc[None, :]
        sc = sc1
        if gl == GPS - 1:  # the item's last group: its epilogue, then a fresh sum for the next item
            rw = tl.sum(tl.where(eq, rw_tab, 0.0), 1)
            dst = out_ptr + (ks * P + slot).to(tl.int64)[None, :] * D + offs_n[:, None]
            tl.store(dst, acc * rw[None, :], mask=active[None, :] & nmask[:, None])
            acc = tl.zeros((128, BM), dtype=tl.float32)
