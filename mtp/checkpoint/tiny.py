"""Tiny DeepSeek-V3.2 checkpoints in exactly the real format, for tests and demos.

`mtp-tiny-checkpoint OUT_DIR` writes config.json (model_type deepseek_v32, quantization_config, YaRN
rope_scaling, index_*), FP8 e4m3 weights with ue8m0 `weight_scale_inv`, bf16/fp32 tensors where the real
checkpoint has them, the MTP layer(s), >= 2 shards with an index, and tokenizer files with DeepSeek's
special tokens. Dimensions: `mtp.model.presets.tiny_config`.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import torch

from ..model.config import ModelConfig
from ..model.presets import tiny_config
from .files import save_checkpoint
from .random_weights import random_tensors


def agreeing_mtp(tensors: dict[str, torch.Tensor], cfg: ModelConfig, seed: int = 5) -> dict[str, torch.Tensor]:
    """`random_tensors` changed so that the MTP heads often agree with the trunk (random ones never do, and
    losslessness is only worth testing where drafts get accepted): every block's output projections are damped
    (o_proj / down_proj block scales / 16, still powers of two) and each eh_proj passes the token embedding
    through plus a small random mix of the hidden state. Returns a new dict."""
    out = dict(tensors)
    D = cfg.hidden_size
    g = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if name.endswith(("o_proj.weight_scale_inv", "down_proj.weight_scale_inv")):
            out[name] = t / 16
        elif name.endswith("eh_proj.weight"):
            mix = 0.25 * torch.randn(D, D, generator=g) / math.sqrt(D)
            out[name] = torch.cat((torch.eye(D), mix), dim=1).to(t.dtype)
    return out


def write_tiny_checkpoint(out_dir: str | Path, seed: int = 0, layers: int = 3, dense_layers: int = 1,
                          mtp_modules: int = 1, index_topk: int = 16, vocab: int = 512, n_shards: int = 2) -> Path:
    from ..text.tokenizer import default_corpus, save_tokenizer, train_bpe_tokenizer

    tok = train_bpe_tokenizer(default_corpus(), vocab_size=vocab)
    cfg = tiny_config(layers, dense_layers, mtp_modules, index_topk, tok.get_vocab_size())
    with tempfile.TemporaryDirectory() as td:
        save_tokenizer(tok, td, model_max_length=cfg.max_position_embeddings)
        extra = {n: Path(td) / n for n in ("tokenizer.json", "tokenizer_config.json")}
        return save_checkpoint(random_tensors(cfg, seed), cfg, out_dir, n_shards=n_shards, extra_files=extra)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=3, help="num_hidden_layers (trunk)")
    ap.add_argument("--dense-layers", type=int, default=1, help="first_k_dense_replace")
    ap.add_argument("--mtp-modules", type=int, default=1, help="num_nextn_predict_layers")
    ap.add_argument("--index-topk", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=512, help="BPE vocabulary size (incl. special tokens)")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--force", action="store_true", help="replace OUT_DIR even if it holds files (all are deleted)")
    a = ap.parse_args(argv)
    out_dir = Path(a.out_dir)
    refusal = (f"{out_dir} is a file, not a folder" if out_dir.exists() and not out_dir.is_dir() else
               f"{out_dir} is not empty (its files would be deleted); pass --force to replace it"
               if out_dir.is_dir() and any(out_dir.iterdir()) and not a.force else None)
    if refusal:
        print(f"mtp-tiny-checkpoint: error: {refusal}", file=sys.stderr)
        sys.exit(2)
    if (a.layers < 1 or not 0 <= a.dense_layers <= a.layers or a.mtp_modules < 0 or a.index_topk < 1 or a.vocab < 300
            or a.shards < 1):
        ap.error("need --layers >= 1, 0 <= --dense-layers <= --layers, --mtp-modules >= 0, --index-topk >= 1, "
                 "--vocab >= 300 (256 bytes + special tokens), --shards >= 1")
    out = write_tiny_checkpoint(a.out_dir, a.seed, a.layers, a.dense_layers, a.mtp_modules, a.index_topk, a.vocab,
                                a.shards)
    print(f"wrote {out}")


# A small DeepSeek-V3.2 trained on the standard library (`mtp-train`, see MODEL_CARD.md), shipped in the repo.
SHIPPED_CHECKPOINT = Path(__file__).resolve().parent.parent / "assets" / "dsv32_stdlib_mini"


def default_checkpoint() -> Path:
    """The default model of `mtp-eval` / `mtp-chat`: the trained checkpoint shipped under mtp/assets when it is
    there, else a tiny random checkpoint written on first use under $MTP_CACHE (default ~/.cache/mtp).
    Writing goes through a temp dir, so concurrent first uses are safe."""
    import os
    import shutil

    if (SHIPPED_CHECKPOINT / "config.json").is_file():
        return SHIPPED_CHECKPOINT
    root = Path(os.environ.get("MTP_CACHE", Path.home() / ".cache" / "mtp"))
    path = root / "tiny-random-v1"
    if not (path / "config.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        # Write beside it, then rename into place only if still absent: save_checkpoint alone would delete a
        # racing writer's finished copy under its readers (seen: ENOTEMPTY and "shard ... does not exist").
        tmp = Path(tempfile.mkdtemp(prefix=".tiny-random-", dir=root))
        try:
            write_tiny_checkpoint(tmp / "ckpt", seed=0)
            try:
                os.rename(tmp / "ckpt", path)
            except OSError:
                if not (path / "config.json").is_file():
                    raise  # not a lost race: a real error
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


if __name__ == "__main__":  # `python -m mtp.checkpoint.tiny OUT_DIR` where the console script is not installed
    main()
