"""Training: a small DeepSeek-V3.2 from scratch (MTP loss, DSA indexer, aux-loss-free MoE), FP8 export,
and heads-only MTP training on a frozen target. Entry point: `mtp-train` (`mtp/train/cli.py`).

| file | job |
|---|---|
| `config.py` | `ModelShape`, `TrainConfig`, `HeadsConfig` (validated dataclasses; CLI flags are generated from them) |
| `data.py` | stdlib corpus -> plain files + chat examples, BPE tokenizer, held-out split by file |
| `model_init.py` | build + initialize the library's `DeepseekV32` with float weights; shared embedding/head |
| `objective.py` | MTP loss, indexer KL, router load hooks and the balance update |
| `trainer.py` | the loop (time budget, dense -> sparse stage, eval, logging) |
| `export.py` | FP8 checkpoint through `mtp.checkpoint.files.save_checkpoint` |
| `heads.py`, `append.py` | heads-only: hidden-state shards, distillation, appending MTP layers to a checkpoint |
| `evaluate.py` | held-out loss and acceptance (through `mtp.generate`) |
| `log.py` | JSON-lines + optional W&B (offline unless configured) |

Design notes: where this departs from the DeepSeek-V3 / V3.2 reports, and why.
- Indexer: trained, not bypassed. The reports train the lightning indexer in a dense warm-up (main model
  frozen, KL to the head-summed attention) and then a sparse stage (everything trains, top-k attention, KL on
  the selected keys). From scratch there is no pre-trained model to freeze, so the warm-up runs *alongside*
  dense language-model training (the indexer's inputs are detached, so neither loss reaches the other's
  weights); the last `sparse_frac` of the run is the sparse stage with the exported `index_topk` (64 of a
  256-token context by default). The exported model therefore attends sparsely beyond 64 tokens, as
  DeepSeek-V3.2 does beyond 2048.
- MTP: D = `mtp_modules` (1 by default) with lambda = 0.3 throughout (the report lowers it to 0.1 for the last
  third of 14.8T tokens; a run of minutes has no such phase). The chained hidden is the post-norm one, the
  engine's default (`target_hidden = chain_hidden = 'normed'`); the report chains the block output.
- Balance: only the bias update (gamma = 1e-3 per step, counted over the whole step); the report's tiny
  sequence-wise auxiliary loss is left out.
- Precision: fp32 master weights with bf16 autocast on CUDA (the report trains in FP8; the export is FP8).
- KV cache during training: `objective.TrainCache`, one tensor per layer. `mtp.model.cache.KVCache` keeps all layers
  in one tensor, and the write into layer i then invalidates the saved reads of earlier layers for autograd.
"""
