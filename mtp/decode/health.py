"""Stop a run whose logits go non-finite or collapse, and say where the bad values come from.

A NaN anywhere in the target (a corrupt weight, an out-of-range setting) makes every logit NaN, every argmax
token 0 and every draft "accepted": garbage that reads as perfect acceptance. A finite overflow does the same
without any NaN: a residual of ~3.5e21 overflows RMSNorm's mean square to inf, rsqrt gives 0, the normed state
is exactly zero and so is every logit. So "bad" means non-finite, or all values of a vector equal (a state
collapsed to zero, logits that cannot rank any token). The engine keeps one device-side flag per call
(`logits_nonfinite`), or-ed after each target forward and read with the step's existing host sync (eager) or
staged with the step's outputs (graph / overlap, `mtp.decode.graphs._Slot`): no extra sync on the hot path.
`scan` takes the check together with the argmax a greedy verifier needs: on the fast path with switch
`logits_scan`, one launch of `mtp.kernels.logits_scan` for both (torch's ops took ~35 us for the check and 27.8 us
per argmax of a 129280-wide row on an H200), the same flag and indices.
Once the flag is seen, `first_nonfinite` re-runs the committed tokens through the target's own forward (fresh
cache) with forward hooks on its modules and names the first module whose output is bad.

Shape legend: B batch, T tokens, D width.
"""

from __future__ import annotations

import torch


class NonFiniteError(RuntimeError):
    """The target's logits went NaN, infinite or all equal (a collapsed state) during generation."""


def collapsed(x: torch.Tensor) -> torch.Tensor:
    """Per vector (last dim): every value equal (a state collapsed to zero, logits that rank nothing)."""
    return x.amax(-1) == x.amin(-1)


def logits_nonfinite(flag: torch.Tensor, logits: torch.Tensor, opts=None) -> None:
    """flag |= any logit is non-finite or some position's logits are all equal; device ops only (safe inside a
    captured step). opts: as `scan`'s."""
    scan(logits, opts, flag, argmax=False)


def scan(logits: torch.Tensor, opts=None, flag: torch.Tensor | None = None, argmax: bool = True):
    """torch.argmax(logits, -1) when `argmax` (else None), and with `flag` the check of `logits_nonfinite` or-ed into
    it first; device ops only. opts: the model's fast-path switches (`model.fast_options`, a
    `mtp.kernels.dispatch.FastPathOptions`; None on the reference path): there `dispatch.scan_logits` (one launch of
    the logits scan kernel with switch logits_scan), else torch's ops."""
    if opts is not None:
        from ..kernels.dispatch import scan_logits  # the fast path's module (loaded with it): no Triton import here

        return scan_logits(logits, opts, flag, argmax)
    if flag is not None:
        flag.logical_or_(~torch.isfinite(logits).all() | collapsed(logits).any())
    return logits.argmax(dim=-1) if argmax else None


class _Found(Exception):
    """Raised by a hook to stop the diagnostic forward at the first bad output."""

    def __init__(self, name: str, rows: list[int], what: str):
        super().__init__(name)
        self.found = (name, rows, what)


def checked_outputs(model) -> list[tuple[str, torch.nn.Module, bool]]:
    """(name, module, pre) in forward order: the embedding, per layer its input norm, the residual after the
    attention (the input of the post-attention norm, hence pre=True: a forward pre-hook), the post-attention
    norm, the residual after the MLP / MoE (the block's output), then the final norm and the head. The residual
    is what `Block.forward` carries on, so a finite sum that overflows is named at the sub-module that made it."""
    out = [("model.embed_tokens", model.model.embed_tokens, False)]
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}"
        out += [(f"{p}.input_layernorm", layer.input_layernorm, False),
                (f"{p}.self_attn", layer.post_attention_layernorm, True),
                (f"{p}.post_attention_layernorm", layer.post_attention_layernorm, False),
                (f"{p}.mlp", layer, False)]
    return out + [("model.norm", model.model.norm, False), ("lm_head", model.lm_head, False)]


@torch.no_grad()
def first_nonfinite(model, tokens_BT: torch.Tensor,
                    lengths_B: torch.Tensor | None = None) -> tuple[str, list[int], str] | None:
    """(name, rows, what) of the first module of the target (in forward order, `checked_outputs`) whose output is
    bad at a position < lengths_B[b] (default: every position), the rows where it is, and `what` ('non-finite',
    or 'collapsed (all values equal)' for a finite vector whose values are all equal); None when the whole
    forward stays good. Right padding past a row's length cannot reach its positions (causal).
    The model's own forward runs once over the tokens (fresh cache) with hooks on those modules, so the check
    follows whatever `Block.forward` does; a hook that sees a bad output stops the forward. (On the fast path a
    fused norm kernel is no module call: a bad norm output is then named at the module that reads it.)"""
    B, T = tokens_BT.shape
    dev = tokens_BT.device
    lengths_B = torch.full((B,), T, device=dev) if lengths_B is None else lengths_B.to(dev)
    valid_BT = torch.arange(T, device=dev).unsqueeze(0) < lengths_B.unsqueeze(1)

    def check(name: str, x_BTD: torch.Tensor) -> None:
        for what, bad_BT in (("non-finite", (~torch.isfinite(x_BTD)).any(-1)),
                             ("collapsed (all values equal)", collapsed(x_BTD))):
            if rows := bad_BT.logical_and(valid_BT).any(1).nonzero().flatten().tolist():
                raise _Found(name, rows, what)

    handles = []
    try:
        for name, mod, pre in checked_outputs(model):
            if pre:
                handles.append(mod.register_forward_pre_hook(lambda m, args, n=name: check(n, args[0])))
            else:
                handles.append(mod.register_forward_hook(lambda m, args, out, n=name: check(n, out)))
        model(tokens_BT, model.new_cache(B, T), kv_len=T)
    except _Found as e:
        return e.found
    finally:
        for h in handles:
            h.remove()
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
