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
pipeliner leaves such loads in their iteration (checked on the sm_90 TTGIR, also as [BM] vectors), where each
iteration would wait for them: they are loaded one iteration ahead by hand. Not further: a value carried across
more than one iteration makes triton 3.6's pipeliner give up on the whole loop (seen: no cp.async at all with 2 or
4). hs was just written by gate/up (in L2); s2, another expert's at each item, would come from DRAM, and at one
token a program's 2 items' 4 tiles are all asked before its loop, so the second item's s2, asked one iteration
ahead, would arrive well after its tiles: every item's s2 line is asked of L2 before the loop instead
(`prefetch_l2`, one per item; PREFETCH_S2, off under the interpreter, which runs no inline asm).

Bit-identical to `_moe_down_persistent` (tested with torch.equal under the interpreter and on the GPU): the same
work items on the same programs, and each output tile the same fp32 sum in the same order: acc from +0 over the
item's groups in order, each dot scaled by (hs * s2), then x the slot's route weight. A slice shorter than the others
(GI % KS != 0) runs its missing groups masked: dot(0, 0) * 0 adds +0, which leaves an fp32 sum that started at +0
unchanged (it is never -0). The route weight is picked from the preloaded [BM, KPAD] table by a sum over the row's
slots, of which at most one names the expert (ids are distinct within a token): x + 0 = x.
"""

from __future__ import annotations

from mtp.kernels._triton import pdl_launch, pdl_wait, prefetch_l2, tl, triton
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
def _iter_scales(it, n_it, pid, nprog, GPS, NB, KS, GI, iq, lead, rank, id_tab, hs_ptr, s2_ptr, stride_se, stride_sn,
                 TOPK: tl.constexpr, BM: tl.constexpr, KPAD: tl.constexpr):
    """hs * s2 [BM] of iteration `it`: h's scale per active row times the weight's (expert e, N-block nb, group g)
    scale, as `moe._down_tile` multiplies them; 0 past the loop (it >= n_it), in a short slice's masked groups and
    in rows not routed to e."""
    gl, nb, ks, g, e, eq, active, slot = _flat_step(it, pid, nprog, GPS, NB, KS, iq, lead, rank, id_tab, TOPK, BM,
                                                    KPAD)
    ok = (g < GI) & (it < n_it)
    hs = tl.load(hs_ptr + slot * GI + g, mask=active & ok, other=0.0)
    s2 = tl.load(s2_ptr + e.to(tl.int64) * stride_se + nb * stride_sn + g, mask=ok, other=0.0)
    return hs * s2


@triton.jit
def _prefetch_item_scales(it, pid, nprog, GPS, NB, KS, GI, iq, lead, rank, id_tab, s2_ptr, stride_se, stride_sn,
                          TOPK: tl.constexpr, BM: tl.constexpr, KPAD: tl.constexpr):
    """Ask L2 for the line of the first weight scale of iteration it's item and slice (GI <= 16 fp32 a row, at a
    multiple of GI: one line for the slice unless GI is odd)."""
    gl, nb, ks, g, e, eq, active, slot = _flat_step(it, pid, nprog, GPS, NB, KS, iq, lead, rank, id_tab, TOPK, BM,
                                                    KPAD)
    prefetch_l2(s2_ptr + e.to(tl.int64) * stride_se + nb * stride_sn + tl.minimum(g, GI - 1))


@triton.jit
def _moe_down_flat(h8_ptr, hs_ptr, idx_ptr, rw_ptr, w2_ptr, s2_ptr, out_ptr,
                   T, D, I, stride_we, stride_se, stride_sn, KS, S,
                   TOPK: tl.constexpr, J: tl.constexpr, BM: tl.constexpr, PPAD: tl.constexpr,
                   KPAD: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, PREFETCH_S2: tl.constexpr):
    """`moe._moe_down_persistent`'s arguments and outputs (slice ks of slot s in out[ks, s]); one flattened loop
    over this program's (item, K group) iterations (module docstring). PREFETCH_S2: each item's weight scales asked
    of L2 before the loop."""
    pdl_launch(PDL)
    _shared_prefetch(w2_ptr, S, stride_we, D * I, TOPK, J, PDL, PREFETCH)
    pdl_wait(PDL)  # the router's ids and weights, gate / up's h
    P = T * TOPK
    q, iq, lead, rank, n_act = _leader_ids(idx_ptr, P, S, TOPK, J, PPAD)
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
    if PREFETCH_S2:
        for it in range(0, n_it, GPS):
            _prefetch_item_scales(it, pid, nprog, GPS, NB, KS, GI, iq, lead, rank, id_tab, s2_ptr, stride_se,
                                  stride_sn, TOPK, BM, KPAD)
    sc = _iter_scales(0, n_it, pid, nprog, GPS, NB, KS, GI, iq, lead, rank, id_tab, hs_ptr, s2_ptr, stride_se,
                      stride_sn, TOPK, BM, KPAD)
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
        sc1 = _iter_scales(it + 1, n_it, pid, nprog, GPS, NB, KS, GI, iq, lead, rank, id_tab, hs_ptr, s2_ptr,
                           stride_se, stride_sn, TOPK, BM, KPAD)  # the next iteration's, loaded now
        acc += tl.dot(w, tl.trans(h)) * sc[None, :]
        sc = sc1
        if gl == GPS - 1:  # the item's last group: its epilogue, then a fresh sum for the next item
            rw = tl.sum(tl.where(eq, rw_tab, 0.0), 1)
            dst = out_ptr + (ks * P + slot).to(tl.int64)[None, :] * D + offs_n[:, None]
            tl.store(dst, acc * rw[None, :], mask=active[None, :] & nmask[:, None])
            acc = tl.zeros((128, BM), dtype=tl.float32)
