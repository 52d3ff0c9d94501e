"""Heads-only training: new or re-trained MTP modules on a frozen target, by self-distillation.

Shape legend: N sequences, T positions, D width, K distilled top-k, V vocabulary.

Two phases, so the trunk never sits beside an optimizer:
1. `precompute` runs the frozen target (as deployed: `mtp.load_model`, FP8 numerics) over token windows and
   writes shards to disk: tokens [N, T], the hidden h^s [N, T-s, D] that feeds the first trained depth s+1
   (the trunk's normed hidden, chained through the frozen modules 0..s-1 as vanilla drafting chains them),
   and the target's top-K next-token probabilities at every position [N, T, K].
2. `train_heads` loads only the MTP modules (trained ones in float, frozen ones of the chain dequantized)
   and the rotary table, streams the shards, and trains module k (1-based depth) at position i to match the
   target's distribution for position i+k from (h^{k-1}_i, token t_{i+k}): soft cross-entropy against the
   renormalized top-K (K=1 is the greedy token). Embedding and output head stay the target's (frozen).
   Routers keep the aux-loss-free bias update; indexers train with the KL objective over their top-k.
The result is written with `write_mtp_layers`: new modules become layers L+n.., num_nextn_predict_layers grows.

Scaling note: the data path (sharded hidden states, one shard in memory) is what the real checkpoint needs;
the module itself is a full MoE block (~11B parameters at 671B scale) and would need the team's sharded
optimizer there. Nothing here holds more than the MTP modules being trained.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..checkpoint.files import load_model
from ..model.config import ModelConfig
from ..model.layers import yarn_inv_freq
from ..model.deepseek import DeepseekV32, MTPLayer
from ..checkpoint.inventory import block_spec, mtp_extra_spec
from .append import read_layer, write_mtp_layers
from .config import HeadsConfig
from .data import random_windows
from .evaluate import autocast
from .export import fp8_config, quantize_tensors
from .log import NullLogger
from .model_init import TRAIN_RUNTIME, init_parameters, lr_at, param_groups
from .objective import Capture, TrainCache


def plan(cfg: ModelConfig, hc: HeadsConfig) -> tuple[list[int], int, int]:
    """(trained module indices, first chain index s, total modules after training)."""
    n = cfg.num_nextn_predict_layers
    bad = [j for j in hc.retrain if not 0 <= j < n]
    if bad:
        raise ValueError(f"retrain indices {bad} are not modules of the checkpoint (it has {n})")
    if hc.init == "copy" and hc.new_modules and n == 0:
        raise ValueError("init='copy' needs an existing MTP module to copy; the checkpoint has none "
                         "(use init='random')")
    trained = sorted(set(hc.retrain) | set(range(n, n + hc.new_modules)))
    return trained, trained[0], n + hc.new_modules


@torch.no_grad()
def precompute(target_dir: str | Path, stream: torch.Tensor, out_dir: str | Path, hc: HeadsConfig,
               progress: bool = True) -> Path:
    """Write the hidden-state shards for training modules from depth s+1 on (see module docstring)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_json(Path(target_dir) / "config.json")
    _, s, _ = plan(cfg, hc)
    dev = torch.device(hc.device)
    dtype = torch.bfloat16 if hc.autocast_bf16 else torch.float32
    target = load_model(target_dir, device=dev, dtype=dtype, numerics="fp8", n_mtp=s)
    gen = torch.Generator().manual_seed(hc.seed)
    T, K = hc.seq_len, hc.distill_topk
    n_shards = -(-hc.n_seqs // hc.shard_seqs)
    for i in tqdm(range(n_shards), desc="precompute", unit="shard", disable=not progress):
        n = min(hc.shard_seqs, hc.n_seqs - i * hc.shard_seqs)
        ids = random_windows(stream, n, T, gen).to(dev)
        o = target(ids, kv_len=T)
        p, top = o.logits.float().softmax(-1).topk(K, dim=-1)
        h = o.hidden
        for j in range(s):
            cache = target.new_cache(n, T - j - 1, n_layers=1)
            h = target.mtp_forward(j, ids[:, j + 1: T], h[:, : T - j - 1], cache, kv_len=T - j - 1).hidden
        save_file({"tokens": ids.int().cpu(), "hidden": h.to(torch.bfloat16).cpu(), "topk_ids": top.int().cpu(),
                   "topk_p": p.cpu()}, str(out / f"shard-{i:05d}.safetensors"))
    meta = {"target": str(target_dir), "seq_len": T, "start_depth": s, "topk": K, "n_seqs": hc.n_seqs,
            "shards": n_shards, "hidden": "normed", "hidden_size": cfg.hidden_size}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    del target
    return out


def shard_batches(shard_dir: Path, batch: int, gen: torch.Generator):
    """Endless batches: shards in a fresh random order each pass, one shard loaded at a time."""
    files = sorted(shard_dir.glob("shard-*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{shard_dir}: no shard-*.safetensors (run precompute first)")
    while True:
        for fi in torch.randperm(len(files), generator=gen).tolist():
            sh = load_file(str(files[fi]))
            order = torch.randperm(sh["tokens"].shape[0], generator=gen)
            for b in range(0, len(order) - batch + 1 if len(order) >= batch else 1, batch):
                idx = order[b: b + batch]
                yield {k: v[idx] for k, v in sh.items()}


def _module_from(cfg: ModelConfig, layer_id: int, tensors: dict[str, torch.Tensor], trainable: bool) -> MTPLayer:
    layer = MTPLayer(cfg, layer_id, torch.float32)
    missing, unexpected = layer.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f"layer {layer_id}: tensors do not fit an MTP layer: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    for name, p in layer.named_parameters():
        p.requires_grad_(trainable and name not in ("embed_tokens.weight", "shared_head.head.weight")
                         and not name.endswith("e_score_correction_bias"))
    return layer


def build_chain(target_dir: Path, cfg: ModelConfig, hc: HeadsConfig) -> tuple[DeepseekV32, list[int], int, int]:
    """A `DeepseekV32` on the meta device whose MTP modules s..end are real float modules (trunk never built)."""
    trained, s, n_total = plan(cfg, hc)
    fcfg = dataclasses.replace(cfg, quantization_config=None, num_nextn_predict_layers=n_total)
    dev = torch.device(hc.device)
    with torch.device("meta"):
        holder = DeepseekV32(fcfg, dtype=torch.float32, runtime=TRAIN_RUNTIME)
    L, n_old = cfg.num_hidden_layers, cfg.num_nextn_predict_layers
    gen = torch.Generator().manual_seed(hc.seed)
    for j in range(s, trained[-1] + 1):
        if j < n_old:
            layer = _module_from(fcfg, L + j, read_layer(target_dir, L + j), trainable=j in trained)
        else:
            src = read_layer(target_dir, L + n_old - 1)
            layer = _module_from(fcfg, L + j, src, trainable=True)
            if hc.init == "random":  # everything but the target's embedding and head
                init_parameters(layer, L + n_total, gen)
                with torch.no_grad():
                    layer.embed_tokens.weight.copy_(src["embed_tokens.weight"])
                    layer.shared_head.head.weight.copy_(src["shared_head.head.weight"])
        holder.mtp[j] = layer.to(dev)
    holder.rotary.inv_freq = yarn_inv_freq(fcfg).to(dev)
    holder.set_runtime(TRAIN_RUNTIME)
    return holder, trained, s, n_total


def soft_ce(logits_BNV: torch.Tensor, ids_BNK: torch.Tensor, p_BNK: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against the target's renormalized top-K distribution."""
    logp = logits_BNV.float().log_softmax(-1).gather(-1, ids_BNK.long())
    p = p_BNK.float() / p_BNK.float().sum(-1, keepdim=True)
    return -(p * logp).sum(-1).mean()


def heads_step_losses(holder: DeepseekV32, batch: dict, s: int, end: int, trained: list[int],
                      dev) -> list[torch.Tensor]:
    """Run the chain s..end on one shard batch; the distillation loss of each trained module."""
    tokens, h = batch["tokens"].long().to(dev), batch["hidden"].to(dev, torch.float32)
    ids, p = batch["topk_ids"].to(dev), batch["topk_p"].to(dev)
    B, T = tokens.shape
    losses = []
    for j in range(s, end + 1):
        k = j + 1  # depth: module k at position i reads t_{i+k}, imitates the target at position i+k
        n = T - k
        cache = TrainCache(holder.cfg, 1, B, n, dev, torch.float32)
        o = holder.mtp_forward(j, tokens[:, k: k + n], h[:, :n], cache, kv_len=n)
        if j in trained:
            losses.append(soft_ce(o.logits, ids[:, k: k + n], p[:, k: k + n]))
        h = o.hidden
    return losses


def train_heads(target_dir: str | Path, shard_dir: str | Path, out_dir: str | Path, hc: HeadsConfig,
                logger=None, progress: bool = True) -> dict:
    """Train the planned modules from the shards and write the checkpoint; returns a summary dict."""
    target_dir, shard_dir = Path(target_dir), Path(shard_dir)
    logger = logger or NullLogger()
    meta = json.loads((shard_dir / "meta.json").read_text())
    cfg = ModelConfig.from_json(target_dir / "config.json")
    holder, trained, s, n_total = build_chain(target_dir, cfg, hc)
    if meta["start_depth"] != s or meta["seq_len"] != hc.seq_len:
        raise ValueError(f"{shard_dir}: shards start at depth {meta['start_depth']} with seq_len {meta['seq_len']}, "
                         f"this run needs depth {s} and seq_len {hc.seq_len}: precompute again")
    dev = torch.device(hc.device)
    modules = torch.nn.ModuleList([holder.mtp[j] for j in trained])
    opt = torch.optim.AdamW(param_groups(modules, hc.weight_decay), lr=hc.lr, betas=(0.9, 0.95))
    cap = Capture(modules, rows=min(4, hc.batch_size))
    gen = torch.Generator().manual_seed(hc.seed)
    batches = shard_batches(shard_dir, hc.batch_size, gen)
    bar = tqdm(total=1000, desc="heads", unit="‰", disable=not progress, dynamic_ncols=True)
    t0, step, history = time.perf_counter(), 0, []
    while (prog := max(step / hc.max_steps, (time.perf_counter() - t0) / (60 * hc.max_minutes))) < 1:
        lr = lr_at(prog, step, hc.lr, hc.warmup_steps, hc.min_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        cap.active = True
        with autocast(dev, hc.autocast_bf16):
            losses = heads_step_losses(holder, next(batches), s, trained[-1], trained, dev)
            cap.active = False
            ikl = cap.indexer_loss(cfg.index_topk)
            total = torch.stack(losses).mean() + (ikl if ikl is not None else 0.0)
        total.backward()
        cap.clear()
        torch.nn.utils.clip_grad_norm_(modules.parameters(), hc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        cap.update_biases(hc.bias_update_speed)
        step += 1
        bar.update(int(min(prog, 1.0) * 1000) - bar.n)
        if step % hc.log_every == 0 or step == 1:
            vals = torch.stack([x.detach() for x in losses]).float().cpu().tolist()  # host sync, logging only
            rec = {f"heads/distill_{j}": v for j, v in zip(trained, vals)}
            rec.update({"heads/lr": lr, "heads/progress": prog})
            history.append({"step": step, **rec})
            logger.log(rec, step)
            bar.set_postfix(loss=f"{sum(vals) / len(vals):.3f}", step=step)
    bar.update(1000 - bar.n)
    bar.close()
    cap.remove()
    qcfg = fp8_config(dataclasses.replace(cfg, quantization_config=None, num_nextn_predict_layers=n_total))
    new = {}
    for j in trained:
        prefix = f"model.layers.{cfg.num_hidden_layers + j}"
        spec = {**block_spec(qcfg, cfg.num_hidden_layers + j, prefix), **mtp_extra_spec(qcfg, prefix)}
        floats = {f"{prefix}.{n}": p.detach() for n, p in holder.mtp[j].named_parameters()}
        new.update(quantize_tensors(floats, spec))
    write_mtp_layers(target_dir, out_dir, new, n_total)
    return {"trained_modules": trained, "num_nextn_predict_layers": n_total, "steps": step,
            "seconds": time.perf_counter() - t0, "history": history}
