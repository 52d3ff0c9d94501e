"""Relaxed acceptance for reasoning models (TensorRT-LLM's 'relaxed' MTP): inside a thinking span a draft is
accepted if it is among the target's top-N tokens with probability >= p_top1 - delta; outside (and with
delta = 0) the rule is exactly strict. The token after the accepted drafts is always the target's argmax.

Top-N membership is by value: a draft is in the top N when its probability is >= the N-th largest probability,
so with ties at the N-th value every tied token counts (more than N tokens can qualify); the argmax is taken
from the logits, so near-ties that softmax rounds together still resolve as strict does.

Where a thinking span is (`think_B`: the state after the last committed token, tracked per sequence on the
device: on at `<think>`, off at `</think>`) follows one of two rules, `span_rule`:

    rule       state after the prompt                      state for draft j of a step
    tracked    the later of <think> / </think> in it is    the step's start state, updated by drafts
    (default)  <think>                                     1..j-1 (a drafted </think> ends the span for the
                                                           drafts after it, a drafted <think> opens one)
    trtllm     on if it holds any <think>                  the step's start state, for all K drafts
               (TensorRT-LLM's rule)

Both update the state the same way from committed tokens between steps. `trtllm` reproduces TensorRT-LLM's
published relaxed-acceptance numbers; `tracked` never relaxes a draft that follows a drafted `</think>`.
"""

from __future__ import annotations

import torch

from .common import Verdict, prefix_len
from ..spec.options import SPAN_RULES


def update_think_state(think_B: torch.Tensor, tokens_BT: torch.Tensor, valid_BT: torch.Tensor,
                       think_id: int, end_think_id: int) -> torch.Tensor:
    """State after consuming `tokens_BT` left to right (only where valid). Returns a new tensor."""
    s = think_B.clone()
    for t in range(tokens_BT.shape[1]):
        tok, ok = tokens_BT[:, t], valid_BT[:, t]
        s = torch.where(ok & (tok == think_id), torch.ones_like(s), s)
        s = torch.where(ok & (tok == end_think_id), torch.zeros_like(s), s)
    return s


def prompt_think_state(prompt_BT: torch.Tensor, valid_BT: torch.Tensor, think_id: int, end_think_id: int,
                       span_rule: str = "tracked") -> torch.Tensor:
    """The span state after each row's prompt (valid positions only), by `span_rule`."""
    if span_rule == "trtllm":
        return ((prompt_BT == think_id) & valid_BT).any(dim=1)
    start = torch.zeros(prompt_BT.shape[0], dtype=torch.bool, device=prompt_BT.device)
    return update_think_state(start, prompt_BT, valid_BT, think_id, end_think_id)


def relaxed_verify(draft_BK: torch.Tensor, logits_BKV: torch.Tensor, think_B: torch.Tensor, top_n: int,
                   delta: float, think_id: int, end_think_id: int, span_rule: str = "tracked") -> Verdict:
    B, K = draft_BK.shape
    if span_rule not in SPAN_RULES:
        raise ValueError(f"span_rule must be one of {SPAN_RULES}, got {span_rule!r}")
    probs = logits_BKV.float().softmax(dim=-1)
    # The argmax of the logits, not of the probabilities: softmax can round near-tied logits to equal
    # probabilities, and outside a span (or with delta = 0) the result must be exactly strict_verify's.
    target_BK1 = logits_BKV.argmax(dim=-1)
    if span_rule == "trtllm":
        in_span_BK = think_B.unsqueeze(1).expand(B, K)
    else:  # span state before each draft: after x_{n-1}, then after each earlier draft
        states = [think_B]
        for j in range(K - 1):
            d = draft_BK[:, j]
            s = torch.where(d == think_id, torch.ones_like(think_B), states[-1])
            states.append(torch.where(d == end_think_id, torch.zeros_like(think_B), s))
        in_span_BK = torch.stack(states, dim=1) if K else torch.zeros(B, 0, dtype=torch.bool, device=draft_BK.device)
    exact_BK = draft_BK == target_BK1[:, :K]
    p = probs[:, :K]
    p_draft = p.gather(2, draft_BK.unsqueeze(-1)).squeeze(-1)
    n = min(top_n, p.shape[-1])
    topn_vals = p.topk(n, dim=-1).values
    in_topn = p_draft >= topn_vals[..., -1]  # by value: ties at the N-th probability all count
    close = p_draft >= topn_vals[..., 0] - delta
    ok_BK = exact_BK | (in_span_BK & in_topn & close & (delta > 0))
    a = prefix_len(ok_BK)
    nxt = target_BK1.gather(1, a.unsqueeze(1)).squeeze(1)
    pos = torch.arange(K, device=draft_BK.device).unsqueeze(0)
    relaxed_only = ((pos < a.unsqueeze(1)) & ~exact_BK).long().sum(dim=1)
    return Verdict(a, nxt, relaxed_only)


def chain(g, drafts_BK, q_BKV, logits_BKV, think_B, rng) -> Verdict:
    """The engine's call (mtp.verify.registry): top_n, delta, think_ids and span_rule from the config `g`."""
    return relaxed_verify(drafts_BK, logits_BKV, think_B, g.top_n, g.delta, *g.think_ids, g.span_rule)
