"""Model-config presets: every `ModelConfig` the tests, benchmarks and tiny checkpoints build by name.

- `real_config`: the 671B model (`ModelConfig()`'s defaults, facts section 1) cut to a few trunk layers.
- `gpu_test_config`: the smallest config the Triton kernels accept (GPU tests and the `gpu-test` bench config).
- `tiny_config`: the tiny checkpoints' shape (`mtp.checkpoint.tiny`): every FP8 input a multiple of the 128 block.
- `tiny_parallel_config`: `tiny_config` widened so that it splits over `world` tensor-parallel ranks.
"""

from __future__ import annotations

import dataclasses

from .config import ModelConfig, QuantConfig, RopeScaling


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


def tiny_config(layers: int = 3, dense_layers: int = 1, mtp_modules: int = 1, index_topk: int = 16,
                vocab: int = 512, fp8_weights: bool = True) -> ModelConfig:
    """The tiny checkpoints' config: the smallest dimensions that keep every FP8 input a multiple of the block."""
    cfg = ModelConfig(
        vocab_size=vocab, hidden_size=256, intermediate_size=384, moe_intermediate_size=128,
        num_hidden_layers=layers, first_k_dense_replace=dense_layers, num_attention_heads=4,
        q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
        n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
        index_n_heads=8, index_head_dim=128, index_topk=index_topk, num_nextn_predict_layers=mtp_modules,
        max_position_embeddings=4096, rope_scaling=RopeScaling(original_max_position_embeddings=256),
        quantization_config=QuantConfig() if fp8_weights else None,
    )
    cfg.validate("tiny_config")
    return cfg


def tiny_parallel_config(world: int = 2, layers: int = 3, dense_layers: int = 1, mtp_modules: int = 1,
                         index_topk: int = 16) -> ModelConfig:
    """`tiny_config` widened so that it splits over `world` ranks under fp8 numerics: 4 heads per rank (o_proj
    input 4 x 32 = one 128 group) and 2 dense-MLP blocks per rank; 16 experts and the 512 vocabulary divide by
    world <= 16 (powers of two)."""
    cfg = dataclasses.replace(tiny_config(layers, dense_layers, mtp_modules, index_topk),
                              num_attention_heads=4 * world, intermediate_size=256 * world)
    cfg.validate("tiny_parallel_config")
    return cfg
