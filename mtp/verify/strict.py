"""Greedy verification: lossless, the output equals plain greedy decoding token for token."""

from __future__ import annotations

import torch

from .common import Verdict, prefix_len


def strict_verify(draft_BK: torch.Tensor, logits_BKV: torch.Tensor) -> Verdict:
    return strict_verdict(draft_BK, logits_BKV.argmax(dim=-1))


def strict_verdict(draft_BK: torch.Tensor, target_BK1: torch.Tensor) -> Verdict:
    """`strict_verify` given the target's argmax at each of the K + 1 positions."""
    K = draft_BK.shape[1]
    a = prefix_len(draft_BK == target_BK1[:, :K])
    nxt = target_BK1.gather(1, a.unsqueeze(1)).squeeze(1)
    return Verdict(a, nxt, torch.zeros_like(a))


def chain(g, drafts_BK, q_BKV, logits_BKV, think_B, rng) -> Verdict:
    """The engine's call (mtp.verify.registry)."""
    return strict_verify(drafts_BK, logits_BKV)


def chain_argmax(g, drafts_BK, target_BK1) -> Verdict:
    """The engine's call with the argmax taken (mtp.verify.registry: the same verdict as `chain`)."""
    return strict_verdict(drafts_BK, target_BK1)
