"""Random FP8 DeepSeek-V3.2 models built directly on a device (no checkpoint on disk), for benchmarks and GPU
tests at real width. Weights follow the checkpoint layout (FP8 + ue8m0 128x128 block scales, bf16 norms and
router, fp32 router bias); values are N(0, 1) in FP8 with a power-of-two block scale near 1/sqrt(in), so
activations keep their scale through the layers, as with the tiny checkpoints.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from . import fp8
from .config import ModelConfig, RuntimeOptions
from .layers import yarn_inv_freq
from .model import DeepseekV32


def real_config(layers: int = 4, dense_layers: int = 1, mtp_modules: int = 1, **overrides) -> ModelConfig:
    """The 671B config (facts section 1) truncated to `layers` trunk layers."""
    cfg = dataclasses.replace(ModelConfig(), num_hidden_layers=layers, first_k_dense_replace=dense_layers,
                              num_nextn_predict_layers=mtp_modules, **overrides)
    cfg.validate("real_config")
    return cfg


def gpu_test_config(layers: int = 3, mtp_modules: int = 1, index_topk: int = 64) -> ModelConfig:
    """Smallest config the Triton kernels accept (latent 512, rope 64, power-of-two experts and indexer heads)."""
    return real_config(layers=layers, dense_layers=1, mtp_modules=mtp_modules, vocab_size=2048, hidden_size=1024,
                       intermediate_size=1024, moe_intermediate_size=256, num_attention_heads=16, q_lora_rank=512,
                       n_routed_experts=32, n_group=8, topk_group=4, num_experts_per_tok=8, index_n_heads=16,
                       index_topk=index_topk, max_position_embeddings=8192)


@torch.no_grad()
def random_model(cfg: ModelConfig, device="cuda", dtype=torch.bfloat16, seed: int = 0,
                 runtime: RuntimeOptions | None = None) -> DeepseekV32:
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        model = DeepseekV32(cfg, dtype=dtype, runtime=runtime or RuntimeOptions(numerics="fp8"))
    for name, p in list(model.named_parameters()):
        mod_path, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_path)
        if attr == "weight_scale_inv":
            continue  # filled with its weight
        if p.dtype == fp8.FP8_DTYPE:
            w8 = torch.randn(p.shape, generator=g, device=device).to(fp8.FP8_DTYPE)
            k = p.shape[1]
            s = torch.full(mod.weight_scale_inv.shape, 2.0 ** round(math.log2(1 / math.sqrt(k))), device=device)
            mod.weight = torch.nn.Parameter(w8, requires_grad=False)
            mod.weight_scale_inv = torch.nn.Parameter(s, requires_grad=False)
            continue
        if attr == "e_score_correction_bias":
            v = 0.05 * torch.randn(p.shape, generator=g, device=device)
        elif "norm" in mod_path and attr == "bias":
            v = 0.1 * torch.randn(p.shape, generator=g, device=device)
        elif "norm" in mod_path:
            v = 1.0 + 0.1 * torch.randn(p.shape, generator=g, device=device)
        elif "embed_tokens" in mod_path:
            v = torch.randn(p.shape, generator=g, device=device)
        else:
            v = torch.randn(p.shape, generator=g, device=device) / math.sqrt(p.shape[-1])
        setattr(mod, attr, torch.nn.Parameter(v.to(p.dtype), requires_grad=False))
    model.rotary.inv_freq = yarn_inv_freq(cfg).to(device)
    return model.eval()
