"""Export a trained model as a real HF DeepSeek-V3.2 FP8 checkpoint through `mtp.checkpoint.files.save_checkpoint`.

Every tensor the spec marks FP8 is quantized with `mtp.model.fp8.weight_quant` (e4m3, one ue8m0 scale per
128x128 block); embeddings, norms, the router, eh_proj and the heads are stored bf16, the router bias fp32.
MTP layers get their own copies of the (training-time shared) embedding and output head, as in the real file.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path

import torch

from ..model import fp8
from ..checkpoint.files import ckpt_name, save_checkpoint
from ..model.config import ModelConfig, QuantConfig
from ..model.deepseek import DeepseekV32
from ..checkpoint.inventory import TensorSpec, checkpoint_spec
from ..text.tokenizer import Tokenizer, save_tokenizer

MAX_SHARD_BYTES = 12 * 2 ** 20  # keeps every shard of a small model well under 16 MB


def fp8_config(cfg: ModelConfig, **overrides) -> ModelConfig:
    out = dataclasses.replace(cfg, quantization_config=QuantConfig(), **overrides)
    out.validate("export config")
    return out


def named_float_tensors(model: DeepseekV32) -> dict[str, torch.Tensor]:
    """Checkpoint-named parameters, shared ones under each of their names (the MTP embed/head copies)."""
    return {ckpt_name(n, model.cfg): p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


def quantize_tensors(floats: dict[str, torch.Tensor], spec: dict[str, TensorSpec]) -> dict[str, torch.Tensor]:
    """Float tensors named as in `spec` (of an FP8 config) -> the tensors the checkpoint stores."""
    out: dict[str, torch.Tensor] = {}
    for name, ts in spec.items():
        if ts.kind == "scale":
            continue
        if name not in floats:
            raise KeyError(f"export: tensor {name!r} required by the config is not among the model's parameters")
        w = floats[name].float().cpu()
        if tuple(w.shape) != ts.shape:
            raise ValueError(f"export: tensor {name!r} has shape {tuple(w.shape)}, the config implies {ts.shape}")
        if ts.kind == "fp8":
            out[name], out[name.replace(".weight", ".weight_scale_inv")] = fp8.weight_quant(w)
        else:
            out[name] = w.to(ts.dtypes[0])
    return out


def n_shards_for(tensors: dict[str, torch.Tensor], max_shard_bytes: int = MAX_SHARD_BYTES) -> int:
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    return max(2, math.ceil(total / max_shard_bytes))


def export_checkpoint(model: DeepseekV32, tok: Tokenizer, out_dir: str | Path, index_topk: int | None = None,
                      extra_files: dict[str, Path] | None = None) -> Path:
    """Write `model` as an FP8 checkpoint with tokenizer files; returns the folder."""
    cfg = fp8_config(model.cfg, **({} if index_topk is None else {"index_topk": index_topk}))
    tensors = quantize_tensors(named_float_tensors(model), checkpoint_spec(cfg))
    with tempfile.TemporaryDirectory() as td:
        save_tokenizer(tok.backend, td, model_max_length=cfg.max_position_embeddings)
        extra = {n: Path(td) / n for n in ("tokenizer.json", "tokenizer_config.json")}
        extra.update(extra_files or {})
        return save_checkpoint(tensors, cfg, out_dir, n_shards=n_shards_for(tensors), extra_files=extra)
