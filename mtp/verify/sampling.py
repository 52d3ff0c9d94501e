"""Speculative rejection sampling (Leviathan et al. / Chen et al.): the output follows the target's
(temperature / top-k / top-p filtered) distribution exactly, whatever the draft distribution q.

Draft j is accepted with probability min(1, p_j(d) / q_j(d)); at the first rejection the token is drawn from
norm(max(p_j - q_j, 0)); after K acceptances the bonus is drawn from p_K. Greedy drafts are the q = one-hot
case. All randomness comes from `rng`: per-row counter-based draws (`RowDraws`, mtp/spec/draws.py: what the
engine uses, so a row's output depends only on its own seed and prompt) or a torch.Generator.

Draft ids are checked to lie in the vocabulary (a -1 placeholder would otherwise fail deep inside torch). The
check reads a flag on the host, so it is skipped while a CUDA graph is being captured and the engine turns it
off on CUDA devices (`check_ids=False`: its proposers draw inside the vocabulary); on the CPU it always runs.
"""

from __future__ import annotations

import torch

from .common import Verdict, prefix_len
from ..spec.draws import ACCEPT, RowDraws, filter_probs, sample, uniforms
from ..spec.options import SamplingParams


def check_draft_ids(draft_BK: torch.Tensor, V: int) -> None:
    """Every draft must be a token id in [0, V) (one host read of a flag)."""
    bad = (draft_BK < 0) | (draft_BK >= V)
    if bool(bad.any()):
        raise ValueError(f"draft_BK holds ids outside the vocabulary [0, {V}): {draft_BK[bad][:5].tolist()} "
                         "(a placeholder such as -1?); every draft must be a token id")


def sampling_verify(draft_BK: torch.Tensor, q_BKV: torch.Tensor | None, logits_BKV: torch.Tensor,
                    sp: SamplingParams, rng: RowDraws | torch.Generator | None,
                    check_ids: bool | None = None) -> Verdict:
    """q_BKV: the draft distributions the drafts were sampled from; None means greedy (one-hot) drafts.
    `check_ids`: None checks the draft ids unless a CUDA graph is being captured (see the module doc)."""
    B, K = draft_BK.shape
    capturing = draft_BK.is_cuda and torch.cuda.is_current_stream_capturing()
    if check_ids or (check_ids is None and not capturing):
        check_draft_ids(draft_BK, logits_BKV.shape[-1])
    p = filter_probs(logits_BKV, sp)  # [B, K+1, V]
    if q_BKV is None:
        q_BKV = torch.zeros_like(p[:, :K]).scatter_(2, draft_BK.unsqueeze(-1), 1.0)
    p_d = p[:, :K].gather(2, draft_BK.unsqueeze(-1)).squeeze(-1)
    q_d = q_BKV.gather(2, draft_BK.unsqueeze(-1)).squeeze(-1)
    # no drafts (the prefill's first token): no acceptance draws, so a torch.Generator is not advanced by them
    u = uniforms(rng, (B, K), ACCEPT, p.device) if K else p_d
    ok = u * q_d < p_d  # u < p/q without dividing by a zero q
    a = prefix_len(ok)
    # Distribution of the token after the accepted prefix: residual at the first miss, p_K after all K.
    idx = a.view(B, 1, 1).expand(B, 1, p.shape[-1])
    p_a = p.gather(1, idx).squeeze(1)
    if K:
        q_pad = torch.cat((q_BKV, torch.zeros_like(p[:, :1])), dim=1)
        resid = (p_a - q_pad.gather(1, idx).squeeze(1)).clamp_min(0.0)
        mass = resid.sum(dim=-1, keepdim=True)
        # All K accepted (a == K): q_pad row is zero, so resid == p_K. A zero residual (p == q) cannot be
        # reached by a rejection; guard anyway by falling back to p.
        p_a = torch.where(mass > 0, resid / mass.clamp_min(1e-30), p_a)
    nxt = sample(p_a, rng)
    exact = draft_BK == p[:, :K].argmax(dim=-1)
    pos = torch.arange(K, device=p.device).unsqueeze(0)
    relaxed_only = ((pos < a.unsqueeze(1)) & ~exact).long().sum(dim=1)
    return Verdict(a, nxt, relaxed_only)


def chain(g, drafts_BK, q_BKV, logits_BKV, think_B, rng) -> Verdict:
    """The engine's call (mtp.verify.registry). Draft ids are checked on the CPU only: on CUDA the check would add
    a host sync to every step (the proposers draw inside the vocabulary)."""
    return sampling_verify(drafts_BK, q_BKV, logits_BKV, g.sampling, rng, check_ids=logits_BKV.device.type == "cpu")
