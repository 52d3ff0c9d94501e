"""Typical acceptance (Medusa, Cai et al. 2024; TensorRT-LLM's `posterior_threshold` / `posterior_alpha`): a lossy
rule for sampling at temperature T > 0. With p the target distribution at T and H(p) its entropy, a draft x is
accepted iff

    p(x) > min(posterior_threshold, posterior_alpha * exp(-H(p)))

so a confident (low-entropy) target demands a probable draft and a flat one accepts more. Drafts are accepted
as a prefix (chains) or along the deepest path whose every node passes (trees, `mtp.verify.tree`). The token
after the accepted drafts is the target's argmax there, as in Medusa's reference (the rule needs no random
draw, so a run is reproducible without seeds). Not lossless: the output is not a sample of p.
"""

from __future__ import annotations

import torch

from .common import Verdict, prefix_len


def typical_ok(tokens: torch.Tensor, logits: torch.Tensor, temperature: float, posterior_threshold: float,
               posterior_alpha: float) -> torch.Tensor:
    """Bool [...]: token passes the typical-acceptance test against logits [..., V] (same leading shape)."""
    logp = (logits.float() / temperature).log_softmax(dim=-1)
    entropy = -(logp.exp() * logp).nan_to_num().sum(dim=-1)  # 0 * -inf -> 0 for masked entries
    threshold = torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).exp() > threshold


def typical_verify(draft_BK: torch.Tensor, logits_BKV: torch.Tensor, temperature: float,
                   posterior_threshold: float, posterior_alpha: float) -> Verdict:
    K = draft_BK.shape[1]
    target_BK1 = logits_BKV.argmax(dim=-1)
    ok_BK = typical_ok(draft_BK, logits_BKV[:, :K], temperature, posterior_threshold, posterior_alpha)
    a = prefix_len(ok_BK)
    nxt = target_BK1.gather(1, a.unsqueeze(1)).squeeze(1)
    pos = torch.arange(K, device=draft_BK.device).unsqueeze(0)
    inexact = ((pos < a.unsqueeze(1)) & (draft_BK != target_BK1[:, :K])).long().sum(dim=1)
    return Verdict(a, nxt, inexact)


def chain(g, drafts_BK, q_BKV, logits_BKV, think_B, rng) -> Verdict:
    """The engine's call (mtp.verify.registry): the temperature and posterior options from the config `g`."""
    return typical_verify(drafts_BK, logits_BKV, g.sampling.temperature, g.posterior_threshold, g.posterior_alpha)
