"""Tree verifiers: pure functions choosing the accepted root-to-node path of a draft tree (mtp.spec.tree_shape).

Shape legend: B batch, N tree nodes (node 0 = the root, the last committed token), A = max depth + 1, V vocabulary.

Inputs: the node tokens `tokens_BN` and the target logits at every node `logits_BNV` (node i's logits predict
the token after node i, so they check node i's children). Output: a `TreeVerdict` with the accepted path
(root first, padded with its last node), the number of accepted drafts a = the last node's depth, and the
token the target adds after the path.

- strict: a node is acceptable iff every node on its path equals the target's argmax at its parent; the deepest
  acceptable node wins (ties, possible only with repeated sibling tokens, go to the lower node index: the
  same tokens either way). Lossless: the output equals plain greedy decoding.
- relaxed: the chain rule (mtp.verify.relaxed) per node, with each node's thinking-span state taken along its
  own path; with delta = 0 or outside spans it is exactly strict.
- sampling: recursive rejection sampling over siblings (multi-draft speculative sampling). At a node, with the
  target distribution p there, try its children in rank order: child i (token x_i, drawn from q_i) is accepted
  with probability min(1, p(x_i) / q_i(x_i)); on rejection p <- norm(max(p - q_i, 0)). If every child is
  rejected the token is drawn from what is left of p, and after an accepted leaf from the target at the leaf.
  The output follows p exactly provided x_i ~ q_i given the earlier siblings: for top-k (deterministic) drafts
  q_i is the point mass at x_i (pass q=None), for drafts drawn without replacement q_i is the draft
  distribution with the earlier siblings' tokens removed and renormalized (all zero once they used up its
  support: such a child is skipped).
- typical: Medusa's typical acceptance (mtp.verify.typical) per node against the target at its parent.
Adaptive draft length: every verifier takes an optional per-row node mask `live_BN` (a drafter's pruning, e.g.
nodes whose draft probability fell below a threshold, and their subtrees): masked nodes keep the static shape
but are never accepted, as if the row's tree were the live subtree. For the sampler this stays lossless when the
mask is fixed before the target is read and, for drawn drafts, does not depend on a node's own drawn token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..spec.tree_shape import TreeTensors
from ..spec.draws import filter_probs, sample
from ..spec.options import SamplingParams
from .typical import typical_ok


@dataclass
class TreeVerdict:
    accept_len_B: torch.Tensor  # long [B], accepted drafts (depth of the last accepted node)
    next_token_B: torch.Tensor  # long [B], the target's token after the accepted path
    path_BA: torch.Tensor  # long [B, A], accepted nodes root first, padded with the last accepted node
    relaxed_only_B: torch.Tensor  # long [B], accepted drafts that were not the target argmax at their parent


def _check(tt: TreeTensors, tokens_BN: torch.Tensor, logits_BNV: torch.Tensor) -> None:
    N = tt.shape.n_nodes
    if tokens_BN.dim() != 2 or tokens_BN.shape[1] != N or logits_BNV.shape[:2] != tokens_BN.shape:
        raise ValueError(f"tree verify needs tokens [B, {N}] and logits [B, {N}, V] for a {N}-node tree, got "
                         f"{tuple(tokens_BN.shape)} and {tuple(logits_BNV.shape)}")


def _deepest(ok_BN: torch.Tensor, tt: TreeTensors) -> torch.Tensor:
    """The deepest node whose whole path is ok (the root always is), ties to the lower index."""
    N = ok_BN.shape[1]
    path_ok_BN = ~((~ok_BN).unsqueeze(1) & tt.ancestor_NN).any(-1)
    score_BN = tt.depth_N * N + (N - 1 - torch.arange(N, device=ok_BN.device))
    return torch.where(path_ok_BN, score_BN, -1).argmax(dim=1)


def _verdict(last_B, target_BN, exact_BN, tt: TreeTensors) -> TreeVerdict:
    path_BA = tt.path_NA[last_B]
    a_B = tt.depth_N[last_B]
    on_path_BA = torch.arange(path_BA.shape[1], device=a_B.device).unsqueeze(0) <= a_B.unsqueeze(1)
    inexact_BA = ~exact_BN.gather(1, path_BA) & on_path_BA
    return TreeVerdict(a_B, target_BN.gather(1, last_B.unsqueeze(1)).squeeze(1), path_BA, inexact_BA.long().sum(1))


def _exact(tt: TreeTensors, tokens_BN: torch.Tensor, target_BN: torch.Tensor) -> torch.Tensor:
    """Node equals the target's argmax at its parent (the root counts as exact)."""
    exact = tokens_BN == target_BN[:, tt.parent_N.clamp_min(0)]
    return exact | (tt.parent_N < 0)


def _live(ok_BN: torch.Tensor, live_BN: torch.Tensor | None) -> torch.Tensor:
    return ok_BN if live_BN is None else ok_BN & live_BN


def tree_strict_verify(tt: TreeTensors, tokens_BN: torch.Tensor, logits_BNV: torch.Tensor,
                       live_BN: torch.Tensor | None = None) -> TreeVerdict:
    _check(tt, tokens_BN, logits_BNV)
    return tree_strict_verdict(tt, tokens_BN, logits_BNV.argmax(dim=-1), live_BN)


def tree_strict_verdict(tt: TreeTensors, tokens_BN: torch.Tensor, target_BN: torch.Tensor,
                        live_BN: torch.Tensor | None = None) -> TreeVerdict:
    """`tree_strict_verify` given the target's argmax at every node."""
    _check(tt, tokens_BN, target_BN.unsqueeze(-1))
    exact_BN = _exact(tt, tokens_BN, target_BN)
    return _verdict(_deepest(_live(exact_BN, live_BN), tt), target_BN, exact_BN, tt)


def tree_relaxed_verify(tt: TreeTensors, tokens_BN: torch.Tensor, logits_BNV: torch.Tensor, think_B: torch.Tensor,
                        top_n: int, delta: float, think_id: int, end_think_id: int,
                        live_BN: torch.Tensor | None = None) -> TreeVerdict:
    """think_B: the span state after the root (the last committed token)."""
    _check(tt, tokens_BN, logits_BNV)
    target_BN = logits_BNV.argmax(dim=-1)  # of the logits, as in relaxed_verify: delta = 0 must be exactly strict
    exact_BN = _exact(tt, tokens_BN, target_BN)
    # Span state after each node along its own path (parents come first); a draft is judged by its parent's.
    after = [think_B]
    for i, parent in enumerate(tt.shape.parents[1:], 1):
        tok = tokens_BN[:, i]
        s = torch.where(tok == think_id, torch.ones_like(think_B), after[parent])
        after.append(torch.where(tok == end_think_id, torch.zeros_like(think_B), s))
    after_BN = torch.stack(after, dim=1)
    parent_N = tt.parent_N.clamp_min(0)
    in_span_BN = after_BN[:, parent_N].bool()
    p_BNV = logits_BNV.float().softmax(dim=-1)[:, parent_N]  # the distribution each node was drawn against
    p_draft = p_BNV.gather(2, tokens_BN.unsqueeze(-1)).squeeze(-1)
    topn = p_BNV.topk(min(top_n, p_BNV.shape[-1]), dim=-1).values
    close_BN = (p_draft >= topn[..., -1]) & (p_draft >= topn[..., 0] - delta)
    ok_BN = exact_BN | (in_span_BN & close_BN & (delta > 0))
    return _verdict(_deepest(_live(ok_BN, live_BN), tt), target_BN, exact_BN, tt)


def tree_typical_verify(tt: TreeTensors, tokens_BN: torch.Tensor, logits_BNV: torch.Tensor, temperature: float,
                        posterior_threshold: float, posterior_alpha: float,
                        live_BN: torch.Tensor | None = None) -> TreeVerdict:
    """Typical acceptance (mtp.verify.typical) per node against the target at its parent; the deepest node whose
    whole path passes wins, and the target's argmax follows it."""
    _check(tt, tokens_BN, logits_BNV)
    target_BN = logits_BNV.argmax(dim=-1)
    parent_N = tt.parent_N.clamp_min(0)
    ok_BN = typical_ok(tokens_BN, logits_BNV[:, parent_N], temperature, posterior_threshold, posterior_alpha)
    ok_BN = ok_BN | (tt.parent_N < 0)
    return _verdict(_deepest(_live(ok_BN, live_BN), tt), target_BN, _exact(tt, tokens_BN, target_BN), tt)


def tree_sampling_verify(tt: TreeTensors, tokens_BN: torch.Tensor, q_BNV: torch.Tensor | None,
                         logits_BNV: torch.Tensor, sp: SamplingParams, gen: torch.Generator | None,
                         live_BN: torch.Tensor | None = None) -> TreeVerdict:
    """q_BNV: per node, the distribution its token was drawn from given its earlier siblings (row 0 unused);
    None means top-k / greedy drafts (point masses)."""
    _check(tt, tokens_BN, logits_BNV)
    B, N = tokens_BN.shape
    dev = tokens_BN.device
    p_BNV = filter_probs(logits_BNV, sp)
    if q_BNV is None:
        q_BNV = torch.zeros_like(p_BNV).scatter_(2, tokens_BN.unsqueeze(-1), 1.0)
    rows = torch.arange(B, device=dev)
    cur_B = torch.zeros(B, dtype=torch.long, device=dev)
    walking_B = torch.ones(B, dtype=torch.bool, device=dev)
    p_BV = p_BNV[:, 0]
    for _ in range(tt.shape.max_depth):
        moved_B = torch.zeros_like(walking_B)
        for c in range(tt.shape.max_children):
            child_B = tt.child_NC[cur_B, c]
            ch_B = child_B.clamp_min(0)
            try_B = walking_B & ~moved_B & (child_B >= 0)
            if live_BN is not None:
                try_B &= live_BN[rows, ch_B]
            x_B1 = tokens_BN[rows, ch_B].unsqueeze(1)
            q_BV = q_BNV[rows, ch_B]
            # A child drawn after its siblings used up the draft's support has q = 0: it is no draw, skip it
            # (u * q < p would accept it whenever p > 0).
            try_B &= q_BV.sum(dim=-1) > 0
            u_B = torch.rand(B, generator=gen, device=dev)
            acc_B = try_B & (u_B * q_BV.gather(1, x_B1).squeeze(1) < p_BV.gather(1, x_B1).squeeze(1))
            resid_BV = (p_BV - q_BV).clamp_min(0.0)
            mass_B1 = resid_BV.sum(dim=-1, keepdim=True)
            # A zero residual needs p == q, where the draft is always accepted; guard anyway by keeping p.
            resid_BV = torch.where(mass_B1 > 0, resid_BV / mass_B1.clamp_min(1e-30), p_BV)
            p_BV = torch.where((try_B & ~acc_B).unsqueeze(1), resid_BV, p_BV)
            p_BV = torch.where(acc_B.unsqueeze(1), p_BNV[rows, ch_B], p_BV)
            cur_B = torch.where(acc_B, ch_B, cur_B)
            moved_B |= acc_B
        walking_B &= moved_B
    nxt_B = sample(p_BV, gen)
    exact_BN = _exact(tt, tokens_BN, p_BNV.argmax(dim=-1))
    v = _verdict(cur_B, p_BNV.argmax(dim=-1), exact_BN, tt)
    return TreeVerdict(v.accept_len_B, nxt_B, v.path_BA, v.relaxed_only_B)


# The engine's calls (mtp.verify.registry): rule(g, tt, draft, logits_BNV, think_B, rng, live_BN), options from `g`.
def strict(g, tt, draft, logits_BNV, think_B, rng, live_BN) -> TreeVerdict:
    return tree_strict_verify(tt, draft.tokens_BN, logits_BNV, live_BN)


def strict_argmax(g, tt, draft, target_BN, live_BN, opts=None) -> TreeVerdict:
    """`strict` with the argmax at every node taken (mtp.verify.registry: the same verdict). opts: the model's
    `FastPathOptions` (None: the reference path's): with switch tree_verdict, one launch of
    `kernels.tree_verdict` where it takes the tensors, else `tree_strict_verdict`'s torch ops (the same integers)."""
    if opts is not None and opts.tree_verdict:
        from ..kernels.tree_verdict import tree_verdict, tree_verdict_takes

        if tree_verdict_takes(draft.tokens_BN, target_BN, tt.path_NA, live_BN):
            _check(tt, draft.tokens_BN, target_BN.unsqueeze(-1))
            return TreeVerdict(*tree_verdict(draft.tokens_BN, target_BN, tt.parent_N, tt.depth_N, tt.path_NA,
                                             live_BN, opts.glue_pdl_at(target_BN.shape[0])))
    return tree_strict_verdict(tt, draft.tokens_BN, target_BN, live_BN)


def relaxed(g, tt, draft, logits_BNV, think_B, rng, live_BN) -> TreeVerdict:
    return tree_relaxed_verify(tt, draft.tokens_BN, logits_BNV, think_B, g.top_n, g.delta, *g.think_ids, live_BN)


def sampling(g, tt, draft, logits_BNV, think_B, rng, live_BN) -> TreeVerdict:
    return tree_sampling_verify(tt, draft.tokens_BN, draft.q_BNV, logits_BNV, g.sampling, rng, live_BN)


def typical(g, tt, draft, logits_BNV, think_B, rng, live_BN) -> TreeVerdict:
    return tree_typical_verify(tt, draft.tokens_BN, logits_BNV, g.sampling.temperature, g.posterior_threshold,
                               g.posterior_alpha, live_BN)
