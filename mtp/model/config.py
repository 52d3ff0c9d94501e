"""Typed, validated view of a DeepSeek-V3.2 `config.json`.

`ModelConfig.from_json(path)` reads the file a real checkpoint ships (all fields of the public 671B
config, see `../shared/docs/dsv32-facts.md` section 1) and refuses values this implementation does not
support, naming the field, the value and what is supported. Runtime choices that are not part of the
checkpoint (numerics, attention path) live in `RuntimeOptions`, never in the file.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 128  # FP8 weight block (128x128) and activation-quant group width
NUMERICS = ("fp8", "dequant")  # RuntimeOptions.numerics


class ConfigError(ValueError):
    """A config.json field is missing, malformed or unsupported."""


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters. The defaults are the 671B model's; a config.json's rope_scaling object must name
    factor, original_max_position_embeddings, mscale and mscale_all_dim (see `_rope_from_dict`)."""

    type: str = "yarn"
    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0


@dataclass(frozen=True)
class QuantConfig:
    quant_method: str = "fp8"
    fmt: str = "e4m3"
    scale_fmt: str | None = "ue8m0"
    activation_scheme: str = "dynamic"
    weight_block_size: tuple[int, int] = (BLOCK, BLOCK)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    first_k_dense_replace: int = 3
    num_attention_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    num_nextn_predict_layers: int = 1
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 163840
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = field(default_factory=RopeScaling)
    quantization_config: QuantConfig | None = field(default_factory=QuantConfig)
    bos_token_id: int = 0
    eos_token_id: int = 1
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    model_type: str = "deepseek_v32"
    architectures: tuple[str, ...] = ("DeepseekV32ForCausalLM",)

    # ------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def is_fp8(self) -> bool:
        return self.quantization_config is not None

    @property
    def softmax_scale(self) -> float:
        """192^-0.5 * mscale^2, mscale = 0.1 * mscale * ln(factor) + 1 (DeepSeek reference)."""
        scale = self.qk_head_dim ** -0.5
        rs = self.rope_scaling
        if rs is not None and rs.factor > 1.0:
            m = 0.1 * rs.mscale * math.log(rs.factor) + 1.0
            scale *= m * m
        return scale

    def is_moe_layer(self, layer_id: int) -> bool:
        """MTP layers (id >= num_hidden_layers) are MoE blocks as well."""
        return layer_id >= self.first_k_dense_replace

    # ------------------------------------------------------------------ I/O
    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> "ModelConfig":
        """A field missing from `raw` takes transformers' `DeepseekV32Config` default (`ABSENT_FIELDS` where
        that differs from the dataclass default, which is the 671B model's value).

        No rope_scaling means plain RoPE and an unscaled softmax (issue 27 item 6). DeepSeek's reference inference
        code (DeepSeek-V3.2-Exp `inference/model.py`) would apply YaRN here: its `ModelArgs` default to factor
        40 over 4096 positions, applied whenever its run-time `max_seq_len` (16384 by default) exceeds 4096.
        But that code never reads config.json: it takes its own config file (`config_671B_v3.2.json`, which
        names no RoPE field at all) and `convert.py` rewrites only the weights, so the reference has no reading
        of an HF config.json without rope_scaling. The HF format's meaning comes from transformers, and vLLM
        reads it the same way (plain RoPE, no mscale); every config.json DeepSeek publishes names its YaRN
        parameters. A user holding an HF-format checkpoint expects what transformers and vLLM compute from it,
        so we match them (tests/model/test_hf_oracle.py pins the logits), and say so in every result
        (`defaulted_values`)."""
        raw = dict(raw)
        known = {f.name for f in dataclasses.fields(cls)}
        absent = [name for name in REQUIRED_FIELDS if name not in raw]
        if absent:
            raise ConfigError(f"{source}: field {absent[0]!r} is missing" + (f" (and {absent[1:]})" if absent[1:] else "")
                              + "; no default is assumed: it changes the output without changing any tensor shape, "
                              "and transformers' default is the 671B model's value")
        kwargs: dict[str, Any] = {name: value for name, value in ABSENT_FIELDS.items() if name not in raw}
        for name in known:
            if name in raw:
                kwargs[name] = raw[name]
        if "rope_scaling" in kwargs and kwargs["rope_scaling"] is not None:
            kwargs["rope_scaling"] = _rope_from_dict(kwargs["rope_scaling"], source)
        if "quantization_config" in kwargs and kwargs["quantization_config"] is not None:
            kwargs["quantization_config"] = _quant_from_dict(kwargs["quantization_config"], source)
        if "architectures" in kwargs:
            kwargs["architectures"] = tuple(kwargs["architectures"] or ())
        if isinstance(kwargs.get("eos_token_id"), list):
            ids = kwargs["eos_token_id"]
            if not ids:
                raise ConfigError(f"{source}: field 'eos_token_id' is an empty list")
            kwargs["eos_token_id"] = int(ids[0])
        for f in dataclasses.fields(cls):
            if f.name in kwargs and f.type in ("int", "float", "bool") and kwargs[f.name] is not None:
                kwargs[f.name] = _coerce(f.name, f.type, kwargs[f.name], source)
        cfg = cls(**kwargs)
        cfg.validate(source)
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: no config.json found")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
        return cls.from_dict(raw, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        """The config.json a real checkpoint carries (HF field names)."""
        d = dataclasses.asdict(self)
        d["architectures"] = list(self.architectures)
        if self.quantization_config is not None:
            d["quantization_config"]["weight_block_size"] = list(self.quantization_config.weight_block_size)
        d.update(
            num_key_value_heads=self.num_attention_heads,
            attention_bias=False,
            attention_dropout=0.0,
            initializer_range=0.02,
            use_cache=True,
            torch_dtype="bfloat16",
            ep_size=1,
            moe_layer_freq=1,
        )
        return d

    # ------------------------------------------------------------------ validation
    def validate(self, source: str = "config") -> None:
        def bad(fieldname: str, value: Any, expected: str) -> ConfigError:
            return ConfigError(f"{source}: field '{fieldname}' = {value!r} is not supported; expected {expected}")

        if self.model_type != "deepseek_v32":
            raise bad("model_type", self.model_type, "'deepseek_v32'")
        if self.scoring_func != "sigmoid":
            raise bad("scoring_func", self.scoring_func, "'sigmoid' (DeepSeek-V3/V3.2 routing)")
        if self.hidden_act != "silu":
            raise bad("hidden_act", self.hidden_act, "'silu'")
        if self.tie_word_embeddings:
            raise bad("tie_word_embeddings", True, "false (DeepSeek-V3.2 has a separate lm_head)")
        positive = [
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "index_n_heads",
            "index_head_dim", "index_topk", "max_position_embeddings",
        ]
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise bad(name, v, "a positive integer")
        for name in ("n_shared_experts", "num_nextn_predict_layers", "first_k_dense_replace"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise bad(name, v, "a non-negative integer")
        if self.first_k_dense_replace > self.num_hidden_layers:
            raise bad("first_k_dense_replace", self.first_k_dense_replace,
                      f"<= num_hidden_layers ({self.num_hidden_layers})")
        if self.qk_rope_head_dim % 2:
            raise bad("qk_rope_head_dim", self.qk_rope_head_dim, "an even number (rotary pairs)")
        if self.index_head_dim <= self.qk_rope_head_dim:
            raise bad("index_head_dim", self.index_head_dim, f"> qk_rope_head_dim ({self.qk_rope_head_dim})")
        if self.index_head_dim & (self.index_head_dim - 1):
            raise bad("index_head_dim", self.index_head_dim, "a power of two (Walsh-Hadamard transform)")
        if self.n_routed_experts % self.n_group:
            raise bad("n_group", self.n_group, f"a divisor of n_routed_experts ({self.n_routed_experts})")
        if self.n_routed_experts // self.n_group < 2:
            raise bad("n_group", self.n_group, "groups of at least 2 experts (group score = sum of top-2)")
        if not 1 <= self.topk_group <= self.n_group:
            raise bad("topk_group", self.topk_group, f"in [1, n_group={self.n_group}]")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise bad("num_experts_per_tok", self.num_experts_per_tok,
                      "at most topk_group * experts per group")
        if not 0 <= self.bos_token_id < self.vocab_size:
            raise bad("bos_token_id", self.bos_token_id, f"in [0, vocab_size={self.vocab_size})")
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise bad("eos_token_id", self.eos_token_id, f"in [0, vocab_size={self.vocab_size})")
        if self.rope_scaling is not None and self.rope_scaling.type != "yarn":
            raise bad("rope_scaling.type", self.rope_scaling.type, "'yarn' or no rope_scaling")
        self._validate_ranges(bad)
        if self.quantization_config is not None:
            self._validate_fp8(bad)

    def _validate_ranges(self, bad) -> None:
        """Real-valued fields: finite and in the range the math needs. NaN compares false with everything, so
        each check is written as `ok(value)` and refuses what is not provably in range."""
        def check(name: str, v: Any, ok: bool, expected: str) -> None:
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and ok):
                raise bad(name, v, expected)

        eps = self.rms_norm_eps
        check("rms_norm_eps", eps, 0 < eps < 1, "a finite number in (0, 1) (RMSNorm divides by sqrt(mean + eps))")
        check("routed_scaling_factor", self.routed_scaling_factor, self.routed_scaling_factor > 0,
              "a finite number > 0 (scales the routed experts' output)")
        check("rope_theta", self.rope_theta, self.rope_theta > 1, "a finite number > 1 (RoPE base)")
        rs = self.rope_scaling
        if rs is None:
            return
        check("rope_scaling.factor", rs.factor, rs.factor >= 1, "a finite number >= 1")
        check("rope_scaling.beta_slow", rs.beta_slow, rs.beta_slow > 0, "a finite number > 0")
        check("rope_scaling.beta_fast", rs.beta_fast, rs.beta_fast > rs.beta_slow,
              f"a finite number > beta_slow ({rs.beta_slow})")
        check("rope_scaling.mscale", rs.mscale, rs.mscale > 0, "a finite number > 0")
        # DeepSeek scales the softmax by mscale^2 and leaves cos/sin alone; transformers scales the softmax by
        # mscale_all_dim^2 and cos/sin by mscale / mscale_all_dim. The two agree only when they are equal.
        check("rope_scaling.mscale_all_dim", rs.mscale_all_dim, rs.mscale_all_dim == rs.mscale,
              f"equal to rope_scaling.mscale ({rs.mscale}): this implementation folds both into the softmax scale")
        orig = rs.original_max_position_embeddings
        check("rope_scaling.original_max_position_embeddings", orig, orig >= 1, "a positive integer")

    def _validate_fp8(self, bad) -> None:
        q = self.quantization_config
        assert q is not None
        if q.quant_method != "fp8":
            raise bad("quantization_config.quant_method", q.quant_method, "'fp8'")
        if q.fmt != "e4m3":
            raise bad("quantization_config.fmt", q.fmt, "'e4m3'")
        if q.scale_fmt not in (None, "ue8m0"):
            raise bad("quantization_config.scale_fmt", q.scale_fmt, "'ue8m0' or null")
        if q.activation_scheme != "dynamic":
            raise bad("quantization_config.activation_scheme", q.activation_scheme, "'dynamic'")
        if tuple(q.weight_block_size) != (BLOCK, BLOCK):
            raise bad("quantization_config.weight_block_size", list(q.weight_block_size), f"[{BLOCK}, {BLOCK}]")
        # Every FP8 GEMM quantizes its input per 128 channels, so each input width must be a multiple.
        inputs = {
            "hidden_size": self.hidden_size,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "index_head_dim": self.index_head_dim,
            "num_attention_heads*v_head_dim": self.num_attention_heads * self.v_head_dim,
        }
        for name, v in inputs.items():
            if v % BLOCK:
                raise bad(name, v, f"a multiple of {BLOCK} (input width of an FP8 block-scaled GEMM)")


@dataclass(frozen=True)
class RuntimeOptions:
    """Choices made at load time, not stored in the checkpoint.

    numerics: 'fp8' follows DeepSeek's reference inference numerics (per-128 activation quant with ue8m0
    scales, FP8 latent KV and indexer keys); 'dequant' is plain float math on dequantized weights.
    attn_impl: 'naive' expands the latent KV through kv_b_proj (prefill style), 'absorb' folds kv_b_proj
    into the query and the output (decode style), 'auto' picks naive for blocks longer than
    `absorb_max_tokens` new tokens.
    """

    numerics: str = "fp8"
    attn_impl: str = "auto"
    absorb_max_tokens: int = 16

    def __post_init__(self) -> None:
        if self.numerics not in NUMERICS:
            raise ConfigError(f"numerics must be {' or '.join(map(repr, NUMERICS))}, got {self.numerics!r}")
        if self.attn_impl not in ("auto", "naive", "absorb"):
            raise ConfigError(f"attn_impl must be 'auto', 'naive' or 'absorb', got {self.attn_impl!r}")
        if self.absorb_max_tokens < 1:
            raise ConfigError(f"absorb_max_tokens must be >= 1, got {self.absorb_max_tokens}")


def _coerce(name: str, typ: str, value: Any, source: str) -> Any:
    if typ == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: field '{name}' = {value!r} must be true or false")
        return value
    if typ == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{source}: field '{name}' = {value!r} must be an integer")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{source}: field '{name}' = {value!r} must be a number")
    return float(value)


# Fields whose dataclass default (the 671B model's value) is not what their absence from config.json means to
# transformers' DeepseekV32Config: no rope_scaling is plain RoPE, no quantization_config is bf16 weights, and
# transformers' model has no MTP modules. Every other field's dataclass default equals transformers' default
# (tests/model/test_config.py holds the two together).
ABSENT_FIELDS: dict[str, Any] = {"rope_scaling": None, "quantization_config": None, "num_nextn_predict_layers": 0}

# Fields without a safe default: each changes what the model computes (experts routed per token, groups, the
# routed output's scale, keys the indexer keeps) yet no tensor shape reveals a wrong value, so a default would
# run a different model with exit 0.
REQUIRED_FIELDS = ("num_experts_per_tok", "n_group", "topk_group", "routed_scaling_factor", "index_topk")


def defaulted_fields(raw: dict[str, Any]) -> tuple[str, ...]:
    """The config fields `ModelConfig.from_dict(raw)` fills with a default (reported with every result)."""
    out = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in raw]
    rs = raw.get("rope_scaling")
    if isinstance(rs, dict):
        out += [f"rope_scaling.{k}" for k in ("beta_fast", "beta_slow") if k not in rs]
    return tuple(out)


# What an absent rope_scaling was taken to mean, in results (the reasons are in `ModelConfig.from_dict`).
NO_ROPE_SCALING = "none: plain RoPE, unscaled softmax (transformers' and vLLM's reading; DeepSeek's reference " \
    "code would apply YaRN factor 40)"


def defaulted_values(raw: dict[str, Any]) -> dict[str, str]:
    """Each field `defaulted_fields(raw)` names -> the value assumed for it, as results print it."""
    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(ModelConfig)}
    out = {}
    for name in defaulted_fields(raw):
        if name == "rope_scaling":
            out[name] = NO_ROPE_SCALING
        elif name.startswith("rope_scaling."):
            out[name] = json.dumps(getattr(RopeScaling(), name.split(".", 1)[1]))
        else:
            value = ABSENT_FIELDS.get(name, defaults[name])
            out[name] = "none" if value is None else json.dumps(list(value) if isinstance(value, tuple) else value)
    return out


# rope_scaling keys without a safe default: transformers requires the first two, and its meaning of a missing
# mscale / mscale_all_dim (scaled cos/sin, unscaled softmax) is not DeepSeek's. beta_fast / beta_slow default
# to 32 / 1 in both.
_ROPE_REQUIRED = ("factor", "original_max_position_embeddings", "mscale", "mscale_all_dim")


def _rope_from_dict(raw: Any, source: str) -> RopeScaling:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: field 'rope_scaling' must be an object, got {raw!r}")
    raw = dict(raw)
    typ = raw.pop("type", raw.pop("rope_type", None))
    if typ != "yarn":
        raise ConfigError(f"{source}: field 'rope_scaling.type' = {typ!r} is not supported; expected 'yarn'")
    for k in _ROPE_REQUIRED:
        if k not in raw:
            raise ConfigError(f"{source}: field 'rope_scaling.{k}' is missing; YaRN needs it (no default is "
                              "assumed: the 671B model's value would silently change the positions)")
    names = {f.name for f in dataclasses.fields(RopeScaling)} - {"type"}
    kw = {}
    for k in names:
        if k in raw:
            t = "int" if k == "original_max_position_embeddings" else "float"
            kw[k] = _coerce(f"rope_scaling.{k}", t, raw[k], source)
    return RopeScaling(type="yarn", **kw)


def _quant_from_dict(raw: Any, source: str) -> QuantConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: field 'quantization_config' must be an object, got {raw!r}")
    block = raw.get("weight_block_size", [BLOCK, BLOCK])
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) for b in block)):
        raise ConfigError(
            f"{source}: field 'quantization_config.weight_block_size' = {block!r} must be a pair like [128, 128]")
    return QuantConfig(
        quant_method=raw.get("quant_method", "fp8"),
        fmt=raw.get("fmt", "e4m3"),
        scale_fmt=raw.get("scale_fmt"),
        activation_scheme=raw.get("activation_scheme", "dynamic"),
        weight_block_size=(int(block[0]), int(block[1])),
    )
