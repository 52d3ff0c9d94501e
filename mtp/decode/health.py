"""Stop a run whose logits go non-finite or collapse, and say where the bad values come from.

A NaN anywhere in the target (a corrupt weight, an out-of-range setting) makes every logit NaN, every argmax
token 0 and every draft "accepted": garbage that reads as perfect acceptance. A finite overflow does the same
without any NaN: a residual of ~3.5e21 overflows RMSNorm's mean square to inf, rsqrt gives 0, the normed state
is exactly zero and so is every logit. So "bad" means non-finite, or all values of a vector equal (a state
collapsed to zero, logits that cannot rank any token). The engine keeps one device-side flag per call
(`logits_nonfinite`), or-ed after each target forward and read with the step's existing host sync (eager) or
staged with the step's outputs (graph / overlap, `mtp.decode.graphs._Slot`): no extra sync on the hot path.
Once the flag is seen, `first_nonfinite` re-runs the committed tokens through the target module by module
(plain forward, fresh cache) and names the first module whose output is bad.

Shape legend: B batch, T tokens, D width.
"""

from __future__ import annotations

import torch


class NonFiniteError(RuntimeError):
    """The target's logits went NaN, infinite or all equal (a collapsed state) during generation."""


def collapsed(x: torch.Tensor) -> torch.Tensor:
    """Per vector (last dim): every value equal (a state collapsed to zero, logits that rank nothing)."""
    return x.amax(-1) == x.amin(-1)


def logits_nonfinite(flag: torch.Tensor, logits: torch.Tensor) -> None:
    """flag |= any logit is non-finite or some position's logits are all equal; device ops only (safe inside a
    captured step)."""
    flag.logical_or_(~torch.isfinite(logits).all() | collapsed(logits).any())


@torch.no_grad()
def first_nonfinite(model, tokens_BT: torch.Tensor,
                    lengths_B: torch.Tensor | None = None) -> tuple[str, list[int], str] | None:
    """(name, rows, what) of the first module of the target (in forward order: embedding, then per layer its
    input norm, attention, post-attention norm, MLP / MoE, then the final norm and the head) whose output is bad
    at a position < lengths_B[b] (default: every position), the rows where it is, and `what` ('non-finite', or
    'collapsed (all values equal)' for a finite vector whose values are all equal); None when the whole forward
    stays good. Right padding past a row's length cannot reach its positions (causal)."""
    B, T = tokens_BT.shape
    dev = tokens_BT.device
    lengths_B = torch.full((B,), T, device=dev) if lengths_B is None else lengths_B.to(dev)
    valid_BT = torch.arange(T, device=dev).unsqueeze(0) < lengths_B.unsqueeze(1)

    def bad(x_BTD: torch.Tensor) -> tuple[list[int], str] | None:
        for what, bad_BT in (("non-finite", (~torch.isfinite(x_BTD)).any(-1)),
                             ("collapsed (all values equal)", collapsed(x_BTD))):
            if rows := bad_BT.logical_and(valid_BT).any(1).nonzero().flatten().tolist():
                return rows, what
        return None

    dtype = model.dtype
    cache = model.new_cache(B, T)
    pos_BT, cos, sin, S, _ = model.positions(cache, T, T)
    h = model.model.embed_tokens(tokens_BT).to(model.acc)
    if found := bad(h):
        return "model.embed_tokens", *found
    for i, layer in enumerate(model.model.layers):
        # Block.forward, one sub-module at a time
        x = layer.input_layernorm(h, dtype)
        if found := bad(x):
            return f"model.layers.{i}.input_layernorm", *found
        h = h + layer.self_attn(x, pos_BT, cos, sin, cache.layer(i), S, model.runtime).to(h.dtype)
        if found := bad(h):
            return f"model.layers.{i}.self_attn", *found
        x = layer.post_attention_layernorm(h, dtype)
        if found := bad(x):
            return f"model.layers.{i}.post_attention_layernorm", *found
        h = h + layer.mlp(x).to(h.dtype)
        if found := bad(h):
            return f"model.layers.{i}.mlp", *found
    x = model.model.norm(h, dtype)
    if found := bad(x):
        return "model.norm", *found
    if found := bad(model.lm_head(x)):
        return "lm_head", *found
    return None


def raise_nonfinite(model, tokens_BS: torch.Tensor, n_B: torch.Tensor, where: str) -> None:
    """Diagnose over each row's first n_B tokens and raise NonFiniteError. `where`: 'the prefill' or 'step N'."""
    first = first_nonfinite(model, tokens_BS[:, : int(n_B.max())], n_B)
    if first:
        found = (f"first {first[2]} output: {first[0]} (rows {first[1]}; a layer-by-layer rerun of the committed "
                 "tokens)")
    else:
        found = ("a layer-by-layer rerun of the committed tokens stayed good: the bad values come from the "
                 "tokens being verified or from a fast-path kernel (try the reference path)")
    raise NonFiniteError(f"the target's logits became NaN, infinite or all equal in {where}; {found}. Outputs and "
                         "acceptance from here on would be garbage, so the run stops (check the checkpoint's weights "
                         "and config.json)")
