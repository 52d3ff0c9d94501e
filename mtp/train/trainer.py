"""The pre-training loop: MTP loss + indexer KL, aux-loss-free balancing, a wall-clock budget.

The run ends at `max_steps` or `max_minutes`, whichever comes first, and the learning-rate schedule follows
that same progress (progress = max(step / max_steps, elapsed / budget)), so a time-bounded run still decays
to its final learning rate. Consequence: with a time budget the step count depends on the machine; the
seed fixes initialization and the data order, the logged step count says how far a run got.

Stages (DeepSeek-V3.2's dense warm-up, then sparse training): while progress < 1 - sparse_frac attention is
dense (every indexer keeps all keys) and the indexer learns the dense attention distribution; afterwards the
indexers keep their `index_topk` keys, the language model trains under that sparse attention and the indexer
KL is restricted to the selected keys.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from ..model.deepseek import DeepseekV32
from .config import TrainConfig
from .data import Dataset, fixed_windows, random_windows
from .evaluate import autocast, heldout_loss
from .log import NullLogger
from .model_init import build_model, lr_at, param_groups
from .objective import DENSE_TOPK, Capture, lm_losses, set_index_topk


@dataclass
class TrainResult:
    model: DeepseekV32
    steps: int
    tokens: int
    seconds: float
    history: list[dict] = field(default_factory=list)  # every logged record
    final: dict = field(default_factory=dict)  # held-out losses at the end


def heldout_windows(data: Dataset, tc: TrainConfig) -> torch.Tensor:
    return fixed_windows(data.val, tc.eval_batches * tc.batch_size, tc.seq_len + 1)


def train(tc: TrainConfig, data: Dataset, logger=None, progress: bool = True,
          status_every_s: float = 30.0) -> TrainResult:
    """Pre-train a fresh model of `tc.shape`. Without a progress bar, one status line every `status_every_s`."""
    logger = logger or NullLogger()
    torch.manual_seed(tc.seed)
    dev = torch.device(tc.device)
    cfg = tc.shape.model_config(data.tokenizer.vocab_size)
    model = build_model(cfg, seed=tc.seed, device=dev).train()
    opt = torch.optim.AdamW(param_groups(model, tc.weight_decay), lr=tc.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=dev.type == "cuda")
    cap = Capture(model, rows=min(tc.indexer_rows, tc.batch_size))
    gen = torch.Generator().manual_seed(tc.seed)
    val = heldout_windows(data, tc)
    bf16 = tc.autocast_bf16
    budget = tc.max_minutes * 60
    history: list[dict] = []
    bar = tqdm(total=1000, desc="train", unit="‰", disable=not progress, dynamic_ncols=True)
    t0 = time.perf_counter()
    step, sparse, last_status = 0, None, t0
    while True:
        prog = max(step / tc.max_steps, (time.perf_counter() - t0) / budget)
        if prog >= 1:
            break
        if sparse != (prog >= 1 - tc.sparse_frac):
            sparse = prog >= 1 - tc.sparse_frac
            set_index_topk(model, cfg.index_topk if sparse else DENSE_TOPK)
        topk = cfg.index_topk if sparse else DENSE_TOPK
        lr = lr_at(prog, step, tc.lr, tc.warmup_steps, tc.min_lr_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        ids = random_windows(data.train, tc.batch_size, tc.seq_len + 1, gen).to(dev, non_blocking=True)
        cap.active = True
        with autocast(dev, bf16):
            losses = lm_losses(model, ids, tc.mtp_lambda)
            cap.active = False
            losses.indexer = cap.indexer_loss(topk)
            total = losses.total
            if losses.indexer is not None:
                total = total + tc.indexer_loss_weight * losses.indexer
        total.backward()
        cap.clear()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        balance = cap.update_biases(tc.bias_update_speed)
        step += 1
        bar.update(int(min(prog, 1.0) * 1000) - bar.n)
        if step % tc.log_every == 0 or step == 1:
            rec = losses.scalars()  # host sync, only every log_every steps
            rec.update({"lr": lr, "grad_norm": float(gnorm), "sparse": int(sparse), "progress": prog,
                        "tokens": step * tc.batch_size * tc.seq_len, "time_s": time.perf_counter() - t0})
            rec["balance/max_over_mean"] = max(float(v) for v in balance.values()) if balance else 1.0
            history.append({"step": step, **rec})
            logger.log(rec, step)
            bar.set_postfix(loss=f"{rec['loss/main']:.3f}", mtp=f"{rec.get('loss/mtp_1', 0):.3f}", step=step)
            if not progress and time.perf_counter() - last_status >= status_every_s:
                last_status = time.perf_counter()
                print(f"[train] step {step} {rec['time_s']:.0f}s loss {rec['loss/main']:.3f} "
                      f"mtp {rec.get('loss/mtp_1', 0):.3f} kl {rec.get('loss/indexer_kl', 0):.3f} lr {lr:.2e} "
                      f"sparse {int(sparse)}", flush=True)
        if step % tc.eval_every == 0:
            model.eval()
            ev = heldout_loss(model, val, tc.batch_size, bf16)
            model.train()
            history.append({"step": step, **ev})
            logger.log(ev, step)
    bar.update(1000 - bar.n)
    bar.close()
    seconds = time.perf_counter() - t0
    cap.remove()
    model.eval()
    final = heldout_loss(model, val, tc.batch_size, bf16)
    logger.log(final, step)
    return TrainResult(model, step, step * tc.batch_size * tc.seq_len, seconds, history, final)

