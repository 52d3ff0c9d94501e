"""Routed-expert compute for a batch of tokens (17 to a few thousand): a grouped FP8 GEMM over pairs sorted by expert.

Shape legend: T tokens (<= `moe.MAX_TOKENS`), D hidden (7168), E experts on this rank, I expert intermediate (2048),
J = topk slots per token, P = T * J (token, slot) pairs, p = t * J + j a pair's flat index, BM the M-block (token
rows per tile), NBMAX the static bound on M-blocks, R = NBMAX * BM sorted rows. Expert weights as `moe.moe_experts`
takes them: w_gate / w_up [E, I, D] float8 + [E, I/128, D/128] fp32 scales, w_down [E, D, I] + [E, D/128, I/128].

Why: the pair layouts of `mtp.kernels.moe` give each expert one program per N-block that covers all its tokens in
one tile of next_pow2(T) rows; past a few dozen tokens the tile is mostly masked rows (and at T = 64 two [128, 64]
fp32 accumulators plus the in-register quantization of a [64, 128] x tile no longer fit the registers of 4 warps),
and above 64 tokens `FastMoE` fell back to the reference loop (~20000 launches a step). Here, as vLLM's and SGLang's
fused_moe do (written anew):
1. Align (`moe_align`, two launches, no host sync): the pairs are sorted by expert, stably (pair order inside an
   expert), each expert's segment padded to a multiple of BM, so every M-block of BM sorted rows holds one expert;
   `rows[r]` is the pair at sorted row r (-1 = padding) and `block_expert[b]` the expert of block b. A slot of id
   -1 (another rank's expert) gets no row. The blocks used are at most min(P, (P + E (BM - 1)) // BM) = NBMAX, a
   function of the shapes, so the buffers are static (CUDA-graph capturable); the count used is on the device.
2. x is quantized per 128 channels once (`act_quant`, bit-exact with the reference), not per N-block in registers.
3. `_grouped_gate_up_kernel`: work item (M-block, N-block of 128 intermediate channels): gather the block's token
   rows of x8, per K group one fp8 tl.dot with the expert's gate and up tiles (N in the MMA's M slot, as the other
   MoE kernels), each group's product scaled by s_x * s_w and added in fp32 (DeepSeek's promotion every 128 K);
   h = silu(g) * u in fp32, quantized per 128 (the N-block is one K group of the down projection), stored per
   sorted row (padding rows get h = 0).
4. `_grouped_down_kernel`: work item (M-block, 128 output channels): h8 rows (contiguous: sorted) x the expert's
   down tile, times the pair's routing weight, stored at the pair's row of `part` [P, D] fp32 (no atomics).
5. `moe.moe_experts` sums each token's slots in slot order (`_moe_combine_kernel`, as the other layouts), plus
   the shared expert's output: deterministic, same bits run to run.
Both GEMM kernels are persistent: ~2 programs per SM loop over the used blocks' work items (N-block fastest, so a
wave shares each block's x rows and, for an expert of several blocks, its weight tiles in L2); the work count is
read on the device, so no program is launched for the unused tail of the NBMAX bound.
Numerics: per (token, expert) the formulas of `moe.moe_experts_ref` (fp8 x, 128x128 weight blocks, h re-quantized
per 128, y = sum_j w_tj * down(h)); only the fp32 summation order inside a K group (the MMA's) and the silu's
rounding differ.
"""

from __future__ import annotations

import torch

from mtp.model.fp8 import BLOCK, FP8_DTYPE
from mtp.kernels._triton import tl, triton
from mtp.kernels.act_quant import act_quant, quant_e4m3, ue8m0_scale

__all__ = ["moe_align", "moe_align_ref", "max_blocks", "default_block_m", "grouped_partials", "BLOCK_MS"]

BLOCK_MS = (16, 32, 64, 128)
_CH = 1024  # pairs per step of the align kernels' loops


def max_blocks(P: int, E: int, block_m: int) -> int:
    """Static bound on the M-blocks the align step can use: sum_e ceil(c_e / BM) with sum_e c_e <= P, over at most
    min(E, P) experts holding pairs; and never more blocks than pairs."""
    return max(1, min(P, (P + min(E, P) * (block_m - 1)) // block_m))


def default_block_m(T: int) -> int:
    """M-block by batch size. A function of T only (never of E or of the routing), so that one rank's result is
    bit-equal to the full stack's with the other ranks' slots zeroed. A token picks J of 256 experts, so an
    expert sees ~T/32 tokens: 16 rows keep the MMA's N small while the step is weight-bound, larger blocks cut
    the weight re-reads once it is compute-bound (first guess; to be set from `mtp.bench.topk_moe --only
    moe_batch`)."""
    return 16 if T <= 256 else 32 if T <= 1024 else 64


def moe_align_ref(idx_TJ: torch.Tensor, E: int, block_m: int) -> tuple[list[int], list[int]]:
    """Plain-Python twin of `moe_align`: (rows: the used sorted rows' pairs, -1 for padding; block_expert: the used
    blocks' experts), experts ascending, pairs ascending within an expert, ids -1 skipped."""
    flat = [int(e) for e in idx_TJ.reshape(-1).tolist()]
    rows, block_expert = [], []
    for e in range(E):
        mine = [p for p, f in enumerate(flat) if f == e]
        n = -(-len(mine) // block_m)
        rows += mine + [-1] * (n * block_m - len(mine))
        block_expert += [e] * n
    return rows, block_expert


@triton.jit
def _moe_count_kernel(idx_ptr, cnt_ptr, P, CH: tl.constexpr):
    """cnt[e] = the pairs routed to expert e (program e)."""
    e = tl.program_id(0)
    acc = tl.zeros((CH,), dtype=tl.int32)
    for s in range(0, P, CH):
        q = s + tl.arange(0, CH)
        acc += (tl.load(idx_ptr + q, mask=q < P, other=-1) == e).to(tl.int32)
    tl.store(cnt_ptr + e, tl.sum(acc, 0))


@triton.jit
def _moe_align_kernel(idx_ptr, cnt_ptr, rows_ptr, blk_e_ptr, nblk_ptr, P, E,
                      BM: tl.constexpr, EPAD: tl.constexpr, CH: tl.constexpr):
    """Program e: its segment starts after the padded blocks of experts < e; its pairs go there in pair order
    (a running count plus an in-chunk prefix sum), the segment's tail rows get -1 and its blocks the id e."""
    e = tl.program_id(0)
    k = tl.arange(0, EPAD)
    c = tl.load(cnt_ptr + k, mask=k < E, other=0)
    nb = (c + BM - 1) // BM
    b0 = tl.sum(tl.where(k < e, nb, 0), 0)
    n_e = tl.sum(tl.where(k == e, nb, 0), 0)
    c_e = tl.sum(tl.where(k == e, c, 0), 0)
    if e == 0:
        tl.store(nblk_ptr, tl.sum(nb, 0))
    row0 = b0 * BM
    run = 0
    for s in range(0, tl.where(c_e > 0, P, 0), CH):  # an expert without pairs skips the scan
        q = s + tl.arange(0, CH)
        m = (tl.load(idx_ptr + q, mask=q < P, other=-1) == e).to(tl.int32)
        tl.store(rows_ptr + row0 + run + tl.cumsum(m, 0) - 1, q, mask=m != 0)
        run += tl.sum(m, 0)
    pad = c_e + tl.arange(0, BM)
    tl.store(rows_ptr + row0 + pad, -1, mask=pad < n_e * BM)
    for s in range(0, n_e, CH):
        b = s + tl.arange(0, CH)
        tl.store(blk_e_ptr + b0 + b, e, mask=b < n_e)


def moe_align(idx_TJ: torch.Tensor, E: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort (token, slot) pairs by expert and pad each expert's segment to block_m rows, on the device (two
    launches, no host sync). Returns rows [R] int32 (pair index per sorted row, -1 for padding), block_expert
    [NBMAX] int32, n_blocks [1] int32 (used blocks: rows[:n_blocks * block_m] and block_expert[:n_blocks] are
    written, the rest is not). idx_TJ: ids in [0, E) or -1 (skipped)."""
    if block_m not in BLOCK_MS:
        raise ValueError(f"moe_align: block_m must be one of {BLOCK_MS}, got {block_m}")
    idx = idx_TJ.to(torch.int32).contiguous().view(-1)
    P = idx.numel()
    nbmax = max_blocks(P, E, block_m)
    dev = idx.device
    cnt = torch.empty(E, dtype=torch.int32, device=dev)
    rows = torch.empty(nbmax * block_m, dtype=torch.int32, device=dev)
    blk_e = torch.empty(nbmax, dtype=torch.int32, device=dev)
    nblk = torch.empty(1, dtype=torch.int32, device=dev)
    _moe_count_kernel[(E,)](idx, cnt, P, CH=_CH, num_warps=4)
    _moe_align_kernel[(E,)](idx, cnt, rows, blk_e, nblk, P, E, BM=block_m, EPAD=triton.next_power_of_2(E), CH=_CH,
                            num_warps=4)
    return rows, blk_e, nblk


@triton.jit
def _block_rows(rows_ptr, blk_e_ptr, mb, BM: tl.constexpr):
    """M-block mb: its expert, sorted row indices [BM], their pairs and which rows hold one."""
    e = tl.load(blk_e_ptr + mb)
    r = mb * BM + tl.arange(0, BM)
    pair = tl.load(rows_ptr + r)
    return e, r, pair, pair >= 0


@triton.jit
def _grouped_gate_up_kernel(x8_ptr, sx_ptr, rows_ptr, blk_e_ptr, nblk_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr,
                            h8_ptr, hs_ptr, D, I, stride_we, stride_se, stride_sn,
                            TOPK: tl.constexpr, BM: tl.constexpr):
    NB = I // 128
    G = D // 128
    offs = tl.arange(0, 128)
    for w in range(tl.program_id(0), tl.load(nblk_ptr) * NB, tl.num_programs(0)):
        mb = w // NB
        nb = w % NB
        e, r, pair, valid = _block_rows(rows_ptr, blk_e_ptr, mb, BM)
        tok = tl.where(valid, pair // TOPK, 0)
        offs_n = nb * 128 + offs
        w_off = e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * D + offs[None, :]
        x_ptrs = x8_ptr + tok.to(tl.int64)[:, None] * D + offs[None, :]
        sx_ptrs = sx_ptr + tok * G
        s1_row = s1_ptr + e.to(tl.int64) * stride_se + nb * stride_sn
        s3_row = s3_ptr + e.to(tl.int64) * stride_se + nb * stride_sn
        acc1 = tl.zeros((128, BM), dtype=tl.float32)
        acc3 = tl.zeros((128, BM), dtype=tl.float32)
        for g in range(0, G):
            w1 = tl.load(w1_ptr + w_off + g * 128)
            w3 = tl.load(w3_ptr + w_off + g * 128)
            xt = tl.trans(tl.load(x_ptrs + g * 128, mask=valid[:, None], other=0.0))
            sx = tl.load(sx_ptrs + g, mask=valid, other=0.0)
            acc1 += tl.dot(w1, xt) * (sx * tl.load(s1_row + g))[None, :]
            acc3 += tl.dot(w3, xt) * (sx * tl.load(s3_row + g))[None, :]
        h = acc1 / (1.0 + tl.exp(-acc1)) * acc3  # [128, BM]
        sh, inv = ue8m0_scale(tl.max(tl.abs(h), axis=0))
        tl.store(h8_ptr + r.to(tl.int64)[None, :] * I + offs_n[:, None], quant_e4m3(h, inv[None, :]))
        tl.store(hs_ptr + r * NB + nb, sh)


@triton.jit
def _grouped_down_kernel(h8_ptr, hs_ptr, rows_ptr, blk_e_ptr, nblk_ptr, rw_ptr, w2_ptr, s2_ptr, out_ptr,
                         D, I, stride_we, stride_se, stride_sn, BM: tl.constexpr):
    NB = tl.cdiv(D, 128)
    GI = I // 128
    offs = tl.arange(0, 128)
    for w in range(tl.program_id(0), tl.load(nblk_ptr) * NB, tl.num_programs(0)):
        mb = w // NB
        nb = w % NB
        e, r, pair, valid = _block_rows(rows_ptr, blk_e_ptr, mb, BM)
        offs_n = nb * 128 + offs
        nmask = offs_n < D
        w_ptrs = w2_ptr + e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * I + offs[None, :]
        h_ptrs = h8_ptr + r.to(tl.int64)[:, None] * I + offs[None, :]
        s_row = s2_ptr + e.to(tl.int64) * stride_se + nb * stride_sn
        acc = tl.zeros((128, BM), dtype=tl.float32)
        for g in range(0, GI):
            wt = tl.load(w_ptrs + g * 128, mask=nmask[:, None], other=0.0)
            h = tl.load(h_ptrs + g * 128)  # padding rows were written too (h = 0)
            acc += tl.dot(wt, tl.trans(h)) * (tl.load(hs_ptr + r * GI + g) * tl.load(s_row + g))[None, :]
        acc = acc * tl.load(rw_ptr + pair, mask=valid, other=0.0)[None, :]
        dst = out_ptr + pair.to(tl.int64)[None, :] * D + offs_n[:, None]
        tl.store(dst, acc, mask=valid[None, :] & nmask[:, None])


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def grouped_partials(x_TD: torch.Tensor, idx_TJ: torch.Tensor, w_TJ: torch.Tensor, w_gate, s_gate, w_up, s_up,
                     w_down, s_down, block_m: int | None = None, stages: tuple[int, int] | None = None,
                     programs: tuple[int, int] | None = None, warps: int | None = None) -> torch.Tensor:
    """part [P, D] fp32: row p = t * J + j holds w[t, j] * Expert_idx[t, j](x[t]); rows of -1 slots are not written.
    `moe.moe_experts(layout='grouped')` checks the arguments and sums the slots. block_m: token rows per M-block
    (`BLOCK_MS`, default `default_block_m`); stages: (gate/up, down) pipeline depths; programs: the persistent
    grids (default 2 per SM each); warps: per program (default 4, 8 from 64 rows)."""
    T, D = x_TD.shape
    J = idx_TJ.shape[1]
    E, I = w_gate.shape[0], w_gate.shape[1]
    P = T * J
    bm = block_m or default_block_m(T)
    rows, blk_e, nblk = moe_align(idx_TJ, E, bm)
    x8, sx = act_quant(x_TD)
    dev = x_TD.device
    R = rows.numel()
    h8 = torch.empty(R, I, dtype=FP8_DTYPE, device=dev)
    hs = torch.empty(R, I // BLOCK, dtype=torch.float32, device=dev)
    part = torch.empty(P, D, dtype=torch.float32, device=dev)
    sm = _sm_count(dev)
    g_gu, g_dn = programs or (2 * sm, 2 * sm)
    st_gu, st_dn = stages or (3, 4)
    nw = warps or (8 if bm >= 64 else 4)
    nbmax = R // bm
    _grouped_gate_up_kernel[(max(1, min(g_gu, nbmax * (I // BLOCK))),)](
        x8, sx, rows, blk_e, nblk, w_gate, s_gate, w_up, s_up, h8, hs, D, I, w_gate.stride(0), s_gate.stride(0),
        s_gate.stride(1), TOPK=J, BM=bm, num_stages=st_gu, num_warps=nw)
    _grouped_down_kernel[(max(1, min(g_dn, nbmax * triton.cdiv(D, BLOCK))),)](
        h8, hs, rows, blk_e, nblk, w_TJ.float().contiguous(), w_down, s_down, part, D, I, w_down.stride(0),
        s_down.stride(0), s_down.stride(1), BM=bm, num_stages=st_dn, num_warps=nw)
    return part
