"""Accept and commit: what a verified step keeps, and writing it into the decode state (with the rollback); one
implementation for chains and trees.

Shape legend: B batch, K drafts (a tree's depth), K1 = K + 1 candidate tokens per row, A = K1 nodes on a tree path.

`accept` is a pure function of tensors: the verdict's accepted prefix plus the target's token, cut at the
first stop token and at the row's remaining budget, nothing for finished rows (a tree step passes the drafts along
its verdict's path: the path gather is the caller's). `commit` writes that into the `DecodeState` in place (tokens,
lengths, finished flags, thinking state) and rolls the target cache back to n - 1 positions: a chain by lowering
its lengths (no copy; then the draft window start moves), a tree by moving its kept path's slots into place
(`KVCache.compact`, given the path). `count` adds the step to the device counters both keep.
`fused_commit`: the three for a chain or tree step without a thinking state in one launch on the fast path
(`mtp.kernels.step_commit`, switch `step_commit`; a tree's compaction after it: `KVCache.compact`, or with the tree's
hidden rows and counters one launch of `mtp.kernels.tree_commit`, switch tree_glue, `tree_step`): 47 launches fewer a
chain step, 42 a tree step (counted by `mtp.bench.step_launches`), the same integers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.static import arange
from ..verify.common import Verdict
from ..verify.relaxed import update_think_state
from .state import DecodeState


@dataclass
class Accepted:
    new_BK1: torch.Tensor  # candidates: d_1..d_a, then the target's token at a (entries past it unused)
    accepted_B: torch.Tensor  # drafts accepted (0 for finished rows)
    keep_B: torch.Tensor  # tokens committed: the first keep_B of new_BK1
    kept_BK1: torch.Tensor  # bool, the committed entries
    stopped_B: torch.Tensor  # bool, a stop token was committed


def accept(drafts_BK: torch.Tensor, verdict: Verdict, active_B: torch.Tensor, stop_ids: torch.Tensor,
           room_B: torch.Tensor) -> Accepted:
    """room_B: tokens a row may still generate (max_new_tokens - generated). `verdict`: a chain's `Verdict` or a
    tree's `TreeVerdict` (whose `drafts_BK` are the tokens along its path past the root)."""
    K = drafts_BK.shape[1]
    ar = arange(K + 1, drafts_BK.device)
    rows = arange(drafts_BK.shape[0], drafts_BK.device)
    a_B = torch.where(active_B, verdict.accept_len_B, torch.zeros_like(verdict.accept_len_B))
    new_BK1 = torch.cat((drafts_BK, torch.zeros_like(a_B).unsqueeze(1)), 1)
    new_BK1[rows, a_B] = verdict.next_token_B
    valid_BK1 = ar.unsqueeze(0) <= a_B.unsqueeze(1)
    is_stop = torch.isin(new_BK1, stop_ids) & valid_BK1
    first_stop = torch.where(is_stop.any(1), is_stop.long().argmax(1), torch.full_like(a_B, K + 1))
    keep_B = torch.minimum(torch.minimum(a_B + 1, first_stop + 1), room_B)
    keep_B = torch.where(active_B, keep_B, torch.zeros_like(keep_B))
    kept_BK1 = ar.unsqueeze(0) < keep_B.unsqueeze(1)
    return Accepted(new_BK1, a_B, keep_B, kept_BK1, (is_stop & kept_BK1).any(1))


def commit(st: DecodeState, acc: Accepted, think_ids: tuple[int, int] | None, window: int | None = None,
           path_BA: torch.Tensor | None = None) -> None:
    """Write the kept tokens after each row's n, advance n, update finished / thinking, roll the cache back.
    Chains: `window` (the draft window, whose start follows n). Trees: `path_BA`, the verdict's path (root first),
    whose cache slots are compacted to n-1.."""
    ar = arange(acc.new_BK1.shape[1], st.n_B.device)
    pos = (st.n_B.unsqueeze(1) + ar).clamp_max(st.max_len - 1)
    st.tokens.scatter_(1, pos, torch.where(acc.kept_BK1, acc.new_BK1, st.tokens.gather(1, pos)))
    if think_ids is not None:
        st.think_B.copy_(update_think_state(st.think_B, acc.new_BK1, acc.kept_BK1, *think_ids))
    if path_BA is not None:  # the path's slots, written at n-1+node, move to n-1.. before n moves
        st.cache.compact(st.n_B - 1, path_BA, acc.keep_B)
    st.n_B.add_(acc.keep_B)
    st.gen_B.add_(acc.keep_B)
    st.finished_B.logical_or_(acc.stopped_B).logical_or_(st.gen_B >= st.max_new_B)
    if path_BA is None:
        st.cache.truncate(st.n_B, 1)
    if window is not None:
        torch.clamp_min(st.n_B - (1 + window), 0, out=st.p0_B)


def count(st: DecodeState, acc: Accepted, relaxed_only_B: torch.Tensor, active_B: torch.Tensor) -> None:
    """The step's device counters (no sync; only rows active at its start count) and its outputs for the host."""
    on_B = active_B.long()
    st.hist_BK1.scatter_add_(1, acc.accepted_B.unsqueeze(1), on_B.unsqueeze(1))
    st.relaxed_only.add_((relaxed_only_B * on_B).sum())
    st.row_steps.add_(on_B.sum())
    st.new_BK1.copy_(acc.new_BK1)
    st.keep_B.copy_(acc.keep_B)
    st.acc_B.copy_(torch.minimum(acc.accepted_B, acc.keep_B))


def fused_commit_takes(opts, think_ids: tuple[int, int] | None, st: DecodeState, drafts_BK: torch.Tensor,
                       verdict: Verdict | torch.Tensor, stop_ids: torch.Tensor) -> bool:
    """Whether a chain (or tree) step's accept + commit + count run as `fused_commit`: the fast path's switch
    step_commit (`opts`, the model's `FastPathOptions`; None on the reference path), no thinking state to update
    (`think_ids`, the relaxed verifiers'), and a step the kernel takes (`step_commit.chain_commit_takes`). `verdict`:
    a `Verdict`, or the target's argmax [B, K1] whose strict verdict the kernel makes (`fused_commit`)."""
    if opts is None or not opts.step_commit or think_ids is not None:
        return False
    from ..kernels.step_commit import chain_commit_takes

    if isinstance(verdict, torch.Tensor):
        return chain_commit_takes(st.tokens, drafts_BK, stop_ids, verdict)
    return chain_commit_takes(st.tokens, drafts_BK, stop_ids, verdict.accept_len_B, verdict.next_token_B,
                              verdict.relaxed_only_B)


def fused_commit(st: DecodeState, drafts_BK: torch.Tensor, verdict: Verdict | torch.Tensor, stop_ids: torch.Tensor,
                 window: int | None, pdl: int = 0, path_BA: torch.Tensor | None = None) -> None:
    """`accept`, `commit(window=window, path_BA=path_BA)` and `count` of a chain step, or of a tree step (`path_BA`,
    the verdict's path; window None; drafts_BK the tokens along it), in one launch (`step_commit.chain_commit`), then
    a tree's compaction of its kept path's cache slots (by torch: `KVCache.compact`; a tree step whose compaction is
    `kernels.tree_commit`'s passes no path): the same state, counters and outputs, integer for integer
    (tests/kernels/test_step_commit.py). pdl: the launch's programmatic dependent launch (`FastPathOptions.glue_pdl_at`
    of the rows; the same bits). `verdict` the target's argmax [B, K1] instead: strict's verdict of it
    (`verify.strict.strict_verdict`) made inside the launch (switch strict_commit; 5 torch launches fewer)."""
    from ..kernels.step_commit import chain_commit

    base_B = None if path_BA is None else st.n_B - 1  # the slot of the path's root, before n moves
    if isinstance(verdict, torch.Tensor):
        v, target = (None, None, None), verdict
    else:
        v, target = (verdict.accept_len_B, verdict.next_token_B, verdict.relaxed_only_B), None
    chain_commit(st.tokens, st.n_B, st.gen_B, st.max_new_B, st.finished_B, st.cache.seq_lens, st.p0_B, st.hist_BK1,
                 st.relaxed_only, st.row_steps, st.new_BK1, st.keep_B, st.acc_B, drafts_BK, *v, stop_ids, window, pdl,
                 target_BK1=target)
    if path_BA is not None:  # the cache's lengths the kernel wrote (n - 1) are base + keep: what compact sets
        st.cache.compact(base_B, path_BA, st.keep_B)
