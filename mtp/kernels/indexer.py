"""Lightning-indexer scores over the FP8 key cache (Triton) and top-k selection, with a torch reference.

Shape legend: B batch rows, T queries per row (<= 8), H indexer heads (64), D = 128 head dim, S cache
capacity, J = topk (2048).
I[b, t, s] = sum_h w[b, t, h] * relu(q[b, t, h] . k[b, s]) with q = q8 * q_scale (per (t, h)) and
k = k8 * k_scale (per key), for s < seq_lens[b] + t + 1 (and, for a draft tree's verify, visible[b, t, s]:
the committed keys plus the node's own ancestors), else -inf. Keys a node may not see are never candidates, so
the top-k is per node over what it sees, as `Indexer.select`. `w` carries any constant factor
(DeepSeek's 64^-0.5 * 128^-0.5). Scales are positive, so relu(qs * ks * d) = qs * ks * relu(d): the kernel
runs the fp8 dot on raw q8/k8 (tensor cores, fp32 accumulate) and applies both scales afterwards.

Kernel: one program per (b, BS-key block) loads the key tile once and loops over the T queries, each a
[H, D] x [D, BS] fp8 dot, ReLU, weighted sum over heads; or (`programs`) a grid of at most that many programs,
each walking its key blocks with the next tiles' loads in flight, on the same per-key code (`_score_query`). Top-k: `impl="radix"` (default) is the radix select
of `mtp.kernels.topk` (the reference's rule: ties to the lower position; positions ascending), `"radix_fused"`
the same with its histogram pass in the scores kernel's epilogue; `impl="torch"` is torch.topk on the scores
(ties in torch's order, 48-65 us at S = 32768 on an H200). `one_launch`: the radix select's three phases in one
launch (`topk_one_launch`); the scores with them in one launch: `indexer_one_launch` (which imports this module).
"""

from __future__ import annotations

import torch

from mtp.model.fp8 import FP8_DTYPE
from mtp.kernels._triton import device_lens, pdl_kwargs, pdl_launch, pdl_mode, pdl_wait, require, tl, triton
from mtp.kernels.topk import (add_to_histograms, drop_kept_workspace, histograms, kept_workspace, radix_topk,
                              score_keys, topk_workspace)
from mtp.kernels.topk_one_launch import radix_topk_one_launch

__all__ = ["SCORES_DEFAULT", "TOPK_IMPLS", "check_indexer_args", "indexer_scores", "indexer_scores_ref", "indexer_topk",
           "indexer_topk_ref", "topk_from_scores"]


def indexer_scores_ref(q8, q_scale, w, k8, k_scale, seq_lens, visible=None) -> torch.Tensor:
    """fp32 reference scores [B, T, S] (-inf where masked)."""
    B, T, H, D = q8.shape
    S = k8.shape[1]
    q = q8.float() * q_scale.float().unsqueeze(-1)
    k = k8.float() * k_scale.float().unsqueeze(-1)
    d = torch.einsum("bthd,bsd->bths", q, k).relu()
    score = torch.einsum("bth,bths->bts", w.float(), d)
    limit = seq_lens.view(B, 1, 1).to(q8.device).long() + torch.arange(T, device=q8.device).view(1, T, 1) + 1
    hidden = torch.arange(S, device=q8.device).view(1, 1, S) >= limit
    if visible is not None:
        hidden = hidden | ~visible.to(torch.bool)
    return score.masked_fill(hidden, float("-inf"))


def topk_from_scores(scores: torch.Tensor, topk: int, sorted: bool = False) -> torch.Tensor:
    """Indices [B, T, topk] int32 of the largest scores, in no particular order unless `sorted`; -1 for
    masked (-inf) picks and past S. Attention only needs the set; skipping the sort is cheaper."""
    B, T, S = scores.shape
    k = min(topk, S)
    vals, idx = torch.topk(scores, k, dim=-1, sorted=sorted)
    idx = torch.where(vals == float("-inf"), -1, idx).to(torch.int32)
    if k < topk:
        idx = torch.cat([idx, idx.new_full((B, T, topk - k), -1)], dim=-1)
    return idx


def indexer_topk_ref(q8, q_scale, w, k8, k_scale, seq_lens, topk: int = 2048, visible=None):
    scores = indexer_scores_ref(q8, q_scale, w, k8, k_scale, seq_lens, visible)
    return topk_from_scores(scores, topk), scores


@triton.jit
def _key_tile(k_ptr, ks_ptr, b64, offs_s, smask, S, D: tl.constexpr):
    """Row b's keys at offs_s, transposed for the dot ([D, BS] fp8), and their scales."""
    d = tl.arange(0, D)
    k = tl.load(k_ptr + (b64 * S + offs_s)[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
    ks = tl.load(ks_ptr + b64 * S + offs_s, mask=smask, other=0.0)
    return tl.trans(k), ks


@triton.jit
def _score_query(q_ptr, qs_ptr, w_ptr, vis_ptr, out_ptr, h16_ptr, h8_ptr, kt, ks, L, row, t, offs_s, smask, S,
                 H: tl.constexpr, D: tl.constexpr, HIST: tl.constexpr, VIS: tl.constexpr):
    """Scores of query row (b, t) over one key tile: the per-key math of both scores kernels, written once so
    that which program computes a key never changes its bits."""
    h = tl.arange(0, H)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (row * H + h)[:, None] * D + d[None, :])
    wq = tl.load(w_ptr + row * H + h) * tl.load(qs_ptr + row * H + h)
    logits = tl.dot(q, kt)  # [H, BS] fp32
    sc = tl.sum(tl.maximum(logits, 0.0) * wq[:, None], 0) * ks
    seen = offs_s < L + t + 1
    if VIS:  # a tree node: the committed keys and its own ancestors
        seen = seen & (tl.load(vis_ptr + row * S + offs_s, mask=smask, other=0) != 0)
    sc = tl.where(seen, sc, float("-inf"))
    tl.store(out_ptr + row * S + offs_s, sc, mask=smask)
    if HIST:  # the radix top-k's first pass, on the scores still in registers
        key, valid = score_keys(sc, smask & seen)
        h8 = add_to_histograms(h16_ptr + row * 65536, key, valid)
        bins = tl.arange(0, 256)
        tl.atomic_add(h8_ptr + row * 256 + bins, h8, mask=h8 > 0, sem="relaxed")


@triton.jit
def _indexer_kernel(q_ptr, qs_ptr, w_ptr, k_ptr, ks_ptr, lens_ptr, vis_ptr, out_ptr, h16_ptr, h8_ptr, T, S,
                    H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, HIST: tl.constexpr, VIS: tl.constexpr,
                    PDL: tl.constexpr):
    """One program per (row b, BS-key block): one key tile, no loop."""
    pdl_launch(PDL)
    pdl_wait(PDL)  # queries, weights, this step's keys, the re-armed histograms: earlier kernels'
    b = tl.program_id(0)
    offs_s = tl.program_id(1) * BS + tl.arange(0, BS)
    smask = offs_s < S
    b64 = b.to(tl.int64)
    kt, ks = _key_tile(k_ptr, ks_ptr, b64, offs_s, smask, S, D)
    L = tl.load(lens_ptr + b).to(tl.int32)
    for t in range(T):
        _score_query(q_ptr, qs_ptr, w_ptr, vis_ptr, out_ptr, h16_ptr, h8_ptr, kt, ks, L, b64 * T + t, t, offs_s,
                     smask, S, H, D, HIST, VIS)


@triton.jit
def _indexer_loop_kernel(q_ptr, qs_ptr, w_ptr, k_ptr, ks_ptr, lens_ptr, vis_ptr, out_ptr, h16_ptr, h8_ptr, S,
                         T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, HIST: tl.constexpr,
                         VIS: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr):
    """Programs (b, p) of a grid of P per row: program p walks key blocks p, p + P, ... with the next tiles'
    loads in flight (NUM_STAGES). T is a constexpr so that the queries' loop unrolls: Triton pipelines only
    loops without a nested loop."""
    pdl_launch(PDL)
    pdl_wait(PDL)  # as _indexer_kernel
    b = tl.program_id(0)
    b64 = b.to(tl.int64)
    L = tl.load(lens_ptr + b).to(tl.int32)
    for blk in tl.range(tl.program_id(1), tl.cdiv(S, BS), tl.num_programs(1), num_stages=NUM_STAGES):
        offs_s = blk * BS + tl.arange(0, BS)
        smask = offs_s < S
        kt, ks = _key_tile(k_ptr, ks_ptr, b64, offs_s, smask, S, D)
        for t in tl.static_range(T):
            _score_query(q_ptr, qs_ptr, w_ptr, vis_ptr, out_ptr, h16_ptr, h8_ptr, kt, ks, L, b64 * T + t, t,
                         offs_s, smask, S, H, D, HIST, VIS)


def check_indexer_args(name: str, q8, q_scale, w, k8, k_scale, visible) -> tuple[int, int, int, int, int]:
    """(B, T, H, D, S) of an indexer call's inputs, after checking what the scores kernels assume (errors name
    `name`)."""
    require(q8, name)
    B, T, H, D = q8.shape
    S = k8.shape[1]
    if q8.dtype != FP8_DTYPE or k8.dtype != FP8_DTYPE:
        raise TypeError(f"{name}: q8 and k8 must be {FP8_DTYPE}, got {q8.dtype}, {k8.dtype}")
    if k8.shape != (B, S, D) or k_scale.shape != (B, S) or q_scale.shape != (B, T, H) or w.shape != (B, T, H):
        raise ValueError(f"{name}: want k8 [B, S, {D}], k_scale [B, S], q_scale and w [B, T, H]; got "
                         f"{list(k8.shape)}, {list(k_scale.shape)}, {list(q_scale.shape)}, {list(w.shape)}")
    if H & (H - 1) or H < 16 or D & (D - 1) or D < 32:
        raise ValueError(f"{name}: H (>= 16) and D (>= 32) must be powers of two, got H = {H}, D = {D}")
    if visible is not None and (visible.dtype != torch.bool or tuple(visible.shape) != (B, T, S)):
        raise ValueError(f"{name}: visible must be bool [B, T, S] = [{B}, {T}, {S}], got {visible.dtype} "
                         f"{list(visible.shape)}")
    return B, T, H, D, S


# today's launch: one program per 64-key block, no loop (`_indexer_kernel`); what `indexer_topk` runs unless told
SCORES_DEFAULT = dict(block_s=64, num_warps=4, num_stages=3, programs=None)
MAX_LOOP_T = 8  # the looping kernel unrolls its T queries (a constexpr): one compile per T up to this


def indexer_scores(q8, q_scale, w, k8, k_scale, seq_lens, block_s: int = 64,
                   hist: torch.Tensor | None = None, visible: torch.Tensor | None = None, num_warps: int = 4,
                   num_stages: int = 3, programs: int | None = None, pdl: bool = False) -> torch.Tensor:
    """Kernel twin of `indexer_scores_ref`: scores [B, T, S] fp32. hist: a `topk.topk_workspace(B * T)`
    whose histograms the kernel fills for `radix_topk(..., workspace=hist)` (one launch fewer). visible: bool
    [B, T, S], the keys each query may see (a draft tree's verify), or None (causal).

    Launch settings (`SCORES_DEFAULT` is today's; the GPU sweep is `python -m mtp.bench.topk_moe --only topk`):
    block_s keys per tile, num_warps; programs None: one program per (row, block), no loop (`_indexer_kernel`);
    an int: at most that many programs in all, max(1, programs // B) per row, each walking its rows' blocks with
    num_stages tiles in flight (`_indexer_loop_kernel`, T <= MAX_LOOP_T). Every setting runs the same per-key
    code (`_score_query`) on the same tile shape per block_s: scores bit-identical to the default's wherever the
    compiler keeps the head sum's order for that block_s / num_warps (held on a GPU by the tests and the sweep's
    checks). pdl: programmatic dependent launch (`_triton.pdl_kwargs`)."""
    B, T, H, D, S = check_indexer_args("indexer_scores", q8, q_scale, w, k8, k_scale, visible)
    if block_s < 16 or block_s & (block_s - 1):
        raise ValueError(f"indexer_scores: block_s must be a power of two >= 16, got {block_s}")
    if programs is not None and (programs < 1 or T > MAX_LOOP_T):
        raise ValueError(f"indexer_scores: programs must be None or >= 1, with T <= {MAX_LOOP_T} queries per row; "
                         f"got programs = {programs}, T = {T}")
    out = torch.empty(B, T, S, dtype=torch.float32, device=q8.device)
    vis = visible.contiguous().view(torch.uint8) if visible is not None else out  # (unused pointer: no tree)
    lens = device_lens(seq_lens, q8.device)
    h16, h8 = histograms(hist, B * T) if hist is not None else (out, out)  # (unused pointers without hist)
    args = (q8.contiguous(), q_scale.float().contiguous(), w.float().contiguous(), k8.contiguous(),
            k_scale.float().contiguous(), lens, vis, out, h16, h8)
    launch = pdl_kwargs(pdl, q8)
    flags = dict(H=H, D=D, BS=block_s, HIST=hist is not None, VIS=visible is not None, num_warps=num_warps,
                 num_stages=num_stages, PDL=pdl_mode(pdl, launch), **launch)
    blocks = triton.cdiv(S, block_s)
    if programs is None:
        _indexer_kernel[(B, blocks)](*args, T, S, **flags)
    else:
        per_row = max(1, min(blocks, programs // B))
        _indexer_loop_kernel[(B, per_row)](*args, S, T=T, NUM_STAGES=num_stages, **flags)
    return out


TOPK_IMPLS = ("radix", "radix_fused", "torch")


def indexer_topk(q8, q_scale, w, k8, k_scale, seq_lens, topk: int = 2048, impl: str = "radix",
                 visible: torch.Tensor | None = None, rearm: bool = False, scores: dict | None = None,
                 one_launch: bool = False, pdl: bool = False, split_v2: bool = True):
    """(idx [B, T, topk] int32 with -1 padding, scores [B, T, S]) from the kernel's scores.
    impl: 'radix' (`mtp.kernels.topk.radix_topk`), 'radix_fused' (the same with its histogram pass done by the
    scores kernel: one launch fewer) or 'torch' (`topk_from_scores`). visible: as `indexer_scores` (the
    top-k then never picks a key the query may not see: its score is -inf, not a candidate). rearm (radix
    impls): the top-k workspace kept per (device, rows) and left zeroed by the top-k's last kernel
    (`topk.kept_workspace`): no memset launch per call. scores: the scores kernel's launch settings
    (`indexer_scores`' block_s, num_warps, num_stages, programs), over `SCORES_DEFAULT`. one_launch (radix impls):
    the radix select's three phases in one launch (`topk_one_launch.radix_topk_one_launch`, where the grid fits the
    SMs; the same index sets). pdl: the scores and the three-launch radix top-k with programmatic
    dependent launch (`_triton.pdl_kwargs`; torch.topk, the memset and the cooperative one-launch top-k stay plain).
    split_v2 (radix impls): the top-k kernels' V2 (`topk.radix_topk(split_v2=)`, switch topk_split_v2; the same index
    sets)."""
    if impl not in TOPK_IMPLS:
        raise ValueError(f"indexer_topk: impl must be one of {TOPK_IMPLS}, got {impl!r}")
    tune = dict(SCORES_DEFAULT, **(scores or {}))
    select = radix_topk_one_launch if one_launch else radix_topk
    chain = dict(split_v2=split_v2) if one_launch else dict(pdl=pdl, split_v2=split_v2)  # (one launch: no PDL)
    if impl == "radix_fused":
        R = q8.shape[0] * q8.shape[1]
        ws = kept_workspace(R, q8.device) if rearm else topk_workspace(R, q8.device)
        try:
            sc = indexer_scores(q8, q_scale, w, k8, k_scale, seq_lens, hist=ws, visible=visible, pdl=pdl, **tune)
        except BaseException:
            if rearm:  # the scores kernel may have counted into it before failing
                drop_kept_workspace(ws)
            raise
        return select(sc, seq_lens, topk, workspace=ws, rearm=rearm, **chain), sc
    sc = indexer_scores(q8, q_scale, w, k8, k_scale, seq_lens, visible=visible, pdl=pdl, **tune)
    if impl == "radix":
        return select(sc, seq_lens, topk, rearm=rearm, **chain), sc
    return topk_from_scores(sc, topk), sc
