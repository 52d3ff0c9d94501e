"""Experiment layer of `mtp`: Hydra configs (`conf/`), the `mtp-eval` runner, the `mtp-chat` entry, datasets, W&B
and reports. Installed as `mtp_eval` (this folder; `conf/` ships inside it as `mtp_eval/conf`), so no top-level
package named `eval` lands in site-packages; in the repository it imports as `eval`. Relative imports only.

The library `mtp/` never imports Hydra, W&B or this package. Entry points:
- `run`     : `mtp-eval` / `python -m mtp_eval.run` (Hydra main);
- `chat`    : `mtp-chat` / `python -m mtp_eval.chat` (Hydra main around the `mtp.chat` application);
- `serve`   : `mtp-serve` / `python -m mtp_eval.serve` (Hydra main around the `mtp.serve` OpenAI-compatible server);
- `common`  : `build(cfg) -> (model, tokenizer)` and `generate_kwargs(cfg)`, shared by both;
- `schema`  : the structured-config schemas behind every `conf/` group (importing it registers them);
- `summary` : the sweep summary (Hydra callback and `python -m mtp_eval.summary SWEEP_DIR`).
"""

from pathlib import Path


def conf_dir() -> Path:
    """The Hydra config folder: `conf/` beside this package in the repository, `conf/` inside it once installed.
    Absolute: relative config paths resolve as Python packages when run as a console script."""
    here = Path(__file__).resolve().parent
    for d in (here / "conf", here.parent / "conf"):
        if (d / "eval.yaml").is_file():
            return d
    raise FileNotFoundError(f"no Hydra config folder (conf/eval.yaml) in {here} or {here.parent}")
