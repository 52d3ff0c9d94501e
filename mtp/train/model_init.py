"""Build a trainable `DeepseekV32`: float weights, initialization, shared embedding/head, optimizer groups.

The model is the library's own module tree (`mtp.model.deepseek.DeepseekV32`), run with dequant numerics and the naive
(expanded) attention path. As in DeepSeek-V3, the MTP modules share the main model's embedding and output
head during training: their `embed_tokens` / `shared_head.head` are the same Parameter objects, and the
export writes the copies the checkpoint format carries.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..model.config import ModelConfig, RuntimeOptions
from ..model.deepseek import DeepseekV32

TRAIN_RUNTIME = RuntimeOptions(numerics="dequant", attn_impl="naive")
# Output projections write into the residual stream; scaled down by sqrt(2 * blocks) (GPT-2 style) so the
# stream's scale does not grow with depth at initialization.
_OUT_PROJ = ("o_proj.weight", "down_proj.weight")


def init_parameters(model: nn.Module, n_blocks: int, gen: torch.Generator) -> None:
    """Deterministic init: linears N(0, 1/in), embeddings N(0, 1), norms 1, biases and router bias 0."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias") or name.endswith("norm.bias"):
                p.zero_()
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.dim() == 2:
                std = p.shape[1] ** -0.5
                if name.endswith(_OUT_PROJ):
                    std /= math.sqrt(2 * n_blocks)
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            else:
                raise RuntimeError(f"init_parameters: no rule for parameter {name!r} of shape {tuple(p.shape)}")


def tie_mtp_to_main(model: DeepseekV32) -> None:
    """Make every MTP module use the main embedding and lm_head (DeepSeek-V3 shares them)."""
    for layer in model.mtp:
        layer.embed_tokens.weight = model.model.embed_tokens.weight
        layer.shared_head.head.weight = model.lm_head.weight


def build_model(cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu") -> DeepseekV32:
    """A freshly initialized fp32 model of `cfg` (float weights required) on `device`."""
    if cfg.is_fp8:
        raise ValueError("build_model trains float weights: pass a config with quantization_config=None")
    gen = torch.Generator().manual_seed(seed)
    model = DeepseekV32(cfg, dtype=torch.float32, runtime=TRAIN_RUNTIME)
    init_parameters(model, cfg.num_hidden_layers + cfg.num_nextn_predict_layers, gen)
    tie_mtp_to_main(model)
    return model.to(device)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices except embeddings (and the heads tied to them); none on vectors."""
    decay, no_decay = [], []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() == 2 and "embed_tokens" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(progress: float, step: int, lr: float, warmup: int, min_frac: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine to `min_frac * lr` as progress goes 0 -> 1."""
    if step < warmup:
        return lr * (step + 1) / warmup
    p = min(max(progress, 0.0), 1.0)
    return lr * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * p)))
