"""Absorbed MLA decode attention over a real-FP8 latent cache (Triton flash-decoding), with a torch reference.

Shape legend: B batch rows, T query tokens per row (<= 8: the k drafts + 1), H heads (128), S cache
capacity, C = 512 latent channels (4 groups of 128, one ue8m0 scale each), R = 64 rope channels,
NS KV splits, J = top-k selected keys (DSA indexer).
Inputs: q_lat [B, T, H, C] (q_nope already multiplied by Wk_b), q_pe [B, T, H, R], kv8 [B, S, C] float8,
kv_scale [B, S, 4] fp32, pe [B, S, R] bf16, seq_lens [B] int (valid keys before this block: query t sees
keys s < seq_lens[b] + t + 1), optional topk_idx [B, T, J] int32 (-1 = none; only those keys count),
optional visible [B, T, S] bool (a draft tree's verify: only keys with visible[b, t, s] count, on top of the
causal bound and the top-k; the committed keys plus the node's ancestors, `model.layers.tree_visibility`).
Output o_lat [B, T, H, C] = softmax((q_lat . kv + q_pe . pe) * sm_scale) . kv, with kv dequantized.

Kernel: stage 1 gives each program BH heads of one (b, t) and one of NS slices of the keys (dense: the
causal range; sparse: the top-k list, keys gathered by index) and runs an online softmax over BN-key
tiles; K and V are the same fp8 latent tile, loaded once, scaled exactly into bf16 and used for both
dots (bf16 tensor cores, fp32 accumulate; q_lat and p are rounded to bf16: ~2e-3 relative error vs the
fp32 reference). With channel splits CS > 1 (`mla_decode(channel_splits=)`), CS programs share each (b, t, heads,
key slice): each computes the same scores and softmax, and the output on 512 / CS channels only, from its own load of
those channels (V); the same bits. Stage 2 merges the NS partial results by their log-sum-exp
(`mla_out.merge_splits`); given W_vb it also applies the absorbed output projection in the same launch
(`mla_out.stage2_absorb`: o [B, T, H, V], bit-identical to stage 2 + `absorb.absorb_out`). The number of slices
comes from the static capacity (S or J) so the launch is the same on every step (CUDA-graph friendly). Under the
Triton interpreter (CPU tests) the dots take fp32 operands: its bf16 tl.dot is wrong.
"""

from __future__ import annotations

import torch

from mtp.model.fp8 import BLOCK, FP8_DTYPE
from mtp.kernels._triton import (
    device_lens, interpreting, pdl_kwargs, pdl_launch, pdl_mode, pdl_wait, require, tl, triton,
)
from mtp.kernels.mla_out import merge_splits, stage2_absorb

__all__ = ["mla_decode", "mla_decode_ref"]

LOG2E = 1.4426950408889634


def mla_decode_ref(q_lat, q_pe, kv8, kv_scale, pe, seq_lens, sm_scale: float, topk_idx=None, out_dtype=torch.float32,
                   visible=None):
    """Plain-PyTorch fp32 reference. Rows with no visible key give zeros."""
    B, T, H, C = q_lat.shape
    S = kv8.shape[1]
    kv = (kv8.float().view(B, S, C // BLOCK, BLOCK) * kv_scale.float().unsqueeze(-1)).view(B, S, C)
    out = torch.zeros(B, T, H, C, dtype=torch.float32, device=q_lat.device)
    pos = torch.arange(S, device=q_lat.device)
    for b in range(B):
        L = int(seq_lens[b])
        for t in range(T):
            valid = pos < min(L + t + 1, S)
            if topk_idx is not None:
                sel = torch.zeros(S, dtype=torch.bool, device=q_lat.device)
                ids = topk_idx[b, t].long()
                ids = ids[(ids >= 0) & (ids < S)]
                sel[ids] = True
                valid &= sel
            if visible is not None:
                valid &= visible[b, t].to(torch.bool)
            if not valid.any():
                continue
            k = kv[b][valid]
            s = (q_lat[b, t].float() @ k.t() + q_pe[b, t].float() @ pe[b][valid].float().t()) * sm_scale
            out[b, t] = torch.softmax(s, dim=-1) @ k
    return out.to(out_dtype)


@triton.jit
def _mla_stage1(q_ptr, qpe_ptr, kv_ptr, kvs_ptr, pe_ptr, lens_ptr, idx_ptr, vis_ptr, o_ptr, lse_ptr,
                T, H, S, J, qk_scale, NS,
                s_qb, s_qt, s_qh, s_pb, s_pt, s_ph, s_kvb, s_kvs, s_scb, s_scs, s_peb, s_pes,
                SPARSE: tl.constexpr, VIS: tl.constexpr, DOT: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
                PDL: tl.constexpr):
    # The 512 latent channels are handled as 4 groups of 128 (one fp8 scale each): the scale multiplies the
    # group's score contribution and, for the value side, the probabilities, so the fp8 tile only needs an
    # exact fp8 -> bf16 conversion and no per-element scale gather.
    pdl_launch(PDL)
    pdl_wait(PDL)  # the queries, the cache's new keys, the top-k: earlier kernels' (nothing here is constant)
    pid_bt = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    b = pid_bt // T
    t = pid_bt % T
    heads = hb * BH + tl.arange(0, BH)
    hmask = heads < H
    c = tl.arange(0, 128)
    r = tl.arange(0, 64)
    q_rows = q_ptr + b.to(tl.int64) * s_qb + t * s_qt + heads[:, None] * s_qh + c[None, :]
    q0 = tl.load(q_rows, mask=hmask[:, None], other=0.0).to(DOT)
    q1 = tl.load(q_rows + 128, mask=hmask[:, None], other=0.0).to(DOT)
    q2 = tl.load(q_rows + 256, mask=hmask[:, None], other=0.0).to(DOT)
    q3 = tl.load(q_rows + 384, mask=hmask[:, None], other=0.0).to(DOT)
    qpe = tl.load(qpe_ptr + b.to(tl.int64) * s_pb + t * s_pt + heads[:, None] * s_ph + r[None, :],
                  mask=hmask[:, None], other=0.0).to(DOT)
    limit = tl.minimum(tl.load(lens_ptr + b).to(tl.int32) + t + 1, S)
    if SPARSE:
        n_items = J
    else:
        n_items = limit
    chunk = tl.cdiv(tl.cdiv(n_items, NS), BN) * BN
    start = sp * chunk
    end = tl.minimum(start + chunk, n_items)
    kv_base = kv_ptr + b.to(tl.int64) * s_kvb
    sc_base = kvs_ptr + b.to(tl.int64) * s_scb
    pe_base = pe_ptr + b.to(tl.int64) * s_peb
    idx_base = idx_ptr + pid_bt.to(tl.int64) * J
    m_i = tl.full((BH,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BH,), dtype=tl.float32)
    acc0 = tl.zeros((BH, 128), dtype=tl.float32)
    acc1 = tl.zeros((BH, 128), dtype=tl.float32)
    acc2 = tl.zeros((BH, 128), dtype=tl.float32)
    acc3 = tl.zeros((BH, 128), dtype=tl.float32)
    for j0 in range(start, end, BN):
        offs = j0 + tl.arange(0, BN)
        valid = offs < end
        if SPARSE:
            pos = tl.load(idx_base + offs, mask=valid, other=-1)
            valid = valid & (pos >= 0) & (pos < limit)
        else:
            pos = offs
        pos = tl.where(valid, pos, 0).to(tl.int64)
        if VIS:  # a tree node sees the committed keys and its own ancestors only
            valid = valid & (tl.load(vis_ptr + pid_bt.to(tl.int64) * S + pos, mask=valid, other=0) != 0)
        vm = valid[:, None]
        kb = kv_base + pos[:, None] * s_kvs + c[None, :]
        k0 = tl.load(kb, mask=vm, other=0.0).to(DOT)
        k1 = tl.load(kb + 128, mask=vm, other=0.0).to(DOT)
        k2 = tl.load(kb + 256, mask=vm, other=0.0).to(DOT)
        k3 = tl.load(kb + 384, mask=vm, other=0.0).to(DOT)
        sb = sc_base + pos * s_scs
        g0 = tl.load(sb, mask=valid, other=0.0)
        g1 = tl.load(sb + 1, mask=valid, other=0.0)
        g2 = tl.load(sb + 2, mask=valid, other=0.0)
        g3 = tl.load(sb + 3, mask=valid, other=0.0)
        kpe = tl.load(pe_base + pos[:, None] * s_pes + r[None, :], mask=vm, other=0.0).to(DOT)
        s = tl.dot(qpe, tl.trans(kpe))
        s += tl.dot(q0, tl.trans(k0)) * g0[None, :]
        s += tl.dot(q1, tl.trans(k1)) * g1[None, :]
        s += tl.dot(q2, tl.trans(k2)) * g2[None, :]
        s += tl.dot(q3, tl.trans(k3)) * g3[None, :]
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))  # log2 domain
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc0 = acc0 * alpha[:, None] + tl.dot((p * g0[None, :]).to(DOT), k0)
        acc1 = acc1 * alpha[:, None] + tl.dot((p * g1[None, :]).to(DOT), k1)
        acc2 = acc2 * alpha[:, None] + tl.dot((p * g2[None, :]).to(DOT), k2)
        acc3 = acc3 * alpha[:, None] + tl.dot((p * g3[None, :]).to(DOT), k3)
        m_i = m_new
    has = l_i > 0
    inv_l = 1.0 / tl.where(has, l_i, 1.0)
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    row = (pid_bt.to(tl.int64) * H + heads) * NS + sp
    o_rows = o_ptr + row[:, None] * 512 + c[None, :]
    tl.store(o_rows, acc0 * inv_l[:, None], mask=hmask[:, None])
    tl.store(o_rows + 128, acc1 * inv_l[:, None], mask=hmask[:, None])
    tl.store(o_rows + 256, acc2 * inv_l[:, None], mask=hmask[:, None])
    tl.store(o_rows + 384, acc3 * inv_l[:, None], mask=hmask[:, None])
    tl.store(lse_ptr + row, lse, mask=hmask)


@triton.jit
def _mla_stage1_fused(q_ptr, qpe_ptr, kv_ptr, kvs_ptr, pe_ptr, lens_ptr, idx_ptr, vis_ptr, o_ptr, lse_ptr,
                      T, H, S, J, qk_scale, NS,
                      s_qb, s_qt, s_qh, s_pb, s_pt, s_ph, s_kvb, s_kvs, s_scb, s_scs, s_peb, s_pes,
                      SPARSE: tl.constexpr, VIS: tl.constexpr, DOT: tl.constexpr, BH: tl.constexpr,
                      BN: tl.constexpr, PDL: tl.constexpr, CS: tl.constexpr):
    # Same math as _mla_stage1, one 512-wide dot per side: the fp8 tile is loaded as [BN, 4, 128], scaled by
    # its 4 group scales (exact: powers of two) and flattened to a bf16 [BN, 512] K = V tile.
    # CS > 1 (channel splits): CS programs share a (row, head block, key split), each computes the same scores
    # and softmax over all 576 channels and the output on its W = 512 / CS of them only, from its own fp8 load of
    # those channels of the tile (V). The compiler converts the K tile once per dot operand layout (2 x 128
    # elements a thread at BH = 16, 8 warps); the V side shrinks to 128 / CS, the P.V MMAs and the epilogue
    # to 1 / CS. Each output element sees the same p, keys and MMA chain: the same bits as CS = 1.
    pdl_launch(PDL)
    pdl_wait(PDL)  # as _mla_stage1
    pid_bt = tl.program_id(0)
    hb = tl.program_id(1) // CS
    cs = tl.program_id(1) % CS  # this program's slice of the output channels
    sp = tl.program_id(2)
    b = pid_bt // T
    t = pid_bt % T
    heads = hb * BH + tl.arange(0, BH)
    hmask = heads < H
    c = tl.arange(0, 512)
    g4 = tl.arange(0, 4)
    c3 = g4[None, :, None] * 128 + tl.arange(0, 128)[None, None, :]
    W: tl.constexpr = 512 // CS
    VG: tl.constexpr = (W + 127) // 128  # scale groups of 128 the slice spans (CS = 8: half of one)
    cv = cs * W + tl.arange(0, W)  # the output channels
    vg = tl.arange(0, VG)
    cv3 = cs * W + vg[None, :, None] * (W // VG) + tl.arange(0, W // VG)[None, None, :]  # as c3: [1, VG, W / VG]
    gv = (cs * W + vg * (W // VG)) // 128  # each piece's scale
    r = tl.arange(0, 64)
    q = tl.load(q_ptr + b.to(tl.int64) * s_qb + t * s_qt + heads[:, None] * s_qh + c[None, :],
                mask=hmask[:, None], other=0.0).to(DOT)
    qpe = tl.load(qpe_ptr + b.to(tl.int64) * s_pb + t * s_pt + heads[:, None] * s_ph + r[None, :],
                  mask=hmask[:, None], other=0.0).to(DOT)
    limit = tl.minimum(tl.load(lens_ptr + b).to(tl.int32) + t + 1, S)
    if SPARSE:
        n_items = J
    else:
        n_items = limit
    chunk = tl.cdiv(tl.cdiv(n_items, NS), BN) * BN
    start = sp * chunk
    end = tl.minimum(start + chunk, n_items)
    kv_base = kv_ptr + b.to(tl.int64) * s_kvb
    sc_base = kvs_ptr + b.to(tl.int64) * s_scb
    pe_base = pe_ptr + b.to(tl.int64) * s_peb
    idx_base = idx_ptr + pid_bt.to(tl.int64) * J
    m_i = tl.full((BH,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BH,), dtype=tl.float32)
    acc = tl.zeros((BH, W), dtype=tl.float32)
    for j0 in range(start, end, BN):
        offs = j0 + tl.arange(0, BN)
        valid = offs < end
        if SPARSE:
            pos = tl.load(idx_base + offs, mask=valid, other=-1)
            valid = valid & (pos >= 0) & (pos < limit)
        else:
            pos = offs
        pos = tl.where(valid, pos, 0).to(tl.int64)
        if VIS:  # a tree node sees the committed keys and its own ancestors only
            valid = valid & (tl.load(vis_ptr + pid_bt.to(tl.int64) * S + pos, mask=valid, other=0) != 0)
        k8 = tl.load(kv_base + pos[:, None, None] * s_kvs + c3, mask=valid[:, None, None], other=0.0)
        ksc = tl.load(sc_base + pos[:, None] * s_scs + g4[None, :], mask=valid[:, None], other=0.0)
        k = tl.reshape((k8.to(tl.float32) * ksc[:, :, None]).to(DOT), (BN, 512))
        if CS == 1:
            v = k
        else:  # the same lines (in flight or in L2), the same exact conversion, W channels
            v8 = tl.load(kv_base + pos[:, None, None] * s_kvs + cv3, mask=valid[:, None, None], other=0.0)
            vsc = tl.load(sc_base + pos[:, None] * s_scs + gv[None, :], mask=valid[:, None], other=0.0)
            v = tl.reshape((v8.to(tl.float32) * vsc[:, :, None]).to(DOT), (BN, W))
        kpe = tl.load(pe_base + pos[:, None] * s_pes + r[None, :], mask=valid[:, None], other=0.0).to(DOT)
        s = tl.dot(q, tl.trans(k)) + tl.dot(qpe, tl.trans(kpe))
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))  # log2 domain
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v)
        m_i = m_new
    has = l_i > 0
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    row = (pid_bt.to(tl.int64) * H + heads) * NS + sp
    tl.store(o_ptr + row[:, None] * 512 + cv[None, :], acc / tl.where(has, l_i, 1.0)[:, None], mask=hmask[:, None])
    tl.store(lse_ptr + row, lse, mask=hmask & (cs == 0))  # every slice has it: one store


@triton.jit
def _mla_stage2(o_ptr, lse_ptr, out_ptr, NS, NSP: tl.constexpr, PDL: tl.constexpr):
    pdl_launch(PDL)
    pdl_wait(PDL)  # stage 1's partial results
    row = tl.program_id(0).to(tl.int64) + tl.zeros((1, 1), dtype=tl.int64)  # (b, t, h)
    c = tl.arange(0, 512)[None, :]
    res = merge_splits(o_ptr, lse_ptr, row, c, NS, NSP, 1, 512)
    tl.store(out_ptr + row * 512 + c, res.to(out_ptr.dtype.element_ty))


MIN_BLOCK_H = 16  # fewest heads per program (TP=8 rank: 16 heads)
CHANNEL_SPLITS = (1, 2, 4, 8)  # stage 1's programs per (row, head block, key split): 512 / CS output channels each
# channel splits by score rows (B * T), the rest 1: one TP=8 rank on an H200 (BENCHMARKS.md session 18), alone
# (stage 1 + 2, 16 heads, us at CS = 1 / 2 / 4): one row 12.25 / 10.64 / 9.73 dense 1k, 14.18 / 12.53 / 11.26 top-2048;
# two rows 12.39 / 10.96 / 15.16 and 14.72 / 13.02 / 17.36; four rows 12.52 / 17.74 / 20.95 and 15.66 / 20.65 / 29.16;
# in the 61-layer step (b2b) CS = 4 -0.12 / -0.22 ms at w = 1 (1k / 32k), CS = 2 -0.11 / -0.05 at w = 2 and slower
# at w = 4 (both), +0.33 at 32k w = 3
CHANNEL_SPLITS_BY_ROWS = {1: 4, 2: 2}


def channel_splits_for(rows: int, heads: int = MIN_BLOCK_H) -> int:
    """Stage 1's channel splits for `rows` score rows (B * T) of `heads` heads where the option says 0 (by rows, the
    default): `CHANNEL_SPLITS_BY_ROWS`, else 1. 1 where the heads take a tile of more than MIN_BLOCK_H heads (a TP=1,
    2 or 4 rank of the real model: 128 / 64 / 32 heads), which the rule was not measured on, and whose 64-head tile
    does not fit an SM's shared memory at CS = 2 / 4 dense (sm_90: 291 / 259 KB against 227; `mtp-bench` at TP=1,
    128 heads, failed with triton's OutOfResources at one row until session 24). Under the Triton interpreter 1 at
    every width: its dots are numpy matmuls whose rounding follows the tile's shape (~1e-7 apart across CS), so one
    row's result would depend on how many rows share the call, where a strict decode needs a row's bits whatever the
    width (greedy at w = 1 against a verify at w = k + 1); on a GPU they are the same bits at every CS
    (tests/kernels/test_mla_channel_splits_gpu.py)."""
    if interpreting() or triton.next_power_of_2(heads) > MIN_BLOCK_H:
        return 1
    return CHANNEL_SPLITS_BY_ROWS.get(rows, 1)


def default_splits(n_rows: int, capacity: int, n_sms: int = 132, min_keys: int = 64) -> int:
    """KV slices: about one program per SM (the 64 x 64 tile takes ~190 KB of shared memory: one resident
    program per SM), each slice at least `min_keys` keys. H200, T = 1 (2 rows): top-k 2048 took 29.8 / 20.6 /
    17.6 / 21.7 us at 8 / 16 / 32 / 64 slices, S = 4096 took 44.4 / 28.4 / 22.1 / 23.0; T = 2, S = 4096
    (4 rows): 25.0 us at 32 slices, 41.9 at 64."""
    want = triton.cdiv(n_sms, max(1, n_rows))
    return max(1, min(want, triton.cdiv(capacity, min_keys), 64))


def mla_decode(q_lat, q_pe, kv8, kv_scale, pe, seq_lens, sm_scale: float, topk_idx=None,
               out_dtype: torch.dtype = torch.float32, visible: torch.Tensor | None = None,
               splits: int | None = None, variant: str = "fused",
               block_h: int = 64, block_n: int = 64, num_warps: int = 8, num_stages: int | None = None,
               min_block_h: int | None = None, w_vb: torch.Tensor | None = None,
               block_v: int | None = None, pdl: bool = False, prefetch: bool = True,
               channel_splits: int = 1) -> torch.Tensor:
    """Kernel twin of `mla_decode_ref`: o_lat [B, T, H, 512] in out_dtype. w_vb [H, V, 512] (in out_dtype, at most
    absorb.MAX_TOKENS tokens): o = absorb_out(o_lat, w_vb) [B, T, H, V] instead, stage 2 and the projection in one
    launch (`mla_out.stage2_absorb`, the same bits; block_v: its output channels per program). The keyword knobs
    are for benchmarks:
    variant "fused" (one 512-wide dot on the scaled tile; default: 1.2-1.7x faster on an H200) or "split4"
    (4 dots of 128 channels, scales folded into scores / probabilities). Default tile: 64 heads x 64 keys,
    8 warps (wgmma; the 16/32-head mma.sync tiles spilled: 255 registers), 3 stages dense / 2 sparse
    (S = 32768, T = 1: 54 vs 60 us; top-k: 20.7 vs 21.8 us). min_block_h: fewest heads per program (default
    MIN_BLOCK_H); a rank's 16 heads may run in a 64-head tile (masked) to take the wgmma tile. pdl: both launches
    with programmatic dependent launch (`_triton.pdl_kwargs`); prefetch: with w_vb, `stage2_absorb`'s (its W_vb tile
    asked of L2 before the wait; False: compiled out, `FastPathOptions.prefetch_at`).
    channel_splits (CS, one of CHANNEL_SPLITS; variant "fused"): stage 1 runs CS programs per (row, head block, key
    split), each the whole softmax and 512 / CS of the output channels (`FastPathOptions.mla_channel_splits`): the
    same bits, CS x the programs, each converting 128 + 128 / CS instead of 2 x 128 tile elements a thread (sm_90,
    16 heads, 8 warps: the compiler converts the K tile once per dot operand layout). The key splits do not
    change with it. With the 64-head tile (min_block_h 64) the value slice's own pipelined buffers take dense
    calls past an SM's shared memory (sm_90 compile: 291 / 259 KB at CS = 2 / 4; top-k 210 KB at CS = 4)."""
    require(q_lat, "mla_decode")
    B, T, H, C = q_lat.shape
    S = kv8.shape[1]
    if C != 512 or q_pe.shape != (B, T, H, 64):
        raise ValueError(f"mla_decode: q_lat must be [B, T, H, 512] and q_pe [B, T, H, 64], got {list(q_lat.shape)}, {list(q_pe.shape)}")
    if kv8.dtype != FP8_DTYPE or kv8.shape != (B, S, 512) or kv_scale.shape != (B, S, 4) or pe.shape != (B, S, 64):
        raise ValueError(f"mla_decode: cache must be kv8 float8 [B, S, 512], kv_scale [B, S, 4], pe [B, S, 64]; got "
                         f"{kv8.dtype} {list(kv8.shape)}, {list(kv_scale.shape)}, {list(pe.shape)}")
    for name, x, last in (("q_lat", q_lat, 512), ("q_pe", q_pe, 64), ("kv8", kv8, 512), ("kv_scale", kv_scale, 4), ("pe", pe, 64)):
        if x.stride(-1) != 1:
            raise ValueError(f"mla_decode: {name} needs a contiguous last dim")
    sparse = topk_idx is not None
    J = topk_idx.shape[-1] if sparse else 0
    if num_stages is None:
        num_stages = 2 if sparse else 3
    if sparse and tuple(topk_idx.shape) != (B, T, J):
        raise ValueError(f"mla_decode: topk_idx must be [B, T, J] = [{B}, {T}, J], got {list(topk_idx.shape)}")
    idx = topk_idx.to(torch.int32).contiguous() if sparse else seq_lens  # dummy pointer when dense
    if visible is not None and (visible.dtype != torch.bool or tuple(visible.shape) != (B, T, S)):
        raise ValueError(f"mla_decode: visible must be bool [B, T, S] = [{B}, {T}, {S}], got {visible.dtype} "
                         f"{list(visible.shape)}")
    vis = visible.contiguous().view(torch.uint8) if visible is not None else seq_lens  # dummy pointer: no tree
    # heads per program: H rounded up to a power of two, at least min_block_h (masked heads cost MMA work only)
    bh = min(block_h, max(min_block_h or MIN_BLOCK_H, triton.next_power_of_2(H)))
    nhb = triton.cdiv(H, bh)
    if splits is None:
        splits = default_splits(B * T * nhb, J if sparse else S)
    if w_vb is not None and (w_vb.dtype != out_dtype or tuple(w_vb.shape[::2]) != (H, 512)):
        raise ValueError(f"mla_decode: w_vb must be [{H}, V, 512] in out_dtype {out_dtype} (o_lat's rounding), got "
                         f"{w_vb.dtype} {list(w_vb.shape)}")
    dev = q_lat.device
    o_part = torch.empty(B * T * H * splits, 512, dtype=torch.float32, device=dev)
    lse = torch.empty(B * T * H * splits, dtype=torch.float32, device=dev)
    lens = device_lens(seq_lens, dev)
    if variant not in ("split4", "fused"):
        raise ValueError(f"mla_decode: variant must be 'split4' or 'fused', got {variant!r}")
    if type(channel_splits) is not int or channel_splits not in CHANNEL_SPLITS:
        raise ValueError(f"mla_decode: channel_splits must be one of {CHANNEL_SPLITS}, got {channel_splits!r}")
    if channel_splits != 1 and variant != "fused":
        raise ValueError(f"mla_decode: channel_splits {channel_splits} needs variant 'fused', got {variant!r}")
    stage1, cs = (_mla_stage1, {}) if variant == "split4" else (_mla_stage1_fused, dict(CS=channel_splits))
    launch = pdl_kwargs(pdl, q_lat)
    stage1[(B * T, nhb * channel_splits, splits)](
        q_lat, q_pe, kv8, kv_scale, pe, lens, idx, vis, o_part, lse, T, H, S, J, float(sm_scale) * LOG2E, splits,
        q_lat.stride(0), q_lat.stride(1), q_lat.stride(2), q_pe.stride(0), q_pe.stride(1), q_pe.stride(2),
        kv8.stride(0), kv8.stride(1), kv_scale.stride(0), kv_scale.stride(1), pe.stride(0), pe.stride(1),
        SPARSE=sparse, VIS=visible is not None, DOT=tl.float32 if interpreting() else tl.bfloat16, BH=bh,
        BN=block_n, PDL=pdl_mode(pdl, launch), num_warps=num_warps, num_stages=num_stages, **cs, **launch)
    if w_vb is not None:
        return stage2_absorb(o_part, lse, splits, w_vb, B, T, block_v, pdl=pdl, prefetch=prefetch)
    out = torch.empty(B, T, H, 512, dtype=out_dtype, device=dev)
    _mla_stage2[(B * T * H,)](o_part, lse, out, splits, NSP=triton.next_power_of_2(splits), PDL=pdl_mode(pdl, launch),
                              num_warps=4, **launch)
    return out
