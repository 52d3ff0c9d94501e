"""Two table lookups of every decode forward in one launch each (Triton): a vocabulary-parallel rank's embedding rows,
and the new tokens' cache slots with their rotary angles (a tree forward's with its visibility).

References (plain PyTorch, the ops they replace): `embed_rows_ref` (`mtp.parallel.modules.VocabParallelEmbedding`'s
lookup: 8 launches), `rope_slots_ref` (`mtp.model.layers.Rotary.slots`: the slots' add, then the angles' cast,
product, cos and sin, 5 launches) and `tree_slots_ref` (`Rotary.tree_slots`: the slots' add, the first slot's two
and the depths' add, the angles' 4, `tree_visibility`'s 10: 18 launches; a tree forward's angles are those of its
nodes' positions, the tree's first slot + depth, the same table's rows). Shape legend: N tokens (B rows x T), D
width, Vl the rank's vocabulary rows, P positions of the angle table, R/2 rotary pairs, U tree slots, S key bound.

Why: a CUDA-graph decode step pays per launch (~1 us of GPU plus its gap each). An eagle k = 3 step of a TP=8 rank
runs 4 forwards (the verify and 3 MTP module drafts), each with both: ~52 launches a step (session 20's profile:
the compare / and / not / where / clamp / indexSelect / cos / sin rows, ~1.2-3 us each).
Exact: an embedding row is copied (or zeros outside the rank's rows: +0.0, as masked_fill's 0); an angle is read
from a table the reference's own ops computed (`Rotary.angles` over 0..P-1: the same cast, product, cos and sin of
the same position, elementwise), so the same bits as computing it per step.
PDL (`_triton.pdl_launch` / `pdl_wait`, switches pdl and glue_pdl): both read rows at addresses an earlier kernel's
output gives (the ids, the lengths), so each program waits first thing; only the launch overlaps the kernel before.
In a forward the embedding follows the slots' gather, whose trigger lets it launch while that kernel runs.
The visibility is exact too: bools from integer compares and the mask's bytes, as `tree_visibility`'s.
"""

from __future__ import annotations

import torch

from mtp.kernels._triton import (HAS_TRITON, interpreting, pdl_kwargs, pdl_launch, pdl_mode, pdl_wait, require, tl,
                                 triton)

__all__ = ["embed_rows", "embed_rows_ref", "embed_takes", "rope_slots", "rope_slots_ref", "rope_takes", "tree_slots",
           "tree_slots_ref", "tree_takes"]

EMBED_BLOCK = 1024  # channels per program: 7 programs per token at D = 7168, 8 bf16 a thread at 4 warps
VIS_BLOCK = 1024  # visibility slots per program: 8 bools a thread at 4 warps; 2 column blocks at a 1k context


def _runs_on(t: torch.Tensor) -> bool:
    return HAS_TRITON and (t.is_cuda or (interpreting() and t.device.type == "cpu"))


# ----------------------------------------------------------------------------- vocabulary-parallel embedding
def embed_rows_ref(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """Rows ids - start of weight [Vl, D] for the ids this rank holds (start <= id < start + Vl), zeros for the
    others: `VocabParallelEmbedding`'s lookup before its all-reduce."""
    local = ids - start
    inside = (local >= 0) & (local < weight.shape[0])
    out = torch.nn.functional.embedding(local.clamp(0, weight.shape[0] - 1), weight)
    return out.masked_fill(~inside.unsqueeze(-1), 0)


@triton.jit
def _embed_kernel(ids_ptr, w_ptr, out_ptr, start, V, D, T, stride_ib, stride_it, stride_w,
                  BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_launch(PDL)
    pdl_wait(PDL)  # the ids are an earlier kernel's, and the rows read depend on them
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    tok = tl.load(ids_ptr + (n // T) * stride_ib + (n % T) * stride_it)
    local = tok - start
    inside = (local >= 0) & (local < V)
    d = c * BLOCK + tl.arange(0, BLOCK)
    m = d < D
    row = tl.load(w_ptr + tl.where(inside, local, 0) * stride_w + d, mask=m & inside, other=0.0)
    tl.store(out_ptr + n * D + d, row, mask=m)


def embed_takes(ids: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `embed_rows` takes these: int64 ids [B, T] or [N], a weight [Vl, D] with a unit last stride, on a CUDA
    device (or the interpreter's CPU), without autograd."""
    return (_runs_on(ids) and ids.device == weight.device and ids.dtype == torch.long and ids.dim() in (1, 2)
            and weight.dim() == 2 and weight.stride(1) == 1 and weight.shape[0] > 0
            and not (weight.requires_grad and torch.is_grad_enabled()))


def embed_rows(ids: torch.Tensor, weight: torch.Tensor, start: int, pdl: int = 0) -> torch.Tensor:
    """`embed_rows_ref` in one launch: [*ids.shape, D] in weight's dtype (ids read through their strides). pdl:
    programmatic dependent launch (`_triton.pdl_kwargs`; `FastPathOptions.glue_pdl_at`'s value)."""
    require(ids, "embed_rows")
    if not embed_takes(ids, weight):
        raise ValueError(f"embed_rows: takes int64 ids [B, T] or [N] and a weight [Vl, D] (unit last stride) on one "
                         f"device, no autograd; got ids {ids.dtype} {list(ids.shape)} on {ids.device}, weight "
                         f"{list(weight.shape)} {weight.stride()} on {weight.device}")
    D = weight.shape[1]
    out = torch.empty((*ids.shape, D), dtype=weight.dtype, device=weight.device)
    ids2 = ids.unsqueeze(0) if ids.dim() == 1 else ids
    N, T = ids2.numel(), ids2.shape[1]
    if N:
        launch = pdl_kwargs(pdl, ids2)
        _embed_kernel[(N, triton.cdiv(D, EMBED_BLOCK))](ids2, weight, out, start, weight.shape[0], D, T,
                                                        ids2.stride(0), ids2.stride(1), weight.stride(0),
                                                        BLOCK=EMBED_BLOCK, PDL=pdl_mode(pdl, launch), num_warps=4,
                                                        **launch)
    return out


# ----------------------------------------------------------------------------- slots and rotary angles
def rope_slots_ref(seq_lens_B: torch.Tensor, T: int, inv_freq: torch.Tensor):
    """(pos [B, T] = seq_lens[b] + t, cos, sin [B, T, R/2] fp32): `Rotary.slots`."""
    pos_BT = seq_lens_B.unsqueeze(1) + torch.arange(T, device=seq_lens_B.device)
    ang = pos_BT.float().unsqueeze(-1) * inv_freq
    return pos_BT, ang.cos(), ang.sin()


@triton.jit
def _rope_slots_kernel(lens_ptr, cos_tab_ptr, sin_tab_ptr, pos_ptr, cos_ptr, sin_ptr, T, R2,
                       BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    pdl_launch(PDL)
    pdl_wait(PDL)  # the lengths are an earlier kernel's (the last commit), and the table rows read depend on them
    n = tl.program_id(0).to(tl.int64)
    pos = tl.load(lens_ptr + n // T) + n % T
    tl.store(pos_ptr + n, pos)
    r = tl.arange(0, BLOCK_R)
    m = r < R2
    tl.store(cos_ptr + n * R2 + r, tl.load(cos_tab_ptr + pos * R2 + r, mask=m), mask=m)
    tl.store(sin_ptr + n * R2 + r, tl.load(sin_tab_ptr + pos * R2 + r, mask=m), mask=m)


def rope_takes(seq_lens_B: torch.Tensor) -> bool:
    """Whether `rope_slots` takes these lengths: int64 [B] (unit stride) on a device that runs kernels (the tables must
    be there too)."""
    return (_runs_on(seq_lens_B) and seq_lens_B.dtype == torch.long and seq_lens_B.dim() == 1
            and seq_lens_B.stride(0) == 1)


def rope_slots(seq_lens_B: torch.Tensor, T: int, cos_PR: torch.Tensor, sin_PR: torch.Tensor, pdl: int = 0):
    """`rope_slots_ref` in one launch, the angles read from tables cos_PR / sin_PR [P, R/2] fp32 (contiguous) that
    hold `Rotary.angles` of positions 0..P-1: the caller bounds every slot below P (no check on the device). pdl:
    programmatic dependent launch (`_triton.pdl_kwargs`; `FastPathOptions.glue_pdl_at`'s value)."""
    require(seq_lens_B, "rope_slots")
    if not rope_takes(seq_lens_B) or cos_PR.device != seq_lens_B.device:
        raise ValueError(f"rope_slots: takes int64 lengths [B] (unit stride) on the table's device; got "
                         f"{seq_lens_B.dtype} {list(seq_lens_B.shape)} on {seq_lens_B.device}, table on "
                         f"{cos_PR.device}")
    B, R2 = seq_lens_B.shape[0], cos_PR.shape[1]
    dev = seq_lens_B.device
    pos = torch.empty(B, T, dtype=torch.long, device=dev)
    cos = torch.empty(B, T, R2, dtype=cos_PR.dtype, device=dev)
    sin = torch.empty(B, T, R2, dtype=sin_PR.dtype, device=dev)
    if B * T:
        launch = pdl_kwargs(pdl, seq_lens_B)
        _rope_slots_kernel[(B * T,)](seq_lens_B, cos_PR, sin_PR, pos, cos, sin, T, R2,
                                     BLOCK_R=triton.next_power_of_2(R2), PDL=pdl_mode(pdl, launch), num_warps=1,
                                     **launch)
    return pos, cos, sin


# ------------------------------------------------------------------------- a tree forward's slots, angles, visibility
def tree_slots_ref(seq_lens_B: torch.Tensor, T: int, depth: torch.Tensor, mask_TU: torch.Tensor, S: int,
                   inv_freq: torch.Tensor):
    """(pos [B, T] = seq_lens[b] + t, cos, sin [B, T, R/2] fp32 of positions first[b] + depth, visible [B, T, S]
    bool), first = seq_lens + T - U: `Rotary.tree_slots` (depth [T] or [B, T], mask [T, U] or [B, T, U])."""
    from mtp.model.layers import tree_visibility

    pos_BT = seq_lens_B.unsqueeze(1) + torch.arange(T, device=seq_lens_B.device)
    first_B = seq_lens_B + T - mask_TU.shape[-1]
    ang = (first_B.unsqueeze(1) + depth).expand_as(pos_BT).float().unsqueeze(-1) * inv_freq
    return pos_BT, ang.cos(), ang.sin(), tree_visibility(first_B, mask_TU, S)


@triton.jit
def _tree_slots_kernel(lens_ptr, depth_ptr, mask_ptr, cos_tab_ptr, sin_tab_ptr, pos_ptr, cos_ptr, sin_ptr, vis_ptr,
                       T, U, S, R2, stride_db, stride_dt, stride_mb, stride_mt, stride_mu,
                       BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    pdl_launch(PDL)
    pdl_wait(PDL)  # the lengths are an earlier kernel's (the last commit), and every address here depends on them
    n = tl.program_id(0).to(tl.int64)  # the node b * T + t
    c = tl.program_id(1)  # its block of visibility slots
    b, t = n // T, n % T
    seq_len = tl.load(lens_ptr + b)
    first = seq_len + T - U
    if c == 0:  # the node's slot and angles, once
        tl.store(pos_ptr + n, seq_len + t)
        row = first + tl.load(depth_ptr + b * stride_db + t * stride_dt)
        r = tl.arange(0, BLOCK_R)
        m = r < R2
        tl.store(cos_ptr + n * R2 + r, tl.load(cos_tab_ptr + row * R2 + r, mask=m), mask=m)
        tl.store(sin_ptr + n * R2 + r, tl.load(sin_tab_ptr + row * R2 + r, mask=m), mask=m)
    s = c * BLOCK_S + tl.arange(0, BLOCK_S)
    u = s - first
    inside = (u >= 0) & (u < U) & (s < S)
    seen = tl.load(mask_ptr + b * stride_mb + t * stride_mt + u * stride_mu, mask=inside, other=0)
    tl.store(vis_ptr + n * S + s, ((u < 0) | (seen != 0)).to(tl.uint8), mask=s < S)


def tree_takes(seq_lens_B: torch.Tensor, depth: torch.Tensor, mask_TU: torch.Tensor) -> bool:
    """Whether `tree_slots` takes these: `rope_takes`' lengths, int64 depths [T] or [B, T] and a bool mask [T, U] or
    [B, T, U] (any strides) on their device, without autograd."""
    B = seq_lens_B.shape[0] if seq_lens_B.dim() == 1 else -1
    return (rope_takes(seq_lens_B) and depth.device == mask_TU.device == seq_lens_B.device
            and depth.dtype == torch.long and mask_TU.dtype == torch.bool
            and (depth.dim() == 1 or (depth.dim() == 2 and depth.shape[0] == B))
            and (mask_TU.dim() == 2 or (mask_TU.dim() == 3 and mask_TU.shape[0] == B))
            and not (mask_TU.requires_grad and torch.is_grad_enabled()))


def tree_slots(seq_lens_B: torch.Tensor, T: int, depth: torch.Tensor, mask_TU: torch.Tensor, S: int,
               cos_PR: torch.Tensor, sin_PR: torch.Tensor, pdl: int = 0):
    """`tree_slots_ref` in one launch: every node's slot and angles (read from the tables of `rope_slots`) and its
    visibility row, over a (node, block of VIS_BLOCK slots) grid. The caller bounds every slot below S and S by the
    table's P, and gives a first slot >= 0 (no check on the device): a tree's node u (of U) has a depth <= u, so its
    angle row first + depth is at most its slot. pdl: as `rope_slots`."""
    require(seq_lens_B, "tree_slots")
    if not tree_takes(seq_lens_B, depth, mask_TU) or cos_PR.device != seq_lens_B.device:
        raise ValueError(f"tree_slots: takes int64 lengths [B] (unit stride), int64 depths [T] or [B, T] and a bool "
                         f"mask [T, U] or [B, T, U] on the table's device; got lengths {seq_lens_B.dtype} "
                         f"{list(seq_lens_B.shape)}, depths {depth.dtype} {list(depth.shape)}, mask {mask_TU.dtype} "
                         f"{list(mask_TU.shape)} on {seq_lens_B.device}, table on {cos_PR.device}")
    B, R2, U = seq_lens_B.shape[0], cos_PR.shape[1], mask_TU.shape[-1]
    if depth.shape[-1] != T or mask_TU.shape[-2] != T or U < T:
        raise ValueError(f"tree_slots: depths [T] / [B, T] and mask [T, U] / [B, T, U] with T = {T} <= U, got "
                         f"{list(depth.shape)} and {list(mask_TU.shape)}")
    dev = seq_lens_B.device
    pos = torch.empty(B, T, dtype=torch.long, device=dev)
    cos = torch.empty(B, T, R2, dtype=cos_PR.dtype, device=dev)
    sin = torch.empty(B, T, R2, dtype=sin_PR.dtype, device=dev)
    vis = torch.empty(B, T, S, dtype=torch.bool, device=dev)
    if B * T:
        d2 = depth if depth.dim() == 2 else depth.unsqueeze(0).expand(B, T)  # stride 0 over the rows
        m3 = mask_TU if mask_TU.dim() == 3 else mask_TU.unsqueeze(0).expand(B, T, U)
        launch = pdl_kwargs(pdl, seq_lens_B)
        _tree_slots_kernel[(B * T, max(triton.cdiv(S, VIS_BLOCK), 1))](
            seq_lens_B, d2, m3.view(torch.uint8), cos_PR, sin_PR, pos, cos, sin, vis.view(torch.uint8), T, U, S, R2,
            d2.stride(0), d2.stride(1), *m3.stride(), BLOCK_R=triton.next_power_of_2(R2), BLOCK_S=VIS_BLOCK,
            PDL=pdl_mode(pdl, launch), num_warps=4, **launch)
    return pos, cos, sin, vis
