"""The experts' down projection by output block, every expert of the call in one pipelined loop:
`moe.moe_experts(down_nb=True)` (switch `FastPathOptions.moe_down_nb`), persistent layout.

Names and shapes as in `mtp.kernels.moe` (P = T * TOPK flat pairs padded to PPAD, TOPK = J + the implicit shared
slot); here BN output rows (of D) per program, GI = I / 128 K groups of the down projection, A distinct experts of
the call (routed + the shared slot's), TP = max(16, next_pow2(T)) token columns of the dot.

Why (issue 25; BENCHMARKS.md session 19, one TP=8 'split' rank, H200, w = 4): `moe._moe_down_persistent` costs 29.4 us
a layer where its weight tiles stream alone in 18.7 (`mtp.bench.weight_reads`). Its work items (expert, 128-row
block, K slice) are 2-group K loops at I = 256 whose loads cannot be pipelined across items, each followed by an
epilogue (scales, route weight, a masked [128, T] fp32 store of a partial), and `moe._moe_combine_kernel` (one launch
more, ~2 us a layer) sums the partials. Session 14's flattened (item, group) loop (branch `downflat`) kept the
per-item values in registers and paid ~18 barriers an iteration extracting them (tl.sum(tl.where(...))).

Here a program owns BN rows of y for every token and loops over the A experts' GI groups, GU (1 or 2) groups an
iteration, in one `for` loop that Triton's pipeliner multi-buffers across expert boundaries: acc [BN, TP] += dot(W_e[
rows, group g], h^T) * cs[None, :], with h's row t the h8 row of the pair that routed token t to e (zeros where none)
and cs[t] = h's scale x the weight's block scale x the route weight (0 where none, so that column adds an exact 0).
Then y[t, rows] = acc (+ add) is stored: no partial buffer, no combine launch. Everything an iteration needs is a
load whose address is affine in i (the expert id, the token slots, the column scales) or depends on one such load
(the weight tile on the id, the h tile on the slots): a plan in global memory, which each program builds before its
loop (`_plan`):
- elist [A]: the distinct experts by ascending id (the shared expert S = E - 1 then last: y = routed + shared, as the
  reference orders it);
- slots [A, TP]: per (expert, token) the flat pair (its h8 row), or -1;
- cs [A * GI, TP]: per (expert, group, token) hs x s_down[e, this block's 128-row scale block, g] x route weight
  (the shared slot's weight 1.0), or 0.
Who builds it: every program, redundantly, from the router's ids and weights and gate/up's h scales (a few [PPAD,
PPAD] compares, as `moe._leader_pairs`), into a scratch of its own that it reads back after a barrier (a CTA's
global writes are visible to its own threads after bar.sync). Not the gate/up kernel once for all: cs holds h's
scales, which gate/up's last-arriving K slices write in different programs with no grid-wide point after all of
them, and the weight's block scale, which differs per output block; a shared plan would leave both scales to
per-iteration loads, and would tie the two kernels to one buffer format. The price is the plan on every program's
critical path after the wait: the ids' load, the down scales' load that depends on them, stores and two barriers
(predicted ~1 us a call more than a plan read from L2). Where gate/up lets this kernel launch only after gate/up's own
wait (the router has completed then), option `FastPathOptions.moe_down_pf_experts` (`down_nb(pf_experts=)`) reads the
ids, route weights and down scales and ranks the experts before this kernel's wait (`_plan_ids`, `_plan_ranks`), and
asks L2 for the program's rows of its loop's first experts there (`_prefetch_routed`): after the wait remain h's
scales, the stores and the barriers. The same plan, the same bits.

Session 15 measured a kernel of this grid slower (`moe_down_fused`, branch `moedown2`: a program per 64 rows, one
loop over the call's (pair, K group) iterations, 4 x 8 KB tiles ahead, the combine's sum order; the experts 86.5 vs
76.6 us at T = 4). Here: one iteration per distinct expert at I = 256 (GU = 2: half the trips, each with the loop's
fixed cost), the column scales precomputed (no scale load after a wgmma's wait), and 5 x 16 KB of weight ahead per
program (`DEFAULT_STAGES`): session 19's probe streamed the down tiles in 18.6 us with 64 KB ahead per SM, 25.7 with 48.

Pipelining (sm_90, triton 3.6): the expert id and the token slots are indirection loads (they feed the weight's and
h's addresses), which the pipeliner issues as cp.async a stage ahead of the tiles that depend on them; the column
scales feed no dot and no address, so a load of them in their iteration would be left there, after the previous
wgmma's wait (a round trip per iteration, as `moe_items` found of the item loop's scales): they are loaded one
iteration ahead instead (not further: a value carried over two iterations makes triton 3.6's pipeliner drop the
loop, `moe_items`). The indirection costs half the stages: num_stages S gives (S + 1) // 2 buffers. Compiled at a
TP=8 split rank's shapes (tests/kernels/test_moe_down_nb.py): one loop, no nested one; per iteration 2 bar.sync with
cp.async tiles (3 with TMA at one group, 4 at two), 264 SASS instructions at BN = 64 and two groups (cp.async; 212-253
by TMA), 168 at one group; no spills; 123 KB of shared memory at the default 11 stages.

Predicted (to be measured: `python -m mtp.bench.topk_moe --only moe_down_nb`; before: BENCHMARKS.md sessions 12-19,
H200, exposed per MoE layer): at T = 4, down 29.4 + combine ~2.2 = ~31.6 us before; after, 33 experts x 7168 x 256
bytes = 60.5 MB at the probe's 3.25 TB/s = 18.6 us of streaming, + ~3 us from the wait to the first tile (the ids
0.5, the down scales 1, stores and barriers, the plan read back 0.5, a tile 1) + ~0.5 us of store: ~22 us if 112
programs of 80 KB ahead stream at the probe's best rate, ~29 at its one-program-per-SM rate (25.7): -3 to -10 us a
layer, -0.15 to -0.55 ms a step at w = 4 (58 MoE layers). At T = 1, down ~9.7 + combine ~2.4 = ~12 us before; after,
16.5 MB (5.1 us at 3.25 TB/s) in 9 iterations a program, mostly the pipeline's ramp (the probe's best 7.6 us), + ~3
us to the first tile: ~8-9 us, -3 to -4 us a layer, -0.17 to -0.23 ms a step at w = 1.
Measured (H200, session 20, BENCHMARKS.md): alone (`topk_moe --only moe_down_nb`, each kernel's time in the experts
call) down + combine 30.59 + 2.38 -> 22.76 us at T = 4, 9.40 + 1.64 -> 8.53 at T = 1; in the TP=8 rank's step (61
layers, 1k, busy) +0.02 / -0.34 / -0.36 / -0.57 ms at w = 1 / 2 / 3 / 4: the T = 4 gain as predicted, none at T = 1.
On by default since. 32-row tiles compile the dot to mma.sync (below wgmma's 64 rows): full fp32 accumulation where
wgmma's FP8 accumulation keeps fewer bits, 2e-4 relative apart, and slower (71.7 vs 60.1 us at T = 4).

Numerics: the same FP8 products as `moe._down_tile` (the same [128-K] dot per group, fp32 accumulate), summed in
another order (expert by expert ascending, each group's product times hs x s x w, where the item kernel sums an
item's groups times hs x s, then times w, and the combine sums slots in slot order): within fp32 reordering of the
reference. Batch invariant by construction: token t's column sums its own experts in ascending id order; another
token's experts add exact zeros to it (its h row is masked to 0, its cs is 0; acc starts at +0 and never becomes -0),
and the dot's column t depends on h's row t alone, so a token's output has the same bits alone as with others for
every T of the same TP (T <= 16).
"""

from __future__ import annotations

import torch

from mtp.kernels._triton import pdl_kwargs, pdl_launch, pdl_mode, pdl_wait, prefetch_rows_l2, tl, triton
from mtp.kernels.moe_items import _ids, _slot_weights

__all__ = ["DOWN_NB_ROWS", "DEFAULT_ROWS", "DEFAULT_STAGES", "default_tile", "resolve_tile", "down_nb"]

DOWN_NB_ROWS = (32, 64, 128)  # rows of D per program: a divisor of a weight-scale block (128 rows)
# 64: 112 programs at D = 7168 on 132 SMs (128: 56 programs, 76 SMs idle; 32: 224, some SMs two). Swept (H200, session
# 20, `python -m mtp.bench.topk_moe --only moe_down_nb`, the experts call at T = 4): 64 rows 60.95 us, 128 64.01, 32 71.68
DEFAULT_ROWS = 64
# num_stages by K groups an iteration: the indirection halves the depth ((S + 1) // 2 buffers of GU weight + h tiles),
# so 11 at two groups: 6 x 2 x (8 + 2) KB of shared memory at BN = 64, T <= 16, 5 x 16 KB = 80 KB of weight in flight
# per program; 13 at one group: 7 x (8 + 2) KB, 48 KB in flight. Why that much: the down items streamed alone
# (`mtp.bench.weight_reads`, H200, session 19, T = 4) took 18.6 us with 2 programs of 2 x 16 KB ahead per SM (64 KB)
# and 25.7 with one program of 3 x 16 KB (48 KB): HBM at ~25 GB/s per SM wants ~64 KB ahead per SM on 132 SMs, ~75
# on this grid's 112. Swept (H200, session 20, T = 4, two groups): 7 / 9 / 11 / 13 stages 60.09 / 60.35 / 60.95 /
# 61.67 us (T = 3: 46.50 / 46.65 / 45.68 / 47.80): within the spread, 11 kept
DEFAULT_STAGES = {1: 13, 2: 11}


def default_tile(I: int) -> tuple[int, int]:
    """(rows, K groups an iteration) of `down_nb` for intermediate width I: DEFAULT_ROWS, and 2 groups where I / 128 is
    even (a TP=8 split rank's 256: an expert an iteration). Two groups an iteration halve the loop's trips and its
    fixed cost per trip (sm_90 PTX at BN = 64, a prototype: 2 bar.sync and 190 instructions an iteration of 2 groups
    against 4 and 138 for one)."""
    return DEFAULT_ROWS, 2 if (I // 128) % 2 == 0 else 1


@triton.jit
def _plan_ids(idx_ptr, s2_ptr, T, S, blk, stride_se, stride_sn, TOPK: tl.constexpr, J: tl.constexpr,
              GI: tl.constexpr, GPAD: tl.constexpr, PPAD: tl.constexpr):
    """The plan's (module docstring) first loads: (iq [PPAD] the pairs' experts (< 0: none), s2 [PPAD, GPAD] the down
    scales of each pair's expert in weight-scale block blk). The router's ids and a constant: read before the PDL
    wait where the router's outputs are final then (`down_nb(pf_experts=)`), else after it."""
    q = tl.arange(0, PPAD)
    iq = _ids(idx_ptr, q, q < T * TOPK, S, TOPK, J)
    g = tl.arange(0, GPAD)
    pg = (iq >= 0)[:, None] & (g < GI)[None, :]
    # issued first: the down scales wait on the ids, the compares of `_plan_ranks` do not wait on them
    s2 = tl.load(s2_ptr + iq.to(tl.int64)[:, None] * stride_se + blk * stride_sn + g[None, :], mask=pg, other=0.0)
    return iq, s2


@triton.jit
def _plan_ranks(rw_ptr, iq, TOPK: tl.constexpr, J: tl.constexpr, PPAD: tl.constexpr):
    """(rw [PPAD] each pair's route weight, lead (the pair naming its expert first), place (its expert's in the loop:
    the number of distinct experts of smaller id), A) from the pairs' experts iq (`_plan_ids`); before the wait or
    after it as `_plan_ids`."""
    q = tl.arange(0, PPAD)
    valid = iq >= 0
    rw = _slot_weights(rw_ptr, q, valid, TOPK, J)
    earlier = (iq[:, None] == iq[None, :]) & (q[None, :] < q[:, None])
    lead = valid & (tl.sum(earlier.to(tl.int32), 1) == 0)
    place = tl.sum((lead[None, :] & (iq[None, :] < iq[:, None])).to(tl.int32), 1)
    return rw, lead, place, tl.sum(lead.to(tl.int32), 0)


@triton.jit
def _h_scales(hs_ptr, iq, GI: tl.constexpr, GPAD: tl.constexpr, PPAD: tl.constexpr):
    """hs [PPAD, GPAD]: gate/up's h scales of the pairs with an expert (0 elsewhere); after the wait."""
    q = tl.arange(0, PPAD)
    g = tl.arange(0, GPAD)
    return tl.load(hs_ptr + q[:, None] * GI + g[None, :], mask=(iq >= 0)[:, None] & (g < GI)[None, :], other=0.0)


@triton.jit
def _plan_store(plan_ptr, cs_ptr, iq, s2, hs, rw, lead, place, n_act, TOPK: tl.constexpr, GI: tl.constexpr,
                GPAD: tl.constexpr, TP: tl.constexpr, PPAD: tl.constexpr):
    """This program's plan (module docstring) at plan_ptr (elist [PPAD] int32, then slots [PPAD, TP] int32) and cs_ptr
    ([PPAD * GI, TP] fp32) from `_plan_ids`', `_h_scales`' and `_plan_ranks`' values: pair q's expert is the
    place-th of the call by id. The cells no pair fills (-1 / 0) are written first, then, after a barrier, each
    pair's own cells (a token names an expert at most once), then a barrier before the loop reads them."""
    q = tl.arange(0, PPAD)
    valid = iq >= 0
    g = tl.arange(0, GPAD)
    pg = valid[:, None] & (g < GI)[None, :]
    c = tl.arange(0, TP)
    tl.store(plan_ptr + PPAD + q[:, None] * TP + c[None, :], tl.full((PPAD, TP), -1, tl.int32),
             mask=(q < n_act)[:, None])
    r = tl.arange(0, PPAD * GPAD)
    tl.store(cs_ptr + r[:, None] * TP + c[None, :], tl.zeros((PPAD * GPAD, TP), tl.float32),
             mask=(r < n_act * GI)[:, None])
    tl.debug_barrier()
    t = q // TOPK
    tl.store(plan_ptr + place, iq, mask=lead)
    tl.store(plan_ptr + PPAD + place * TP + t, q, mask=valid)
    tl.store(cs_ptr + (place[:, None] * GI + g[None, :]) * TP + t[:, None], hs * s2 * rw[:, None], mask=pg)
    tl.debug_barrier()


@triton.jit
def _prefetch_routed(w2_ptr, iq, lead, place, n_act, rows, D, stride_we, I: tl.constexpr, PF: tl.constexpr,
                     PFP: tl.constexpr):
    """This program's rows of the loop's first min(PF, A) experts (the distinct experts by ascending id: the order the
    loop reads them) asked of L2, their ids from `_plan_ids` / `_plan_ranks`' registers (PFP = next_pow2(PF)). The
    prefetch has no predicate: the places past them ask for the first expert's lines again (a repeat only re-asks
    L2); nothing without an expert."""
    k = tl.arange(0, PFP)
    e = tl.sum(tl.where(lead[None, :] & (place[None, :] == k[:, None]), iq[None, :], 0), 1)
    e = tl.where(k < tl.minimum(n_act, PF), e, tl.sum(tl.where(lead & (place == 0), iq, 0), 0))
    if n_act > 0:
        prefetch_rows_l2(w2_ptr + e.to(tl.int64)[:, None] * stride_we + tl.minimum(rows, D - 1).to(tl.int64)[None, :]
                         * I, I, 128)


@triton.jit
def _w_tile(w2_desc, w_rows, rmask, e, nb, g, D, stride_we, BN: tl.constexpr, TMA: tl.constexpr):
    """Expert e's [BN, 128] down tile of output block nb at K group g: by TMA (the [E * D, I] view, D a multiple of
    BN) or from the block's row pointers w_rows (rows past D masked)."""
    if TMA:
        return w2_desc.load([e * D + nb * BN, g * 128])
    return tl.load(w_rows + e.to(tl.int64) * stride_we + g * 128, mask=rmask[:, None], other=0.0)


@triton.jit
def _moe_down_nb_kernel(h8_ptr, hs_ptr, idx_ptr, rw_ptr, w2_ptr, s2_ptr, add_ptr, y_ptr, plan_ptr, cs_ptr, w2_desc,
                        T, D, stride_we, stride_se, stride_sn, S, TOPK: tl.constexpr, J: tl.constexpr,
                        GI: tl.constexpr, GPAD: tl.constexpr, BN: tl.constexpr, GU: tl.constexpr, TP: tl.constexpr,
                        PPAD: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, PF: tl.constexpr,
                        PFP: tl.constexpr, ADD: tl.constexpr, TMA: tl.constexpr):
    """y[t, rows] of output block nb (BN rows) for every token (module docstring), GU (1 or 2, dividing GI) K groups
    an iteration. TMA: the weight tiles through the host descriptor w2_desc of the stack seen as [E * D, I] with
    [BN, 128] blocks (`moe.weight_desc`; None without it). ADD: + add[t, rows] after the experts' sum."""
    pdl_launch(PDL)
    nb = tl.program_id(0)
    I: tl.constexpr = GI * 128
    rows = nb * BN + tl.arange(0, BN)
    rmask = rows < D
    if PDL and PREFETCH:
        if TOPK > J:  # the shared expert's rows of this block, known before the router's ids: asked of L2
            prefetch_rows_l2(w2_ptr + tl.cast(S, tl.int64) * stride_we + tl.minimum(rows, D - 1).to(tl.int64) * I,
                             I, 128)
    blk = (nb * BN) // 128
    EARLY: tl.constexpr = PDL != 0 and PF > 0
    if EARLY:  # the router's ids and weights final already (`down_nb(pf_experts=)`): the routed experts' rows asked
        iq, s2 = _plan_ids(idx_ptr, s2_ptr, T, S, blk, stride_se, stride_sn, TOPK, J, GI, GPAD, PPAD)
        rw, lead, place, n_act = _plan_ranks(rw_ptr, iq, TOPK, J, PPAD)
        _prefetch_routed(w2_ptr, iq, lead, place, n_act, rows, D, stride_we, I, PF, PFP)
    pdl_wait(PDL)  # the router's ids and weights (unless EARLY), gate / up's h and its scales
    if not EARLY:  # the order before the option: h's scales issued before the ranks' reductions and their barriers
        iq, s2 = _plan_ids(idx_ptr, s2_ptr, T, S, blk, stride_se, stride_sn, TOPK, J, GI, GPAD, PPAD)
    hs = _h_scales(hs_ptr, iq, GI, GPAD, PPAD)
    if not EARLY:
        rw, lead, place, n_act = _plan_ranks(rw_ptr, iq, TOPK, J, PPAD)
    plan = plan_ptr + nb * (PPAD * (TP + 1))
    cs_plan = cs_ptr + nb * (PPAD * GI * TP)
    _plan_store(plan, cs_plan, iq, s2, hs, rw, lead, place, n_act, TOPK, GI, GPAD, TP, PPAD)
    k = tl.arange(0, 128)
    c = tl.arange(0, TP)
    w_rows = w2_ptr + rows.to(tl.int64)[:, None] * I + k[None, :]
    n_iter = n_act * (GI // GU)
    # the column scales of iteration i's groups, loaded in iteration i - 1 (module docstring)
    csn0 = tl.load(cs_plan + c, mask=n_iter > 0, other=0.0)
    if GU == 2:
        csn1 = tl.load(cs_plan + TP + c, mask=n_iter > 0, other=0.0)
    acc = tl.zeros((BN, TP), dtype=tl.float32)
    for i in range(0, n_iter):
        a = (i * GU) // GI
        g = (i * GU) % GI
        e = tl.load(plan + a)
        slot = tl.load(plan + PPAD + a * TP + c)
        h_ptrs = h8_ptr + slot.to(tl.int64)[:, None] * I + g * 128 + k[None, :]
        w0 = _w_tile(w2_desc, w_rows, rmask, e, nb, g, D, stride_we, BN, TMA)
        h0 = tl.load(h_ptrs, mask=(slot >= 0)[:, None], other=0.0)
        cs0 = csn0
        csn0 = tl.load(cs_plan + (i + 1) * GU * TP + c, mask=i + 1 < n_iter, other=0.0)
        if GU == 2:
            w1 = _w_tile(w2_desc, w_rows, rmask, e, nb, g + 1, D, stride_we, BN, TMA)
            h1 = tl.load(h_ptrs + 128, mask=(slot >= 0)[:, None], other=0.0)
            cs1 = csn1
            csn1 = tl.load(cs_plan + ((i + 1) * GU + 1) * TP + c, mask=i + 1 < n_iter, other=0.0)
        acc += tl.dot(w0, tl.trans(h0)) * cs0[None, :]
        if GU == 2:  # the next group, summed after the first: the same sums as GU = 1
            acc += tl.dot(w1, tl.trans(h1)) * cs1[None, :]
    omask = rmask[:, None] & (c < T)[None, :]
    dst = c[None, :] * D + rows[:, None]
    if ADD:  # the shared expert's output computed apart, after the experts' sum (the reference's routed + shared)
        acc += tl.load(add_ptr + dst, mask=omask, other=0.0)
    tl.store(y_ptr + dst, acc.to(y_ptr.dtype.element_ty), mask=omask)


def resolve_tile(tile: tuple[int, int] | None, I: int) -> tuple[int, int]:
    """`down_nb`'s tile (rows, K groups an iteration) checked, or `default_tile(I)` for None."""
    if tile is None:
        return default_tile(I)
    if not (isinstance(tile, tuple) and len(tile) == 2 and tile[0] in DOWN_NB_ROWS and tile[1] in (1, 2)
            and (I // 128) % tile[1] == 0):
        raise ValueError(f"moe_experts: down_tile must be (rows, K groups an iteration) with rows one of "
                         f"{DOWN_NB_ROWS} and 1 or 2 groups dividing I / 128 = {I // 128}, got {tile!r}")
    return tile


def down_nb(h8: torch.Tensor, hs: torch.Tensor, idx: torch.Tensor, rw: torch.Tensor, w_down: torch.Tensor,
            s_down: torch.Tensor, T: int, shared: bool, out_dtype: torch.dtype, add: torch.Tensor | None = None,
            pdl: int = 0, prefetch: bool = True, tile: tuple[int, int] | None = None, stages: int | None = None,
            warps: int | None = None, desc=None, pf_experts: int = 0) -> torch.Tensor:
    """y [T, D] (out_dtype) = sum over each token's pairs of route weight x down(h) (+ add) by `_moe_down_nb_kernel`:
    h8 [P, I] fp8 and hs [P, I / 128] fp32 per flat pair (gate/up's output; P = T * slots), idx [T, J] int32 (-1: a
    slot to skip), rw [T, J] fp32, the down stack w_down [E, D, I] fp8 with s_down [E, ceil(D / 128), I / 128]
    (shared: its last entry every token's implicit slot J, weight 1). D need not be a multiple of the rows (the last
    block's rows past D are masked; `moe_experts` has D a multiple of 128 anyway). tile: (rows, K groups an
    iteration): BN of DOWN_NB_ROWS and 1 or 2 (dividing I / 128; the same bits either way), default `default_tile`;
    stages: num_stages (default DEFAULT_STAGES); warps: num_warps (default 4); desc: the stack's TMA descriptor with
    [rows, 128] blocks (`moe.weight_desc(block_rows=rows)`), or None for pointer loads. pdl / prefetch as
    `moe.moe_experts`'. pf_experts (> 0: the caller's word that the launch before this one, gate/up, lets it launch
    only after its own wait, so that the router's ids and route weights are final when this kernel starts:
    `moe_experts(down_pf_experts=)` passes it only then): with PDL and prefetch, the plan's part that reads only
    them and the down scales (`_plan_ids`, `_plan_ranks`) runs before the wait, and each program asks L2 for its rows of the
    loop's first pf_experts experts (`_prefetch_routed`); the same plan, the same bits. 0, or without PDL or
    prefetch: compiled out. Called by `moe.moe_experts`, which checks the other inputs."""
    E, D, I = w_down.shape
    J = idx.shape[1]
    GI = I // 128
    rows, groups = resolve_tile(tile, I)
    P = T * (J + shared)
    ppad, tp = triton.next_power_of_2(P), max(16, triton.next_power_of_2(T))
    grid = triton.cdiv(D, rows)
    dev = h8.device
    plan = torch.empty(grid * ppad * (tp + 1), dtype=torch.int32, device=dev)
    cs = torch.empty(grid * ppad * GI * tp, dtype=torch.float32, device=dev)
    y = torch.empty(T, D, dtype=out_dtype, device=dev)
    launch = pdl_kwargs(pdl, h8)
    pf = min(pf_experts, ppad) if launch and prefetch else 0  # at most P distinct experts
    _moe_down_nb_kernel[(grid,)](h8, hs, idx, rw, w_down, s_down, y if add is None else add, y, plan, cs, desc, T, D,
                                 w_down.stride(0), s_down.stride(0), s_down.stride(1), E - 1 if shared else -3,
                                 TOPK=J + shared, J=J, GI=GI, GPAD=triton.next_power_of_2(GI), BN=rows, GU=groups,
                                 TP=tp, PPAD=ppad, PDL=pdl_mode(pdl, launch), PREFETCH=bool(launch) and prefetch,
                                 PF=pf, PFP=triton.next_power_of_2(max(pf, 1)), ADD=add is not None,
                                 TMA=desc is not None, num_warps=warps or 4,
                                 num_stages=stages or DEFAULT_STAGES[groups], **launch)
    return y
