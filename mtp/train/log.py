"""Run logging: a JSON-lines file always, Weights & Biases when installed (offline unless configured).

W&B is imported lazily (the library never imports it at module level) and can never stop a run: a missing
package, a failing or slow `wandb.init` (bounded by `init_timeout`) or a failing `log` turns W&B off with a
printed note and the JSON-lines log goes on. The mode comes from `mode`, else $WANDB_MODE, else 'offline'.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


class RunLogger:
    def __init__(self, log_dir: str | Path, config: dict, mode: str | None = None, project: str = "mtp-train",
                 name: str | None = None):
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.file = open(self.dir / "metrics.jsonl", "a", encoding="utf-8")
        (self.dir / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
        self.mode = mode or os.environ.get("WANDB_MODE", "offline")
        self.run = None
        if self.mode != "disabled":
            self._start_wandb(config, project, name)

    def _start_wandb(self, config, project, name) -> None:
        try:
            import wandb
        except ImportError:
            self.note("wandb is not installed: logging to metrics.jsonl only")
            return
        try:
            self.run = wandb.init(project=project, name=name, config=config, mode=self.mode, dir=str(self.dir),
                                  settings=wandb.Settings(init_timeout=60, silent=True))
        except Exception as e:  # any failure (network, auth, timeout) must leave the run going
            self.note(f"wandb.init failed ({type(e).__name__}: {e}); logging to metrics.jsonl only")
            self.run = None

    @staticmethod
    def note(msg: str) -> None:
        print(f"[mtp-train] {msg}", file=sys.stderr, flush=True)

    def log(self, metrics: dict, step: int) -> None:
        self.file.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        self.file.flush()
        if self.run is not None:
            try:
                self.run.log(metrics, step=step)
            except Exception as e:
                self.note(f"wandb.log failed ({type(e).__name__}: {e}); W&B off for the rest of the run")
                self.run = None

    def finish(self) -> None:
        self.file.close()
        if self.run is not None:
            try:
                self.run.finish()
            except Exception as e:
                self.note(f"wandb.finish failed ({type(e).__name__}: {e})")
            self.run = None


class NullLogger:
    def log(self, metrics: dict, step: int) -> None:
        pass

    def finish(self) -> None:
        pass
