"""The reference forward in 'dequant' numerics against transformers' DeepseekV32ForCausalLM (the oracle).

Both models get the same weights: the tiny checkpoint's tensors read straight from its safetensors shards (not
through mtp's loader), FP8 ones dequantized with `mtp.model.fp8.weight_dequant`, in float32, eager attention.
Prompts: batch 2, T=8 (< index_topk=16, DSA is dense causal attention) and T=40 (sparse: later queries keep
16 of up to 40 keys).

Where transformers departs from DeepSeek's reference on purpose, the part is held to a float64 implementation
of the reference formula instead, in tests/model/test_fp8.py:
- indexer without the Walsh-Hadamard rotation and without FP8 q/k: the rotation is orthogonal, so in dequant
  numerics both score the same (checked below through the selections); the rotated, FP8 scoring is held to
  float64 in `test_indexer_ranking_matches_float64_reference` (both numerics).
- router group mask: transformers 5.x fills dropped groups with -inf like DeepSeek (older ports used 0.0);
  `test_moe_routing_masks_dropped_groups_with_minus_inf` pins the -inf semantics with negative biased scores.
- no FP8 latent / indexer-key cache: `test_fp8_latent_kv_cache_stores_act_quant_of_latent`.
transformers also drops the MTP layer (model.layers.N for N = num_hidden_layers), so only the trunk is compared.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.oracles import yarn_inv_freq64
from safetensors import safe_open

from mtp.model.deepseek import fp8
from mtp.model.attention import Indexer
from mtp.checkpoint.files import INDEX_NAME, load_model
from mtp.model.config import ModelConfig

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM  # noqa: E402

F64 = torch.float64
TOL = 1e-4  # float32 end to end; measured max deviation ~1e-6 relative


def hf_config(cfg: ModelConfig) -> DeepseekV32Config:
    """The equivalent transformers config: no quantization_config (weights arrive dequantized), YaRN with the
    same parameters. The tiny config's max_position_embeddings / original (16) differs from factor (40);
    transformers warns and uses the explicit factor, as DeepSeek's reference does."""
    rs = cfg.rope_scaling
    return DeepseekV32Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        first_k_dense_replace=cfg.first_k_dense_replace, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        n_routed_experts=cfg.n_routed_experts, n_shared_experts=cfg.n_shared_experts,
        num_experts_per_tok=cfg.num_experts_per_tok, n_group=cfg.n_group, topk_group=cfg.topk_group,
        norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor,
        index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=dict(rope_type="yarn", rope_theta=cfg.rope_theta, factor=rs.factor,
                             original_max_position_embeddings=rs.original_max_position_embeddings,
                             beta_fast=rs.beta_fast, beta_slow=rs.beta_slow, mscale=rs.mscale,
                             mscale_all_dim=rs.mscale_all_dim),
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, tie_word_embeddings=False,
        attn_implementation="eager",
    )


def checkpoint_float_tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in float32, FP8 weights dequantized with their block scales."""
    wm = json.loads((path / INDEX_NAME).read_text())["weight_map"]
    raw = {}
    for fname in sorted(set(wm.values())):
        with safe_open(str(path / fname), framework="pt") as f:
            raw.update({k: f.get_tensor(k) for k in f.keys()})
    out = {}
    for name, t in raw.items():
        if name.endswith("weight_scale_inv"):
            continue
        if t.dtype == fp8.FP8_DTYPE:
            out[name] = fp8.weight_dequant(t, raw[name.replace(".weight", ".weight_scale_inv")], torch.float32)
        else:
            out[name] = t.float()
    return out


def hf_state_dict(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Checkpoint names -> transformers names: experts stacked as gate_up_proj [E, 2I, D] (gate rows first) and
    down_proj [E, D, I]; MTP layers dropped; everything else keeps its name."""
    out = {}
    for name, t in tensors.items():
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m and int(m.group(1)) >= cfg.num_hidden_layers:
            continue
        if re.search(r"\.mlp\.experts\.\d+\.", name):
            continue
        out[name] = t
    for i in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts"
        E = cfg.n_routed_experts
        out[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat((tensors[f"{p}.{e}.gate_proj.weight"], tensors[f"{p}.{e}.up_proj.weight"])) for e in range(E)])
        out[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in range(E)])
    return out


@pytest.fixture(scope="module")
def hf_model(tiny_ckpt, tiny_model_dequant):
    cfg = tiny_model_dequant.cfg
    model = DeepseekV32ForCausalLM(hf_config(cfg)).float().eval()
    sd = hf_state_dict(checkpoint_float_tensors(tiny_ckpt), cfg)
    expected = model.state_dict()
    assert sorted(sd) == sorted(expected), (sorted(set(sd) ^ set(expected))[:5])
    for k, v in sd.items():
        assert v.shape == expected[k].shape, f"{k}: {tuple(v.shape)} vs transformers {tuple(expected[k].shape)}"
    model.load_state_dict(sd, strict=True)
    return model


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def test_rope_and_softmax_scale_match_hf_and_reference(hf_model, tiny_model_dequant):
    """Before comparing logits: the frequencies, transformers' cos/sin factor and the softmax scale."""
    cfg = tiny_model_dequant.cfg
    rot = hf_model.model.rotary_emb
    # YaRN's attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) = 1 here: the
    # cos/sin carry no extra mscale, as in DeepSeek's reference (which has no such factor at all).
    assert rot.attention_scaling == 1.0
    ref, _, _ = yarn_inv_freq64(cfg)
    assert rel(rot.inv_freq, ref) < 1e-6 and rel(tiny_model_dequant.rotary.inv_freq, ref) < 1e-6
    pos = torch.arange(64).unsqueeze(0)
    cos_hf, sin_hf = rot(torch.zeros(1, dtype=torch.float32), pos)
    cos, sin = tiny_model_dequant.rotary.angles(pos)
    half = cfg.qk_rope_head_dim // 2  # transformers' cos/sin are cat(freqs, freqs)
    assert (cos_hf[..., :half] - cos).abs().max() < 1e-5 and (sin_hf[..., :half] - sin).abs().max() < 1e-5
    # softmax scale = qk_head_dim^-0.5 * (0.1 * mscale * ln(factor) + 1)^2
    m = 0.1 * cfg.rope_scaling.mscale * math.log(cfg.rope_scaling.factor) + 1
    want = cfg.qk_head_dim ** -0.5 * m * m
    for layer in hf_model.model.layers:
        assert layer.self_attn.scaling == pytest.approx(want, rel=1e-12)
    assert tiny_model_dequant.model.layers[0].self_attn.softmax_scale == pytest.approx(want, rel=1e-12)


def test_full_size_config_reference_numbers():
    """The 671B numbers of facts section 3: softmax scale 0.135234, YaRN correction range (10, 23)."""
    cfg = ModelConfig()
    assert cfg.softmax_scale == pytest.approx(0.135234, abs=1e-6)
    _, low, high = yarn_inv_freq64(cfg)
    assert (low, high) == (10, 23)


def _record(model: torch.nn.Module, names: list[str], store: dict) -> list:
    hooks = []
    for n in names:
        def hook(mod, inp, out, n=n):
            store[n] = out[0] if isinstance(out, tuple) else out
        hooks.append(model.get_submodule(n).register_forward_hook(hook))
    return hooks


ROUTE_MARGIN = 1e-4  # smallest gap at a routing decision the inputs may have: 100x the ~1e-6 the paths differ by


def _route_margin(model, ids: torch.Tensor) -> float:
    """The smallest gap, over every MoE layer and token of a forward of `ids`, at the router's two decisions (the
    last kept group's score against the next group's; the last chosen biased expert score against the next kept one),
    as `mtp.model.moe.route` makes them."""
    from mtp.model.moe import Gate

    gaps = []

    def grab(gate, args):
        x = args[0]
        b = torch.nn.functional.linear(x.double(), gate.weight.double()).sigmoid() + gate.e_score_correction_bias.double()
        if gate.n_groups > 1:
            g = b.view(b.shape[0], gate.n_groups, -1)
            top2 = g.topk(2, dim=-1).values.sum(-1)
            gs = top2.sort(-1, descending=True).values
            gaps.append((gs[:, gate.topk_groups - 1] - gs[:, gate.topk_groups]).min().item())
            drop = torch.ones_like(top2, dtype=torch.bool).scatter_(1, top2.topk(gate.topk_groups, dim=-1).indices, False)
            b = g.masked_fill(drop.unsqueeze(-1), float("-inf")).view(b.shape[0], -1)
        s = b.sort(-1, descending=True).values
        gaps.append((s[:, gate.topk - 1] - s[:, gate.topk]).min().item())

    hooks = [m.register_forward_pre_hook(grab) for m in model.modules() if isinstance(m, Gate)]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return min(gaps)


def _clear_ids(model, B: int, T: int) -> torch.Tensor:
    """Token ids (seeded from T) whose forward routes with every decision at least ROUTE_MARGIN apart: a tiny random
    model can put two experts' scores within rounding of each other, and then whether the reference and transformers
    pick the same one depends on the CPU's summation order (an AMD EPYC runner flipped one at layer 1 of the dense
    absorb case, session 15), which is not what this test compares."""
    for seed in range(T, T + 64 * 100, 100):
        ids = torch.randint(0, model.cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))
        if _route_margin(model, ids) >= ROUTE_MARGIN:
            return ids
    raise AssertionError(f"no seed of 64 gives routing margins >= {ROUTE_MARGIN}")


@pytest.mark.parametrize("attn_impl", ["naive", "absorb"])
@pytest.mark.parametrize("T", [8, 40], ids=["dense", "sparse"])
def test_logits_match_transformers(hf_model, tiny_model_dequant, monkeypatch, T, attn_impl):
    ours_model, cfg = tiny_model_dequant, tiny_model_dequant.cfg
    assert ours_model.runtime.numerics == "dequant"
    B, L = 2, cfg.num_hidden_layers
    ids = _clear_ids(ours_model, B, T)

    # Per-layer taps: attention out, MLP/MoE out, block out (the fp32 residual stream).
    names = [f"model.layers.{i}.{s}" for i in range(L) for s in ("self_attn", "mlp")]
    names += [f"model.layers.{i}" for i in range(L)]
    ours, theirs = {}, {}
    hooks = _record(ours_model, names, ours) + _record(hf_model, names + ["model.norm"], theirs)
    # Indexer selections: ours as a keep mask, transformers' as top-k indices.
    layer_of = {id(ours_model.model.layers[i].self_attn.indexer): i for i in range(L)}
    ours_keep, original_select = {}, Indexer.select

    def recording_select(self, *args, **kwargs):
        keep = original_select(self, *args, **kwargs)
        ours_keep[layer_of[id(self)]] = keep
        return keep

    monkeypatch.setattr(Indexer, "select", recording_select)
    hooks += _record(hf_model, [f"model.layers.{i}.self_attn.indexer" for i in range(L)], theirs)
    saved = ours_model.runtime
    try:
        ours_model.set_runtime(dataclasses.replace(saved, attn_impl=attn_impl))  # session fixture: restored below
        with torch.no_grad():
            out = ours_model(ids)
            hf_out = hf_model(input_ids=ids, use_cache=False)
    finally:
        ours_model.set_runtime(saved)
        for h in hooks:
            h.remove()

    causal_BTS = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    for i in range(L):
        picked = theirs[f"model.layers.{i}.self_attn.indexer"].long()
        hf_keep = torch.zeros(B, T, T, dtype=torch.bool).scatter_(-1, picked, True) & causal_BTS
        assert torch.equal(ours_keep[i], hf_keep), f"layer {i}: indexer selections differ"
        n_dropped = (causal_BTS & ~ours_keep[i]).sum().item()
        if T > cfg.index_topk:  # make sure the sparse case really is sparse: later queries drop keys
            assert n_dropped == B * sum(t + 1 - cfg.index_topk for t in range(cfg.index_topk, T))
        else:
            assert n_dropped == 0

    # First divergence, in forward order, so a failure names the layer and sublayer.
    for n in [f"model.layers.{i}{s}" for i in range(L) for s in (".self_attn", ".mlp", "")]:
        err = rel(ours[n], theirs[n])
        assert err < TOL, f"first divergence at {n}: max rel {err:.2e}"
    assert rel(out.hidden_prenorm, theirs[f"model.layers.{L - 1}"]) < TOL
    assert rel(out.hidden, theirs["model.norm"]) < TOL, "final (normed) hidden states differ"
    err = rel(out.logits, hf_out.logits)
    print(f"T={T} {attn_impl}: logits max rel err vs transformers {err:.2e}")
    assert err < TOL
    assert torch.equal(out.logits.argmax(-1), hf_out.logits.argmax(-1))


def test_config_without_rope_scaling_matches_transformers(tiny_ckpt, tmp_path):
    """A config.json without rope_scaling (issue 27 item 6): transformers (and vLLM) read it as plain RoPE with
    an unscaled softmax; DeepSeek's reference code would apply its YaRN defaults (factor 40) instead. We follow
    transformers (`ModelConfig.from_dict` says why). Both sides read the same file, as `from_pretrained` would."""
    path = Path(shutil.copytree(tiny_ckpt, tmp_path / "no_rope_scaling"))
    raw = json.loads((path / "config.json").read_text())
    del raw["rope_scaling"]
    (path / "config.json").write_text(json.dumps(raw))
    ours = load_model(path, dtype=torch.float32, numerics="dequant")
    raw.pop("quantization_config")  # the weights arrive dequantized
    hf = DeepseekV32ForCausalLM(DeepseekV32Config(**raw, attn_implementation="eager")).float().eval()
    hf.load_state_dict(hf_state_dict(checkpoint_float_tensors(path), ours.cfg), strict=True)
    assert ours.cfg.rope_scaling is None and hf.config.rope_parameters["rope_type"] == "default"

    dim = ours.cfg.qk_rope_head_dim
    plain = ours.cfg.rope_theta ** (-torch.arange(0, dim, 2, dtype=F64) / dim)
    assert rel(ours.rotary.inv_freq, plain) < 1e-6 and rel(hf.model.rotary_emb.inv_freq, plain) < 1e-6
    assert hf.model.rotary_emb.attention_scaling == 1.0
    unscaled = ours.cfg.qk_head_dim ** -0.5
    assert ours.model.layers[0].self_attn.softmax_scale == pytest.approx(unscaled, rel=1e-12)
    assert hf.model.layers[0].self_attn.scaling == pytest.approx(unscaled, rel=1e-12)
    for T in (8, 40):  # dense and sparse (index_topk 16)
        ids = torch.randint(0, ours.cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(T))
        with torch.no_grad():
            err = rel(ours(ids).logits, hf(input_ids=ids, use_cache=False).logits)
        assert err < TOL, f"T={T}: logits max rel err vs transformers {err:.2e} without rope_scaling"
