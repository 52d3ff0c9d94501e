"""A chain step's bookkeeping after verification in one launch (Triton): accept, commit and count.

Reference: `mtp.decode.accept`'s `accept`, `commit` (a chain's: the draft window, no tree path, no thinking state) and
`count`, plain PyTorch (tests/kernels/test_step_commit.py holds this kernel to them, tensor for tensor). Shape legend:
B rows, K drafts, K1 = K + 1 candidate tokens per row, S buffer positions, NS stop ids.

Why: those three functions are ~55 small torch launches a step (cat, index_put, isin, argmax, minimum, where,
scatter, gather, the counters' adds and copies), each ~1 us of GPU plus its gap in the step's CUDA graph: ~65 us
of an eagle k = 3 step's ~8 ms (one H200, a TP=8 rank, session 20's profile: the add / compare / where / copy
rows). Every value is an integer, so one program can do it all for a batch of rows, in registers, exactly.

Per row b (active: not finished when the step began; a finished row commits nothing and counts nothing):
  a = accept_len if active else 0; new[:K] = drafts, new[K] = 0, new[a] = the target's token;
  the first stop token among new[:a + 1] (or none) cuts the kept count: keep = min(a + 1, first stop + 1, room)
  with room = max_new - generated, 0 if inactive; tokens[n + i] = new[i] for i < keep (positions clamped to the
  buffer as `commit` clamps them: the kept ones never reach its end, see `mtp.spec.options.draft_room`);
  n += keep; generated += keep; finished |= a kept stop | generated >= max_new; the cache's lengths = n - 1; the
  draft window's start = max(n - 1 - W, 0); hist[b, a] += active; relaxed_only += relaxed_only_B[b] * active;
  row_steps += active; new_BK1 = new; keep_B = keep; acc_B = min(a, keep).
Strict verification (switch strict_commit, `verify.strict.strict_verdict`): the kernel takes the target's argmax
[B, K1] instead of a verdict and makes the verdict itself (a = the drafts' leading run equal to the argmax, the
argmax at a, nothing relaxed): the torch ops' compare, cumprod, sum, gather and zeros_like (5 launches) fold in.
One program holds every row: the counters' sums need no atomics, and B x K1 is a few hundred integers at most.
A tree step (`mtp.decode.tree_step`) runs the same kernel on the drafts along its verdict's path (K its depth), with no
draft window (window None: p0 untouched); the cache's lengths it writes, n - 1, are what the tree's compaction of the
kept path's slots (`KVCache.compact` or `kernels.tree_commit`, after this launch) sets them to.
PDL (`_triton.pdl_launch` / `pdl_wait`, switches pdl and glue_pdl): every input but the stop ids is an earlier
kernel's (the verdict, the drafts, the state the step's forwards and the previous commit wrote), so the program waits
first thing; only its launch overlaps the kernel before it.
"""

from __future__ import annotations

import torch

from mtp.kernels._triton import (HAS_TRITON, interpreting, pdl_kwargs, pdl_launch, pdl_mode, pdl_wait, require, tl,
                                 triton)

__all__ = ["chain_commit", "chain_commit_takes", "MAX_ROWS", "MAX_K1", "MAX_STOPS"]

MAX_ROWS = 1024  # one program holds [rows, K1] integers in registers
MAX_K1 = 64
MAX_STOPS = 64  # compared one by one (an unrolled loop)


@triton.jit
def _chain_commit_kernel(tok_ptr, n_ptr, gen_ptr, max_new_ptr, fin_ptr, lens_ptr, p0_ptr, hist_ptr, relaxed_ptr,
                         steps_ptr, new_ptr, keep_ptr, acc_ptr, drafts_ptr, a_ptr, next_ptr, ro_ptr, stop_ptr,
                         B, K, W, S, stride_tok, stride_dr, stride_hist, stride_new, stride_tgt,
                         NS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K1: tl.constexpr, WINDOW: tl.constexpr,
                         STRICT: tl.constexpr, PDL: tl.constexpr):
    pdl_launch(PDL)
    pdl_wait(PDL)  # the verdict, drafts and state are earlier kernels' (the stop ids alone are not: too few to matter)
    rb = tl.arange(0, BLOCK_B)
    mb = rb < B
    i = tl.arange(0, BLOCK_K1)[None, :].to(tl.int64)
    b2 = rb[:, None].to(tl.int64)
    m2 = mb[:, None] & (i < K + 1)
    # accept (`accept.accept`)
    fin8 = tl.load(fin_ptr + rb, mask=mb, other=1)
    fin = fin8 != 0
    active = mb & (fin8 == 0)
    d = tl.load(drafts_ptr + b2 * stride_dr + i, mask=mb[:, None] & (i < K), other=0)
    if STRICT:  # the verdict from the target's argmax (`verify.strict.strict_verdict`): a_ptr holds it, [B, K1]
        tgt = tl.load(a_ptr + b2 * stride_tgt + i, mask=m2, other=0)
        a_v = tl.min(tl.where((d != tgt) & (i < K), i, K), axis=1)  # the drafts' leading run equal to the argmax
        nxt = tl.sum(tl.where(i == a_v[:, None], tgt, 0), axis=1)  # the argmax after it (of every row, as torch's)
        a = tl.where(active, a_v, 0)
    else:
        a = tl.where(active, tl.load(a_ptr + rb, mask=mb, other=0), 0)
        nxt = tl.load(next_ptr + rb, mask=mb, other=0)
    new = tl.where(i == a[:, None], nxt[:, None], d)
    is_stop = i < 0  # all False, [BLOCK_B, BLOCK_K1]
    for s in tl.static_range(NS):
        is_stop = is_stop | (new == tl.load(stop_ptr + s))
    is_stop = is_stop & m2 & (i <= a[:, None])
    first = tl.min(tl.where(is_stop, i, K + 1), axis=1)  # the first stop's index, K + 1 without one
    n = tl.load(n_ptr + rb, mask=mb, other=0)
    gen = tl.load(gen_ptr + rb, mask=mb, other=0)
    max_new = tl.load(max_new_ptr + rb, mask=mb, other=0)
    keep = tl.minimum(tl.minimum(a + 1, first + 1), max_new - gen)
    keep = tl.where(active, keep, 0)
    kept = m2 & (i < keep[:, None])
    stopped = tl.max((is_stop & kept).to(tl.int32), axis=1) > 0
    # commit (`accept.commit`, a chain's)
    pos = tl.minimum(n[:, None] + i, S - 1)
    tl.store(tok_ptr + b2 * stride_tok + pos, new, mask=kept)
    n = n + keep
    gen = gen + keep
    tl.store(n_ptr + rb, n, mask=mb)
    tl.store(gen_ptr + rb, gen, mask=mb)
    tl.store(fin_ptr + rb, (fin | stopped | (gen >= max_new)).to(tl.uint8), mask=mb)
    tl.store(lens_ptr + rb, n - 1, mask=mb)
    if WINDOW:  # a chain's draft window follows n (a tree's proposer keeps its own)
        tl.store(p0_ptr + rb, tl.maximum(n - 1 - W, 0), mask=mb)
    # count (`accept.count`)
    on = active.to(tl.int64)
    h_ptr = hist_ptr + rb.to(tl.int64) * stride_hist + a
    tl.store(h_ptr, tl.load(h_ptr, mask=mb, other=0) + on, mask=mb)
    if not STRICT:  # strict accepts argmaxes only: its relaxed count adds 0
        ro = tl.load(ro_ptr + rb, mask=mb, other=0)
        tl.store(relaxed_ptr, tl.load(relaxed_ptr) + tl.sum(ro * on, axis=0))
    tl.store(steps_ptr, tl.load(steps_ptr) + tl.sum(on, axis=0))
    tl.store(new_ptr + b2 * stride_new + i, new, mask=m2)
    tl.store(keep_ptr + rb, keep, mask=mb)
    tl.store(acc_ptr + rb, tl.minimum(a, keep), mask=mb)


def chain_commit_takes(tokens_BS: torch.Tensor, drafts_BK: torch.Tensor, stop_ids: torch.Tensor, *verdict) -> bool:
    """Whether `chain_commit` takes a step of these shapes: triton on a CUDA device (or its interpreter), int64 token
    buffer, drafts and verdict tensors (accept_len_B, next_token_B, relaxed_only_B), at most MAX_ROWS rows, MAX_K1
    candidates and MAX_STOPS stop ids."""
    if not HAS_TRITON or not (tokens_BS.is_cuda or interpreting()):
        return False
    B, K = drafts_BK.shape
    return (B <= MAX_ROWS and K + 1 <= MAX_K1 and 0 < stop_ids.numel() <= MAX_STOPS
            and all(t.dtype == torch.long for t in (tokens_BS, drafts_BK, stop_ids, *verdict)))


def chain_commit(tokens_BS: torch.Tensor, n_B: torch.Tensor, gen_B: torch.Tensor, max_new_B: torch.Tensor,
                 finished_B: torch.Tensor, seq_lens_B: torch.Tensor, p0_B: torch.Tensor, hist_BK1: torch.Tensor,
                 relaxed_only: torch.Tensor, row_steps: torch.Tensor, new_BK1: torch.Tensor, keep_B: torch.Tensor,
                 acc_B: torch.Tensor, drafts_BK: torch.Tensor, accept_len_B: torch.Tensor, next_token_B: torch.Tensor,
                 relaxed_only_B: torch.Tensor, stop_ids: torch.Tensor, window: int | None, pdl: int = 0,
                 target_BK1: torch.Tensor | None = None) -> None:
    """`accept` + a chain's `commit` (draft window `window`) + `count` of `mtp.decode.accept` in one launch, every
    output in place: tokens_BS [B, S], the row state (n_B, gen_B, finished_B bool, the target cache's seq_lens_B,
    the window start p0_B, untouched when window is None: a tree's step), the counters (hist_BK1 [B, K1],
    relaxed_only and row_steps 0-d) and the step's outputs (new_BK1 [B, K1], keep_B, acc_B); read: max_new_B,
    drafts_BK [B, K] (any row stride), the verdict (accept_len_B, next_token_B, relaxed_only_B) and stop_ids [NS].
    int64 throughout but finished_B. pdl: programmatic dependent launch (`_triton.pdl_kwargs`;
    `FastPathOptions.glue_pdl_at`'s value). `target_BK1` [B, K1] (unit last stride): the target's argmax, the verdict
    taken from it inside the launch as `verify.strict.strict_verdict` takes it (switch strict_commit), where the
    verdict's three tensors are then None."""
    require(tokens_BS, "chain_commit")
    B, K = drafts_BK.shape
    strict = target_BK1 is not None
    if strict:
        if target_BK1.shape != (B, K + 1) or target_BK1.stride(1) != 1:
            raise ValueError(f"chain_commit: target_BK1 must be [{B}, {K + 1}] with a unit last stride, got "
                             f"{list(target_BK1.shape)} strides {target_BK1.stride()}")
        # the three verdict pointers become the argmax's start (the kernel reads its rows by stride_tgt)
        accept_len_B = next_token_B = relaxed_only_B = target_BK1[:, 0]
    if not chain_commit_takes(tokens_BS, drafts_BK, stop_ids, accept_len_B, next_token_B, relaxed_only_B):
        raise ValueError(f"chain_commit: takes int64 tokens, drafts [B, K], stop ids and verdict with B <= {MAX_ROWS}, "
                         f"K + 1 <= {MAX_K1}, 1..{MAX_STOPS} stop ids; got tokens {tokens_BS.dtype}, drafts "
                         f"{drafts_BK.dtype} {list(drafts_BK.shape)}, {stop_ids.numel()} stop ids {stop_ids.dtype}, "
                         f"verdict {[t.dtype for t in (accept_len_B, next_token_B, relaxed_only_B)]}")
    rows = (n_B, gen_B, max_new_B, finished_B, seq_lens_B, p0_B, keep_B, acc_B,
            *(() if strict else (accept_len_B, next_token_B, relaxed_only_B)))
    if (any(t.shape != (B,) or t.stride(0) != 1 for t in rows) or finished_B.dtype != torch.bool
            or hist_BK1.shape != (B, K + 1) or new_BK1.shape != (B, K + 1) or hist_BK1.stride(1) != 1
            or new_BK1.stride(1) != 1 or tokens_BS.shape[0] != B or tokens_BS.stride(1) != 1
            or (K and drafts_BK.stride(1) != 1) or relaxed_only.numel() != 1 or row_steps.numel() != 1):
        raise ValueError(f"chain_commit: rows of {B} (unit stride, finished_B bool), hist / new [{B}, {K + 1}] and "
                         f"tokens [{B}, S] with unit last strides, 0-d counters; got tokens {list(tokens_BS.shape)}, "
                         f"rows {[tuple(t.shape) for t in rows]}, hist {list(hist_BK1.shape)}, new "
                         f"{list(new_BK1.shape)}")
    launch = pdl_kwargs(pdl, tokens_BS)
    _chain_commit_kernel[(1,)](
        tokens_BS, n_B, gen_B, max_new_B, finished_B.view(torch.uint8), seq_lens_B, p0_B, hist_BK1, relaxed_only,
        row_steps, new_BK1, keep_B, acc_B, drafts_BK, accept_len_B, next_token_B, relaxed_only_B, stop_ids,
        B, K, window or 0, tokens_BS.shape[1], tokens_BS.stride(0), drafts_BK.stride(0) if K else 0, hist_BK1.stride(0),
        new_BK1.stride(0), target_BK1.stride(0) if strict else 0, NS=stop_ids.numel(),
        BLOCK_B=max(2, triton.next_power_of_2(B)), BLOCK_K1=max(2, triton.next_power_of_2(K + 1)),
        WINDOW=window is not None, STRICT=strict,
        PDL=pdl_mode(pdl, launch),
        num_warps=1 if B * (K + 1) <= 512 else 4, **launch)
