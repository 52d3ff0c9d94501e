"""`python -m mtp.parallel.launch` under torchrun (2 ranks, gloo, CPU) on a tiny checkpoint with a tokenizer:
the sharded run prints the same greedy continuation as `mtp.generate` on the whole model, every rank agrees
(--check), and the run exits cleanly. (The bundled trained model has 2 attention heads: one head's 192 q_b
rows per rank would cut a 128x128 scale block, which load_parallel refuses by name.)"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import torch

import mtp
from mtp.checkpoint.files import save_checkpoint
from mtp.checkpoint.random_weights import random_tensors
from mtp.model.presets import tiny_config
from mtp.text.tokenizer import Tokenizer, default_corpus, save_tokenizer, train_bpe_tokenizer

PROMPT = "def parse_args(argv):\n    "


def _checkpoint(out):
    tok = train_bpe_tokenizer(default_corpus(), vocab_size=512)
    save_tokenizer(tok, out.parent / "tok", model_max_length=4096)
    cfg = tiny_config(vocab=tok.get_vocab_size())
    cfg = dataclasses.replace(cfg, num_attention_heads=8, intermediate_size=512)  # splits over 2 ranks
    extra = {n: out.parent / "tok" / n for n in ("tokenizer.json", "tokenizer_config.json")}
    return save_checkpoint(random_tensors(cfg, seed=3), cfg, out, extra_files=extra)


def test_torchrun_two_ranks_match_one_process(tmp_path):
    ckpt = _checkpoint(tmp_path / "tiny-tp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "mtp.parallel.launch", str(ckpt), "--prompt", PROMPT, "--max-new-tokens", "12",
           "--draft", "eagle", "--k", "2", "--check"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[world 2," in r.stderr and "accepted/step" in r.stderr

    tok = Tokenizer.from_dir(ckpt)
    model = mtp.load_model(ckpt, dtype=torch.float32)
    ids = [tok.bos_id] + tok.encode(PROMPT)
    out = mtp.generate(model, [ids], 12, draft="eagle", k=2, eos_id=tok.eos_id)
    assert len(out.tokens[0]) >= 4, out.tokens  # a continuation to compare, not an immediate EOS
    assert r.stdout.rstrip("\n") == tok.decode(out.tokens[0])
