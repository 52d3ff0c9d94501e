"""mla_decode's stage 2 (the merge of its key splits) with the absorbed output projection, in one launch (Triton).

Shape legend: n = B*T tokens (<= absorb.MAX_TOKENS), H heads, C = 512 latent channels, V value channels, NS key
splits of stage 1; a row is one (b, t, h).

Unfused, an absorbed decode ends in two launches: `mla_decode`'s stage 2 merges the NS partial results of every row
by their log-sum-exp and stores the latent output o_lat [n, H, C] in bf16, then `absorb.absorb_out` reads it back
and multiplies each head's rows by that head's W_vb [V, C]: o [n, H, V]. Here the absorb kernel's programs (one per
head and block of output channels, the same grid) merge the splits of their head's rows themselves, 128 latent
channels at a time, round them to the latent dtype where stage 2 stored them, and feed them to the same
tensor-core product (`absorb.dot_acc`, same tiles: token rows `token_block(n)`, 128 channels per step, output block
`out_block(H, V)`), so o is bit-identical to stage 2 + absorb_out. The merge is `merge_splits`, which stage 2
runs too (elementwise per row and channel, the weights summed in split order: the same bits in either kernel).

A program merges its head's rows for every one of its head's V / block output programs (8 at a TP=8 rank, 16 heads,
block 16): the partial results are re-read from L2 (n x NS x 2 KB per program) instead of written and read back
as o_lat; `block_v` trades programs for re-reads. Measured (BENCHMARKS.md, session 11; one TP=8 rank on an H200, 61
layers): the re-reads cost more than the launch saves, 0.3-0.6 ms a step at 1k and 0.9-1.6 ms at 32k (more key
splits), so the fast path keeps the two launches by default (`FastPathOptions.fuse_absorb_out` off).
"""

from __future__ import annotations

import torch

from mtp.kernels._triton import line_elems, pdl_kwargs, pdl_launch, pdl_mode, pdl_wait, require, tl, triton
from mtp.kernels.absorb import MAX_TOKENS, dot_acc, out_block, prefetch_weight_tile, token_block, weight_prefetch

__all__ = ["merge_splits", "stage2_absorb"]

LATENT = 512


@triton.jit
def merge_splits(o_ptr, lse_ptr, row, c, NS, NSP: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """The NS partial results of rows `row` ([R, 1] int64 (b, t, h) rows) at channels c ([1, C]) merged by their
    log-sum-exp (base 2): fp32 [R, C], zeros for a row no split saw a key of. The weights are summed in split
    order, in the loop that adds the parts (not a tree sum, whose order follows the tensor's layout), so a row
    gets the same bits in any kernel that merges it."""
    sidx = tl.arange(0, NSP)
    lse = tl.load(lse_ptr + row * NS + sidx[None, :], mask=sidx[None, :] < NS, other=float("-inf"))
    m = tl.max(lse, axis=1, keep_dims=True)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros((R, C), dtype=tl.float32)
    tot = tl.zeros((R, 1), dtype=tl.float32)
    for s in range(NS):
        w = tl.exp2(tl.load(lse_ptr + row * NS + s) - m_safe)  # an empty split weighs 0
        acc += w * tl.load(o_ptr + (row * NS + s) * 512 + c)
        tot += w
    return acc / tl.where(tot > 0, tot, 1.0)


@triton.jit
def _stage2_absorb_kernel(o_ptr, lse_ptr, w_ptr, y_ptr, n_tok, NS, stride_wh, stride_wk, stride_wo,
                          H: tl.constexpr, V: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
                          NSP: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, PF: tl.constexpr,
                          LINE: tl.constexpr):
    """y[n, h, o] = sum_k round(merge(n, h)[k]) * w[h, o, k], o in this program's block (absorb's kernel, its x
    merged here instead of loaded). PDL: the W_vb tile asked of L2 (PF: how; 0 none) before the wait for stage 1's
    results."""
    pdl_launch(PDL)
    h = tl.program_id(0)
    ob = tl.program_id(1)
    if PDL:
        prefetch_weight_tile(w_ptr, h, ob * BO, stride_wh, stride_wk, stride_wo, 512, BO, PF, LINE)
    pdl_wait(PDL)
    t = tl.arange(0, BT)
    o = ob * BO + tl.arange(0, BO)
    tmask = t < n_tok
    # rows past the tokens merge token 0's row: a product row depends on its own x row only, and is not stored
    row = (tl.where(tmask, t, 0).to(tl.int64) * H + h)[:, None]
    acc = tl.zeros((BT, BO), dtype=tl.float32)
    for k0 in tl.static_range(0, 512, BK):
        k = k0 + tl.arange(0, BK)
        x = merge_splits(o_ptr, lse_ptr, row, k[None, :], NS, NSP, BT, BK).to(w_ptr.dtype.element_ty)
        w = tl.load(w_ptr + h * stride_wh + k[:, None] * stride_wk + o[None, :] * stride_wo)
        acc = dot_acc(acc, x, w, IEEE)
    y = y_ptr + (t[:, None] * H + h) * V + o[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=tmask[:, None])


def stage2_absorb(o_part: torch.Tensor, lse: torch.Tensor, splits: int, w_vb_HVC: torch.Tensor, B: int, T: int,
                  block_v: int | None = None, pdl: bool = False, prefetch: bool = True) -> torch.Tensor:
    """o [B, T, H, V] in W_vb's dtype from stage 1's partial results (o_part [B*T*H*splits, 512] fp32, lse
    [B*T*H*splits] fp32, base 2): `absorb_out(stage 2's o_lat in W_vb's dtype, w_vb)` in one launch, the same bits.
    block_v: output channels per program (default `absorb.out_block`, absorb_out's; a power of two >= 16
    dividing V). pdl: programmatic dependent launch (`_triton.pdl_kwargs`), the W_vb tile asked of L2 before the
    wait unless not prefetch (`FastPathOptions.prefetch_at`: compiled out, the same bits)."""
    require(o_part, "stage2_absorb")
    H, V, C = w_vb_HVC.shape
    n = B * T
    if C != LATENT or not 1 <= n <= MAX_TOKENS:
        raise ValueError(f"stage2_absorb: w_vb must be [H, V, {LATENT}] and 1..{MAX_TOKENS} tokens, got "
                         f"{list(w_vb_HVC.shape)} and {n} tokens")
    if o_part.shape != (n * H * splits, LATENT) or lse.shape != (n * H * splits,):
        raise ValueError(f"stage2_absorb: o_part must be [{n * H * splits}, {LATENT}] and lse [{n * H * splits}] "
                         f"(B*T*H*splits), got {list(o_part.shape)}, {list(lse.shape)}")
    bo = block_v or out_block(H, V)
    if bo < 16 or bo & (bo - 1) or V % bo:
        raise ValueError(f"stage2_absorb: block_v must be a power of two >= 16 dividing V = {V}, got {bo}")
    y = torch.empty(B, T, H, V, dtype=w_vb_HVC.dtype, device=o_part.device)
    launch = pdl_kwargs(pdl, o_part)
    _stage2_absorb_kernel[(H, V // bo)](o_part, lse, w_vb_HVC, y, n, splits, w_vb_HVC.stride(0), w_vb_HVC.stride(2),
                                        w_vb_HVC.stride(1), H=H, V=V, BO=bo, BK=128, BT=token_block(n),
                                        NSP=triton.next_power_of_2(splits), IEEE=w_vb_HVC.dtype == torch.float32,
                                        PDL=pdl_mode(pdl, launch),
                                        PF=weight_prefetch(w_vb_HVC.stride(2), w_vb_HVC.stride(1),
                                                           bool(launch) and prefetch),
                                        LINE=line_elems(w_vb_HVC), num_warps=4, **launch)
    return y
