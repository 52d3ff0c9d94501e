"""The persistent MoE layout's down projection and combine in one launch: `moe_experts(down_fused=True)`.

Names and shapes as in `mtp.kernels.moe` (T tokens, J routed slots, TOPK = J + 1 with the implicit shared slot,
P = T * TOPK flat (token, slot) pairs, D hidden, I expert width, GI = I / 128 K groups, BM = next_pow2(T) >= 16
token columns). `moe._moe_down_persistent` hands out (distinct expert, 128-row N-block, K slice) work items, each one
dependent load -> dot -> store of an fp32 partial [KS, P, D] that `moe._moe_combine_kernel`, a second launch, reads
back: on a TP=8 'split' rank (I = 256: an item is 2 weight tiles) every item pays its own load latency (H200,
BENCHMARKS.md session 15: down 10.7 + combine 2.6 us per layer at one token for a 4 us byte floor, 29.9 + 3.3 at four
for 13.6). Pipelining the same items across item boundaries (branch downflat, session 14) lost: its per-iteration
lookups of the item's expert and rows from registers were cross-warp reductions (~18 barriers an iteration).

Here a program owns BN = 64 output rows for every token (D / 64 = 112 programs for D = 7168 on 132 SMs; 128 rows
would leave 56 programs, each needing ~2.4x an SM's share of HBM bandwidth) and runs one loop over the step's
(pair, K group) iterations: the shared slot's GI groups first (all tokens' rows in one dot: its weight was asked of
L2 before the PDL wait), then every routed pair (t, j) in order, one token's row of h per dot. Each iteration's
numbers come from its index by arithmetic (pair p = t * J + j, h row t * TOPK + j) except the expert id, one load
of the router's ids, which the weight tile's address depends on: triton 3.6's pipeliner treats it as an indirect
load (the id copied ahead into shared memory, the tile after it) and gives each level (num_stages - 1) / 2 stages
of lead (`DEFAULT_STAGES` 9: the 8 KB weight tiles issued 4 iterations ahead, checked on the sm_90 TTGIR by
tests/kernels/test_moe_down_fused.py). The per-iteration scales (h's hs per row, the weight's s2, the route weight)
feed no dot operand, so the pipeliner leaves them in their iteration: they are loaded one iteration ahead by hand
(carried; a deeper hand lookahead stops the pipelining, as downflat saw), s2's lines of every stack entry for this
program's rows asked of L2 before the PDL wait (constants; ~115 KB for the whole grid), so that the one-ahead load
finds them in L2. Duplicate experts (two tokens routing to one expert) read the tile twice: the second read is an L2
hit (about 30 distinct of 32 routed pairs at four tokens on a split rank), and the shared expert is read once.

Bit-identical to `_moe_down_persistent` + `_moe_combine_kernel` with the same K slices (tested with torch.equal
under the interpreter and on the GPU): each (slot, K slice) partial is the same fp32 sum (from +0 over the slice's
groups in order, each dot scaled by hs * s2 as `moe._down_tile` does, then times the route weight, rounded by
itself: `mul.rn` on the GPU so that it is not fused into the add that follows, as the partial's store kept it
apart), and each token's sum takes them in the combine's order: routed slots j, then K slices; the shared slot's
slices summed apart and added after; then `add`. A dot's column for token t does not depend on the other columns,
nor on the tile having 64 rows rather than 128 (wgmma's m64 per warp group either way). No partials in memory, no
atomics, no spin-waits.
"""

from __future__ import annotations

import torch

from mtp.kernels._triton import interpreting, pdl_kwargs, pdl_launch, pdl_mode, pdl_wait, prefetch_l2, \
    prefetch_span_l2, tl, triton

__all__ = ["moe_down_fused", "BN", "DEFAULT_STAGES"]

# output rows per program (module docstring): D / 64 programs, each one wgmma m64 tile. 128 (the item kernel's
# N-block) is the other choice that keeps its bits: read at call time, so tests may set it (the interpreter's numpy
# matmul sums a 64-row tile's columns in another order than a 128-row one's; wgmma's m64 instructions do not)
BN = 64
# pipeline depth: with the one level of indirection (the id, then the tile) triton 3.6 gives each load
# (num_stages - 1) / 2 stages of lead: 9 -> 4 weight tiles of 8 KB in flight per program (~32 KB per SM; a
# prediction that this covers ~1 us of loaded HBM latency at the program's ~35 GB/s share, not measured)
DEFAULT_STAGES = 9


@triton.jit
def _mul_rn(a, b, ASM: tl.constexpr):
    """a * b rounded on its own (`mul.rn.f32`: ptxas never contracts it into a following add), as the partial's
    product with the route weight was when it was stored; the interpreter (no inline asm) fuses nothing."""
    if ASM:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return a * b


@triton.jit
def _iter_pair(it, GI, T, TOPK: tl.constexpr, J: tl.constexpr):
    """Iteration it: K group g, whether it is one of the shared slot's (the first GI where TOPK > J), the routed
    pair p = t * J + j (>= 0; 0 for the shared slot's), its token t and its flat slot q = t * TOPK + j (h's row)."""
    c = it // GI
    g = it - c * GI
    shared = c < TOPK - J
    p = tl.maximum(c - (TOPK - J), 0)
    t = p // J
    return g, shared, p, t, p + t * (TOPK - J)


@triton.jit
def _iter_rows(shared, t, q, m, T, TOPK: tl.constexpr, J: tl.constexpr):
    """The token rows an iteration's dot reads (every token's shared slot, or token t's row) and their h rows."""
    rows = tl.where(shared, m < T, m == t)
    return rows, tl.where(shared, m * TOPK + J, q)


@triton.jit
def _iter_scales(it, n_it, idx_ptr, hs_ptr, rw_ptr, s2_ptr, GI, T, S, stride_se, s2_off, m,
                 TOPK: tl.constexpr, J: tl.constexpr):
    """The scales of iteration it, as loads (multiplied where used, the next iteration: see the module docstring):
    hs [BM] of its token rows (0 in the others), its weight's group scale s2, its route weight (1 for the shared
    slot's, 0 for a -1 slot or past the loop)."""
    g, shared, p, t, q = _iter_pair(it, GI, T, TOPK, J)
    live = it < n_it
    e = tl.load(idx_ptr + p, mask=live & ~shared, other=-1)
    e = tl.where(live & shared, S, e)
    ok = e >= 0
    rows, slot = _iter_rows(shared, t, q, m, T, TOPK, J)
    hs = tl.load(hs_ptr + slot * GI + g, mask=rows & ok, other=0.0)
    s2 = tl.load(s2_ptr + e.to(tl.int64) * stride_se + s2_off + g, mask=ok, other=0.0)
    rw = tl.load(rw_ptr + p, mask=ok & ~shared, other=0.0)
    return hs, s2, rw


@triton.jit
def _moe_down_fused_kernel(h8_ptr, hs_ptr, idx_ptr, rw_ptr, w2_ptr, s2_ptr, add_ptr, y_ptr,
                           T, D, I, E, stride_we, stride_se, stride_sn, KS, S,
                           TOPK: tl.constexpr, J: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                           ADD: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, ASM: tl.constexpr):
    """y[t, rows] = routed slots' partials in (j, K slice) order + the shared slot's + add[t, rows] for this
    program's BN rows (module docstring). ASM: on the GPU (inline asm: `mul.rn`, the scales' L2 prefetch)."""
    pdl_launch(PDL)
    pid = tl.program_id(0)
    offs_n = pid * BN + tl.arange(0, BN)
    nmask = offs_n < D
    GI = I // 128
    s2_off = ((pid * BN) // 128) * stride_sn  # BN divides 128: one weight-scale row per program
    if ASM:  # constants: every stack entry's group scales of these rows (one line each), for the one-ahead loads
        for e0 in range(0, E, 128):
            ee = e0 + tl.arange(0, 128)
            prefetch_l2(s2_ptr + tl.where(ee < E, ee, e0).to(tl.int64) * stride_se + s2_off)
    if PDL and PREFETCH and TOPK > J:  # the shared expert's rows of this program, wanted by its first iterations
        prefetch_span_l2(w2_ptr + tl.cast(S, tl.int64) * stride_we, D * I, 128, 32)
    pdl_wait(PDL)  # the router's ids and weights, gate / up's h, and `add`
    m = tl.arange(0, BM)
    offs_k = tl.arange(0, 128)
    w_rows = w2_ptr + offs_n.to(tl.int64)[:, None] * I + offs_k[None, :]
    GPS = tl.cdiv(GI, KS)  # groups per K slice, as `moe._work_item` cuts them
    n_it = (T * J + TOPK - J) * GI
    acc = tl.zeros((BN, BM), dtype=tl.float32)  # the routed slots' sum per token column
    sh = tl.zeros((BN, BM), dtype=tl.float32)  # the shared slot's, summed apart
    part = tl.zeros((BN, BM), dtype=tl.float32)  # the current (slot, K slice) partial
    hs, s2, rw = _iter_scales(0, n_it, idx_ptr, hs_ptr, rw_ptr, s2_ptr, GI, T, S, stride_se, s2_off, m, TOPK, J)
    for it in range(0, n_it):
        g, shared, p, t, q = _iter_pair(it, GI, T, TOPK, J)
        e = tl.where(shared, S, tl.load(idx_ptr + p, mask=~shared, other=-1))  # the pipelined indirection
        ok = e >= 0  # -1: the expert is on another rank: nothing read, + 0 added
        rows, slot = _iter_rows(shared, t, q, m, T, TOPK, J)
        w = tl.load(w_rows + e.to(tl.int64) * stride_we + g * 128, mask=nmask[:, None] & ok, other=0.0)
        h = tl.load(h8_ptr + slot.to(tl.int64)[:, None] * I + g * 128 + offs_k[None, :], mask=(rows & ok)[:, None],
                    other=0.0)
        hs1, s21, rw1 = _iter_scales(it + 1, n_it, idx_ptr, hs_ptr, rw_ptr, s2_ptr, GI, T, S, stride_se, s2_off, m,
                                     TOPK, J)
        part += tl.dot(w, tl.trans(h)) * (hs * s2)[None, :]
        last = ((g + 1) % GPS == 0) | (g == GI - 1)  # the K slice's last group: the partial is complete
        sh += tl.where(last & shared, part, 0.0)  # x its route weight 1.0: itself
        acc += tl.where(last & ~shared & (m == t)[None, :], _mul_rn(part, rw, ASM), 0.0)
        part = tl.where(last, 0.0, part)
        hs, s2, rw = hs1, s21, rw1
    if TOPK > J:
        acc += sh
    out = m[None, :] * D + offs_n[:, None]
    omask = (m < T)[None, :] & nmask[:, None]
    if ADD:
        acc += tl.load(add_ptr + out, mask=omask, other=0.0)
    tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=omask)


def moe_down_fused(h8: torch.Tensor, hs: torch.Tensor, idx: torch.Tensor, rw: torch.Tensor, w_down: torch.Tensor,
                   s_down: torch.Tensor, add: torch.Tensor | None, T: int, J: int, ks: int, out_dtype: torch.dtype,
                   shared: bool, pdl=False, prefetch: bool = True, stages: int | None = None) -> torch.Tensor:
    """y [T, D] = the down projection of h8 / hs ([T * slots, I] fp8 + [T * slots, I / 128] scales, as gate / up
    writes them) through the experts idx ([T, J] int32, -1 to skip; the shared expert S = E - 1 as every token's
    slot J when `shared`), weighted by rw ([T, J] fp32), summed per token as `moe._combine` sums the down kernel's
    ks K slices, + add; one launch (`moe_experts(down_fused=True)` checks the arguments)."""
    E, D, I = w_down.shape
    y = torch.empty(T, D, dtype=out_dtype, device=h8.device)
    launch = pdl_kwargs(pdl, h8)
    S = E - 1 if shared else -3  # read only where TOPK = J + 1
    _moe_down_fused_kernel[(triton.cdiv(D, BN),)](
        h8, hs, idx, rw, w_down, s_down, y if add is None else add, y, T, D, I, E, w_down.stride(0),
        s_down.stride(0), s_down.stride(1), ks, S, TOPK=J + shared, J=J, BN=BN, BM=max(16, triton.next_power_of_2(T)),
        ADD=add is not None, PDL=pdl_mode(pdl, launch), PREFETCH=bool(launch) and prefetch, ASM=not interpreting(),
        num_warps=4, num_stages=stages or DEFAULT_STAGES, **launch)
    return y
