"""`mtp-train`: prepare the corpus, pre-train + export, heads-only training, evaluation.

    mtp-train prepare --out data/stdlib                       # corpus + BPE tokenizer + held-out split
    mtp-train train --data data/stdlib --out ckpt --device cuda --max-minutes 5.5
    mtp-train heads --target ckpt --data data/stdlib --out ckpt3 --new-modules 2 --device cuda
    mtp-train eval --ckpt ckpt3 --data data/stdlib            # held-out loss (FP8) + acceptance table

Options of `train` and `heads` are generated from the `TrainConfig` / `ModelShape` / `HeadsConfig` fields
(`--seq-len`, `--experts`, ...), so the dataclasses stay the single source of defaults. Every command prints
one `RESULT {json}` line with its numbers and, with --log-dir, writes them to `<log-dir>/<command>.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..checkpoint.files import load_model
from ..model.config import NUMERICS
from .config import HeadsConfig, ModelShape, TrainConfig


def _add_fields(ap: argparse.ArgumentParser, cls, skip=()) -> None:
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        flag = "--" + f.name.replace("_", "-")
        if isinstance(default, tuple):
            ap.add_argument(flag, type=int, nargs="*", default=list(default))
        else:
            ap.add_argument(flag, type=type(default), default=default)


def _build(cls, args, **extra):
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()}
    return cls(**kw, **extra)


def _result(name: str, res: dict, log_dir: str | None) -> None:
    """One compact `RESULT` line on stdout; the full record (config, history) in <log_dir>/<name>.json."""
    short = {k: v for k, v in res.items() if k not in ("config", "history")}
    print(f"RESULT {name} " + json.dumps(short, default=str), flush=True)
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        (Path(log_dir) / f"{name}.json").write_text(json.dumps(res, indent=2, default=str) + "\n")


def cmd_prepare(a) -> None:
    from .data import prepare

    t0 = time.perf_counter()
    out = prepare(a.out, a.root, a.vocab, a.val_permille, a.include_tests, a.max_files, a.seed)
    meta = json.loads((out / "meta.json").read_text())
    _result("prepare", {**meta, "seconds": time.perf_counter() - t0}, a.log_dir)


def _logger(a, name: str, config: dict):
    from .log import NullLogger, RunLogger

    if not a.log_dir:
        return NullLogger()
    return RunLogger(Path(a.log_dir) / name, config, mode=a.wandb, name=name)


def cmd_train(a) -> None:
    from .data import Dataset
    from .evaluate import heldout_loss
    from .export import export_checkpoint
    from .objective import DENSE_TOPK, set_index_topk
    from .trainer import heldout_windows, train

    tc = _build(TrainConfig, a, shape=_build(ModelShape, a))
    data = Dataset.load(a.data)
    logger = _logger(a, "train", dataclasses.asdict(tc))
    try:
        r = train(tc, data, logger=logger, progress=not a.no_progress)
    finally:
        logger.finish()
    val = heldout_windows(data, tc)
    ckpt = export_checkpoint(r.model, data.tokenizer, a.out, index_topk=tc.shape.index_topk)
    set_index_topk(r.model, DENSE_TOPK)
    dense = heldout_loss(r.model, val, tc.batch_size, tc.autocast_bf16)
    q = load_model(ckpt, device=tc.device, dtype=torch.float32, numerics="fp8")
    fp8 = heldout_loss(q, val, tc.batch_size)
    n_params = sum(p.numel() for p in r.model.parameters())
    size = sum(f.stat().st_size for f in Path(ckpt).iterdir())
    _result("train", {"checkpoint": str(ckpt), "steps": r.steps, "tokens": r.tokens, "seconds": r.seconds,
                      "params": n_params, "checkpoint_bytes": size, "heldout_float": r.final,
                      "heldout_float_dense": dense, "heldout_fp8_loaded": fp8, "index_topk": tc.shape.index_topk,
                      "seq_len": tc.seq_len, "config": dataclasses.asdict(tc), "history": r.history}, a.log_dir)


def cmd_heads(a) -> None:
    from .data import Dataset
    from .evaluate import heldout_loss
    from .heads import precompute, train_heads
    from .trainer import heldout_windows

    hc = _build(HeadsConfig, a)
    data = Dataset.load(a.data)
    logger = _logger(a, "heads", dataclasses.asdict(hc))
    with tempfile.TemporaryDirectory() as td:
        shard_dir = Path(a.shard_dir) if a.shard_dir else Path(td)
        t0 = time.perf_counter()
        precompute(a.target, data.train, shard_dir, hc, progress=not a.no_progress)
        t_pre = time.perf_counter() - t0
        try:
            summary = train_heads(a.target, shard_dir, a.out, hc, logger=logger, progress=not a.no_progress)
        finally:
            logger.finish()
    q = load_model(a.out, device=hc.device, dtype=torch.float32, numerics="fp8")
    val = heldout_windows(data, TrainConfig(seq_len=hc.seq_len, batch_size=16, eval_batches=a.eval_batches))
    loss = heldout_loss(q, val, hc.batch_size)
    _result("heads", {**summary, "precompute_seconds": t_pre, "heldout_fp8_loaded": loss,
                      "config": dataclasses.asdict(hc)}, a.log_dir)


def cmd_eval(a) -> None:
    from .data import Dataset
    from .evaluate import acceptance, eval_prompts, heldout_loss
    from .trainer import heldout_windows

    data = Dataset.load(a.data)
    model = load_model(a.ckpt, device=a.device, dtype=torch.float32, numerics=a.numerics)
    res: dict = {"checkpoint": a.ckpt, "numerics": a.numerics}
    if a.eval_batches:
        val = heldout_windows(data, TrainConfig(seq_len=a.seq_len, batch_size=16, eval_batches=a.eval_batches))
        res.update(heldout_loss(model, val, 16))
    prompts = eval_prompts(data.tokenizer, data.eval_examples(), a.prompts, a.max_prompt_tokens)
    res["prompts"] = len(prompts)
    res["max_new_tokens"] = a.max_new_tokens
    for verify in a.verify:
        res.update(acceptance(model, prompts, data.tokenizer, a.max_new_tokens, a.ks, a.modes, verify, a.batch_size,
                              a.draft_head_fp8))
    _result("eval", res, a.log_dir)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="mtp-train", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-dir", default=None, help="metrics.jsonl, W&B files and <command>.json go here")
    common.add_argument("--wandb", default=None, help="W&B mode: offline (default), online or disabled")
    common.add_argument("--no-progress", action="store_true", help="no tqdm bar")

    p = sub.add_parser("prepare", parents=[common], help="corpus, tokenizer and held-out split")
    p.add_argument("--out", required=True)
    p.add_argument("--root", default=None, help="corpus root (default: this Python's standard library)")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--val-permille", type=int, default=50)
    p.add_argument("--include-tests", action="store_true")
    p.add_argument("--max-files", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_prepare)

    p = sub.add_parser("train", parents=[common], help="pre-train from scratch and export an FP8 checkpoint")
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    _add_fields(p, ModelShape)
    _add_fields(p, TrainConfig, skip=("shape",))
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("heads", aliases=["heads-only"], parents=[common],
                       help="train MTP modules on a frozen target (self-distillation)")
    p.add_argument("--target", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--shard-dir", default=None, help="where hidden-state shards go (default: a temp dir)")
    p.add_argument("--eval-batches", type=int, default=32, help="held-out windows / 16 (32: the train command's 512)")
    _add_fields(p, HeadsConfig)
    p.set_defaults(fn=cmd_heads)

    p = sub.add_parser("eval", parents=[common], help="held-out loss and acceptance of a checkpoint")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--numerics", default="fp8", choices=NUMERICS)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-prompt-tokens", type=int, default=96)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--modes", nargs="+", default=["eagle", "vanilla"])
    p.add_argument("--verify", nargs="+", default=["strict"], choices=("strict", "relaxed"))
    p.add_argument("--draft-head-fp8", action="store_true",
                   help="the drafts' logits from an FP8 copy of the heads (draft_head_fp8); keys end in _head_fp8")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--eval-batches", type=int, default=32, help="held-out windows / 16 (0: skip the loss)")
    p.set_defaults(fn=cmd_eval)

    a = ap.parse_args(argv)
    try:
        a.fn(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"mtp-train {a.command}: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
