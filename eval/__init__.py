"""Experiment layer of `mtp`: Hydra configs (`conf/`), the `mtp-eval` runner, datasets, W&B and reports.

The library `mtp/` never imports Hydra or W&B; this package is where they live. Entry points:
- `eval.run`     : `mtp-eval` / `python -m eval.run` (Hydra main);
- `eval.common`  : `build(cfg) -> (model, tokenizer)` and `generate_kwargs(cfg)`, shared with the chat CLI;
- `eval.schema`  : the structured-config schemas behind every `conf/` group (importing it registers them);
- `eval.summary` : the sweep summary (Hydra callback and `python -m eval.summary SWEEP_DIR`).
"""
