"""Stop a run whose logits go non-finite, and say where the non-finite values come from.

A NaN anywhere in the target (a corrupt weight, an out-of-range setting) makes every logit NaN, every argmax
token 0 and every draft "accepted": garbage that reads as perfect acceptance. The engine therefore keeps one
device-side flag per call (`logits_nonfinite`), or-ed after each target forward and read with the step's
existing host sync (eager) or staged with the step's outputs (graph / overlap, `mtp.decode.graphs._Slot`): no extra
sync on the hot path. Once the flag is seen, `first_nonfinite` re-runs the committed tokens through the target
module by module (plain forward, fresh cache) and names the first module whose output is non-finite.

Shape legend: B batch, T tokens, D width.
"""

from __future__ import annotations

import torch


class NonFiniteError(RuntimeError):
    """The target's logits went NaN or infinite during generation."""


def logits_nonfinite(flag: torch.Tensor, logits: torch.Tensor) -> None:
    """flag |= any logit is non-finite; device ops only (safe inside a captured step)."""
    flag.logical_or_(~torch.isfinite(logits).all())


@torch.no_grad()
def first_nonfinite(model, tokens_BT: torch.Tensor,
                    lengths_B: torch.Tensor | None = None) -> tuple[str, list[int]] | None:
    """(name, rows) of the first module of the target (in forward order: embedding, then per layer its input
    norm, attention, post-attention norm, MLP / MoE, then the final norm and the head) whose output is
    non-finite at a position < lengths_B[b] (default: every position), and the rows where it is; None when the
    whole forward stays finite. Right padding past a row's length cannot reach its positions (causal)."""
    B, T = tokens_BT.shape
    dev = tokens_BT.device
    lengths_B = torch.full((B,), T, device=dev) if lengths_B is None else lengths_B.to(dev)
    valid_BT = torch.arange(T, device=dev).unsqueeze(0) < lengths_B.unsqueeze(1)

    def bad(x_BTD: torch.Tensor) -> list[int]:
        return (~torch.isfinite(x_BTD)).any(-1).logical_and(valid_BT).any(1).nonzero().flatten().tolist()

    dtype = model.dtype
    cache = model.new_cache(B, T)
    pos_BT, cos, sin, S, _ = model._positions(cache, T, T)
    h = model.model.embed_tokens(tokens_BT).to(model.acc)
    if rows := bad(h):
        return "model.embed_tokens", rows
    for i, layer in enumerate(model.model.layers):
        # Block.forward, one sub-module at a time
        x = layer.input_layernorm(h, dtype)
        if rows := bad(x):
            return f"model.layers.{i}.input_layernorm", rows
        h = h + layer.self_attn(x, pos_BT, cos, sin, cache.layer(i), S, model.runtime).to(h.dtype)
        if rows := bad(h):
            return f"model.layers.{i}.self_attn", rows
        x = layer.post_attention_layernorm(h, dtype)
        if rows := bad(x):
            return f"model.layers.{i}.post_attention_layernorm", rows
        h = h + layer.mlp(x).to(h.dtype)
        if rows := bad(h):
            return f"model.layers.{i}.mlp", rows
    x = model.model.norm(h, dtype)
    if rows := bad(x):
        return "model.norm", rows
    if rows := bad(model.lm_head(x)):
        return "lm_head", rows
    return None


def raise_nonfinite(model, tokens_BS: torch.Tensor, n_B: torch.Tensor, where: str) -> None:
    """Diagnose over each row's first n_B tokens and raise NonFiniteError. `where`: 'the prefill' or 'step N'."""
    first = first_nonfinite(model, tokens_BS[:, : int(n_B.max())], n_B)
    if first:
        found = f"first non-finite output: {first[0]} (rows {first[1]}; a layer-by-layer rerun of the committed tokens)"
    else:
        found = ("a layer-by-layer rerun of the committed tokens stayed finite: the non-finite values come from the "
                 "tokens being verified or from a fast-path kernel (try the reference path)")
    raise NonFiniteError(f"the target's logits became NaN or infinite in {where}; {found}. Outputs and acceptance "
                         "from here on would be garbage, so the run stops (check the checkpoint's weights and "
                         "config.json)")
