"""MoE routing and routed-expert compute (Triton), with plain-PyTorch references.

Shape legend: T tokens (<= 64 for the pair layouts, <= MAX_TOKENS for the grouped one), D hidden (7168), E experts
(256), I expert intermediate (2048), J = topk experts per token (8), NG expert groups (8), P = T * J (token, slot)
pairs.
Expert weights are stacked: w_gate / w_up [E, I, D] float8 + [E, I/128, D/128] fp32 scales,
w_down [E, D, I] float8 + [E, D/128, I/128].

Routing (facts section 3; reference: the model's router `mtp.model.moe.route`): s = sigmoid(x_f32 . Wg^T);
b = s + bias; group score = sum of the top-2 b in each group; keep the top `topk_group` groups; top-J experts
by b among them; weights = s of those, normalized to sum 1, times `route_scale`. Ties go to the lower index
(group and expert), as a stable descending sort gives.
Kernels: `_gate_logits_kernel` (the [E, D] gate GEMV with fp32 results: bf16 x bf16 on tensor cores, whose
products are exact, else fp32 FMA; split over E-blocks x K-slices so that 3.7 MB of bf16 weight is read
by ~100 programs) and `_route_kernel` (one warp per token: sums the K-slices in a fixed order, then
sigmoid, group scores on an [NG, E/NG] view, top-k by iterated arg-max). 7.9 us for both on an H200.

Expert compute reads only the selected experts' weights. A program is launched per (token, slot) pair
and N-block; the first pair that names an expert (the "leader") computes it for every token routed to it
(so an expert picked by several tokens is read once) and the others do no loop iterations. This keeps
the grid static (CUDA-graph friendly, no host sync). An expert id of -1 marks a slot to skip (expert
parallelism: the expert lives on another rank): it is never a leader, reads no weights, writes nothing and
adds exactly 0, so a token may hold any number of -1 slots.
1. `_moe_gate_up_kernel`: x quantized per 128 in registers, gate and up FP8 tiles dotted together,
   h = silu(g) * u in fp32, then h quantized per 128 in the epilogue (the 128-row N-block is exactly one
   K-group of the down projection) and stored as fp8 + scale per (token, slot).
2. `_moe_down_kernel`: down projection of h8, times the routing weight, stored per (token, slot) in fp32.
3. `_moe_combine_kernel`: y[t] = sum over slots j = 0..J-1 in order (deterministic, no atomics), skipping
   the -1 slots (their rows of the per-slot buffer are never written).
H200, 256 experts of 7168 x 2048: 105 us for one token (79% of copy bandwidth), 89-94% from two tokens on.
Shared expert as a slot (`shared=True`): the stack's last entry S is every token's implicit slot J (weight 1), so
the three kernels above run it with the routed experts (its weights read once by the leader of the first token's
slot J) instead of its own gate | up GEMV, silu * up and down: 3 launches fewer per MoE layer, the same weight
bytes. No [T, J + 1] id tensor is built (that would be a launch): the kernels read S where a pair's slot is J
(`_ids`, `_slot_weights`); the combine sums that slot's K slices apart and adds them after the routed slots, as
it adds `add`, so the routed slots' bits are unchanged.

Persistent layout (default for T * J <= 64, `layout=`): at TP=8 a rank computes ~1 (T=1) to ~3.5 (T=4) of its
32 experts, and the pair grid above gives them only 16 gate/up (56 down) working programs of 132 SMs (gate/up
25 us at T=1, 62 us at T=4 on an H200, ~30% of the HBM floor). Here ~one program per SM loops over work items
(a-th distinct expert, N-block, K slice), the experts found on the device in each program (`_leader_pairs`,
a [P, P] compare) so the grid stays static; gate/up slices meet in an fp32 workspace where the last slice of
an (expert, N-block) to arrive (atomic counter, re-armed) sums them in slice order and writes h; down slices
write separate partials that the combine kernel sums slot by slot, slice by slice. Deterministic; the slice
counts depend on the shapes only (`default_splits`). `moe_experts(item_regs=True)`: the same work items with no
dependent load before their weight tiles (`mtp.kernels.moe_items`), the same bits. `moe_experts(xq=(x8, sx))` (pair
and persistent layouts): gate/up reads x already quantized (the block's norm's output) instead of quantizing x in
every K group of every item, the same bits where (x8, sx) is x's quantization. `moe_experts(tma=True)`: the weight
tiles copied by TMA through host tensor descriptors (`weight_desc`) instead of cp.async, the same bits.
`moe_experts(down_nb=True)`: the down projection by output block instead of work items, one program per 64 rows of D
looping over every expert of the call in one pipelined loop and storing y itself (`mtp.kernels.moe_down_nb`): no
partials, no combine launch; another fp32 sum order (each token's experts by ascending id), batch invariant.

Grouped layout (default above GROUPED_ABOVE tokens, up to MAX_TOKENS; `mtp.kernels.moe_grouped`): the pairs sorted
by expert on the device and padded to M-blocks of one expert each, then a grouped FP8 GEMM for gate|up and one for
down (persistent programs over (M-block, N-block) work items), the per-pair outputs summed by the same combine
kernel. A batch (verify widths x rows, prefill chunks) is what it is for: each expert's tokens share its weight
tiles in one MMA instead of masked rows of a next_pow2(T) tile.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from mtp.model.fp8 import BLOCK, FP8_DTYPE, fp8_gemm_ref
from mtp.model.fp8 import act_quant as act_quant_ref
from mtp.model.moe import route
from mtp.kernels._triton import (PDL_AFTER_WAIT, asm_ok, pdl_kwargs, pdl_launch, pdl_mode, pdl_wait, prefetch_span_l2,
                                 require, tl, triton)
from mtp.kernels.act_quant import quant_e4m3, ue8m0_scale
from mtp.kernels.fp8_gemm import _counters
from mtp.kernels.moe_down_nb import resolve_tile
from mtp.kernels.moe_down_nb import down_nb as down_nb_kernel
from mtp.kernels.moe_grouped import BLOCK_MS, grouped_partials
from mtp.kernels.moe_items import (_down_ptrs, _down_tile_ahead, _down_weights, _fixup_sums, _gate_up_ptrs,
                                   _gate_up_tile_ahead, _gate_up_weights, _ids, _item_regs, _item_rows, _partial_tile,
                                   _prefetch_item, _slot_weights, _x_quant)

__all__ = ["wave_splits", "waves_for", "moe_route", "moe_route_ref", "route_from_logits_ref", "moe_experts",
           "moe_experts_ref", "gate_logits", "default_layout", "weight_desc", "has_tma", "MAX_TOKENS", "PAIRS_MAX_TOKENS",
           "GROUPED_ABOVE"]

# Tokens per `moe_experts` call. The grouped layout keeps a [T * J, D] fp32 buffer of per-pair outputs (0.94 GB at
# 4096 tokens, J = 8, D = 7168), and 4096 tokens are already compute-bound at TP=8 (~128 local pairs per expert),
# so longer inputs go in chunks of this size (`FastMoE.routed`) rather than in one bigger call.
MAX_TOKENS = 4096
PAIRS_MAX_TOKENS = 64  # the pair and persistent layouts: a tile of next_pow2(T) token rows per expert
# Layout by size (`default_layout`): the pair / persistent kernels up to here, the grouped GEMM above. A first
# guess before the GPU sweep (`python -m mtp.bench.topk_moe --only moe_batch`).
GROUPED_ABOVE = 16


# ----------------------------------------------------------------------------- references
def route_from_logits_ref(logits_TE: torch.Tensor, bias_E: torch.Tensor, n_group: int = 8, topk_group: int = 4,
                          topk: int = 8, route_scale: float = 2.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing from gate logits [T, E] (fp32) as the kernels return it: (weights [T, J] fp32, idx [T, J] int32).
    The model's router (`mtp.model.moe.route`) on sigmoid(logits), normalized weights."""
    w, idx = route(logits_TE.float().sigmoid(), bias_E, n_group, topk_group, topk, True, route_scale)
    return w, idx.to(torch.int32)


def moe_route_ref(x_TD: torch.Tensor, wg_ED: torch.Tensor, bias_E: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch routing: gate in fp32, then `route_from_logits_ref`."""
    return route_from_logits_ref(x_TD.float() @ wg_ED.float().t(), bias_E, **kw)


def moe_experts_ref(x_TD, idx_TJ, w_TJ, w_gate, s_gate, w_up, s_up, w_down, s_down, out_dtype=None,
                    acc: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-token loop over the selected experts with `fp8_gemm_ref`: y[t] = sum_j w[t,j] * down(silu(gate x) * up x).
    Slots with expert id -1 (not on this rank) are skipped. acc: the accumulation dtype (float64 gives the
    same FP8 formulas without fp32 rounding noise, for tests that need to know how large that noise is)."""
    T, D = x_TD.shape
    y = torch.zeros(T, w_down.shape[1], dtype=acc, device=x_TD.device)
    for t in range(T):
        x8, sx = act_quant_ref(x_TD[t:t + 1].to(acc))
        for j in range(idx_TJ.shape[1]):
            e = int(idx_TJ[t, j])
            if e < 0:
                continue
            g = fp8_gemm_ref(x8, sx, w_gate[e], s_gate[e], acc=acc)
            u = fp8_gemm_ref(x8, sx, w_up[e], s_up[e], acc=acc)
            h8, sh = act_quant_ref(F.silu(g) * u)
            y[t] += w_TJ[t, j].to(acc) * fp8_gemm_ref(h8, sh, w_down[e], s_down[e], acc=acc)[0]
    return y.to(out_dtype or x_TD.dtype)


# ----------------------------------------------------------------------------- routing kernels
@triton.jit
def _gate_logits_kernel(x_ptr, w_ptr, part_ptr, T, E, D, groups_per_split, stride_xm,
                        BE: tl.constexpr, BT: tl.constexpr, BF16: tl.constexpr):
    pid_e = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_e = pid_e * BE + tl.arange(0, BE)
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, 128)
    emask = offs_e < E
    tmask = offs_t < T
    w_ptrs = w_ptr + offs_e[:, None] * D + offs_k[None, :]
    x_ptrs = x_ptr + offs_t[:, None] * stride_xm + offs_k[None, :]
    G = D // 128
    g0 = pid_s * groups_per_split
    g1 = tl.minimum(g0 + groups_per_split, G)
    acc = tl.zeros((BE, BT), dtype=tl.float32)
    for g in range(g0, g1):
        w = tl.load(w_ptrs + g * 128, mask=emask[:, None], other=0.0)
        x = tl.load(x_ptrs + g * 128, mask=tmask[:, None], other=0.0)
        if BF16:  # bf16 x bf16 products are exact in fp32: tensor cores give the fp32 result
            acc += tl.dot(w, tl.trans(x))
        else:
            acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
    out = part_ptr + pid_s * T * E + offs_t[None, :] * E + offs_e[:, None]
    tl.store(out, acc, mask=emask[:, None] & tmask[None, :])


@triton.jit
def _route_kernel(part_ptr, bias_ptr, w_out_ptr, idx_out_ptr, T, n_split, route_scale,
                  E: tl.constexpr, NG: tl.constexpr, TOPK_GROUP: tl.constexpr, TOPK: tl.constexpr,
                  KPAD: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, E)
    logit = tl.zeros((E,), dtype=tl.float32)
    for s in range(n_split):  # fixed order: deterministic
        logit += tl.load(part_ptr + s * T * E + t * E + e)
    score = tl.sigmoid(logit)
    b = score + tl.load(bias_ptr + e)
    # group scores on the [NG, EG] view: 3 reductions for all groups at once instead of 3 per group
    EG: tl.constexpr = E // NG
    b2 = tl.reshape(b, (NG, EG))
    eg = tl.arange(0, EG)
    m1 = tl.max(b2, 1)
    first = tl.min(tl.where(b2 == m1[:, None], eg[None, :], EG), 1)
    m2 = tl.max(tl.where(eg[None, :] == first[:, None], float("-inf"), b2), 1)
    gscore = m1 + m2
    gi = tl.arange(0, NG)
    keep_g = tl.zeros((NG,), dtype=tl.int32)
    for i in tl.static_range(TOPK_GROUP):
        mx = tl.max(gscore, 0)
        sel = tl.min(tl.where(gscore == mx, gi, NG), 0)
        keep_g = tl.where(gi == sel, 1, keep_g)
        gscore = tl.where(gi == sel, float("-inf"), gscore)
    keep = tl.reshape(tl.broadcast_to(keep_g[:, None], (NG, EG)), (E,)) != 0
    bm = tl.where(keep, b, float("-inf"))
    ki = tl.arange(0, KPAD)
    out_idx = tl.zeros((KPAD,), dtype=tl.int32)
    out_w = tl.zeros((KPAD,), dtype=tl.float32)
    for i in tl.static_range(TOPK):
        mx = tl.max(bm, 0)
        sel = tl.min(tl.where(bm == mx, e, E), 0)
        out_idx = tl.where(ki == i, sel, out_idx)
        out_w = tl.where(ki == i, tl.sum(tl.where(e == sel, score, 0.0), 0), out_w)
        bm = tl.where(e == sel, float("-inf"), bm)
    out_w = out_w / tl.sum(out_w, 0) * route_scale
    kmask = ki < TOPK
    tl.store(w_out_ptr + t * TOPK + ki, out_w, mask=kmask)
    tl.store(idx_out_ptr + t * TOPK + ki, out_idx, mask=kmask)


def gate_logits(x_TD: torch.Tensor, wg_ED: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """Split-K partial gate logits [S, T, E] fp32 (sum over S = x_f32 . Wg^T)."""
    T, D = x_TD.shape
    E = wg_ED.shape[0]
    if D % BLOCK:
        raise ValueError(f"gate_logits: D = {D} must be a multiple of {BLOCK}")
    G = D // BLOCK
    be, bt = 64, max(16, triton.next_power_of_2(T))
    nbe = triton.cdiv(E, be)
    splits = splits or max(1, min(G, triton.cdiv(112, nbe)))
    gps = triton.cdiv(G, splits)
    splits = triton.cdiv(G, gps)
    part = torch.empty(splits, T, E, dtype=torch.float32, device=x_TD.device)
    x = x_TD if x_TD.stride(-1) == 1 else x_TD.contiguous()
    bf16 = x.dtype == torch.bfloat16 and wg_ED.dtype == torch.bfloat16
    _gate_logits_kernel[(nbe, splits)](x, wg_ED.contiguous(), part, T, E, D, gps, x.stride(0), BE=be, BT=bt, BF16=bf16,
                                       num_warps=4)
    return part


def moe_route(x_TD: torch.Tensor, wg_ED: torch.Tensor, bias_E: torch.Tensor, n_group: int = 8, topk_group: int = 4,
              topk: int = 8, route_scale: float = 2.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel twin of `moe_route_ref`: returns (weights [T, J] fp32, idx [T, J] int32). Two launches."""
    require(x_TD, "moe_route")
    T, D = x_TD.shape
    E = wg_ED.shape[0]
    if wg_ED.shape[1] != D or bias_E.shape != (E,):
        raise ValueError(f"moe_route: gate weight must be [E, {D}] and bias [E], got {list(wg_ED.shape)}, {list(bias_E.shape)}")
    if E & (E - 1) or E % n_group or E // n_group < 2 or topk > E:
        raise ValueError(f"moe_route: E = {E} must be a power of two divisible by n_group = {n_group} (>= 2 per group)")
    part = gate_logits(x_TD, wg_ED)
    w = torch.empty(T, topk, dtype=torch.float32, device=x_TD.device)
    idx = torch.empty(T, topk, dtype=torch.int32, device=x_TD.device)
    _route_kernel[(T,)](part, bias_E.float().contiguous(), w, idx, T, part.shape[0], float(route_scale),
                        E=E, NG=n_group, TOPK_GROUP=topk_group, TOPK=topk, KPAD=triton.next_power_of_2(topk),
                        num_warps=1)  # ~40 dependent reductions over 256 lanes: one warp needs no barriers
    return w, idx


# ----------------------------------------------------------------------------- expert kernels
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
def _gate_up_tile(x_ptr, sx_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, e, nb, active, g0, g1, D, stride_xm, stride_sxm,
                  stride_we, stride_se, stride_sn, w1_desc, w3_desc, I, BM: tl.constexpr, X8: tl.constexpr,
                  TMA: tl.constexpr):
    """gate and up of expert e, N-block nb, over K groups [g0, g1): fp32 accumulators [128, BM] (x quantized
    per 128 in registers, or with X8 its fp8 tile and row scales loaded (`moe_experts(xq=)`); rows of tokens not
    routed to e read as 0). TMA: the weight tiles through the descriptors (`moe_items._gate_up_weights`)."""
    w1_ptrs, w3_ptrs, s1_row, s3_row, x_ptrs, sx_rows = _gate_up_ptrs(
        x_ptr, sx_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, e, nb, D, stride_xm, stride_sxm, stride_we, stride_se,
        stride_sn, BM)
    acc1 = tl.zeros((128, BM), dtype=tl.float32)
    acc3 = tl.zeros((128, BM), dtype=tl.float32)
    for g in range(g0, g1):
        w1, w3 = _gate_up_weights(w1_desc, w3_desc, w1_ptrs, w3_ptrs, e, nb, g, I, TMA)
        if X8:
            xt = tl.trans(tl.load(x_ptrs + g * 128, mask=active[:, None], other=0.0))
            sx = tl.load(sx_rows + g, mask=active, other=0.0)
        else:
            xt, sx = _x_quant(x_ptrs, g, active)
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
               w2_desc, BM: tl.constexpr, TMA: tl.constexpr):
    """Down projection of expert e, output block nb, over K groups [g0, g1): fp32 [128, BM]. TMA: the weight tiles
    through the descriptor (`moe_items._down_weights`)."""
    GI = I // 128
    w_ptrs, s_row, h_ptrs, nmask = _down_ptrs(h8_ptr, w2_ptr, s2_ptr, e, nb, slot, D, I, stride_we, stride_se,
                                              stride_sn)
    acc = tl.zeros((128, BM), dtype=tl.float32)
    for g in range(g0, g1):
        w = _down_weights(w2_desc, w_ptrs, nmask, e, nb, g, D, TMA)
        h = tl.load(h_ptrs + g * 128, mask=active[:, None], other=0.0)
        hs = tl.load(hs_ptr + slot * GI + g, mask=active, other=0.0)
        acc += tl.dot(w, tl.trans(h)) * (hs * tl.load(s_row + g))[None, :]
    return acc


@triton.jit
def _moe_gate_up_kernel(x_ptr, sx_ptr, idx_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, h8_ptr, hs_ptr,
                        T, D, I, stride_xm, stride_sxm, stride_we, stride_se, stride_sn, S,
                        TOPK: tl.constexpr, J: tl.constexpr, BM: tl.constexpr, PPAD: tl.constexpr,
                        KPAD: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, X8: tl.constexpr):
    pdl_launch(PDL)
    _shared_prefetch(w1_ptr, S, stride_we, I * D, TOPK, J, PDL, PREFETCH)
    _shared_prefetch(w3_ptr, S, stride_we, I * D, TOPK, J, PDL, PREFETCH)
    pdl_wait(PDL)  # which routed experts (the router's ids) decides which weights: nothing to load before it
    p = tl.program_id(0)
    nb = tl.program_id(1)
    e, is_leader, active, slot = _slot_info(idx_ptr, p, T, S, TOPK, J, BM, PPAD, KPAD)
    n_iter = tl.where(is_leader, D // 128, 0)
    acc1, acc3 = _gate_up_tile(x_ptr, sx_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, e, nb, active, 0, n_iter, D, stride_xm,
                               stride_sxm, stride_we, stride_se, stride_sn, None, None, I, BM, X8, False)
    _gate_up_store(acc1, acc3, nb, slot, active & is_leader, h8_ptr, hs_ptr, I)


@triton.jit
def _moe_down_kernel(h8_ptr, hs_ptr, idx_ptr, rw_ptr, w2_ptr, s2_ptr, out_ptr,
                     T, D, I, stride_we, stride_se, stride_sn, S,
                     TOPK: tl.constexpr, J: tl.constexpr, BM: tl.constexpr, PPAD: tl.constexpr,
                     KPAD: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr):
    pdl_launch(PDL)
    _shared_prefetch(w2_ptr, S, stride_we, D * I, TOPK, J, PDL, PREFETCH)
    pdl_wait(PDL)  # the router's ids and weights, gate / up's h
    p = tl.program_id(0)
    nb = tl.program_id(1)
    e, is_leader, active, slot = _slot_info(idx_ptr, p, T, S, TOPK, J, BM, PPAD, KPAD)
    n_iter = tl.where(is_leader, I // 128, 0)
    acc = _down_tile(h8_ptr, hs_ptr, w2_ptr, s2_ptr, e, nb, active, slot, 0, n_iter, D, I, stride_we, stride_se,
                     stride_sn, None, BM, False)
    rw = _slot_weights(rw_ptr, slot, active, TOPK, J)
    acc = acc * rw[None, :]
    offs_n = nb * 128 + tl.arange(0, 128)
    smask = active & is_leader
    tl.store(out_ptr + slot.to(tl.int64)[None, :] * D + offs_n[:, None], acc,
             mask=smask[None, :] & (offs_n < D)[:, None])


# ----------------------------------------------------------------------------- persistent expert kernels
@triton.jit
def _leader_pairs(idx_ptr, P, S, TOPK: tl.constexpr, J: tl.constexpr, PPAD: tl.constexpr):
    """Pairs q in [0, PPAD), their expert ids (-2 past the P pairs), which of them lead (a valid expert no earlier
    pair names), each leader's rank among the leaders, and the number of leaders (distinct experts to compute).
    [PPAD, PPAD] compares: small P."""
    q = tl.arange(0, PPAD)
    iq = _ids(idx_ptr, q, q < P, S, TOPK, J)
    earlier = (iq[:, None] == iq[None, :]) & (q[None, :] < q[:, None])
    lead = (iq >= 0) & (tl.sum(earlier.to(tl.int32), 1) == 0)
    rank = tl.cumsum(lead.to(tl.int32), 0) - 1
    return q, iq, lead, rank, tl.sum(lead.to(tl.int32), 0)


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
def _moe_gate_up_persistent(x_ptr, sx_ptr, idx_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, h8_ptr, hs_ptr, part_ptr, cnt_ptr,
                            w1_desc, w3_desc, T, D, I, stride_xm, stride_sxm, stride_we, stride_se, stride_sn, KS, S,
                            TOPK: tl.constexpr, J: tl.constexpr, BM: tl.constexpr, PPAD: tl.constexpr,
                            KPAD: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, ITEM_REGS: tl.constexpr,
                            NEXT_PF: tl.constexpr, KSU: tl.constexpr, TP: tl.constexpr, X8: tl.constexpr,
                            TMA: tl.constexpr):
    """Work item (a, nb, ks): the a-th distinct expert, N-block nb, K slice ks, handed out round-robin over a
    grid of ~one program per SM, so the few experts a rank computes at decode still fill every SM. The last
    slice of (a, nb) to finish (atomic counter) sums the fp32 partials in slice order (deterministic) and
    writes h; it re-arms the counter. ITEM_REGS: the items without dependent loads (`moe_items`: KSU = KS slices
    unrolled in the fix-up, on TP = next_pow2(T) columns; NEXT_PF: the next item's weights asked of L2). X8: x_ptr
    is the pre-quantized x8 (e4m3) with its row scales at sx_ptr, loaded per K group instead of quantizing x. TMA:
    the gate and up tiles through the host descriptors w1_desc / w3_desc (`weight_desc`; None without it)."""
    pdl_launch(PDL)
    _shared_prefetch(w1_ptr, S, stride_we, I * D, TOPK, J, PDL, PREFETCH)
    _shared_prefetch(w3_ptr, S, stride_we, I * D, TOPK, J, PDL, PREFETCH)
    pdl_wait(PDL)  # the router's ids; the counters, re-armed by their last user, are touched after it
    q, iq, lead, rank, n_act = _leader_pairs(idx_ptr, T * TOPK, S, TOPK, J, PPAD)
    NB = I // 128
    G = D // 128
    n_items = n_act * NB * KS
    for w in range(tl.program_id(0), n_items, tl.num_programs(0)):
        if ITEM_REGS:
            a, nb, ks, e, active, slot, g0, g1 = _item_regs(w, q, iq, lead, rank, NB, KS, G, TOPK, BM)
            if NEXT_PF:
                _prefetch_item(w + tl.num_programs(0), n_items, iq, lead, rank, NB, KS, G, w1_ptr, w3_ptr,
                               stride_we, D, True)
            acc1, acc3 = _gate_up_tile_ahead(x_ptr, sx_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, e, nb, active, g0, g1,
                                             D, stride_xm, stride_sxm, stride_we, stride_se, stride_sn, w1_desc,
                                             w3_desc, I, BM, X8, TMA)
        else:
            a, nb, ks, e, active, slot, g0, g1 = _work_item(w, q, lead, rank, idx_ptr, T, NB, KS, G, S,
                                                            TOPK, J, BM, PPAD, KPAD)
            acc1, acc3 = _gate_up_tile(x_ptr, sx_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, e, nb, active, g0, g1,
                                       D, stride_xm, stride_sxm, stride_we, stride_se, stride_sn, w1_desc, w3_desc,
                                       I, BM, X8, TMA)
        # fp32 partials [2, 128, T] per (a, nb, ks): the T token columns only (ITEM_REGS: TP columns, `_partial_tile`)
        if ITEM_REGS:
            C = TP
            tile, tmask = _partial_tile(TP, BM)
        else:
            C = T
            m = tl.arange(0, BM)
            tile = tl.arange(0, 128)[:, None] * T + m[None, :]
            tmask = (m < T)[None, :]
        base = part_ptr + ((a * NB + nb) * KS).to(tl.int64) * (2 * 128 * C)
        tl.store(base + ks * (2 * 128 * C) + tile, acc1, mask=tmask)
        tl.store(base + ks * (2 * 128 * C) + 128 * C + tile, acc3, mask=tmask)
        tl.debug_barrier()
        if tl.atomic_add(cnt_ptr + a * NB + nb, 1, sem="acq_rel", scope="gpu") == KS - 1:
            if ITEM_REGS:  # [128, TP] tiles: T columns (+ zero ones), not the dot's BM
                sum1, sum3 = _fixup_sums(base, KS, KSU, TP)
                rows, slots = _item_rows(e, q, iq, TOPK, TP)
                _gate_up_store(sum1, sum3, nb, slots, rows, h8_ptr, hs_ptr, I)
            else:
                acc1 = tl.zeros((128, BM), dtype=tl.float32)
                acc3 = tl.zeros((128, BM), dtype=tl.float32)
                for s in range(KS):
                    acc1 += tl.load(base + s * (2 * 128 * T) + tile, mask=tmask, other=0.0, cache_modifier=".cg")
                    acc3 += tl.load(base + s * (2 * 128 * T) + 128 * T + tile, mask=tmask, other=0.0,
                                    cache_modifier=".cg")
                _gate_up_store(acc1, acc3, nb, slot, active, h8_ptr, hs_ptr, I)
            tl.atomic_xchg(cnt_ptr + a * NB + nb, 0, sem="relaxed", scope="gpu")


@triton.jit
def _moe_down_persistent(h8_ptr, hs_ptr, idx_ptr, rw_ptr, w2_ptr, s2_ptr, out_ptr, w2_desc,
                         T, D, I, stride_we, stride_se, stride_sn, KS, S,
                         TOPK: tl.constexpr, J: tl.constexpr, BM: tl.constexpr, PPAD: tl.constexpr,
                         KPAD: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, ITEM_REGS: tl.constexpr,
                         NEXT_PF: tl.constexpr, TMA: tl.constexpr):
    """Work item (a, nb, ks) as in `_moe_gate_up_persistent`; slice ks writes its weighted partial to
    out[ks, slot], which the combine kernel sums in a fixed order. ITEM_REGS: without dependent loads (`moe_items`;
    the route weights loaded before the loop; NEXT_PF: the next item's weights asked of L2). TMA: the down tiles
    through the host descriptor w2_desc (`weight_desc`; None without it)."""
    pdl_launch(PDL)
    _shared_prefetch(w2_ptr, S, stride_we, D * I, TOPK, J, PDL, PREFETCH)
    pdl_wait(PDL)  # the router's ids and weights, gate / up's h
    q, iq, lead, rank, n_act = _leader_pairs(idx_ptr, T * TOPK, S, TOPK, J, PPAD)
    NB = tl.cdiv(D, 128)
    GI = I // 128
    P = T * TOPK
    n_items = n_act * NB * KS
    for w in range(tl.program_id(0), n_items, tl.num_programs(0)):
        if ITEM_REGS:
            a, nb, ks, e, active, slot, g0, g1 = _item_regs(w, q, iq, lead, rank, NB, KS, GI, TOPK, BM)
            rw = _slot_weights(rw_ptr, slot, active, TOPK, J)
            if NEXT_PF:
                _prefetch_item(w + tl.num_programs(0), n_items, iq, lead, rank, NB, KS, GI, w2_ptr, w2_ptr,
                               stride_we, I, False)
            acc = _down_tile_ahead(h8_ptr, hs_ptr, w2_ptr, s2_ptr, e, nb, active, slot, g0, g1, D, I,
                                   stride_we, stride_se, stride_sn, w2_desc, BM, TMA)
        else:
            a, nb, ks, e, active, slot, g0, g1 = _work_item(w, q, lead, rank, idx_ptr, T, NB, KS, GI, S,
                                                            TOPK, J, BM, PPAD, KPAD)
            acc = _down_tile(h8_ptr, hs_ptr, w2_ptr, s2_ptr, e, nb, active, slot, g0, g1, D, I,
                             stride_we, stride_se, stride_sn, w2_desc, BM, TMA)
            rw = _slot_weights(rw_ptr, slot, active, TOPK, J)
        acc = acc * rw[None, :]
        offs_n = nb * 128 + tl.arange(0, 128)
        dst = out_ptr + (ks * P + slot).to(tl.int64)[None, :] * D + offs_n[:, None]
        tl.store(dst, acc, mask=active[None, :] & (offs_n < D)[:, None])


@triton.jit
def _moe_combine_kernel(part_ptr, idx_ptr, add_ptr, y_ptr, D, P, TOPK: tl.constexpr, J: tl.constexpr,
                        KS: tl.constexpr, BLOCK_D: tl.constexpr, ADD: tl.constexpr, PDL: tl.constexpr):
    pdl_launch(PDL)
    pdl_wait(PDL)  # the down kernel's partials, the router's ids, the shared expert's output
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(J):  # slot order, then K-slice order: deterministic
        used = tl.load(idx_ptr + t * J + j) >= 0  # a -1 slot's rows of `part` were never written
        for s in tl.static_range(KS):
            acc += tl.load(part_ptr + (s * P + t * TOPK + j).to(tl.int64) * D + offs, mask=mask & used, other=0.0)
    if TOPK > J:  # the implicit shared slot: its K slices summed apart, then added (routed + shared, as `add`)
        sh = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for s in tl.static_range(KS):
            sh += tl.load(part_ptr + (s * P + t * TOPK + J).to(tl.int64) * D + offs, mask=mask, other=0.0)
        acc += sh
    if ADD:  # the shared expert's output, after the routed sum (the reference's routed + shared)
        acc += tl.load(add_ptr + t.to(tl.int64) * D + offs, mask=mask, other=0.0)
    tl.store(y_ptr + t.to(tl.int64) * D + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _check_experts(name, w, s, E, N, K):
    if w.dtype != FP8_DTYPE or tuple(w.shape) != (E, N, K):
        raise ValueError(f"moe_experts: {name} must be float8 [{E}, {N}, {K}], got {w.dtype} {list(w.shape)}")
    want = (E, -(-N // BLOCK), K // BLOCK)
    if tuple(s.shape) != want:
        raise ValueError(f"moe_experts: {name} scales must be {list(want)}, got {list(s.shape)}")
    if not (w.is_contiguous() and s.is_contiguous()):
        raise ValueError(f"moe_experts: {name} weight and scales must be contiguous")


def _check_xq(xq, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_experts`' xq = (x8, sx) for x [T, D]: float8 [T, D] and fp32 [T, D / 128] on x's device, returned with a
    unit stride along their last dim (a copy where not)."""
    T, D = x_TD.shape
    if not (isinstance(xq, (tuple, list)) and len(xq) == 2 and all(isinstance(t, torch.Tensor) for t in xq)):
        raise ValueError(f"moe_experts: xq must be a pair (x8, sx) of tensors, got {type(xq).__name__}")
    x8, sx = xq
    if x8.dtype != FP8_DTYPE or tuple(x8.shape) != (T, D):
        raise ValueError(f"moe_experts: xq's x8 must be {FP8_DTYPE} [{T}, {D}] (x quantized), got {x8.dtype} "
                         f"{list(x8.shape)}")
    if sx.dtype != torch.float32 or tuple(sx.shape) != (T, D // BLOCK):
        raise ValueError(f"moe_experts: xq's sx must be float32 [{T}, {D // BLOCK}] (x8's scale per {BLOCK}), got "
                         f"{sx.dtype} {list(sx.shape)}")
    for name, t in (("x8", x8), ("sx", sx)):
        if t.device != x_TD.device:
            raise ValueError(f"moe_experts: xq's {name} must be on x's device {x_TD.device}, got {t.device}")
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in (x8, sx))


class _DescBase:
    """What a host tensor descriptor reads of its base (the CUDA launcher: data_ptr() for the tensor map it encodes at
    each launch; the JIT: dtype for the signature), without holding the tensor, so that the cache of `weight_desc`
    keeps no freed stack alive. A descriptor is a function of (address, shape, strides, dtype) alone: an entry whose
    tensor was freed describes exactly the memory of any later tensor with its key."""

    __slots__ = ("ptr", "dtype")

    def __init__(self, ptr: int, dtype: torch.dtype):
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self.ptr


@functools.lru_cache(maxsize=1024)  # ~3 stacks per MoE layer: 174 entries for 58 layers
def _stack_desc(ptr: int, rows: int, K: int, dtype: torch.dtype, device: torch.device, block_rows: int = BLOCK):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(_DescBase(ptr, dtype), [rows, K], [K, 1], [block_rows, BLOCK])


def has_tma(device: torch.device) -> bool:
    """Whether `moe_experts(tma=True)` runs on `device` by default (`FastMoE` with switch `moe_tma`): a CUDA GPU of
    compute capability >= 9.0 (Hopper's tensor memory accelerator). Elsewhere the pointer loads: an older GPU
    (moe_experts refuses tma there) and the CPU's Triton interpreter, where the descriptors would be rebuilt at
    every call for the same bits."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def weight_desc(name: str, w: torch.Tensor, block_rows: int = BLOCK):
    """Host tensor descriptor (triton's TensorDescriptor) of expert stack `name` w [E, N, K] (fp8) seen as [E * N,
    K] with [block_rows, 128] blocks (128 rows, or the BN rows of `moe_down_nb`'s programs), for `moe_experts(tma=
    True)`: cached per (address, shape, strides, dtype, device, block rows) on a CUDA device, so a decode step builds
    none (the launcher still encodes its 128-byte tensor map per launch, on the host; a CUDA graph holds the encoded
    one); built each call for the interpreter, which reads the tensor itself.
    TMA's terms, each refused by name: a 16-byte aligned base, 16-byte aligned row stride (K bytes), a unit stride
    along K, and N a multiple of 128 (and so of block_rows, a divisor of 128): with N-blocks that overhang, the 2-D
    view would copy the next expert's first rows where the pointer load's row mask gives 0 (TMA fills with 0 only past
    the whole [E * N, K] view)."""
    E, N, K = w.shape
    if block_rows not in (16, 32, 64, BLOCK):
        raise ValueError(f"moe_experts: a weight descriptor's block rows must divide {BLOCK} (16..{BLOCK}), got "
                         f"{block_rows!r}")
    ok = {"a unit stride along K and rows of K elements (contiguous)": w.stride(-1) == 1 and w.stride(-2) == K
          and w.stride(0) == N * K,
          "a 16-byte aligned base address": w.data_ptr() % 16 == 0,
          "16-byte aligned rows (K bytes a multiple of 16)": K * w.element_size() % 16 == 0,
          f"N = {N} a multiple of {BLOCK} (no N-block reaching the next expert's rows)": N % BLOCK == 0}
    bad = [what for what, good in ok.items() if not good]
    if bad:
        raise ValueError(f"moe_experts: tma needs {name} [{E}, {N}, {K}] (strides {list(w.stride())}, address "
                         f"{w.data_ptr():#x}) with " + "; ".join(bad))
    if not w.is_cuda:
        from triton.tools.tensor_descriptor import TensorDescriptor

        return TensorDescriptor.from_tensor(w.view(E * N, K), [block_rows, BLOCK])
    return _stack_desc(w.data_ptr(), E * N, K, w.dtype, w.device, block_rows)


PERSISTENT_MAX_PAIRS = 64  # the persistent kernels compare all (token, slot) pairs pairwise: small P only
LAYOUTS = ("pairs", "persistent", "grouped")


def default_layout(T: int, J: int) -> str:
    """'persistent' for T * J <= PERSISTENT_MAX_PAIRS, 'pairs' up to GROUPED_ABOVE tokens, 'grouped' above."""
    if T * J <= PERSISTENT_MAX_PAIRS:
        return "persistent"
    return "pairs" if T <= GROUPED_ABOVE else "grouped"


def default_splits(T: int, G: int, GI: int) -> tuple[int, int]:
    """K slices of the persistent gate/up and down kernels. A function of the shapes only (never of which
    experts were picked), so a rank's result is bit-equal to the full stack with the other ranks' slots zeroed.
    At TP=8 a decode token has ~1 local expert (16 gate/up and 56 down blocks): 8 and 4 slices give ~130 and
    ~220 work items, about one wave on 132 SMs; from 2 tokens on, 4 and 2."""
    return min(G, 8 if T == 1 else 4), min(GI, 4 if T == 1 else 2)


# a work item's fixed cost (its pipeline fill, its partial's store, counter and fix-up) in K groups' streaming time:
# fitted to the sweep below (20 would pick 3 gate/up slices at 3 tokens, measured 14 us slower than 2; 22 keeps
# every measured choice), not derived
WAVE_ITEM_GROUPS = 22


@functools.lru_cache(maxsize=None)  # a function of shapes, asked per MoE layer and call: computed once per shape
def wave_splits(items: int, G: int, programs: int) -> int:
    """K slices of a persistent kernel whose work items are `items` x slices (each slice ~G / slices K groups long)
    on `programs` programs: the count that minimizes (rounds of items, fractional, at least one: a thin last round
    costs little) x (groups per item + WAVE_ITEM_GROUPS), the fewest slices among equals. Fitted to `mtp.bench.
    topk_moe --only moe_split` (one TP=8 split rank, H200, BENCHMARKS.md session 12: gate/up + down + combine, 8
    routed + the shared slot per token, 2 N-blocks each), where the fastest gate/up slices were 7 / 2 / 2 / 2 at
    1 / 2 / 3 / 4 tokens (31.1 / 53.6 / 63.2 / 77.0 us; this rule: 7 / 4 / 2 / 2, 4 slices at 2 tokens took 56.4-57.5)
    and the down kernel's fastest was always 1 slice (this rule: 1). `default_splits` assumes ~1 active expert per
    token (a contiguous expert-parallel rank: this rule gives its 8 too); where every pair names a distinct expert
    of the stack (a 'split' rank) its 8 gate/up slices at one token give 144 items on 132 SMs, two rounds of 7
    groups, where 7 give one round of 8."""
    if items < 1 or G < 1 or programs < 1:
        raise ValueError(f"wave_splits: items, G and programs must be >= 1, got {items}, {G}, {programs}")
    return min(range(1, G + 1),
               key=lambda ks: (max(1.0, items * ks / programs) * (-(-G // ks) + WAVE_ITEM_GROUPS), ks))


def waves_for(P: int, E: int, D: int, I: int, programs: tuple[int, int]) -> tuple[int, int]:
    """(gate/up, down) K slices of `moe_experts(splits='waves')`: `wave_splits` with every one of the P pairs a
    distinct expert of the E-entry stack (the bound: the kernels compute n_act <= P experts), on the persistent
    kernels' (gate/up, down) programs."""
    n = min(P, E)
    return (wave_splits(n * (I // BLOCK), D // BLOCK, programs[0]),
            wave_splits(n * triton.cdiv(D, BLOCK), I // BLOCK, programs[1]))


def moe_experts(x_TD: torch.Tensor, idx_TJ: torch.Tensor, w_TJ: torch.Tensor, w_gate, s_gate, w_up, s_up, w_down, s_down,
                out_dtype: torch.dtype | None = None, gate_up_stages: int | None = None, down_stages: int | None = None,
                layout: str | None = None, splits: tuple[int, int] | str | None = None,
                programs: tuple[int, int] | None = None, add: torch.Tensor | None = None,
                block_m: int | None = None, shared: bool = False, pdl: bool = False,
                prefetch: bool = True, item_regs: bool = False, item_prefetch: bool = False,
                warps: tuple[int, int] | None = None,
                xq: tuple[torch.Tensor, torch.Tensor] | None = None, tma: bool = False, down_nb: bool = False,
                down_tile: tuple[int, int] | None = None, gate_up_after_wait: bool = False,
                down_pf_experts: int = 0) -> torch.Tensor:
    """Kernel twin of `moe_experts_ref` for T <= MAX_TOKENS: y [T, D] = sum_j w[t,j] * Expert_idx[t,j](x[t]).

    idx_TJ int32 expert ids in [0, E), distinct within a token (the grouped layout takes repeats), or -1 for a slot
    to skip (its expert is on another rank: reads nothing, adds 0; any number per token). w_TJ fp32. Three launches
    (grouped: six); reads each selected expert's weights once. Ids are checked (in range; distinct within a token
    on the pairs / persistent layouts, whose work items assume it: a repeat gave garbage on the CPU, NaN on a GPU,
    session 20) only when they live on the CPU (interpreter): on CUDA a check would be a host sync, and the call
    must stay CUDA-graph capturable.
    layout: 'pairs' (a program per (token, slot) pair and N-block; the leader pair computes the expert) or
    'persistent' (~one program per SM looping over (distinct expert, N-block, K-slice) work items, so that a
    few experts still fill the GPU; T * J <= 64), both for T <= PAIRS_MAX_TOKENS; or 'grouped' (pairs sorted by
    expert into M-blocks, a grouped FP8 GEMM: `mtp.kernels.moe_grouped`; any T <= MAX_TOKENS); default
    `default_layout`. splits: (gate/up, down) K slices of the persistent layout (default `default_splits`), or
    "waves": chosen by `wave_splits` for every one of the T * slots pairs a distinct expert of the stack (where
    every routed slot is local: a 'split' rank), so that the work items fill whole rounds of the grid;
    programs: the persistent / grouped grid sizes (default one and two programs per SM; grouped: two and two);
    gate_up_stages / down_stages: pipeline depths (down: default 5; grouped: 3 and 4); block_m: the grouped layout's
    M-block (`moe_grouped.BLOCK_MS`; default `moe_grouped.default_block_m`). add: fp32 [T, D] added to each
    token's routed sum in the combine launch (the shared expert's output: y = routed + add, as the
    reference's `out + shared`).
    shared: the last stack entry S = E - 1 is the shared expert (stacked after the routed ones,
    `fast_path.stack_experts`), applied to every token with weight 1.0 as an implicit slot J after the routed ones:
    pairs / persistent layouts only, no launch more (the kernels read S where a pair's slot is J; idx_TJ keeps the
    router's J columns, ids in [0, E - 1)). y = (routed slots in order) + shared expert (+ add): the order of
    `add`, the shared slot's K slices summed apart, and the routed slots' bits are those of the call without it.
    The persistent layout then holds T * (J + 1) pairs.
    pdl: the pair / persistent layouts' three launches with programmatic dependent launch (`_triton.pdl_kwargs`:
    which routed experts' weights they read is the router's output, read after the wait; with `shared` the shared
    expert's weights are asked of L2 before it, a share per program, unless not prefetch
    (`FastPathOptions.prefetch_at`: the prefetch compiled out, the same bits); the grouped layout's launches stay
    plain).
    item_regs: the persistent layout's work items without a dependent load before their weight tiles
    (`mtp.kernels.moe_items`: ids from registers, the scales one K group ahead, the fix-up's slices in flight at
    once, with item_prefetch the program's next item's weights asked of L2 on a CUDA device): the same tiles, the
    same sums in the same order, the same bits (switch `FastPathOptions.moe_item_regs`). item_prefetch off by
    default: on a TP=8 split rank's stack (H200, `mtp.bench.topk_moe --only moe_split`, BENCHMARKS.md session 17)
    item_regs took 25.96 / 48.61 / 54.84 / 72.93 us at T = 1..4 without it, 27.36 / 53.34 / 58.86 / 75.16 with it.
    warps: the persistent (gate/up, down) kernels' num_warps (default 4 and 4), for benchmarks (`mtp.bench.topk_moe
    --only moe_knobs`, with the stages and grids: the same bits, checked there; none paid on an H200, session 18).
    xq = (x8, sx): x already quantized per 128 (float8 [T, D], fp32 [T, D / 128] on x's device: the block's
    post-attention norm's output, `norm_quant.add_rms_norm_quant`), which the pair / persistent layouts' gate/up
    kernel loads per K group instead of quantizing x in its loop (switch `FastPathOptions.moe_x8`); the grouped
    layout refuses it. The same bits as without it where (x8, sx) is x's quantization (`act_quant`'s: the ue8m0 scale
    and e4m3 rounding of x's values, which the norm kernels store for the y they return); x itself then only gives
    T, D, the device and the default out_dtype.
    tma: the persistent layout's weight tiles (gate, up, down; either item loop) loaded by Hopper's tensor memory
    accelerator, one bulk copy of a [128, 128] tile into shared memory per K group and weight, through host tensor
    descriptors of the stacks seen as [E * N, K] (`weight_desc`: cached per stack, passed by value, so a CUDA graph
    captures them), instead of pointer tensors compiled to cp.async (switch `FastPathOptions.moe_tma`). The same
    tiles, scales, dots and sums in the same order: the same bits. Persistent layout only, on sm_90+ (or the
    interpreter); a stack a descriptor cannot describe is refused by name (`weight_desc`).
    down_nb: the persistent layout's down projection by output block (`mtp.kernels.moe_down_nb`, switch
    `FastPathOptions.moe_down_nb`): one program per BN rows of D loops over every expert of the call and its K groups
    in one pipelined loop and stores y (+ add) itself: no per-slot partials, no combine launch (two launches instead
    of three). The same FP8 products summed in another order (each token's experts by ascending id, the shared slot's
    last): within fp32 reordering of this call without it, and a token's bits do not depend on the call's other
    tokens (T <= 16). down_tile: its (BN, K groups an iteration), BN of `moe_down_nb.DOWN_NB_ROWS`, 1 or 2 groups
    (the same bits; default `moe_down_nb.default_tile`); down_stages / warps[1] are its num_stages / num_warps
    (default `moe_down_nb.DEFAULT_STAGES`, 4); with tma its weight tiles by TMA ([BN, 128] blocks); splits' down
    slices do not apply.
    gate_up_after_wait: with PDL, the gate/up launch lets the next one launch only after its own wait
    (`_triton.PDL_AFTER_WAIT`) whatever pdl says (switch `FastPathOptions.moe_gate_up_aw`); the same bits.
    down_pf_experts (>= 0; > 0 only with down_nb): where the gate/up launch triggers after its wait (pdl ==
    PDL_AFTER_WAIT, or gate_up_after_wait) and prefetch, the down kernel reads the router's ids and route weights and
    the down scales before its own wait (final by then: gate/up let it launch only after the router had completed)
    and asks L2 for its rows of its loop's first down_pf_experts experts (`moe_down_nb.down_nb(pf_experts=)`, switch
    `FastPathOptions.moe_down_pf_experts`); the same plan, the same bits. Elsewhere (gate/up's trigger at its start:
    the router may still run) compiled out.
    """
    require(x_TD, "moe_experts")
    T, D = x_TD.shape
    J = idx_TJ.shape[1]
    E, I = w_gate.shape[0], w_gate.shape[1]
    if not 1 <= T <= MAX_TOKENS:
        raise ValueError(f"moe_experts: 1..{MAX_TOKENS} tokens, got {T}")
    if tuple(idx_TJ.shape) != (T, J) or tuple(w_TJ.shape) != (T, J) or idx_TJ.is_floating_point():
        raise ValueError(f"moe_experts: idx (integer) and weights must be [{T}, J], got {idx_TJ.dtype} "
                         f"{list(idx_TJ.shape)} and {list(w_TJ.shape)}")
    if not isinstance(shared, bool) or (shared and E < 2):
        raise ValueError(f"moe_experts: shared must be a bool (the last of >= 2 stack entries is the shared expert), "
                         f"got {shared!r} with {E} entries")
    E_routed = E - shared  # the shared expert is no router's choice: every token gets it as its implicit slot J
    if not idx_TJ.is_cuda and idx_TJ.numel() and not (-1 <= int(idx_TJ.min()) and int(idx_TJ.max()) < E_routed):
        raise ValueError(f"moe_experts: expert ids must be in [0, {E_routed}) or -1"
                         f"{' (the last stack entry is the shared expert)' if shared else ''}, got {idx_TJ.tolist()}")
    if D % BLOCK or I % BLOCK:
        raise ValueError(f"moe_experts: D = {D} and I = {I} must be multiples of {BLOCK}")
    _check_experts("w_gate", w_gate, s_gate, E, I, D)
    _check_experts("w_up", w_up, s_up, E, I, D)
    _check_experts("w_down", w_down, s_down, E, D, I)
    TOPK = J + shared  # slots per token: the router's J, then the implicit shared slot
    P = T * TOPK
    layout = layout or default_layout(T, TOPK)
    if layout not in LAYOUTS or (layout == "persistent" and P > PERSISTENT_MAX_PAIRS) or \
            (layout != "grouped" and T > PAIRS_MAX_TOKENS):
        raise ValueError(f"moe_experts: layout must be one of {LAYOUTS} ('persistent' for T * slots <= "
                         f"{PERSISTENT_MAX_PAIRS}, 'pairs' for T <= {PAIRS_MAX_TOKENS}), got {layout!r} with T = {T}, "
                         f"slots = {TOPK} (J = {J}{' + the shared one' if shared else ''})")
    if not idx_TJ.is_cuda and J > 1 and layout != "grouped":  # their per-expert work items assume distinct ids
        rows = idx_TJ.tolist()  # host lists, not aten ops (`plan.launches` counts those as the GPU's launches)
        t = next((t for t, r in enumerate(rows) if len({e for e in r if e >= 0}) < sum(e >= 0 for e in r)), None)
        if t is not None:
            raise ValueError(f"moe_experts: token {t}'s expert ids repeat ({rows[t]}): the '{layout}' "
                             f"layout needs a token's experts distinct (-1, a slot to skip, may repeat; 'grouped' "
                             f"sums a repeat as the reference does)")
    if shared and layout == "grouped":
        raise ValueError("moe_experts: shared (the implicit shared slot) is for the 'pairs' and 'persistent' "
                         "layouts; the grouped one takes the shared expert's output as add")
    if block_m is not None and (layout != "grouped" or block_m not in BLOCK_MS):
        raise ValueError(f"moe_experts: block_m is the grouped layout's, one of {BLOCK_MS}; got {block_m} with "
                         f"layout {layout!r}")
    if splits is not None and splits != "waves" and not (
            isinstance(splits, tuple) and len(splits) == 2 and all(isinstance(k, int) and k >= 1 for k in splits)):
        raise ValueError(f"moe_experts: splits must be 'waves' or (gate/up, down) K slices >= 1, got {splits!r}")
    if warps is not None and not (isinstance(warps, tuple) and len(warps) == 2 and all(w in (4, 8) for w in warps)):
        raise ValueError(f"moe_experts: warps must be (gate/up, down) num_warps, each 4 or 8, got {warps!r}")
    if add is not None and (add.dtype != torch.float32 or tuple(add.shape) != (T, D) or not add.is_contiguous()):
        raise ValueError(f"moe_experts: add must be contiguous fp32 [{T}, {D}], got {add.dtype} {list(add.shape)}")
    if not isinstance(tma, bool) or (tma and layout != "persistent"):
        raise ValueError(f"moe_experts: tma must be a bool, and True only with the 'persistent' layout; got {tma!r} "
                         f"with layout {layout!r}")
    if not isinstance(down_nb, bool) or (down_nb and layout != "persistent"):
        raise ValueError(f"moe_experts: down_nb must be a bool, and True only with the 'persistent' layout; got "
                         f"{down_nb!r} with layout {layout!r}")
    if down_tile is not None and not down_nb:
        raise ValueError(f"moe_experts: down_tile is down_nb's, got {down_tile!r} with down_nb {down_nb!r}")
    down_tile = resolve_tile(down_tile, I) if down_nb else None
    if not isinstance(gate_up_after_wait, bool):
        raise ValueError(f"moe_experts: gate_up_after_wait must be a bool, got {gate_up_after_wait!r}")
    if isinstance(down_pf_experts, bool) or not isinstance(down_pf_experts, int) or down_pf_experts < 0 or (
            down_pf_experts and not down_nb):
        raise ValueError(f"moe_experts: down_pf_experts must be an integer >= 0, and > 0 only with down_nb; got "
                         f"{down_pf_experts!r} with down_nb {down_nb!r}")
    if tma and x_TD.is_cuda and torch.cuda.get_device_capability(x_TD.device)[0] < 9:
        raise ValueError(f"moe_experts: tma needs a GPU with TMA (compute capability >= 9.0), got "
                         f"{torch.cuda.get_device_name(x_TD.device)}")
    if xq is not None:
        if layout == "grouped":
            raise ValueError("moe_experts: xq (x pre-quantized) is for the 'pairs' and 'persistent' layouts; the "
                             "grouped one quantizes x in its own launch (`moe_grouped.grouped_partials`)")
        x8, sx = _check_xq(xq, x_TD)
    idx = idx_TJ.to(torch.int32).contiguous()
    rw = w_TJ.float().contiguous()
    x = x_TD if x_TD.stride(-1) == 1 else x_TD.contiguous()
    if layout == "grouped":
        part = grouped_partials(x, idx, rw, w_gate, s_gate, w_up, s_up, w_down, s_down, block_m=block_m,
                                stages=(gate_up_stages or 3, down_stages or 4), programs=programs)
        return _combine(part, idx, add, T, D, J, 1, out_dtype or x_TD.dtype, False, False)
    bm = max(16, triton.next_power_of_2(T))
    ppad, kpad = triton.next_power_of_2(P), triton.next_power_of_2(TOPK)
    dev = x.device
    h8 = torch.empty(P, I, dtype=FP8_DTYPE, device=dev)
    hs = torch.empty(P, I // BLOCK, dtype=torch.float32, device=dev)
    wargs = (w_gate, s_gate, w_up, s_up)
    S = E - 1 if shared else -3  # read only where TOPK = J + 1
    launch = pdl_kwargs(pdl, x)
    kw = dict(TOPK=TOPK, J=J, BM=bm, PPAD=ppad, KPAD=kpad, PDL=pdl_mode(pdl, launch), PREFETCH=bool(launch) and prefetch,
              num_warps=4, **launch)
    # gate/up's trigger: after its wait, the router (gate/up's predecessor) has completed when the down kernel starts
    gu_pdl = pdl_mode(PDL_AFTER_WAIT if pdl and gate_up_after_wait else pdl, launch)
    # gate/up's x operand: x8 and its row scales (X8), or x, quantized in the K loop (sx_ptr a stand-in, never read)
    xa, sxa, stride_sxm = (x8, sx, sx.stride(0)) if xq is not None else (x, x, 0)
    if layout == "pairs":
        if gate_up_stages is None:
            # H200 sweep (T=1 / T=4): 4 stages (145 KB smem, 1 program per SM) won when the leaders' programs
            # fit in one wave (105 vs 111 us at T=1); with more programs 3 stages (2 per SM) won (331 vs 358 us).
            # The sweep's shapes had BM = 16; the x tile grows with BM, and 4 stages at BM = 64 need 238 KB of
            # the 227 KB a block may hold (seen: OutOfResources on the bundled model at 64 tokens, 2 x H200).
            gate_up_stages = 4 if bm <= 16 and P * (I // BLOCK) <= _sm_count(dev) else 3
        _moe_gate_up_kernel[(P, I // BLOCK)](xa, sxa, idx, *wargs, h8, hs, T, D, I, xa.stride(0), stride_sxm,
                                             w_gate.stride(0), s_gate.stride(0), s_gate.stride(1), S,
                                             num_stages=gate_up_stages, X8=xq is not None, **dict(kw, PDL=gu_pdl))
        ks_down = 1
        part = torch.empty(P, D, dtype=torch.float32, device=dev)
        _moe_down_kernel[(P, triton.cdiv(D, BLOCK))](h8, hs, idx, rw, w_down, s_down, part, T, D, I, w_down.stride(0),
                                                     s_down.stride(0), s_down.stride(1), S,
                                                     num_stages=down_stages or 5, **kw)
    else:
        sm = _sm_count(dev)
        g_gu, g_down = programs or (sm, 2 * sm)
        if splits == "waves":
            splits = waves_for(P, E, D, I, (g_gu, g_down))
        ks_gu, ks_down = splits or default_splits(T, D // BLOCK, I // BLOCK)
        n_act = min(P, E)  # distinct experts, at most
        nb = I // BLOCK
        cols = triton.next_power_of_2(T) if item_regs else T  # a partial's token columns (`moe_items._partial_tile`)
        gu_part = torch.empty(n_act * nb * ks_gu * 2 * BLOCK * cols, dtype=torch.float32, device=dev)
        cnt = _counters(dev, n_act * nb)
        # item_regs: the fix-up unrolled over the ks_gu slices (a compile per slice count, as per BM) on
        # next_pow2(T) columns; off: 1s, one compile
        items = dict(ITEM_REGS=item_regs, NEXT_PF=item_regs and item_prefetch and asm_ok(x))
        fix = dict(KSU=ks_gu, TP=cols) if item_regs else dict(KSU=1, TP=1)
        wu, wd = warps or (4, 4)
        # tma: the weight tiles through host tensor descriptors (cached per stack); else None (constexpr, unused)
        # (down_nb: the down stack's descriptor with its programs' [BN, 128] blocks, for that kernel alone)
        down_rows = down_tile[0] if down_nb else BLOCK
        stacks = (("w_gate", w_gate, BLOCK), ("w_up", w_up, BLOCK), ("w_down", w_down, down_rows))
        d_gate, d_up, d_down = (weight_desc(n, w, r) for n, w, r in stacks) if tma else (None,) * 3
        _moe_gate_up_persistent[(min(g_gu, n_act * nb * ks_gu),)](
            xa, sxa, idx, *wargs, h8, hs, gu_part, cnt, d_gate, d_up, T, D, I, xa.stride(0), stride_sxm,
            w_gate.stride(0), s_gate.stride(0), s_gate.stride(1), ks_gu, S, num_stages=gate_up_stages or 4,
            X8=xq is not None, TMA=tma, **dict(kw, num_warps=wu, PDL=gu_pdl), **items, **fix)
        if down_nb:  # y itself, the shared slot and add included: no partials, no combine
            return down_nb_kernel(h8, hs, idx, rw, w_down, s_down, T, shared, out_dtype or x_TD.dtype, add=add,
                                  pdl=pdl, prefetch=prefetch, tile=down_tile, stages=down_stages, warps=wd,
                                  desc=d_down, pf_experts=down_pf_experts if gu_pdl == PDL_AFTER_WAIT else 0)
        part = torch.empty(ks_down, P, D, dtype=torch.float32, device=dev)
        _moe_down_persistent[(min(g_down, n_act * triton.cdiv(D, BLOCK) * ks_down),)](
            h8, hs, idx, rw, w_down, s_down, part, d_down, T, D, I, w_down.stride(0), s_down.stride(0),
            s_down.stride(1), ks_down, S, num_stages=down_stages or 5, TMA=tma, **dict(kw, num_warps=wd), **items)
    return _combine(part, idx, add, T, D, J, ks_down, out_dtype or x_TD.dtype, shared, pdl)


# the combine's channels per program and warps. 8 warps: 2.38 / 2.23 us at T = 1 / 4 on a TP=8 split rank's shape
# against 2.88 / 2.77 at 4 (H200, graph replays, `mtp.bench.small_kernels` combine, BENCHMARKS.md session 17)
COMBINE_BLOCK_D = 1024
COMBINE_WARPS = 8


def _combine(part: torch.Tensor, idx: torch.Tensor, add: torch.Tensor | None, T: int, D: int, J: int, ks: int,
             out_dtype: torch.dtype, shared: bool, pdl: bool, block_d: int = COMBINE_BLOCK_D,
             num_warps: int = COMBINE_WARPS) -> torch.Tensor:
    """y [T, D] = sum over slots (in order; the implicit shared slot J last when `shared`) and K slices of the
    per-pair partials part [ks, T * slots, D], + add. block_d / num_warps: a program's channels and warps (each
    channel's sum in the same order at any; for benchmarks, `mtp.bench.small_kernels`)."""
    y = torch.empty(T, D, dtype=out_dtype, device=part.device)
    topk = J + shared
    launch = pdl_kwargs(pdl, part)
    _moe_combine_kernel[(T, triton.cdiv(D, block_d))](part, idx, y if add is None else add, y, D, T * topk,
                                                      TOPK=topk, J=J, KS=ks, BLOCK_D=block_d, ADD=add is not None,
                                                      PDL=pdl_mode(pdl, launch), num_warps=num_warps, **launch)
    return y
