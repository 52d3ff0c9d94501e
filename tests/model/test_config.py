"""config.json parsing: the real 671B file parses, derived values are right, bad values are refused by name."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch

from mtp.model.config import REQUIRED_FIELDS, ConfigError, ModelConfig, defaulted_fields, defaulted_values
from mtp.model.layers import yarn_inv_freq

# The public DeepSeek-V3.2 config.json as the HF repo ships it (facts section 1), including the fields this
# implementation ignores (auto_map, torch_dtype, transformers_version, ...).
REAL_CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v32",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.44.2",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def _write(tmp_path, raw) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw, indent=2) if not isinstance(raw, str) else raw)
    return str(path)


def _edited(**changes):
    """REAL_CONFIG with top-level or nested ('rope_scaling__type') fields replaced."""
    raw = copy.deepcopy(REAL_CONFIG)
    for key, value in changes.items():
        *parents, leaf = key.split("__")
        d = raw
        for p in parents:
            d = d[p]
        d[leaf] = value
    return raw


def test_real_config_parses(tmp_path):
    cfg = ModelConfig.from_json(_write(tmp_path, REAL_CONFIG))
    assert cfg.model_type == "deepseek_v32" and cfg.architectures == ("DeepseekV32ForCausalLM",)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.first_k_dense_replace) == (7168, 61, 3)
    assert (cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank) == (128, 1536, 512)
    assert (cfg.n_routed_experts, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok) == (256, 8, 4, 8)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (64, 128, 2048)
    assert cfg.num_nextn_predict_layers == 1 and cfg.vocab_size == 129280
    assert cfg.routed_scaling_factor == 2.5 and cfg.rms_norm_eps == 1e-6 and cfg.rope_theta == 10000.0
    rs = cfg.rope_scaling
    assert (rs.type, rs.factor, rs.original_max_position_embeddings, rs.beta_fast, rs.beta_slow) == (
        "yarn", 40.0, 4096, 32.0, 1.0)
    q = cfg.quantization_config
    assert (q.quant_method, q.fmt, q.scale_fmt, q.activation_scheme, q.weight_block_size) == (
        "fp8", "e4m3", "ue8m0", "dynamic", (128, 128))
    assert cfg.is_fp8
    assert cfg == ModelConfig(), "the dataclass defaults are the real 671B config"
    assert [cfg.is_moe_layer(i) for i in (0, 2, 3, 60, 61)] == [False, False, True, True, True]


def test_derived_values():
    cfg = ModelConfig.from_dict(REAL_CONFIG)
    assert cfg.qk_head_dim == 192
    mscale = 0.1 * math.log(40) + 1
    assert mscale == pytest.approx(1.368888, abs=1e-6)
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * mscale ** 2, rel=1e-12)
    no_yarn = ModelConfig.from_dict(_edited(rope_scaling=None))
    assert no_yarn.softmax_scale == pytest.approx(192 ** -0.5, rel=1e-12)


def test_to_dict_round_trip():
    cfg = ModelConfig.from_dict(REAL_CONFIG)
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_eos_list_takes_the_first_id():
    assert ModelConfig.from_dict(_edited(eos_token_id=[1, 128803])).eos_token_id == 1


BAD_VALUES = [
    # (changes, field named in the message, value named in the message)
    ({"model_type": "deepseek_v3"}, "model_type", "deepseek_v3"),
    ({"scoring_func": "softmax"}, "scoring_func", "softmax"),
    ({"hidden_size": 7000}, "hidden_size", "7000"),
    ({"n_routed_experts": 250}, "n_group", "n_routed_experts (250)"),
    ({"quantization_config__weight_block_size": [64, 64]}, "quantization_config.weight_block_size", "[64, 64]"),
    ({"quantization_config__weight_block_size": ["a", 128]}, "quantization_config.weight_block_size", "'a'"),
    ({"quantization_config__scale_fmt": "e5m2"}, "quantization_config.scale_fmt", "e5m2"),
    ({"quantization_config__quant_method": "int4"}, "quantization_config.quant_method", "int4"),
    ({"rope_scaling__type": "linear"}, "rope_scaling.type", "linear"),
    ({"rope_scaling__factor": "40"}, "rope_scaling.factor", "'40'"),
    ({"num_hidden_layers": "61"}, "num_hidden_layers", "'61'"),
    ({"hidden_size": 7168.5}, "hidden_size", "7168.5"),
    ({"vocab_size": True}, "vocab_size", "True"),
    ({"norm_topk_prob": "true"}, "norm_topk_prob", "'true'"),
    ({"topk_group": 9}, "topk_group", "9"),
    ({"first_k_dense_replace": 62}, "first_k_dense_replace", "62"),
    ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers", "-1"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings", "True"),
    ({"index_head_dim": 96}, "index_head_dim", "96"),
]


@pytest.mark.parametrize("changes, field, value", BAD_VALUES, ids=[f"{c}" for c, _, _ in BAD_VALUES])
def test_unsupported_value_names_field_and_value(tmp_path, changes, field, value):
    path = _write(tmp_path, _edited(**changes))
    with pytest.raises(ConfigError) as ei:
        ModelConfig.from_json(path)
    msg = str(ei.value)
    assert path in msg and f"'{field}'" in msg and value in msg, msg


def test_invalid_json_file(tmp_path):
    path = _write(tmp_path, json.dumps(REAL_CONFIG)[:-20])
    with pytest.raises(ConfigError, match="not valid JSON") as ei:
        ModelConfig.from_json(path)
    assert path in str(ei.value)


def test_json_that_is_not_an_object(tmp_path):
    with pytest.raises(ConfigError, match="expected a JSON object, got list"):
        ModelConfig.from_json(_write(tmp_path, "[1, 2]"))


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json") as ei:
        ModelConfig.from_json(tmp_path / "nowhere" / "config.json")
    assert "nowhere" in str(ei.value)
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_json(tmp_path)  # a directory without config.json


def _yarn_reference(dim=64, base=10000.0, factor=40.0, orig=4096, beta_fast=32.0, beta_slow=1.0):
    """Facts section 3, written independently in float64 (plain Python math, no torch ops)."""
    def corr(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = math.floor(corr(beta_fast)), math.ceil(corr(beta_slow))
    out = []
    for i in range(dim // 2):
        f = base ** (-2 * i / dim)
        smooth = 1 - min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(f / factor * (1 - smooth) + f * smooth)
    return (low, high), torch.tensor(out, dtype=torch.float64)


def test_yarn_inv_freq_matches_reference():
    (low, high), ref = _yarn_reference()
    assert (low, high) == (10, 23)
    got = yarn_inv_freq(ModelConfig.from_dict(REAL_CONFIG))
    assert got.shape == (32,)
    err = ((got.double() - ref).abs() / ref).max().item()
    assert err < 1e-7, f"max relative error {err:.2e}"
    # below the correction range: unscaled; above it: divided by the factor
    assert torch.allclose(got[:10].double(), torch.tensor([1e4 ** (-2 * i / 64) for i in range(10)],
                                                          dtype=torch.float64), rtol=1e-7)
    assert torch.allclose(got[23:].double(), torch.tensor([1e4 ** (-2 * i / 64) / 40 for i in range(23, 32)],
                                                          dtype=torch.float64), rtol=1e-7)


# ---------------------------------------------------------------------------------------------- numeric ranges
OUT_OF_RANGE = [
    # (changes, field named in the message, value named in the message): garbage that used to load
    ({"rms_norm_eps": -1}, "rms_norm_eps", "-1"),
    ({"rms_norm_eps": 0}, "rms_norm_eps", "0"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps", "nan"),
    ({"routed_scaling_factor": float("nan")}, "routed_scaling_factor", "nan"),
    ({"routed_scaling_factor": float("inf")}, "routed_scaling_factor", "inf"),
    ({"routed_scaling_factor": 0}, "routed_scaling_factor", "0"),
    ({"routed_scaling_factor": -2.5}, "routed_scaling_factor", "-2.5"),
    ({"rope_theta": 0}, "rope_theta", "0"),
    ({"rope_theta": float("nan")}, "rope_theta", "nan"),
    ({"rope_theta": 1}, "rope_theta", "1"),
    ({"rope_scaling__factor": float("nan")}, "rope_scaling.factor", "nan"),
    ({"rope_scaling__factor": float("inf")}, "rope_scaling.factor", "inf"),
    ({"rope_scaling__beta_fast": float("nan")}, "rope_scaling.beta_fast", "nan"),
    ({"rope_scaling__beta_slow": 0}, "rope_scaling.beta_slow", "0"),
    ({"rope_scaling__beta_fast": 0.5}, "rope_scaling.beta_fast", "0.5"),
    ({"rope_scaling__mscale": float("nan")}, "rope_scaling.mscale", "nan"),
    ({"rope_scaling__mscale": -1}, "rope_scaling.mscale", "-1"),
    ({"rope_scaling__mscale_all_dim": 0.707}, "rope_scaling.mscale_all_dim", "0.707"),
    ({"rope_scaling__original_max_position_embeddings": 0}, "rope_scaling.original_max_position_embeddings", "0"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok", "0"),
    ({"n_shared_experts": -1}, "n_shared_experts", "-1"),
    ({"eos_token_id": 129280}, "eos_token_id", "129280"),
]


@pytest.mark.parametrize("changes, field, value", OUT_OF_RANGE, ids=[f"{c}" for c, _, _ in OUT_OF_RANGE])
def test_numeric_field_out_of_range_names_field_value_and_range(tmp_path, changes, field, value):
    path = _write(tmp_path, _edited(**changes))  # json.dumps writes NaN / Infinity, which json.loads reads back
    with pytest.raises(ConfigError) as ei:
        ModelConfig.from_json(path)
    msg = str(ei.value)
    assert path in msg and f"'{field}'" in msg and value in msg and "expected" in msg, msg


# ---------------------------------------------------------------------------------------------- missing fields
def _without(*names):
    raw = copy.deepcopy(REAL_CONFIG)
    for name in names:
        *parents, leaf = name.split("__")
        d = raw
        for p in parents:
            d = d[p]
        del d[leaf]
    return raw


def test_missing_fields_take_transformers_defaults():
    """Every field transformers' DeepseekV32Config knows takes its default there when config.json lacks it."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV32Config()
    ours = {f.name for f in dataclasses.fields(ModelConfig)}
    shared = sorted(n for n in ours if n in REAL_CONFIG and hasattr(hf, n) and n not in REQUIRED_FIELDS
                    and n not in ("architectures", "model_type", "rope_scaling"))  # rope: tested below
    assert len(shared) >= 20, shared  # the numeric fields of the model
    for name in shared:
        got = getattr(ModelConfig.from_dict(_without(name)), name)
        want = getattr(hf, name)
        assert got == want, f"{name}: missing from config.json gives {got!r}, transformers' default is {want!r}"
    theta = ModelConfig.from_dict(_without("rope_theta")).rope_theta
    assert theta == hf.rope_parameters["rope_theta"]


@pytest.mark.parametrize("name", REQUIRED_FIELDS)
def test_fields_without_a_safe_default_are_refused(tmp_path, name):
    """num_experts_per_tok / index_topk missing used to load transformers' (the 671B's) value, exit 0."""
    path = _write(tmp_path, _without(name))
    with pytest.raises(ConfigError, match=f"field '{name}' is missing; no default is assumed") as ei:
        ModelConfig.from_json(path)
    assert path in str(ei.value)


def test_defaulted_fields_are_listed():
    assert defaulted_fields(REAL_CONFIG) == ()
    raw = _without("rope_theta", "tie_word_embeddings", "rope_scaling__beta_slow")
    assert defaulted_fields(raw) == ("rope_theta", "tie_word_embeddings", "rope_scaling.beta_slow")


def test_defaulted_values_say_what_was_assumed():
    """A result names each defaulted field and the value taken; for rope_scaling, that no scaling was applied and
    what DeepSeek's reference code would have done instead (the two readings differ, issue 27 item 6)."""
    assert defaulted_values(REAL_CONFIG) == {}
    got = defaulted_values(_without("rope_scaling", "rope_theta", "tie_word_embeddings", "quantization_config"))
    assert list(got) == ["rope_theta", "rope_scaling", "quantization_config", "tie_word_embeddings"]
    assert (got["rope_theta"], got["tie_word_embeddings"], got["quantization_config"]) == ("10000.0", "false", "none")
    assert got["rope_scaling"].startswith("none: plain RoPE") and "YaRN factor 40" in got["rope_scaling"]
    assert defaulted_values(_without("rope_scaling__beta_slow")) == {"rope_scaling.beta_slow": "1.0"}


def test_missing_rope_scaling_means_no_scaling():
    """transformers runs plain RoPE without rope_scaling; the 671B's YaRN factor 40 must not sneak in."""
    cfg = ModelConfig.from_dict(_without("rope_scaling"))
    assert cfg.rope_scaling is None
    dim = cfg.qk_rope_head_dim
    plain = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    torch.testing.assert_close(yarn_inv_freq(cfg), plain.float(), rtol=0, atol=0)
    assert cfg.softmax_scale == pytest.approx(cfg.qk_head_dim ** -0.5, rel=1e-12)


def test_missing_quantization_config_means_bf16_weights():
    cfg = ModelConfig.from_dict(_without("quantization_config"))
    assert cfg.quantization_config is None and not cfg.is_fp8


def test_missing_max_position_embeddings_is_transformers_default():
    transformers = pytest.importorskip("transformers")
    raw = _without("max_position_embeddings")
    raw["rope_scaling"] = None  # no 671B YaRN either: the default must come from transformers, not the 671B file
    cfg = ModelConfig.from_dict(raw)
    assert cfg.max_position_embeddings == transformers.DeepseekV32Config().max_position_embeddings


def test_missing_num_nextn_predict_layers_means_no_mtp_modules():
    """transformers' DeepseekV32 has no MTP modules; a config without the field describes none."""
    assert ModelConfig.from_dict(_without("num_nextn_predict_layers")).num_nextn_predict_layers == 0


@pytest.mark.parametrize("name", ["factor", "original_max_position_embeddings", "mscale", "mscale_all_dim"])
def test_rope_scaling_without_a_required_field_names_it(tmp_path, name):
    path = _write(tmp_path, _without(f"rope_scaling__{name}"))
    with pytest.raises(ConfigError, match=f"'rope_scaling.{name}'") as ei:
        ModelConfig.from_json(path)
    assert path in str(ei.value)


def test_rope_scaling_betas_default_as_in_transformers():
    rs = ModelConfig.from_dict(_without("rope_scaling__beta_fast", "rope_scaling__beta_slow")).rope_scaling
    assert (rs.beta_fast, rs.beta_slow) == (32.0, 1.0)


def test_bundled_model_config_has_every_field():
    """The shipped model must not depend on a default: every field is written in its config.json."""
    from mtp.checkpoint.tiny import default_checkpoint

    raw = json.loads((default_checkpoint() / "config.json").read_text())
    missing = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in raw]
    assert not missing, missing
