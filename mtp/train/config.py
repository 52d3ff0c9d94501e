"""Typed, validated configs of the training layer: the model shape, the run, and heads-only training.

`ModelShape` names only what a small DeepSeek-V3.2 needs chosen (widths, depths, experts); everything else
(YaRN, softmax scale, routing function, norms) stays the real architecture's default in `ModelConfig`.
The trained model always uses float weights (quantization_config=None); the export quantizes to FP8.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..model.config import ModelConfig, RopeScaling


class TrainConfigError(ValueError):
    """A training option is out of range; the message names the option, the value and what is expected."""


def _check(cond: bool, name: str, value, expected: str) -> None:
    if not cond:
        raise TrainConfigError(f"{name} = {value!r} is not valid; expected {expected}")


@dataclass(frozen=True)
class ModelShape:
    hidden: int = 256
    layers: int = 4
    dense_layers: int = 1
    heads: int = 4
    q_lora_rank: int = 128
    kv_lora_rank: int = 128
    nope_dim: int = 32
    rope_dim: int = 64
    v_dim: int = 64
    intermediate: int = 512
    moe_intermediate: int = 128
    experts: int = 8
    shared_experts: int = 1
    experts_per_token: int = 2
    groups: int = 4
    topk_groups: int = 2
    index_heads: int = 8
    index_head_dim: int = 128
    index_topk: int = 64  # written to the exported config.json (see mtp/train/__init__.py, "indexer")
    mtp_modules: int = 1
    max_position_embeddings: int = 4096

    def model_config(self, vocab_size: int, n_mtp: int | None = None) -> ModelConfig:
        """The float-weight `ModelConfig` of this shape (FP8 input widths checked too: the export needs them)."""
        cfg = ModelConfig(
            vocab_size=vocab_size, hidden_size=self.hidden, intermediate_size=self.intermediate,
            moe_intermediate_size=self.moe_intermediate, num_hidden_layers=self.layers,
            first_k_dense_replace=self.dense_layers, num_attention_heads=self.heads, q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.nope_dim, qk_rope_head_dim=self.rope_dim,
            v_head_dim=self.v_dim, n_routed_experts=self.experts, n_shared_experts=self.shared_experts,
            num_experts_per_tok=self.experts_per_token, n_group=self.groups, topk_group=self.topk_groups,
            index_n_heads=self.index_heads, index_head_dim=self.index_head_dim, index_topk=self.index_topk,
            num_nextn_predict_layers=self.mtp_modules if n_mtp is None else n_mtp,
            max_position_embeddings=self.max_position_embeddings,
            rope_scaling=RopeScaling(original_max_position_embeddings=256), quantization_config=None,
        )
        cfg.validate("ModelShape")
        dataclasses.replace(cfg, quantization_config=_fp8()).validate("ModelShape (FP8 export)")
        return cfg


def _fp8():
    from ..model.config import QuantConfig

    return QuantConfig()


@dataclass(frozen=True)
class TrainConfig:
    shape: ModelShape = field(default_factory=ModelShape)
    seq_len: int = 256
    batch_size: int = 64
    max_steps: int = 1_000_000  # the run ends at max_steps or max_minutes, whichever comes first
    max_minutes: float = 5.0
    lr: float = 3e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mtp_lambda: float = 0.3  # DeepSeek-V3: 0.3 for the first 10T tokens, then 0.1
    bias_update_speed: float = 1e-3  # gamma of the aux-loss-free balance update
    indexer_loss_weight: float = 1.0
    indexer_rows: int = 8  # batch rows the indexer KL is computed on (the target is a second attention pass)
    sparse_frac: float = 0.25  # last fraction of training runs attention through the indexer's top-k
    eval_every: int = 500
    eval_batches: int = 8
    log_every: int = 25
    seed: int = 0
    device: str = "cpu"
    dtype: str = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU

    def __post_init__(self) -> None:
        s = self.shape
        _check(s.mtp_modules >= 0, "shape.mtp_modules", s.mtp_modules, ">= 0")
        _check(self.seq_len > s.mtp_modules + 1, "seq_len", self.seq_len, f"> mtp_modules + 1 ({s.mtp_modules + 1})")
        _check(self.seq_len <= s.max_position_embeddings, "seq_len", self.seq_len,
               f"<= max_position_embeddings ({s.max_position_embeddings})")
        for name in ("batch_size", "max_steps", "log_every", "eval_every", "eval_batches", "indexer_rows"):
            _check(getattr(self, name) >= 1, name, getattr(self, name), ">= 1")
        _check(self.max_minutes > 0, "max_minutes", self.max_minutes, "> 0")
        _check(self.lr > 0, "lr", self.lr, "> 0")
        _check(0 <= self.min_lr_frac <= 1, "min_lr_frac", self.min_lr_frac, "in [0, 1]")
        _check(0 <= self.sparse_frac < 1, "sparse_frac", self.sparse_frac, "in [0, 1)")
        _check(self.mtp_lambda >= 0, "mtp_lambda", self.mtp_lambda, ">= 0")
        _check(self.dtype in ("auto", "fp32", "bf16"), "dtype", self.dtype, "'auto', 'fp32' or 'bf16'")

    @property
    def autocast_bf16(self) -> bool:
        return self.dtype == "bf16" or (self.dtype == "auto" and self.device.startswith("cuda"))


@dataclass(frozen=True)
class HeadsConfig:
    """Heads-only training: MTP modules trained on a frozen target from precomputed hidden-state shards."""

    new_modules: int = 2  # appended after the checkpoint's modules (num_nextn_predict_layers grows)
    retrain: tuple[int, ...] = ()  # existing module indices trained in place instead (e.g. a weakened one)
    init: str = "copy"  # new modules start as a copy of the last existing module ('copy') or at random
    seq_len: int = 256
    n_seqs: int = 256  # sequences precomputed into the shards
    shard_seqs: int = 64
    distill_topk: int = 8  # soft targets: the target's top-k probabilities (1 = its greedy token)
    batch_size: int = 16
    max_steps: int = 1_000_000
    max_minutes: float = 2.0
    lr: float = 1e-3
    warmup_steps: int = 20
    min_lr_frac: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    bias_update_speed: float = 1e-3
    log_every: int = 10
    seed: int = 0
    device: str = "cpu"
    dtype: str = "auto"

    def __post_init__(self) -> None:
        _check(self.new_modules >= 0, "new_modules", self.new_modules, ">= 0")
        _check(self.new_modules > 0 or len(self.retrain) > 0, "new_modules/retrain", (self.new_modules, self.retrain),
               "at least one module to train")
        _check(self.init in ("copy", "random"), "init", self.init, "'copy' or 'random'")
        _check(self.distill_topk >= 1, "distill_topk", self.distill_topk, ">= 1")
        for name in ("seq_len", "n_seqs", "shard_seqs", "batch_size", "max_steps", "log_every"):
            _check(getattr(self, name) >= 1, name, getattr(self, name), ">= 1")
        _check(self.max_minutes > 0, "max_minutes", self.max_minutes, "> 0")
        _check(self.dtype in ("auto", "fp32", "bf16"), "dtype", self.dtype, "'auto', 'fp32' or 'bf16'")

    @property
    def autocast_bf16(self) -> bool:
        return self.dtype == "bf16" or (self.dtype == "auto" and self.device.startswith("cuda"))
