"""The MoE router in one launch (Triton): gate GEMV -> sigmoid -> + bias -> group top-2 sums -> top-k groups
-> top-k experts -> normalized weights x route_scale.

Reference: `mtp.kernels.moe.route_from_logits_ref` on the gate logits x_f32 . Wg^T (`moe_route_ref`), that is
the model's router `mtp.model.moe.route` (facts section 3). Shape legend: T tokens (<= 64), D hidden, E experts
(a power of two), NG groups, EG = E // NG, J = topk, S split-K slices, K = D padded to a power of two.

`moe.moe_route` takes two launches (the split gate GEMV, then a one-warp routing kernel per token; 7.9 us at
T = 1 on an H200, of which the GEMV alone is 3.0 us). Here the GEMV programs (E-blocks x K-slices, ~112, each
a 32 x 512 bf16 tile) store their partial logits, and the last program to arrive (an atomic counter, re-armed
by it: CUDA-graph safe) sums the slices in a fixed order (deterministic) and routes all T tokens at once on
[T, E] tensors whose rows each live in one warp, so the ~40 dependent reductions are warp shuffles.
Predicted: ~4-5 us at T = 1 (one launch, the GEMV's HBM time plus one L2 round trip for the partials and the
routing arithmetic), saving ~3-4 us per MoE layer. Measured (H200, TP=8 rank, BENCHMARKS.md): 11 us per layer:
the ~40 dependent reductions over [T, 256] run in one program of 4 warps, each a cross-warp round trip.

impl="grouped" splits that tail. An E-block holds whole groups (32 experts = one of DeepSeek's 8 groups); the
last slice of each E-block to arrive (a counter per E-block) sums its partials, takes sigmoid + bias, ranks each
expert within its group by comparing all EG x EG pairs at once (one reduction, not a loop of argmaxes), and
stores the group score (its two best) and the group's CPAD = min(8, EG) best candidates in order. The last
E-block to finish (one more counter) ranks the NG group scores against each other ([T, NG x CPAD, NG] compares)
and the kept groups' candidates (64 at E = 256: [T, 64, 64] compares), and picks the top-k by rank: about 8
reductions, mostly independent, instead of ~40 in a chain, and the group work runs on 8 SMs at once.
Compiled for sm_90 (SASS after the GEMV, per thread; BAR = a cross-warp round trip): serial, 4 warps: T = 1 /
4 / 8: 859 / 2655 / 5254 instructions, 96-100 BAR on one program; grouped, 8 warps (its default): block phase +
final phase 334 + 288 / 789 + 918 / 725 + 1736 instructions, 26 / 54 / 69 BAR (16 warps: 503 / 1144 / 1853,
26 / 40 / 53 BAR). Predicted: ~5-6 us per call at T = 1, ~6-7 us at T = 8 (the GEMV's ~3 us, two L2 round
trips, the rest), to be measured by `mtp.bench.fused`'s router section (4, 8 and 16 warps). Same logits, ids and
weights as the serial tail, bit for bit.

impl="one" (`FastPathOptions.router_one_tokens`, 8 by default; <= ONE_MAX_TOKENS tokens) drops split-K and the second
arrival: each of E / 2 programs (128) computes its 2 experts' whole dot over K (28 KB of the gate, loaded into registers
before the PDL wait: the step exposes none of it) for T tokens, and stores its logits [T, 2] to the [T, E] buffer it
returns (return_logits); one counter (re-armed by the last program), and the last program routes every token on the
[T, E] logits at once: in-group ranks from [T, EG, NG, EG] compares (the other expert first, so that it lies in
registers: the counts are sums in each thread), the group scores from ranks 0 and 1, the group ranks from [T, NG, NG]
compares, each group's CPAD best in order as [T, CPAD, NG, EG] selects (one expert per place: an integer sum of its
bits, a warp's REDUX), their ranks from [T, 64, 64] compares: a few independent reductions. Its logits are summed in
another fixed order (`_pair_tree` over k = i * CH + c at m = c * NCH + i, `one_logits_ref`): the same bits at any
warps, experts per program or tokens a pass, within fp32 rounding of the split-K sums; on equal logits the same ids.
Compiled for sm_90 at DeepSeek's shapes (PTX instructions per thread to the arrival + after it, and bar.sync in
each): 8 warps (ONE_WARPS), T = 1 / 2 / 4 / 8: 451 + 709 / 667 + 1336 / 1103 + 2526 / 1984 + 4503 instructions,
9 + 28 / 11 + 36 / 22 + 66 / 44 + 121 bar.sync (SASS 1048 / 1800 / 3200 / 6072, no spill; the GEMV's barriers are
its pair tree's 3 warp levels per pass of 2 tokens, the tail's mostly the layout changes around the [T, 64, 64]
compares); 4 warps: 781 + 1238 / 1189 + 2281 / 2016 + 4322 instructions, 6 + 39 / 12 + 57 / 24 + 78 bar.sync, and
spills at T = 8 (so does 8 warps at T = 16). Predicted (H200): alone at T = 1 ~5-7 us (launch ~1, the gate from
HBM ~1.6, the dots and tree ~0.6, one arrival ~0.7, the .cg reload ~0.5, the tail ~1.3, stores ~0.3) against
grouped's 8.5; at T = 4 ~8-9 us (the tail ~3.5 us: 2.5 K instructions and 66 barriers in one program) against
9.3. In the step (PDL: the gate already in registers) ~4 us exposed at T = 1 and ~6-7 us at T = 4, against
9.2 / 9.0 us measured for grouped (BENCHMARKS.md session 19): -0.25 to -0.3 ms a step at w = 1 over 58 MoE layers
(+ the MTP layers'), -0.1 to -0.15 ms at w = 4. Measured (H200, session 20, BENCHMARKS.md; `mtp-bench --tp 8
--kernel-variants router_one`, impl one up to 16 tokens, busy ms a step at 1k): -0.27 / -0.22 / +0.05 / -0.00 at
w = 1 / 2 / 3 / 4 (the tail's growth with T as predicted, the T = 1 gain as predicted); alone at T = 3 / 4 (8 warps,
`mtp.bench.fused --only router`) 10.9 / 11.0 us against grouped's 9.6 / 9.8. Hence session 20's default: up to 2
tokens (up to 8 since the split tail below).

impl "one" with split_tail (`FastPathOptions.router_one_split`, from 2 tokens by default since session 21) splits that
routing over tokens. The dots, the stores and the one arrival counter are as before; then the last P = min(T, programs)
programs to arrive route a token each (tokens slot, slot + P, ... where the grid has fewer programs than tokens), their
slot the count of arrivals after theirs (programs - 1 - ticket, the ticket being the add's old value): slot 0, whose
arrival completed the count, at once; every other once the counter shows every arrival (a spin on acquire loads of it,
which read from the chain of read-modify-writes holding every program's acq_rel arrival: each program's logits are
visible after it). Each routes its token's row of the [T, E] logits (.cg) with the one-token routing (`_one_tail` at one
row): the same dots, so the same logits, and per token the same arithmetic (compares, integer sums, sigmoid and bias
elementwise; the chosen weights' normalizing sum in the unsplit tail's layout, lanes then registers, checked on the
sm_90 build), so the same ids and weights bit for bit.

Re-arming (CUDA graphs replay with no memset): the counter reaches `programs` with the arrivals; each tail program but
slot 0 adds one as it leaves its spin (an atomic whose result nothing waits for); slot 0, done routing, waits for
those P - 1 and zeroes it. So it is zeroed only when no program of the call will read it again, it stays the one word
`_counters` hands out (a generation word, never zeroed, would need a buffer of its own), and slot 0, which starts
routing a poll ahead of the others, rarely waits at the end. Why the spin cannot hang without a cooperative launch:
the spinners are at most P <= ONE_MAX_TOKENS (16) programs, each past its dots and arrival; an SM is otherwise held by
programs still computing (they reach their arrival) or by other grids: the previous kernel's, which finish without
waiting on this one, and with PDL the next kernel's, which launch only once every program of this grid has run its
launch_dependents (`pdl_launch` / `pdl_wait`, before the arrival), that is once every program is resident. On an H100
or H200 the 128 programs (E = 256, 2 experts each) fit the 132 SMs at once; on any GPU of more than 16 SMs the
spinners alone cannot fill it. The Triton interpreter runs programs one after another, where a tail program would spin
for ever on programs after it: there (where P > 1) the kernel runs as two launches, PHASE 1 the dots and arrivals,
PHASE 2 the P tail programs (slot 0 last), the same code, whose spins find the counter complete; at P = 1 as the one
launch.

Compiled for sm_90 (8 warps, DeepSeek's shapes), PTX after the arrival: 761 instructions and 32 bar.sync at every T
(the one-token routing's 709 and 28, the two spins, the leaving add and the re-arm), against 709 + 28 / 2526 + 66 /
4503 + 121 unsplit at T = 1 / 4 / 8; SASS 1112 / 1768 / 2664 (unsplit 1048 / 3200 / 6072), registers 73 / 128 / 128
(71 / 128 / 248); no spill at T = 16 (the unsplit tail spills there); the dots the same PTX (7 address instructions
more at T >= 4). Predicted (H200): a fit of session 20's unsplit times (5.84 / 7.24 / 11.03 / 18.8 us at T = 1, 2, 4,
8) to their PTX counts, ~2.35 us + 0.56 ns an instruction + 77 ns a bar.sync (residuals <= 0.16 us), puts the unsplit
routing after the arrival at ~2.6 / 3.5 / 6.5 / 11.9 us (a fit without the barriers, 2.47 ns an instruction: ~1.8 /
3.3 / 6.2 / 11.1). Split, alone: at T = 3 and 4 ~7-8 us (the dots to the arrival ~4.5-4.8, one token's routing
~1.8-2.6, the spinners' extra poll ~0.5-1) against 10.9 / 11.0 unsplit and grouped's 9.6 / 9.8; at T = 8 ~10-10.5
(18.8; grouped 12.05); at T = 2 ~6.5-7.3 (7.24: little or no gain); at T = 1 the unsplit time (no spin at P = 1).
Nothing after the arrival is hidden by PDL, so the step gains what the call does: ~3-3.9 us per MoE layer at w = 3 and
4, ~5-6 us exposed against grouped's ~9 (impl one unsplit was measured level with grouped there), -0.17 to -0.23 ms a
step over 58 MoE layers (2.4-3.2% of the 7.07 ms w = 4 step), the same at the eagle k = 3 step's w = 4 verify.
Measured (H200, session 21, BENCHMARKS.md): alone 7.80 / 7.86 us at T = 3 / 4 (in the range), 10.09 at T = 8, 6.50 at
T = 2, 5.99 at T = 1 (unsplit 5.80); in the step (busy ms, 1k, against session 20's defaults) -0.03 / -0.08 / -0.16 at
w = 2 / 3 / 4: at w = 4 near the prediction, at w = 3 half of it.

Ties (equal biased scores, equal group scores): the lower index wins, at every step, as the stable
descending sort of `mtp.model.moe.route` gives. Group score = the two largest biased scores of the group (a
repeated maximum counts twice, as topk(2) of the values does).
"""

from __future__ import annotations

import torch

from mtp.model.fp8 import BLOCK
from mtp.kernels._triton import (
    interpreting, line_elems, pdl_kwargs, pdl_launch, pdl_mode, pdl_wait, prefetch_rows_l2, require, tl, triton,
)
from mtp.kernels.fp8_gemm import _counters
from mtp.kernels.moe import moe_route_ref, route_from_logits_ref
from mtp.kernels.topk_one_launch import _wait

__all__ = ["moe_route_fused", "moe_route_ref", "route_from_logits_ref", "MAX_TOKENS", "GROUPED_MAX_TOKENS",
           "ONE_MAX_TOKENS", "IMPLS", "SPLITK_IMPLS", "one_logits_ref", "one_takes"]

MAX_TOKENS = 64
GROUPED_MAX_TOKENS = 16  # the last program compares [T, NG x CPAD, NG x CPAD] candidates: 64 K at T = 16
IMPLS = ("serial", "grouped", "one")
SPLITK_IMPLS = ("serial", "grouped")  # the same split-K logits, ids and weights bit for bit
# impl "one" (`_route_one_kernel`): tokens (its last program compares [T, EG, NG, EG] in-group pairs: 128 K at T = 16,
# where it spills on sm_90); experts per program (128 programs at E = 256, 28 KB of the gate each at D = 7168);
# warps (sm_90 PTX at T = 1, 8 vs 4 warps: 451 vs 781 instructions to the arrival, 709 vs 1238 after it); the
# chunk of K (k = i * CH + c, CH = min(this, K padded to a power of two): it sets the logits' order, so it is fixed)
ONE_MAX_TOKENS = 16
ONE_BLOCK_E = 2
ONE_WARPS = 8
ONE_CHUNK = 2048


def one_logits_ref(x_TD: torch.Tensor, wg_ED: torch.Tensor, chunk: int = ONE_CHUNK) -> torch.Tensor:
    """impl "one"'s gate logits [T, E] fp32 in its order, plain PyTorch: the products x[t, k] * w[e, k] (fp32; exact
    for bf16 inputs, so FMAs change nothing) at m = c * NCH + i for k = i * CH + c, zeros past D up to K, a power
    of two; then adjacent pairs summed, level by level (`_pair_tree`). Bit for bit what the kernel returns."""
    T, D = x_TD.shape
    E = wg_ED.shape[0]
    K = 1 << (D - 1).bit_length()
    CH = min(K, chunk)
    p = torch.nn.functional.pad(x_TD.float()[:, None, :] * wg_ED.float()[None, :, :], (0, K - D))  # [T, E, K]
    p = p.view(T, E, K // CH, CH).transpose(2, 3).reshape(T, E, K)
    while p.shape[-1] > 1:
        p = p[..., 0::2] + p[..., 1::2]
    return p[..., 0]


def one_takes(tokens: int, n_experts: int, n_group: int, topk_group: int, topk: int) -> bool:
    """Whether impl "one" takes a call (as impl "grouped": each kept group gives at most topk candidates)."""
    return 1 <= tokens <= ONE_MAX_TOKENS and topk <= topk_group * (n_experts // n_group)


def one_tokens_per_pass(num_warps: int) -> int:
    """impl "one": the tokens of a pass over the gate rows (the same bits at any): the products [block_e, tokens, K]
    spread over the threads, ~64 fp32 registers each at K = 7168 (sm_90: no spill at T <= 8 with 8 warps and 2)."""
    return max(1, num_warps // 4)


@triton.jit
def _gate_slice(x_ptr, w_ptr, part_ptr, T, D, stride_xm, E: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
                GPS: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr, LINE: tl.constexpr,
                PREFETCH: tl.constexpr):
    """This program's share of the gate GEMV: its [BE, K-slice] of Wg against all T tokens, stored as fp32
    partial logits part[slice, t, e]. With PDL (and PREFETCH) its slice of Wg (constant) is asked of L2 before the
    wait, one request per LINE elements (128 bytes), so that the loads after it find it there (the same bits)."""
    pid_e = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_e = pid_e * BE + tl.arange(0, BE)
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, 128)
    tmask = offs_t < T
    w_ptrs = w_ptr + offs_e.to(tl.int64)[:, None] * D + offs_k[None, :]
    x_ptrs = x_ptr + offs_t[:, None] * stride_xm + offs_k[None, :]
    G = D // 128
    acc = tl.zeros((BE, BT), dtype=tl.float32)
    if PDL:  # x comes from the previous kernel; Wg's slice is requested while it finishes
        if PREFETCH:
            k0 = pid_s * GPS * 128
            prefetch_rows_l2(w_ptr + offs_e.to(tl.int64) * D + k0, tl.minimum(GPS * 128, D - k0), LINE)
    pdl_wait(PDL)
    for i in tl.static_range(GPS):  # unrolled: every tile of the slice requested at once
        g = pid_s * GPS + i
        gok = g < G
        w = tl.load(w_ptrs + g * 128, mask=gok, other=0.0)
        x = tl.load(x_ptrs + g * 128, mask=tmask[:, None] & gok, other=0.0)
        if BF16:  # bf16 x bf16 products are exact in fp32: tensor cores give the fp32 result
            acc += tl.dot(w, tl.trans(x))
        else:
            acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
    tl.store(part_ptr + pid_s * BT * E + offs_t[None, :] * E + offs_e[:, None], acc)


@triton.jit
def _store_routes(out_w, out_idx, w_out_ptr, idx_out_ptr, table_ptr, T, route_scale, e0, e1,
                  E: tl.constexpr, TOPK: tl.constexpr, KPAD: tl.constexpr, BTR: tl.constexpr, TABLE: tl.constexpr):
    """The chosen experts' scores [BTR, KPAD] (0 past TOPK) -> normalized weights x route_scale, and their ids
    as this rank sees them, stored for the T real tokens: e - e0 in [e0, e1), else -1; or (TABLE) table[e], the
    rank's global -> local table (-1: another rank's expert), one gather after the choice."""
    t2 = tl.arange(0, BTR)
    ki = tl.arange(0, KPAD)
    out_w = out_w / tl.sum(out_w, 1)[:, None] * route_scale
    omask = (t2 < T)[:, None] & (ki < TOPK)[None, :]
    if TABLE:  # this rank's view of scattered experts ('interleaved', 'permuted')
        out_idx = tl.load(table_ptr + out_idx, mask=omask & (out_idx >= 0) & (out_idx < E), other=-1)
    else:  # a range (contiguous; [0, E) for a rank holding every expert): arithmetic, no load
        out_idx = tl.where((out_idx >= e0) & (out_idx < e1), out_idx - e0, -1)
    tl.store(w_out_ptr + t2[:, None] * TOPK + ki[None, :], out_w, mask=omask)
    tl.store(idx_out_ptr + t2[:, None] * TOPK + ki[None, :], out_idx, mask=omask)


@triton.jit
def _route_fused_kernel(x_ptr, w_ptr, bias_ptr, part_ptr, cnt_ptr, w_out_ptr, idx_out_ptr, logits_ptr, table_ptr,
                        T, D, stride_xm, route_scale, e0, e1,
                        E: tl.constexpr, NG: tl.constexpr, TOPK_GROUP: tl.constexpr, TOPK: tl.constexpr,
                        KPAD: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr, BTR: tl.constexpr,
                        GPS: tl.constexpr, SPLITS: tl.constexpr,
                        BF16: tl.constexpr, STORE_LOGITS: tl.constexpr, PDL: tl.constexpr, TABLE: tl.constexpr,
                        LINE: tl.constexpr, PREFETCH: tl.constexpr):
    pdl_launch(PDL)
    _gate_slice(x_ptr, w_ptr, part_ptr, T, D, stride_xm, E, BE, BT, GPS, BF16, PDL, LINE, PREFETCH)
    tl.debug_barrier()
    n_prog = tl.num_programs(0) * tl.num_programs(1)
    arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == n_prog - 1:
        # ---- the last program: sum the slices in slice order, then route every token (one row each)
        e = tl.arange(0, E)
        t2 = tl.arange(0, BTR)
        logit = tl.zeros((BTR, E), dtype=tl.float32)
        for s in tl.static_range(SPLITS):  # unrolled: the loads are independent, issued together
            logit += tl.load(part_ptr + s * BT * E + t2[:, None] * E + e[None, :], cache_modifier=".cg")
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
        if STORE_LOGITS:
            tl.store(logits_ptr + t2[:, None] * E + e[None, :], logit, mask=(t2 < T)[:, None])
        score = tl.sigmoid(logit)
        b = score + tl.load(bias_ptr + e)[None, :]
        EG: tl.constexpr = E // NG
        b3 = tl.reshape(b, (BTR, NG, EG))
        eg = tl.arange(0, EG)
        m1 = tl.max(b3, 2)
        first = tl.min(tl.where(b3 == m1[:, :, None], eg[None, None, :], EG), 2)
        m2 = tl.max(tl.where(eg[None, None, :] == first[:, :, None], float("-inf"), b3), 2)
        gscore = m1 + m2  # [BT, NG]
        gi = tl.arange(0, NG)
        keep_g = tl.zeros((BTR, NG), dtype=tl.int32)
        for i in tl.static_range(TOPK_GROUP):
            mx = tl.max(gscore, 1)
            sel = tl.min(tl.where(gscore == mx[:, None], gi[None, :], NG), 1)
            hit = gi[None, :] == sel[:, None]
            keep_g = tl.where(hit, 1, keep_g)
            gscore = tl.where(hit, float("-inf"), gscore)
        keep = tl.reshape(tl.broadcast_to(keep_g[:, :, None], (BTR, NG, EG)), (BTR, E)) != 0
        bm = tl.where(keep, b, float("-inf"))
        ki = tl.arange(0, KPAD)
        out_idx = tl.zeros((BTR, KPAD), dtype=tl.int32)
        out_w = tl.zeros((BTR, KPAD), dtype=tl.float32)
        for i in tl.static_range(TOPK):
            mx = tl.max(bm, 1)
            sel = tl.min(tl.where(bm == mx[:, None], e[None, :], E), 1)
            hit = e[None, :] == sel[:, None]
            out_idx = tl.where(ki[None, :] == i, sel[:, None], out_idx)
            out_w = tl.where(ki[None, :] == i, tl.sum(tl.where(hit, score, 0.0), 1)[:, None], out_w)
            bm = tl.where(hit, float("-inf"), bm)
        _store_routes(out_w, out_idx, w_out_ptr, idx_out_ptr, table_ptr, T, route_scale, e0, e1, E, TOPK, KPAD, BTR,
                      TABLE)


@triton.jit
def _ahead(v, i, v_other, i_other):
    """Whether the other entry sorts before this one in a stable descending sort: a larger value, or an equal
    value at a lower index."""
    return (v_other > v) | ((v_other == v) & (i_other < i))


@triton.jit
def _route_grouped_kernel(x_ptr, w_ptr, bias_ptr, part_ptr, gs_ptr, cv_ptr, cs_ptr, ci_ptr, cnt_ptr,
                          w_out_ptr, idx_out_ptr, logits_ptr, table_ptr, T, D, stride_xm, route_scale, e0, e1,
                          E: tl.constexpr, NG: tl.constexpr, TOPK_GROUP: tl.constexpr, TOPK: tl.constexpr,
                          KPAD: tl.constexpr, CPAD: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
                          BTR: tl.constexpr, GPS: tl.constexpr, SPLITS: tl.constexpr,
                          BF16: tl.constexpr, STORE_LOGITS: tl.constexpr, PDL: tl.constexpr, TABLE: tl.constexpr,
                          LINE: tl.constexpr, PREFETCH: tl.constexpr):
    pdl_launch(PDL)
    _gate_slice(x_ptr, w_ptr, part_ptr, T, D, stride_xm, E, BE, BT, GPS, BF16, PDL, LINE, PREFETCH)
    tl.debug_barrier()
    pid_e = tl.program_id(0)
    nbe = tl.num_programs(0)
    arrived = tl.atomic_add(cnt_ptr + pid_e, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLITS - 1:
        # ---- the last slice of this E-block: its GPB whole groups, one [EG] row per (token, group)
        EG: tl.constexpr = E // NG
        GPB: tl.constexpr = BE // EG
        R: tl.constexpr = BTR * GPB
        r = tl.arange(0, R)
        j = tl.arange(0, EG)
        t = r // GPB
        g = pid_e * GPB + r % GPB
        e = g[:, None] * EG + j[None, :]  # [R, EG] expert ids
        offs = t[:, None] * E + e
        logit = tl.zeros((R, EG), dtype=tl.float32)
        for s in tl.static_range(SPLITS):  # slice order: the serial tail's sums, bit for bit
            logit += tl.load(part_ptr + s * BT * E + offs, cache_modifier=".cg")
        tl.atomic_xchg(cnt_ptr + pid_e, 0, sem="relaxed", scope="gpu")
        if STORE_LOGITS:
            tl.store(logits_ptr + offs, logit, mask=(t < T)[:, None])
        score = tl.sigmoid(logit)
        b = score + tl.load(bias_ptr + e)
        # each expert's place in its group, biased score descending, lower index first among equals (a stable
        # descending sort): all EG x EG comparisons at once, one reduction instead of a loop of argmaxes
        rank = tl.sum(_ahead(b[:, :, None], j[None, :, None], b[:, None, :], j[None, None, :]).to(tl.int32), 2)
        gscore = tl.max(tl.where(rank == 0, b, float("-inf")), 1) + tl.max(tl.where(rank == 1, b, float("-inf")), 1)
        tl.store(gs_ptr + t * NG + g, gscore)
        # the group's CPAD best, in order: no group adds more than TOPK experts to the final choice
        c = tl.arange(0, CPAD)
        hit = rank[:, :, None] == c[None, None, :]  # [R, EG, CPAD]
        coffs = (t * NG + g)[:, None] * CPAD + c[None, :]
        tl.store(cv_ptr + coffs, tl.max(tl.where(hit, b[:, :, None], float("-inf")), 1))
        tl.store(cs_ptr + coffs, tl.max(tl.where(hit, score[:, :, None], float("-inf")), 1))
        tl.store(ci_ptr + coffs, tl.max(tl.where(hit, e[:, :, None], -1), 1))
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + nbe, 1, sem="acq_rel", scope="gpu")
        if done == nbe - 1:
            # ---- the last E-block: rank the NG group scores, then the kept groups' NG x CPAD candidates
            NC: tl.constexpr = NG * CPAD
            tt = tl.arange(0, BTR)
            q = tl.arange(0, NC)
            h = tl.arange(0, NG)
            cg = q // CPAD  # each candidate's group
            gs = tl.load(gs_ptr + tt[:, None] * NG + h[None, :], cache_modifier=".cg")  # [BTR, NG]
            gq = tl.load(gs_ptr + tt[:, None] * NG + cg[None, :], cache_modifier=".cg")  # [BTR, NC]
            gahead = _ahead(gq[:, :, None], cg[None, :, None], gs[:, None, :], h[None, None, :])
            keep = tl.sum(gahead.to(tl.int32), 2) < TOPK_GROUP  # [BTR, NC]: the candidate's group is kept
            qoffs = tt[:, None] * NC + q[None, :]
            v = tl.where(keep, tl.load(cv_ptr + qoffs, cache_modifier=".cg"), float("-inf"))
            sc = tl.load(cs_ptr + qoffs, cache_modifier=".cg")
            ci = tl.load(ci_ptr + qoffs, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + nbe, 0, sem="relaxed", scope="gpu")
            cahead = _ahead(v[:, :, None], ci[:, :, None], v[:, None, :], ci[:, None, :])
            crank = tl.sum(cahead.to(tl.int32), 2)  # [BTR, NC]: place among all candidates (ids are unique)
            ki = tl.arange(0, KPAD)
            pick = (crank[:, :, None] == ki[None, None, :]) & (ki < TOPK)[None, None, :]  # [BTR, NC, KPAD]
            out_idx = tl.max(tl.where(pick, ci[:, :, None], -1), 1)
            out_w = tl.sum(tl.where(pick, sc[:, :, None], 0.0), 1)  # one term per slot: exact
            _store_routes(out_w, out_idx, w_out_ptr, idx_out_ptr, table_ptr, T, route_scale, e0, e1, E, TOPK, KPAD,
                          BTR, TABLE)


@triton.jit
def _pair_tree(v, R: tl.constexpr, LOG2N: tl.constexpr):
    """[R, 2 ** LOG2N] -> [R]: adjacent pairs summed, level by level ((v0 + v1) + (v2 + v3)) + ...: a fixed order
    whatever the layout (a sum of two terms is the same either way round), so the result depends on the values
    only, never on the warps, the tile or the grid."""
    for _ in tl.static_range(LOG2N):
        v = tl.sum(tl.reshape(v, (R, v.shape[1] // 2, 2)), 2)
    return tl.reshape(v, (R,))


@triton.jit
def _one_tail(lg_ptr, cnt_ptr, bias_ptr, w_out_ptr, idx_out_ptr, table_ptr, T, route_scale, e0, e1,
              E: tl.constexpr, NG: tl.constexpr, TOPK_GROUP: tl.constexpr, TOPK: tl.constexpr, KPAD: tl.constexpr,
              CPAD: tl.constexpr, BTR: tl.constexpr, TABLE: tl.constexpr, REARM: tl.constexpr):
    """impl "one"'s routing of the rows 0..BTR-1 (the real ones: < T) of the [., E] logits at lg_ptr, by ranks (all
    pairs compared at once: a few independent reductions, not a chain of argmaxes), stored at w_out_ptr / idx_out_ptr;
    REARM: the arrival counter zeroed once the logits are loaded. Every row's arithmetic is its own: one row (the split
    tail's program) or BTR at once give it the same bits."""
    EG: tl.constexpr = E // NG
    t = tl.arange(0, BTR)[:, None, None]
    j = tl.arange(0, EG)
    h = tl.arange(0, NG)
    offs = t * E + (h[:, None] * EG + j[None, :])[None, :, :]  # [T, NG, EG]
    logit = tl.load(lg_ptr + offs, mask=t < T, other=0.0, cache_modifier=".cg")
    if REARM:
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
    score = tl.sigmoid(logit)
    b = score + tl.load(bias_ptr + offs - t * E)  # the bias in the logits' layout: no shuffle
    # each expert's place in its group (biased score descending, lower index first): [T, EG, NG, EG] compares,
    # the other expert k ahead of the group, so that k falls to registers (the last dim to lanes, the group to
    # warps) and the count is a sum in each thread
    bk = tl.permute(b, (0, 2, 1))  # [T, EG, NG]
    rank = tl.sum(_ahead(b[:, None, :, :], j[None, None, None, :], bk[:, :, :, None],
                         j[None, :, None, None]).to(tl.int32), 1)
    gs = tl.max(tl.where(rank == 0, b, float("-inf")), 2) + tl.max(tl.where(rank == 1, b, float("-inf")), 2)
    # each group's place among the groups: [T, NG, NG] compares; the TOPK_GROUP first are kept
    grank = tl.sum(_ahead(gs[:, :, None], h[None, :, None], gs[:, None, :], h[None, None, :]).to(tl.int32), 2)
    # each group's CPAD best in order (no group gives more than TOPK to the choice): [T, CPAD, NG, EG] selects in
    # the compares' layout; one expert holds each place, so an integer sum of its bits (a warp's REDUX) is it
    cp = tl.arange(0, CPAD)
    hit = rank[:, None, :, :] == cp[None, :, None, None]
    cv = tl.sum(tl.where(hit, b.to(tl.int32, bitcast=True)[:, None, :, :], 0), 3).to(tl.float32, bitcast=True)
    sc = tl.sum(tl.where(hit, score.to(tl.int32, bitcast=True)[:, None, :, :], 0), 3).to(tl.float32, bitcast=True)
    ci = tl.sum(tl.where(hit, (h[:, None] * EG + j[None, :])[None, None, :, :], 0), 3)  # [T, CPAD, NG]
    # a kept group's as they are, another's at -inf
    cv = tl.where((grank < TOPK_GROUP)[:, None, :], cv, float("-inf"))
    NC: tl.constexpr = NG * CPAD
    v = tl.reshape(cv, (BTR, NC))
    sc = tl.reshape(sc, (BTR, NC))
    ci = tl.reshape(ci, (BTR, NC))
    # each candidate's place among all NG x CPAD (ids are unique): [T, NC, NC] compares; the TOPK first chosen
    crank = tl.sum(_ahead(v[:, :, None], ci[:, :, None], v[:, None, :], ci[:, None, :]).to(tl.int32), 2)
    ki = tl.arange(0, KPAD)
    pick = (crank[:, :, None] == ki[None, None, :]) & (ki < TOPK)[None, None, :]  # [T, NC, KPAD]
    out_idx = tl.max(tl.where(pick, ci[:, :, None], -1), 1)
    out_w = tl.sum(tl.where(pick, sc[:, :, None], 0.0), 1)  # one term per slot: exact
    _store_routes(out_w, out_idx, w_out_ptr, idx_out_ptr, table_ptr, T, route_scale, e0, e1, E, TOPK, KPAD, BTR,
                  TABLE)


@triton.jit
def _route_one_kernel(x_ptr, w_ptr, bias_ptr, lg_ptr, cnt_ptr, w_out_ptr, idx_out_ptr, table_ptr,
                      T, D, stride_xm, route_scale, e0, e1,
                      E: tl.constexpr, NG: tl.constexpr, TOPK_GROUP: tl.constexpr, TOPK: tl.constexpr,
                      KPAD: tl.constexpr, CPAD: tl.constexpr, EPB: tl.constexpr, BTR: tl.constexpr,
                      TB: tl.constexpr, CH: tl.constexpr, NCH: tl.constexpr, LOG2K: tl.constexpr,
                      PDL: tl.constexpr, TABLE: tl.constexpr, SPLIT: tl.constexpr, PHASE: tl.constexpr):
    """SPLIT off: the last program to arrive routes every token. SPLIT: the last P = min(T, programs) to arrive route
    the tokens, one each (tokens slot, slot + P, ... where fewer programs than tokens), the program whose arrival was
    the last (slot 0) at once, each other one (slot = its place from the end) once the counter shows every arrival.
    PHASE 0: one launch; the interpreter's two launches (it runs programs one after another: a tail program would
    wait for ever on those after it): 1, the dots and the arrivals only; 2, the P tail programs only (slot 0 last)."""
    if PHASE < 2:
        pdl_launch(PDL)
        # ---- this program's EPB experts, the whole K: logit[e, t] = the pair tree over m = c * NCH + i of
        # w[e, k] * x[t, k], k = i * CH + c (0 past D); the tile is loaded before the wait (a constant: PDL's contract)
        pid = tl.program_id(0)
        offs_e = pid * EPB + tl.arange(0, EPB)
        c = tl.arange(0, CH)
        i = tl.arange(0, NCH)
        k = i[None, :] * CH + c[:, None]  # [CH, NCH]
        kmask = k < D
        w = tl.load(w_ptr + offs_e.to(tl.int64)[:, None, None] * D + k[None, :, :], mask=kmask[None, :, :], other=0.0)
        wf = tl.reshape(w.to(tl.float32), (EPB, 1, CH * NCH))
        pdl_wait(PDL)
        for t0 in tl.static_range(0, BTR, TB):  # TB tokens a pass: the products' registers bounded, the same bits
            if t0 < T:  # at any TB; no pass for padding
                tt = t0 + tl.arange(0, TB)
                tmask = tt < T
                x = tl.load(x_ptr + tt[:, None, None] * stride_xm + k[None, :, :],
                            mask=tmask[:, None, None] & kmask[None], other=0.0)
                p = wf * tl.reshape(x.to(tl.float32), (1, TB, CH * NCH))  # bf16 x bf16: exact in fp32 (an FMA or not)
                dots = tl.reshape(_pair_tree(tl.reshape(p, (EPB * TB, CH * NCH)), EPB * TB, LOG2K), (EPB, TB))
                tl.store(lg_ptr + tt[None, :] * E + offs_e[:, None], dots, mask=tmask[None, :])
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if not SPLIT:
        if arrived == tl.num_programs(0) - 1:  # ---- the last program: every token's routing on the [T, E] logits
            _one_tail(lg_ptr, cnt_ptr, bias_ptr, w_out_ptr, idx_out_ptr, table_ptr, T, route_scale, e0, e1, E, NG,
                      TOPK_GROUP, TOPK, KPAD, CPAD, BTR, TABLE, True)
    elif PHASE != 1:
        # ---- the split tail. The counter goes to NPROG (every arrival), then each tail program but slot 0 adds one
        # as it leaves its wait, and slot 0, done routing, waits for those P - 1 and zeroes it: it is zeroed only when
        # no program will read it again this call (CUDA-graph safe), and slot 0, ahead of the others by their wait,
        # rarely waits itself; none of the others waits for an atomic's result after its routing
        NPROG: tl.constexpr = E // EPB
        P = tl.minimum(T, NPROG)
        if PHASE == 2:
            slot = P - 1 - tl.program_id(0)
        else:
            slot = NPROG - 1 - arrived
        if (slot >= 0) & (slot < P):  # >= 0: a counter left armed by a failed launch routes nothing out of bounds
            if slot > 0:
                _wait(cnt_ptr, NPROG)  # acquire: every program's logits are visible after it
                tl.atomic_add(cnt_ptr, 1, sem="relaxed", scope="gpu")  # left the wait (no result: nothing waits on it)
            for tok in range(slot, T, P):
                _one_tail(lg_ptr + tok * E, cnt_ptr, bias_ptr, w_out_ptr + tok * TOPK, idx_out_ptr + tok * TOPK,
                          table_ptr, T - tok, route_scale, e0, e1, E, NG, TOPK_GROUP, TOPK, KPAD, CPAD, 1, TABLE,
                          False)
            if slot == 0:
                if P > 1:
                    _wait(cnt_ptr, NPROG + P - 1)
                tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")


def moe_route_fused(x_TD: torch.Tensor, wg_ED: torch.Tensor, bias_E: torch.Tensor, n_group: int = 8,
                    topk_group: int = 4, topk: int = 8, route_scale: float = 2.5, return_logits: bool = False,
                    block_e: int | None = None, splits: int | None = None,
                    local: tuple[int, int] | torch.Tensor | None = None, pdl: bool = False, impl: str = "auto",
                    num_warps: int | None = None, prefetch: bool = True, tokens_per_pass: int | None = None,
                    split_tail: bool = False):
    """Kernel twin of `moe_route_ref` in one launch: (weights [T, J] fp32, idx [T, J] int32), plus the fp32
    gate logits [T, E] the choice was made on when return_logits (for tests: `route_from_logits_ref` on them
    must choose the same experts exactly). local = (e0, e1): return ids as an expert-parallel rank holding
    experts [e0, e1) sees them: e - e0, or -1 for an expert on another rank (no separate mapping launches); or
    local = an int32 table [E] on x's device (`dispatch.expert_map`: a rank holding scattered experts): table[e],
    -1 where e is on another rank, gathered in the same launch (a kernel variant: the range's code is unchanged).
    pdl: programmatic dependent launch (`_triton.pdl_kwargs`), each program's slice of the gate weight asked of L2
    before the wait; prefetch False (`FastPathOptions.prefetch_at`) compiles that prefetch out (the same
    bits). impl: "serial" (the last program routes on [T, E]) or "grouped" (each E-block's last slice ranks its
    groups, the last block merges; <= GROUPED_MAX_TOKENS tokens, topk <= topk_group x E / n_group); both give the
    same logits, ids and weights bit for bit. "one" (<= ONE_MAX_TOKENS tokens, the same topk limit): no split-K,
    block_e experts' whole dot per program (2 by default: 128 programs at E = 256), its gate rows loaded before
    the PDL wait (not a prefetch: `prefetch` does not apply), tokens_per_pass tokens a pass (`one_tokens_per_pass`
    by warps by default; the same bits at any); logits in another fixed order (`_pair_tree`), the same choice
    on them as the others' on theirs.
    split_tail (impl "one" only): its routing split over its last min(T, E / block_e) programs to arrive, one token
    each, instead of every token in the last one (the module docstring); the same logits, ids and weights bit for bit.
    block_e: experts per program (split-K impls: 32, "grouped" at least a group). num_warps: default 4 (serial,
    and grouped chosen by "auto") / 8 (grouped: its rank comparisons spread over more threads) / ONE_WARPS (one).
    impl "auto" (default): the faster of serial and grouped at T tokens as measured on an H200."""
    require(x_TD, "moe_route_fused")
    if impl not in IMPLS + ("auto",):
        raise ValueError(f"moe_route_fused: impl must be 'auto' or one of {IMPLS}, got {impl!r}")
    T, D = x_TD.shape
    E = wg_ED.shape[0]
    one = impl == "one"
    if split_tail and not one:
        raise ValueError(f"moe_route_fused: split_tail is impl 'one''s, got impl={impl!r}")
    block_e = min(block_e or (ONE_BLOCK_E if one else 32), E)
    if wg_ED.shape[1] != D or bias_E.shape != (E,):
        raise ValueError(f"moe_route_fused: gate weight must be [E, {D}] and bias [E], got {list(wg_ED.shape)}, "
                         f"{list(bias_E.shape)}")
    if E & (E - 1) or E % n_group or E // n_group < 2 or topk > E or topk_group > n_group or E % block_e:
        raise ValueError(f"moe_route_fused: E = {E} must be a power of two divisible by n_group = {n_group} "
                         f"(>= 2 per group) and by block_e = {block_e}; topk {topk} <= E, topk_group {topk_group} "
                         f"<= n_group")
    if not 1 <= T <= MAX_TOKENS:
        raise ValueError(f"moe_route_fused: 1..{MAX_TOKENS} tokens, got {T}")
    if D % BLOCK:
        raise ValueError(f"moe_route_fused: D = {D} must be a multiple of {BLOCK}")
    EG = E // n_group
    if impl == "auto":
        # H200, E = 256, D = 7168, graph replays (BENCHMARKS.md, session 4): grouped with 4 warps 8.5 / 9.6 / 9.3 /
        # 12.4 / 12.2 us at T = 1 / 3 / 4 / 5 / 8 vs serial 9.7 / 11.0 / 10.9 / 12.9 / 13.0; at T = 2 serial
        # (9.7 vs 11.1)
        impl = "grouped" if T <= GROUPED_MAX_TOKENS and T != 2 and topk <= topk_group * EG else "serial"
        num_warps = num_warps or 4
    grouped = impl == "grouped"
    if grouped or one:
        limit = GROUPED_MAX_TOKENS if grouped else ONE_MAX_TOKENS
        if T > limit:
            raise ValueError(f"moe_route_fused: impl={impl!r} takes 1..{limit} tokens, got {T} (use impl='serial')")
        if topk > topk_group * EG:
            raise ValueError(f"moe_route_fused: impl={impl!r} needs topk {topk} <= topk_group {topk_group} x "
                             f"{EG} experts per group")
    if grouped:
        block_e = max(block_e, EG)  # an E-block holds whole groups
    btr = triton.next_power_of_2(T)
    dev = x_TD.device
    w = torch.empty(T, topk, dtype=torch.float32, device=dev)
    idx = torch.empty(T, topk, dtype=torch.int32, device=dev)
    x = x_TD if x_TD.stride(-1) == 1 else x_TD.contiguous()
    launch = pdl_kwargs(pdl, x)
    table = isinstance(local, torch.Tensor)
    if table:
        if local.shape != (E,) or local.dtype != torch.int32 or local.device != dev or not local.is_contiguous():
            raise ValueError(f"moe_route_fused: a local expert table must be a contiguous int32 [{E}] on {dev}, got "
                             f"{local.dtype} {list(local.shape)} on {local.device}")
        e0, e1 = 0, E
    else:
        e0, e1 = local if local is not None else (0, E)
        if not 0 <= e0 <= e1 <= E:
            raise ValueError(f"moe_route_fused: local expert range must lie in [0, {E}], got {local}")
    routing = dict(E=E, NG=n_group, TOPK_GROUP=topk_group, TOPK=topk, KPAD=triton.next_power_of_2(topk), BTR=btr,
                   PDL=pdl_mode(pdl, launch), TABLE=table, **launch)
    args = (T, D, x.stride(0), float(route_scale), e0, e1)
    tab = local if table else idx  # the table, or any pointer the range's code never reads
    wg, bias = wg_ED.contiguous(), bias_E.float().contiguous()
    cpad = min(triton.next_power_of_2(topk), EG)  # candidates kept per group (grouped, one)
    if one:
        num_warps = num_warps or ONE_WARPS
        tb = tokens_per_pass or one_tokens_per_pass(num_warps)
        if tb < 1 or tb & (tb - 1):
            raise ValueError(f"moe_route_fused: tokens_per_pass must be a power of two, got {tb}")
        tb = min(btr, tb)
        kp = triton.next_power_of_2(D)
        ch = min(kp, ONE_CHUNK)
        logits = torch.empty(T, E, dtype=torch.float32, device=dev)  # the programs' results, returned as they are
        n_prog = E // block_e
        one_args = (x, wg, bias, logits, _counters(dev, 1), w, idx, tab, *args)
        meta = dict(CPAD=cpad, EPB=block_e, TB=tb, CH=ch, NCH=kp // ch, LOG2K=kp.bit_length() - 1, SPLIT=split_tail,
                    num_warps=num_warps, **routing)
        if split_tail and interpreting() and min(T, n_prog) > 1:  # a tail program would wait on later ones for ever
            _route_one_kernel[(n_prog,)](*one_args, PHASE=1, **meta)
            _route_one_kernel[(min(T, n_prog),)](*one_args, PHASE=2, **meta)
        else:
            _route_one_kernel[(n_prog,)](*one_args, PHASE=0, **meta)
        return (w, idx, logits) if return_logits else (w, idx)
    G = D // BLOCK
    nbe = E // block_e
    # ~112 programs (<= 1 per SM), each >= 2 groups; fewer slices = a shorter fix-up
    splits = splits or max(1, min(G // 2, triton.cdiv(112, nbe)))
    gps = triton.cdiv(G, splits)
    splits = triton.cdiv(G, gps)
    bt = max(16, btr)
    part = torch.empty(splits, bt, E, dtype=torch.float32, device=dev)
    logits = torch.empty(T, E, dtype=torch.float32, device=dev) if return_logits else w
    bf16 = x.dtype == torch.bfloat16 and wg_ED.dtype == torch.bfloat16
    common = dict(BE=block_e, BT=bt, GPS=gps, SPLITS=splits, BF16=bf16, STORE_LOGITS=return_logits,
                  PREFETCH=bool(launch) and prefetch, LINE=line_elems(wg_ED), num_warps=num_warps or (8 if grouped else 4),
                  **routing)
    if grouped:
        gs = torch.empty(btr, n_group, dtype=torch.float32, device=dev)
        cand = torch.empty(2, btr, n_group, cpad, dtype=torch.float32, device=dev)
        cand_id = torch.empty(btr, n_group, cpad, dtype=torch.int32, device=dev)
        _route_grouped_kernel[(nbe, splits)](x, wg, bias, part, gs, cand[0], cand[1], cand_id,
                                             _counters(dev, nbe + 1), w, idx, logits, tab, *args, CPAD=cpad, **common)
    else:
        _route_fused_kernel[(nbe, splits)](x, wg, bias, part, _counters(dev, 1), w, idx, logits, tab, *args, **common)
    return (w, idx, logits) if return_logits else (w, idx)
