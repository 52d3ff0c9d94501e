"""A run whose logits go non-finite stops with an error naming the first module whose output is non-finite."""

from __future__ import annotations

import pytest
import torch

from mtp import generate
from mtp.checkpoint.files import load_model
from mtp.decode.health import NonFiniteError, first_nonfinite

PROMPTS = [[5, 17, 33, 8, 91, 4], [7, 7, 300, 12]]


@pytest.fixture
def model(tiny_ckpt):
    """A private copy of the tiny model, free to poison."""
    return load_model(tiny_ckpt, dtype=torch.float32, numerics="fp8")


def _poison(model, name: str, index=0) -> None:
    with torch.no_grad():
        model.get_parameter(name).view(-1)[index] = float("nan")


@pytest.mark.parametrize("draft, k", [("none", 0), ("eagle", 2), ("vanilla", 1)])
@pytest.mark.parametrize("param, named", [
    ("model.layers.1.post_attention_layernorm.weight", "model.layers.1.post_attention_layernorm"),
    ("model.layers.2.mlp.shared_experts.down_proj.weight_scale_inv", "model.layers.2.mlp"),
    ("model.layers.0.self_attn.kv_a_layernorm.weight", "model.layers.0.self_attn"),
])
def test_nan_in_a_layer_stops_the_run_naming_it(model, param, named, draft, k):
    _poison(model, param)
    with pytest.raises(NonFiniteError) as ei:
        generate(model, PROMPTS, max_new_tokens=6, draft=draft, k=k)
    msg = str(ei.value)
    assert f"first non-finite output: {named} " in msg and "prefill" in msg, msg


def test_tree_decoding_stops_too(model):
    """generate_tree (the draft-tree reference loop) has the same check, at the prefill and at a step."""
    from mtp.decode.tree import generate_tree
    from mtp.spec.tree_shape import TreeShape

    tree = TreeShape.from_branching((2, 1))
    first = generate_tree(model, PROMPTS[:1], tree, 1, draft="eagle").tokens[0][0]
    assert first not in PROMPTS[0]
    _poison(model, "model.embed_tokens.weight", first * model.cfg.hidden_size)
    with pytest.raises(NonFiniteError, match=r"in step 1; first non-finite output: model.embed_tokens \(rows \[0\]"):
        generate_tree(model, PROMPTS[:1], tree, 6, draft="eagle")
    _poison(model, "model.layers.1.post_attention_layernorm.weight")
    with pytest.raises(NonFiniteError, match="prefill; first non-finite output: model.layers.1.post_attention_layernorm "):
        generate_tree(model, PROMPTS, tree, 6, draft="eagle")


def test_nan_reached_only_while_decoding_is_caught_at_that_step(model):
    """The prompt is clean; the first generated token's embedding row is NaN, so only the first verify step
    (which feeds that token) goes non-finite."""
    first = generate(model, PROMPTS[:1], max_new_tokens=1).tokens[0][0]
    assert first not in PROMPTS[0]
    _poison(model, "model.embed_tokens.weight", first * model.cfg.hidden_size)
    with pytest.raises(NonFiniteError) as ei:
        generate(model, PROMPTS[:1], max_new_tokens=6, draft="eagle", k=2)
    msg = str(ei.value)
    assert "step 1" in msg and "first non-finite output: model.embed_tokens " in msg and "rows [0]" in msg, msg


def test_clean_model_has_no_nonfinite_module(model):
    assert first_nonfinite(model, torch.tensor(PROMPTS[:1])) is None
    r = generate(model, PROMPTS, max_new_tokens=6, draft="eagle", k=2)
    assert all(len(t) == 6 or t[-1] == model.cfg.eos_token_id for t in r.tokens)


def test_mtp_eval_stops_with_one_line_when_logits_overflow(tmp_path):
    """Finite weights can still overflow: the final norm's weight at 3e38 makes its output infinite. The loader
    accepts the checkpoint; the run must stop at the prefill with one line naming model.norm, no metrics."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from mtp.checkpoint.tiny import default_checkpoint

    root = Path(__file__).resolve().parents[2]
    ckpt = Path(shutil.copytree(default_checkpoint(), tmp_path / "ckpt"))
    shard = ckpt / json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]["model.norm.weight"]
    tensors = load_file(str(shard))
    tensors["model.norm.weight"] = torch.full_like(tensors["model.norm.weight"], 3e38)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(PYTHONPATH=str(root), HYDRA_FULL_ERROR="0")
    r = subprocess.run([sys.executable, "-m", "eval.run", f"model.path={ckpt}", "dataset.limit=1", "max_new_tokens=4",
                        "runtime.warmup=false", "baseline=false", f"hydra.run.dir={run}"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("mtp-eval: error:")]
    assert len(errors) == 1 and "first non-finite output: model.norm " in errors[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not (run / "metrics.json").exists()


def test_a_failed_call_leaves_no_buffers_to_reuse(model):
    """After a non-finite stop the engine drops that call's buffers: its caches hold non-finite entries past the
    rows' lengths, which a later call attending over a static bound (graph modes on CUDA) would multiply by zero
    (0 * NaN = NaN). The repaired model then decodes like a fresh engine."""
    from mtp.decode.config import GenerationConfig
    from mtp.decode.engine import Engine

    name = "model.layers.1.post_attention_layernorm.weight"
    saved = model.get_parameter(name).detach().clone()
    engine = Engine(model, GenerationConfig.from_options(6, "eagle", 2))
    assert engine.run(PROMPTS).tokens and len(engine.pool.states) == 1
    _poison(model, name)
    with pytest.raises(NonFiniteError):
        engine.run(PROMPTS)
    assert engine.pool.states == {}
    with torch.no_grad():
        model.get_parameter(name).copy_(saved)
    assert engine.run(PROMPTS).tokens == generate(model, PROMPTS, max_new_tokens=6, draft="eagle", k=2).tokens


@pytest.mark.parametrize("scale", [2.0 ** 60, 2.0 ** 100])
def test_finite_overflow_that_zeroes_the_logits_stops_the_run(model, scale):
    """A finite but absurd o_proj scale (the loader refuses it; here set on a loaded model): the residual grows
    huge, RMSNorm's mean square overflows, its output collapses to exactly zero and every logit is 0.0, argmax
    token 0. That is the same failure as a NaN: the run stops, naming the first module whose output is bad."""
    with torch.no_grad():
        model.get_parameter("model.layers.0.self_attn.o_proj.weight_scale_inv").fill_(scale)
    with pytest.raises(NonFiniteError) as ei:
        generate(model, PROMPTS, max_new_tokens=6, draft="eagle", k=2)
    msg = str(ei.value)
    assert "prefill" in msg and "output: model.layers.0." in msg, msg


def test_all_equal_logits_are_flagged_and_a_zeroed_norm_is_named(model):
    """A final norm whose weight is zero: finite everywhere, logits all exactly equal."""
    with torch.no_grad():
        model.get_parameter("model.norm.weight").zero_()
    assert first_nonfinite(model, torch.tensor(PROMPTS[:1]))[::2] == ("model.norm", "collapsed (all values equal)")
    with pytest.raises(NonFiniteError, match=r"first collapsed \(all values equal\) output: model.norm \(rows \[0, 1"):
        generate(model, PROMPTS, max_new_tokens=6)
