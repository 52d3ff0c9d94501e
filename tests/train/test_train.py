"""Training layer on CPU: the loss goes down, the FP8 export reloads with matching logits, the indexer and
router objectives do what the reports say, and heads-only training repairs a weakened MTP module."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mtp.checkpoint.files import load_model
from mtp.decode.engine import generate
from mtp.model.deepseek import MTPLayer
from mtp.checkpoint.inventory import block_spec, mtp_extra_spec
from mtp.train.append import write_mtp_layers
from mtp.train.config import HeadsConfig, ModelShape, TrainConfig
from mtp.train.data import Dataset, encode_prompt, prepare
from mtp.train.evaluate import heldout_loss
from mtp.train.export import export_checkpoint, fp8_config, quantize_tensors
from mtp.train.heads import precompute, train_heads
from mtp.train.model_init import build_model, init_parameters
from mtp.train.objective import (DENSE_TOPK, Capture, TrainCache, attention_probs, index_scores, indexer_kl,
                                 lm_losses, set_index_topk)
from mtp.train.trainer import heldout_windows, train

# The smallest shape whose every FP8 GEMM input is a multiple of 128; still MLA + indexer + grouped MoE.
SHAPE = ModelShape(hidden=128, layers=2, dense_layers=1, heads=2, q_lora_rank=128, kv_lora_rank=128, nope_dim=32,
                   rope_dim=32, v_dim=64, intermediate=128, moe_intermediate=128, experts=4, experts_per_token=2,
                   groups=2, topk_groups=1, index_heads=2, index_topk=8, mtp_modules=1)
TC = TrainConfig(shape=SHAPE, seq_len=24, batch_size=4, max_steps=16, max_minutes=5, lr=3e-3, warmup_steps=2,
                 eval_every=1000, eval_batches=2, log_every=1, sparse_frac=0.25, indexer_rows=2)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return Dataset.load(prepare(tmp_path_factory.mktemp("data"), max_files=8, vocab=300, val_permille=200))


@pytest.fixture(scope="module")
def trained(data):
    torch.manual_seed(0)
    return train(TC, data, progress=False)


@pytest.fixture(scope="module")
def exported(trained, data, tmp_path_factory):
    return export_checkpoint(trained.model, data.tokenizer, tmp_path_factory.mktemp("ckpt") / "m", index_topk=8)


def test_data_split_by_file_and_chat_format(data):
    meta = data.meta
    assert meta["train"]["files"] > 0 and meta["val"]["files"] > 0
    ex = data.eval_examples()
    assert ex and all(e["file"] for e in ex)
    tok = data.tokenizer
    ids = encode_prompt(ex[0], tok)
    assert ids[:2] == [tok.bos_id, tok.user_id] and ids[-2:] == [tok.assistant_id, tok.think_id]
    assert ex[0]["module"] in ex[0]["reasoning"] and ex[0]["function"] in ex[0]["reasoning"]


def test_loss_goes_down(trained, data):
    init = build_model(SHAPE.model_config(data.tokenizer.vocab_size), seed=TC.seed).eval()
    set_index_topk(init, SHAPE.index_topk)
    before = heldout_loss(init, heldout_windows(data, TC), TC.batch_size)
    after = trained.final
    assert trained.steps == TC.max_steps
    assert after["heldout/main"] < before["heldout/main"] - 0.5, (before, after)
    assert after["heldout/mtp_1"] < before["heldout/mtp_1"] - 0.5, (before, after)
    kl = [h["loss/indexer_kl"] for h in trained.history if "loss/indexer_kl" in h]
    assert len(kl) == TC.max_steps and all(k >= 0 for k in kl)


def test_export_reloads_with_matching_logits(trained, exported, data):
    model = trained.model
    ids = heldout_windows(data, TC)[:2, :-1]
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["quantization_config"]["scale_fmt"] == "ue8m0" and cfg["num_nextn_predict_layers"] == 1
    q = load_model(exported, numerics="fp8")
    assert q.model.layers[0].self_attn.q_a_proj.weight.dtype == torch.float8_e4m3fn
    with torch.no_grad():
        ref, got = model(ids), q(ids)
        # Same positions through each MTP module (its own cache), from each model's own hidden.
        T = ids.shape[1]
        cache = TrainCache(model.cfg, 1, 2, T - 1, "cpu", torch.float32)
        mref = model.mtp_forward(0, ids[:, 1:], ref.hidden[:, :-1], cache)
        mgot = q.mtp_forward(0, ids[:, 1:], got.hidden[:, :-1], q.new_cache(2, T - 1, n_layers=1))
    for a, b in ((ref.logits, got.logits), (mref.logits, mgot.logits)):
        rel = (a - b).norm() / a.norm()
        agree = (a.argmax(-1) == b.argmax(-1)).float().mean()
        # FP8 weights (about 7% relative logit error here) plus FP8 activations (about 10% in all).
        assert rel < 0.15 and agree > 0.85, (float(rel), float(agree))
    w = heldout_windows(data, TC)
    lf, lq = heldout_loss(model, w, 4), heldout_loss(q, w, 4)
    assert abs(lf["heldout/main"] - lq["heldout/main"]) < 0.05, (lf, lq)


def test_attention_and_index_recomputation_match_modules(trained, data):
    model = trained.model
    set_index_topk(model, DENSE_TOPK)
    try:
        _check_recomputation(model, heldout_windows(data, TC)[:2, :-1])
    finally:
        set_index_topk(model, SHAPE.index_topk)


def _check_recomputation(model, ids):
    mla = model.model.layers[1].self_attn
    seen = {}
    h = mla.register_forward_pre_hook(lambda m, a: seen.setdefault("a", a))
    B, T = ids.shape
    with torch.no_grad():
        model(ids)
        h.remove()
        x, pos, cos, sin = seen["a"][:4]
        causal = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
        p = attention_probs(mla, x, cos, sin, causal)
        c = mla.kv_a_layernorm(mla.kv_a_proj_with_mqa(x)[..., : mla.C], x.dtype)
        v = mla.kv_b_proj(c).view(B, T, mla.H, mla.P + mla.V)[..., mla.P:]
        o = mla.o_proj(torch.einsum("bhts,bshv->bthv", p, v).reshape(B, T, -1))
        fresh = TrainCache(model.cfg, 1, B, T, "cpu", torch.float32).layer(0)
        torch.testing.assert_close(o, mla(x, pos, cos, sin, fresh, T, model.runtime), rtol=1e-4, atol=1e-5)
        # Index scores: their top-k is the selection Indexer.select makes.
        qr = mla.q_a_layernorm(mla.q_a_proj(x), x.dtype)
        score = index_scores(mla.indexer, x, qr, cos, sin).masked_fill(~causal, float("-inf"))
        cache = TrainCache(model.cfg, 1, B, T, "cpu", torch.float32).layer(0)
        cache.write(pos, c, c[..., :1].expand(-1, -1, model.cfg.qk_rope_head_dim), mla.indexer.keys(x, cos, sin))
        mla.indexer.topk = 5
        keep = mla.indexer.select(x, qr, cos, sin, cache, T, causal)
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :5]
    mine = torch.zeros_like(causal).scatter_(-1, order, True) & causal
    assert torch.equal(mine, keep)


def test_indexer_and_lm_losses_touch_disjoint_weights(data):
    model = build_model(SHAPE.model_config(data.tokenizer.vocab_size), seed=1)
    set_index_topk(model, DENSE_TOPK)
    cap = Capture(model, rows=2)
    ids = heldout_windows(data, TC)[:2]
    cap.active = True
    lm = lm_losses(model, ids, 0.3).total
    cap.active = False
    kl = cap.indexer_loss(DENSE_TOPK)
    idx = {n for n, p in model.named_parameters() if ".indexer." in n}
    g_lm = torch.autograd.grad(lm, [p for n, p in model.named_parameters() if n in idx], allow_unused=True)
    assert all(g is None or g.abs().max() == 0 for g in g_lm)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    g_kl = torch.autograd.grad(kl, [p for _, p in named], allow_unused=True)
    touched = {n for (n, _), g in zip(named, g_kl) if g is not None and g.abs().max() > 0}
    assert touched and touched <= idx, sorted(touched - idx)[:3]
    # The sparse-stage loss is a KL over the selected keys: finite and non-negative.
    mla, x, cos, sin = cap.inputs[0]
    assert 0 <= float(indexer_kl(mla, x, cos, sin, topk=4).detach()) < float("inf")


def test_bias_update_moves_toward_balance(data):
    model = build_model(SHAPE.model_config(data.tokenizer.vocab_size), seed=2)
    cap = Capture(model, rows=1)
    gate = cap.gates[0]
    cap.loads[id(gate)].copy_(torch.tensor([10.0, 0.0, 5.0, 5.0]))
    cap.update_biases(0.01)
    torch.testing.assert_close(gate.e_score_correction_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    assert cap.loads[id(gate)].sum() == 0


def _first_draft_acceptance(ckpt, prompts) -> float:
    model = load_model(ckpt, numerics="fp8")
    return generate(model, prompts, max_new_tokens=24, draft="eagle", k=1).metrics.accept_cum[0]


def _random_module_tensors(ckpt, seed: int) -> dict[str, torch.Tensor]:
    """MTP layer 0 of `ckpt` re-initialized at random (the embedding and head kept): a weakened module."""
    q = load_model(ckpt, numerics="dequant")
    fcfg = dataclasses.replace(q.cfg, quantization_config=None)
    L = fcfg.num_hidden_layers
    layer = MTPLayer(fcfg, L, torch.float32)
    init_parameters(layer, L + 1, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        layer.embed_tokens.weight.copy_(q.model.embed_tokens.weight)
        layer.shared_head.head.weight.copy_(q.lm_head.weight)
    qcfg = fp8_config(fcfg)
    spec = {**block_spec(qcfg, L, f"model.layers.{L}"), **mtp_extra_spec(qcfg, f"model.layers.{L}")}
    return quantize_tensors({f"model.layers.{L}.{n}": p for n, p in layer.named_parameters()}, spec)


def test_heads_only_repairs_a_weakened_module(exported, data, tmp_path):
    weak = write_mtp_layers(exported, tmp_path / "weak", _random_module_tensors(exported, seed=5), n_mtp=1)
    prompts = [encode_prompt(e, data.tokenizer)[:16] for e in data.eval_examples(4)]
    before = _first_draft_acceptance(weak, prompts)
    hc = HeadsConfig(new_modules=0, retrain=(0,), seq_len=24, n_seqs=32, shard_seqs=16, distill_topk=4,
                     batch_size=8, max_steps=40, lr=3e-3, warmup_steps=2, log_every=10)
    precompute(weak, data.train, tmp_path / "shards", hc)
    summary = train_heads(weak, tmp_path / "shards", tmp_path / "fixed", hc, progress=False)
    after = _first_draft_acceptance(tmp_path / "fixed", prompts)
    assert summary["trained_modules"] == [0] and summary["num_nextn_predict_layers"] == 1
    assert after > before + 0.2, (before, after)


def test_heads_only_appends_a_module(exported, data, tmp_path):
    hc = HeadsConfig(new_modules=1, seq_len=24, n_seqs=8, shard_seqs=8, batch_size=4, max_steps=2, log_every=1)
    precompute(exported, data.train, tmp_path / "shards", hc)
    out = tmp_path / "two"
    train_heads(exported, tmp_path / "shards", out, hc, progress=False)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 2
    a, b = load_model(exported, numerics="fp8"), load_model(out, numerics="fp8")
    assert b.n_mtp == 2
    for (n, p), (_, p2) in zip(a.named_parameters(), b.named_parameters()):  # old tensors kept bit for bit
        assert torch.equal(p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p,
                           p2.view(torch.uint8) if p2.dtype == torch.float8_e4m3fn else p2), n
    prompt = [encode_prompt(data.eval_examples(1)[0], data.tokenizer)[:12]]
    r = generate(b, prompt, max_new_tokens=8, draft="vanilla", k=2)
    assert r.metrics.draft == "vanilla" and r.metrics.k == 2 and len(r.tokens[0]) == 8


def test_shipped_model_is_the_default_and_drafts_well():
    from mtp.text.prompt import encode_chat
    from mtp.checkpoint.tiny import SHIPPED_CHECKPOINT, default_checkpoint
    from mtp.text.tokenizer import Tokenizer

    if not (SHIPPED_CHECKPOINT / "config.json").is_file():
        pytest.skip("no shipped model in this checkout")
    assert default_checkpoint() == SHIPPED_CHECKPOINT
    assert sum(f.stat().st_size for f in SHIPPED_CHECKPOINT.iterdir()) < 30 * 2 ** 20
    model = load_model(SHIPPED_CHECKPOINT, numerics="fp8")
    assert model.n_mtp == 3 and model.cfg.quantization_config is not None
    tok = Tokenizer.from_dir(SHIPPED_CHECKPOINT)
    docs = ["Return the number of items in the queue.", "Close the file and release its lock.",
            "Parse a comma-separated list of names and return them stripped."]
    prompts = [encode_chat([{"role": "user", "content": d}], tok, thinking=True) for d in docs]
    r = generate(model, prompts, max_new_tokens=32, draft="eagle", k=1, eos_id=tok.eos_id)
    assert r.metrics.accept_cum[0] > 0.5, r.metrics.accept_cum  # 0.87 on 32 held-out prompts (MODEL_CARD.md)


def test_cli_train_heads_eval(data, tmp_path, capsys):
    from mtp.train.cli import main

    shape = ["--hidden", "128", "--layers", "2", "--heads", "2", "--nope-dim", "32", "--rope-dim", "32",
             "--intermediate", "128", "--experts", "4", "--groups", "2", "--topk-groups", "1", "--index-heads", "2",
             "--index-topk", "8"]
    run = ["--no-progress", "--wandb", "disabled", "--log-dir", str(tmp_path / "logs")]
    main(["train", "--data", str(data.root), "--out", str(tmp_path / "a"), "--max-steps", "2", "--batch-size", "2",
          "--seq-len", "24", "--eval-batches", "1", *shape, *run])
    main(["heads-only", "--target", str(tmp_path / "a"), "--data", str(data.root), "--out", str(tmp_path / "b"),
          "--new-modules", "1", "--max-steps", "2", "--seq-len", "24", "--n-seqs", "4", "--batch-size", "2",
          "--eval-batches", "1", *run])
    main(["eval", "--ckpt", str(tmp_path / "b"), "--data", str(data.root), "--prompts", "2", "--max-new-tokens", "4",
          "--max-prompt-tokens", "400", "--ks", "1", "2", "--eval-batches", "1", "--seq-len", "24", *run])
    out = {line.split()[1]: json.loads(line.split(" ", 2)[2])
           for line in capsys.readouterr().out.splitlines() if line.startswith("RESULT ")}
    assert out["train"]["steps"] == 2 and out["heads"]["num_nextn_predict_layers"] == 2
    assert abs(out["train"]["heldout_fp8_loaded"]["heldout/main"] - out["train"]["heldout_float"]["heldout/main"]) < 0.1
    assert {"eagle_k2/accept_len", "vanilla_k2/accept_len", "heldout/mtp_2"} <= set(out["eval"])
    assert json.loads((tmp_path / "logs" / "train.json").read_text())["history"]


def test_acceptance_with_the_fp8_draft_head_has_its_own_keys():
    """`mtp-train eval --draft-head-fp8`: the same generations with the drafts' FP8 head (draft_head_fp8), its metrics
    named apart (the tool that measured the shipped model's acceptance, BENCHMARKS.md)."""
    from mtp.checkpoint.tiny import default_checkpoint
    from mtp.text.tokenizer import Tokenizer
    from mtp.train.evaluate import acceptance

    model = load_model(default_checkpoint(), numerics="fp8")
    tok = Tokenizer.from_dir(default_checkpoint())
    prompts = [[tok.bos_id] + tok.encode("import os\n"), [tok.bos_id] + tok.encode("def main():\n")]
    got = acceptance(model, prompts, tok, 8, ks=(2,), modes=("eagle",), head_fp8=True)
    assert set(got) == {"eagle_k2_head_fp8/" + k for k in ("accept_len", "pos_1", "cond_pos_1", "pos_2", "cond_pos_2",
                                                             "row_steps")}
    assert got["eagle_k2_head_fp8/accept_len"] > 1
