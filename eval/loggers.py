"""Experiment trackers, built from the `logger` group with hydra.utils.instantiate.

Interface (called by eval/run.py): `start(config, name, group, out_dir)`, `log_batch(step, records)`,
`finish(metrics, records, plots)`. Constructors do no I/O, so a config test can build every logger.

W&B never blocks a run: the mode is decided before `wandb.init` (WANDB_MODE is set accordingly), `auto`
goes online only with WANDB_API_KEY set and the server reachable within a few seconds, init has a timeout,
and a failed online init falls back to offline.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .common import reachable

log = logging.getLogger(__name__)


class NullLogger:
    def start(self, config: dict, name: str, group: str | None, out_dir: Path) -> None:
        pass

    def log_batch(self, step: int, records: list[dict]) -> None:
        pass

    def finish(self, metrics: dict, records: list[dict], plots: dict[str, Path]) -> None:
        pass


# The user's WANDB_MODE (this module sets the variable itself later), and whether an online init already
# failed in this process: the next jobs of a sweep then go offline at once instead of timing out again.
_USER_MODE = os.environ.get("WANDB_MODE")
_ONLINE_FAILED = []


def resolve_mode(mode: str) -> str:
    """auto -> online with an API key and a reachable server, else offline. A WANDB_MODE set by the user wins."""
    if _USER_MODE in ("online", "offline", "disabled", "dryrun"):
        return _USER_MODE
    if mode in ("offline", "disabled"):
        return mode
    if _ONLINE_FAILED:
        return "offline"
    if mode == "online":
        return mode
    if not os.environ.get("WANDB_API_KEY"):
        return "offline"
    return "online" if reachable(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")) else "offline"


class WandbLogger:
    def __init__(self, project: str = "mtp-spec", entity: str | None = None, mode="auto", group: str | None = None,
                 tags=(), job_type: str = "eval", init_timeout_s: float = 30.0, log_samples: bool = True,
                 save_dir: str | None = None):
        self.project, self.entity, self.group, self.tags = project, entity, group, list(tags)
        self.mode = getattr(mode, "value", mode)  # enum from the structured config, or a plain string
        self.job_type, self.init_timeout_s, self.log_samples = job_type, init_timeout_s, log_samples
        self.save_dir = save_dir
        self.run = None

    def start(self, config: dict, name: str, group: str | None, out_dir: Path) -> None:
        import wandb

        mode = resolve_mode(self.mode)
        os.environ["WANDB_MODE"] = mode  # also governs any wandb call made later in this process
        save_dir = Path(self.save_dir or out_dir)
        save_dir.mkdir(parents=True, exist_ok=True)
        kw = dict(project=self.project, entity=self.entity, group=self.group or group, name=name, tags=self.tags,
                  job_type=self.job_type, config=config, dir=str(save_dir), reinit="finish_previous",
                  settings=wandb.Settings(init_timeout=self.init_timeout_s))
        try:
            self.run = wandb.init(mode=mode, **kw)
        except Exception as e:  # wandb raises its own CommError/UsageError types, and timeouts
            if mode != "online":
                raise
            log.warning("wandb online init failed (%s); logging offline instead", e)
            _ONLINE_FAILED.append(str(e))
            os.environ["WANDB_MODE"] = "offline"
            self.run = wandb.init(mode="offline", **kw)

    def log_batch(self, step: int, records: list[dict]) -> None:
        for r in records:
            self.run.log({"sample/accept_len": r["row_mean_accepted_len"], "sample/new_tokens": r["new_tokens"],
                          "sample/batch_decode_tok_s": r["batch_decode_tok_s"]})

    def finish(self, metrics: dict, records: list[dict], plots: dict[str, Path]) -> None:
        import wandb

        run = self.run
        final = dict(metrics["overall"])
        for cat, m in metrics["per_category"].items():
            final.update({f"category/{cat}/{key}": v for key, v in m.items()})
        if metrics.get("baseline"):
            final.update({f"baseline/{key}": v for key, v in metrics["baseline"]["overall"].items()})
        if metrics.get("breakdown"):  # acceptance by phase, output position, context length (eval/breakdown.py)
            from .breakdown import flat

            final.update(flat(metrics["breakdown"]))
        flagged = metrics.get("flagged") or {}
        if flagged.get("count"):
            final["flagged"] = wandb.Table(columns=["id", "reasons"], data=[
                [i, "; ".join(r)] for i, r in flagged["reasons"].items()])
        cols = ["position", "acceptance", "acceptance_lo", "acceptance_hi", "acceptance_cond", "acceptance_cond_lo",
                "acceptance_cond_hi"]
        pos = wandb.Table(columns=cols, data=[[p["pos"], p["accept"], p.get("accept_lo"), p.get("accept_hi"),
                                               p["accept_cond"], p.get("accept_cond_lo"), p.get("accept_cond_hi")]
                                              for p in metrics["per_position"]])
        hist = wandb.Table(columns=["accepted", "steps"], data=[[a, c] for a, c in enumerate(metrics["accepted_hist"])])
        final["charts/accept_per_position"] = wandb.plot.bar(pos, "position", "acceptance",
                                                             title="acceptance per draft position")
        final["charts/accepted_len_hist"] = wandb.plot.bar(hist, "accepted", "steps",
                                                           title="drafts accepted per verify step")
        tree = metrics.get("tree")
        if tree:  # acceptance by depth and sibling rank (the flat `accept/depth_*_rank_*` keys are in `final`)
            cells = wandb.Table(columns=["node", "depth", "rank", "acceptance"], data=[
                [f"d{d} r{r}", d, r, p] for d, row in enumerate(tree["accept_depth_rank"], 1) for r, p in enumerate(row)])
            final["charts/tree_accept_depth_rank"] = wandb.plot.bar(cells, "node", "acceptance",
                                                                    title="accepted node by depth and sibling rank")
        for key, path in plots.items():
            final[f"plots/{key}"] = wandb.Image(str(path))
        if self.log_samples:
            cols = ["id", "category", "thinking", "prompt_tokens", "new_tokens", "accept_len", "finish_reason",
                    "flagged", "output"]
            reasons = flagged.get("reasons", {})
            final["samples"] = wandb.Table(columns=cols, data=[
                [r["id"], r["category"], r["thinking"], r["prompt_tokens"], r["new_tokens"],
                 r["row_mean_accepted_len"], r["finish_reason"], "; ".join(reasons.get(r["id"], [])), r["output"]]
                for r in records])
        run.log(final)
        run.summary.update({k: v for k, v in final.items() if isinstance(v, (int, float))})
        offline = run.settings.mode == "offline" or os.environ.get("WANDB_MODE") == "offline"
        run_dir = run.dir
        run.finish()
        if offline:
            log.info("W&B run logged offline in %s; upload with: wandb sync %s", run_dir, Path(run_dir).parent)
