"""Held-out loss and speculative acceptance of a model, trained in memory or loaded from a checkpoint.

Both take any `DeepseekV32` (a training model with float weights or `mtp.load_model` output in fp8 numerics),
so the numbers before and after quantization come from the same code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from ..decode.engine import generate
from ..draft.modes import drafter
from ..model.deepseek import DeepseekV32
from ..text.tokenizer import Tokenizer
from .data import encode_prompt
from .objective import ce, mtp_chain


def autocast(device: torch.device | str, enabled: bool):
    dev = torch.device(device)
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=dev.type, dtype=torch.bfloat16)


@torch.no_grad()
def heldout_loss(model: DeepseekV32, windows_NT1: torch.Tensor, batch_size: int = 16, bf16: bool = False) -> dict:
    """Mean cross-entropy of the main head and of each MTP module over fixed held-out windows [N, T+1]."""
    sums = torch.zeros(1 + model.n_mtp, dtype=torch.float64)
    n = 0
    for i in range(0, windows_NT1.shape[0], batch_size):
        ids = windows_NT1[i: i + batch_size].to(model.device)
        with autocast(model.device, bf16):
            main, tgt, heads = mtp_chain(model, ids)
            vals = [ce(main, tgt)] + [ce(lg, tg) for lg, tg in heads]
        sums += torch.stack(vals).double().cpu() * ids.shape[0]
        n += ids.shape[0]
    mean = (sums / max(n, 1)).tolist()
    out = {"heldout/main": mean[0]}
    out.update({f"heldout/mtp_{k + 1}": v for k, v in enumerate(mean[1:])})
    return out


def eval_prompts(tok: Tokenizer, examples: Sequence[dict], n: int, max_prompt_tokens: int) -> list[list[int]]:
    """The first n held-out chat prompts (`BOS <User>doc<Assistant><think>`) no longer than max_prompt_tokens."""
    out = []
    for ex in examples:
        ids = encode_prompt(ex, tok)
        if len(ids) <= max_prompt_tokens:
            out.append(ids)
        if len(out) == n:
            break
    if not out:
        raise ValueError(f"no held-out prompt is at most {max_prompt_tokens} tokens long")
    return out


@torch.no_grad()
def acceptance(model: DeepseekV32, prompts: list[list[int]], tok: Tokenizer, max_new_tokens: int = 64,
               ks: Sequence[int] = (1, 2, 3), modes: Sequence[str] = ("eagle", "vanilla"), verify: str = "strict",
               batch_size: int = 16, head_fp8: bool = False) -> dict:
    """Greedy speculative generation over the prompts for each (mode, k); namespaced metrics per setting:
    `{mode}_k{k}/accept_len` (AL), `{mode}_k{k}/pos_1` (first-draft acceptance), ... A (mode, k) is skipped
    when the model has fewer modules than its drafts read (`Drafter.modules_needed`: vanilla k > modules).
    head_fp8: the drafts' logits from an FP8 copy of the heads (`draft_head_fp8`, `mtp.draft.head_fp8`); the keys
    then end in `_head_fp8`."""
    out: dict[str, float] = {}
    think = (tok.think_id, tok.end_think_id)
    for mode in modes:
        for k in ks:
            if drafter(mode).modules_needed(k) > model.n_mtp:
                continue
            met = None
            for i in range(0, len(prompts), batch_size):
                r = generate(model, prompts[i: i + batch_size], max_new_tokens=max_new_tokens, draft=mode, k=k,
                             verify=verify, think_ids=think, eos_id=tok.eos_id, draft_head_fp8=head_fp8)
                met = r.metrics if met is None else met.merge(r.metrics)
            key = f"{mode}_k{k}" + ("" if verify == "strict" else f"_{verify}") + ("_head_fp8" if head_fp8 else "")
            out[f"{key}/accept_len"] = met.mean_accepted_len
            for j, (cum, cond) in enumerate(zip(met.accept_cum, met.accept_cond), start=1):
                out[f"{key}/pos_{j}"] = cum
                out[f"{key}/cond_pos_{j}"] = cond
            out[f"{key}/row_steps"] = met.row_steps
    return out
