"""Acceptance vs draft-vocabulary size on a trained model (CPU is fine): the vocabulary is ranked by token
frequency in the model's training stream (`mtp-train prepare` data), acceptance is measured on held-out chat
prompts with strict verification, and every run is checked to reproduce plain greedy decoding exactly.

    python eval/draft_vocab_acceptance.py --data .train_data/stdlib_tests --out eval/results/draft_vocab.json
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import torch

import mtp
from mtp.draft.vocab import top_ids
from mtp.checkpoint.tiny import default_checkpoint
from mtp.train.data import Dataset
from mtp.train.evaluate import eval_prompts
from mtp.utils import write_json_atomic


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", default=None, help="default: the bundled trained model")
    ap.add_argument("--data", required=True, help="mtp-train prepare folder (training stream + held-out prompts)")
    ap.add_argument("--sizes", default="64,128,256,512,1024", help="draft vocabulary sizes (the full one is added)")
    ap.add_argument("--draft", default="eagle", choices=("eagle", "vanilla"))
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    ckpt = a.ckpt or default_checkpoint()
    model = mtp.load_model(ckpt, dtype=torch.float32)
    data = Dataset.load(a.data)
    tok = data.tokenizer
    counts = Counter(data.train.tolist())
    total = sum(counts.values())
    specials = [tok.eos_id, tok.think_id, tok.end_think_id, tok.bos_id]
    prompts = eval_prompts(tok, data.eval_examples(), a.prompts, 96)
    opts = dict(eos_id=tok.eos_id)
    base = mtp.generate(model, prompts, a.max_new_tokens, **opts)
    V = model.cfg.vocab_size
    rows = []
    for n in [int(x) for x in a.sizes.split(",")] + [V]:
        ids = top_ids(counts, n, always=specials) if n < V else None
        t0 = time.perf_counter()
        out = mtp.generate(model, prompts, a.max_new_tokens, draft=a.draft, k=a.k, draft_vocab=ids, **opts)
        m = out.metrics
        rows.append({"vocab": n, "train_token_coverage": sum(counts[i] for i in (ids or counts)) / total,
                     "AL": m.mean_accepted_len, "accept_cum": list(m.accept_cum),
                     "identical_to_greedy": out.tokens == base.tokens, "seconds": time.perf_counter() - t0})
        print(f"vocab {n:5d}  coverage {100 * rows[-1]['train_token_coverage']:6.2f}%  AL {m.mean_accepted_len:.3f}  "
              f"acc {[round(x, 3) for x in m.accept_cum]}  identical {rows[-1]['identical_to_greedy']}")
    write_json_atomic(a.out, {"checkpoint": str(ckpt), "data": a.data, "draft": a.draft, "k": a.k,
                              "prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "vocab_size": V,
                              "rows": rows})
    return 0 if all(r["identical_to_greedy"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
