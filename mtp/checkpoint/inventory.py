"""The tensor inventory of a DeepSeek-V3.2 HF checkpoint, derived from its config.

`checkpoint_spec(cfg)` lists every tensor name the real checkpoint carries, with its shape and storage kind.
It is the single source of truth for the checkpoint writer, the loader's validation and the module tree of
`mtp.model.deepseek` (whose parameter names equal these names, the MTP layers re-rooted, see `mtp.checkpoint.files`).

Kinds:
  fp8   float8_e4m3fn weight; a `<name>_scale_inv` float32 tensor [ceil(out/128), ceil(in/128)] goes with it
  scale the float32 block scales of an fp8 weight
  bf16  stored bfloat16 (embeddings, norms, the router, eh_proj, heads)
  fp32  stored float32 (router bias)
  norm  LayerNorm parameters of the indexer: DeepSeek keeps them in fp32, some exports in bf16; both load
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..model.config import BLOCK, ModelConfig

KIND_DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "fp8": (torch.float8_e4m3fn,),
    "scale": (torch.float32,),
    "bf16": (torch.bfloat16,),
    "fp32": (torch.float32,),
    "norm": (torch.float32, torch.bfloat16),
}


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    kind: str

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        return KIND_DTYPES[self.kind]


def _linear(out: dict[str, TensorSpec], name: str, n_out: int, n_in: int, fp8: bool) -> None:
    if fp8:
        out[f"{name}.weight"] = TensorSpec((n_out, n_in), "fp8")
        out[f"{name}.weight_scale_inv"] = TensorSpec((math.ceil(n_out / BLOCK), math.ceil(n_in / BLOCK)), "scale")
    else:
        out[f"{name}.weight"] = TensorSpec((n_out, n_in), "bf16")


def _mlp(out: dict[str, TensorSpec], p: str, dim: int, inter: int, fp8: bool) -> None:
    _linear(out, f"{p}.gate_proj", inter, dim, fp8)
    _linear(out, f"{p}.up_proj", inter, dim, fp8)
    _linear(out, f"{p}.down_proj", dim, inter, fp8)


def block_spec(cfg: ModelConfig, layer_id: int, prefix: str) -> dict[str, TensorSpec]:
    """One decoder block (attention + indexer + dense MLP or MoE) under `prefix` (e.g. 'model.layers.3')."""
    fp8 = cfg.is_fp8
    D, H = cfg.hidden_size, cfg.num_attention_heads
    out: dict[str, TensorSpec] = {}
    p = prefix
    out[f"{p}.input_layernorm.weight"] = TensorSpec((D,), "bf16")
    out[f"{p}.post_attention_layernorm.weight"] = TensorSpec((D,), "bf16")
    a = f"{p}.self_attn"
    _linear(out, f"{a}.q_a_proj", cfg.q_lora_rank, D, fp8)
    out[f"{a}.q_a_layernorm.weight"] = TensorSpec((cfg.q_lora_rank,), "bf16")
    _linear(out, f"{a}.q_b_proj", H * cfg.qk_head_dim, cfg.q_lora_rank, fp8)
    _linear(out, f"{a}.kv_a_proj_with_mqa", cfg.kv_lora_rank + cfg.qk_rope_head_dim, D, fp8)
    out[f"{a}.kv_a_layernorm.weight"] = TensorSpec((cfg.kv_lora_rank,), "bf16")
    _linear(out, f"{a}.kv_b_proj", H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank, fp8)
    _linear(out, f"{a}.o_proj", D, H * cfg.v_head_dim, fp8)
    i = f"{a}.indexer"
    _linear(out, f"{i}.wq_b", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, fp8)
    _linear(out, f"{i}.wk", cfg.index_head_dim, D, fp8)
    out[f"{i}.k_norm.weight"] = TensorSpec((cfg.index_head_dim,), "norm")
    out[f"{i}.k_norm.bias"] = TensorSpec((cfg.index_head_dim,), "norm")
    out[f"{i}.weights_proj.weight"] = TensorSpec((cfg.index_n_heads, D), "bf16")
    m = f"{p}.mlp"
    if cfg.is_moe_layer(layer_id):
        out[f"{m}.gate.weight"] = TensorSpec((cfg.n_routed_experts, D), "bf16")
        out[f"{m}.gate.e_score_correction_bias"] = TensorSpec((cfg.n_routed_experts,), "fp32")
        for e in range(cfg.n_routed_experts):
            _mlp(out, f"{m}.experts.{e}", D, cfg.moe_intermediate_size, fp8)
        if cfg.n_shared_experts:
            _mlp(out, f"{m}.shared_experts", D, cfg.moe_intermediate_size * cfg.n_shared_experts, fp8)
    else:
        _mlp(out, m, D, cfg.intermediate_size, fp8)
    return out


def mtp_extra_spec(cfg: ModelConfig, prefix: str) -> dict[str, TensorSpec]:
    """The tensors an MTP layer adds to its decoder block."""
    D, V = cfg.hidden_size, cfg.vocab_size
    return {
        f"{prefix}.enorm.weight": TensorSpec((D,), "bf16"),
        f"{prefix}.hnorm.weight": TensorSpec((D,), "bf16"),
        f"{prefix}.eh_proj.weight": TensorSpec((D, 2 * D), "bf16"),
        f"{prefix}.shared_head.norm.weight": TensorSpec((D,), "bf16"),
        f"{prefix}.shared_head.head.weight": TensorSpec((V, D), "bf16"),
        f"{prefix}.embed_tokens.weight": TensorSpec((V, D), "bf16"),
    }


def checkpoint_spec(cfg: ModelConfig, n_mtp: int | None = None) -> dict[str, TensorSpec]:
    """Every tensor of the checkpoint, in file order (trunk, then MTP layers)."""
    n_mtp = cfg.num_nextn_predict_layers if n_mtp is None else n_mtp
    out: dict[str, TensorSpec] = {
        "model.embed_tokens.weight": TensorSpec((cfg.vocab_size, cfg.hidden_size), "bf16"),
    }
    for layer_id in range(cfg.num_hidden_layers):
        out.update(block_spec(cfg, layer_id, f"model.layers.{layer_id}"))
    out["model.norm.weight"] = TensorSpec((cfg.hidden_size,), "bf16")
    out["lm_head.weight"] = TensorSpec((cfg.vocab_size, cfg.hidden_size), "bf16")
    for j in range(n_mtp):
        layer_id = cfg.num_hidden_layers + j
        prefix = f"model.layers.{layer_id}"
        out.update(block_spec(cfg, layer_id, prefix))
        out.update(mtp_extra_spec(cfg, prefix))
    return out
