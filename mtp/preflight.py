"""Checks that need only config.json and the tokenizer files, run before any weight is read.

Loading the real checkpoint reads ~690 GB; a draft setting it cannot serve or a broken tokenizer must not
wait for that. `preflight` parses the config (every field validated), resolves the number of MTP modules,
validates the draft settings against it with the engine's own rules (`DraftConfig.validate`) and loads the
tokenizer, checking it against the config's vocabulary; for a run over several ranks it checks that the
checkpoint splits into that many (`split_degrees` names the degrees that would), and `check_fits` holds the memory
planner's per-rank peak against the GPU's free memory. Entry points (mtp-eval, mtp-chat, a parallel launch) call
them first and pass the loader only what they accepted.
"""

from __future__ import annotations

import os
from pathlib import Path

from .checkpoint.files import resolve_n_mtp
from .spec.options import OptionError
from .draft.config import DraftConfig
from .model.config import ModelConfig
from .text.tokenizer import Tokenizer, match_model


class PreflightError(ValueError):
    """config.json or the tokenizer files make the requested run impossible (found before loading weights)."""


def preflight(path: str | os.PathLike, tokenizer_dir: str | os.PathLike | None = None, *, draft: str = "none",
              k: int = 0, reuse_modules: bool = False, n_mtp: int | None = None, tp: int = 1,
              mlp_split: str = "blocks", numerics: str = "fp8",
              expert_layout: str = "auto") -> tuple[ModelConfig, Tokenizer]:
    """(config, tokenizer) of checkpoint folder `path` once the run `draft` / `k` / `n_mtp` (MTP layers to load,
    None: all) is known to be possible; `tokenizer_dir` defaults to `path`. Raises ConfigError for a bad
    config.json field, PreflightError for the rest, each naming the file (where one is at fault) and the value."""
    try:
        dcfg = DraftConfig(mode=draft, k=k, reuse_modules=reuse_modules)
    except OptionError as e:  # bad whatever the checkpoint
        raise PreflightError(str(e)) from None
    path = Path(path)
    cfg = ModelConfig.from_json(path / "config.json")
    n_mtp = resolve_n_mtp(cfg, n_mtp, path / "config.json")
    try:
        dcfg.validate(n_mtp)
    except ValueError as e:
        loaded = "" if n_mtp == cfg.num_nextn_predict_layers else f", {n_mtp} of them loaded (n_mtp)"
        raise PreflightError(f"{e} ({path / 'config.json'}: num_nextn_predict_layers = "
                             f"{cfg.num_nextn_predict_layers}{loaded})") from None
    if tp > 1:
        check_tp(cfg, tp, mlp_split, numerics, path / "config.json", expert_layout)
    tok_dir = path if tokenizer_dir is None else Path(tokenizer_dir)
    try:
        tok = Tokenizer.from_dir(tok_dir)
    except (OSError, ValueError) as e:
        raise PreflightError(str(e)) from None
    try:
        match_model(tok, cfg.vocab_size, path / "config.json")
    except ValueError as e:
        raise PreflightError(str(e)) from None
    return cfg, tok


def check_tp(cfg: ModelConfig, tp: int, mlp_split: str = "blocks", numerics: str = "fp8", source: str | os.PathLike = "",
             expert_layout: str = "auto") -> None:
    """PreflightError unless a checkpoint of `cfg` splits exactly over `tp` ranks, naming the degrees that would."""
    from .model.config import ConfigError
    from .parallel.layout import ParallelPlan
    from .parallel.load import check_split, split_degrees

    try:
        check_split(cfg, ParallelPlan(tp, mlp_split, expert_layout), numerics)
    except ConfigError as e:
        ok = split_degrees(cfg, mlp_split, numerics)
        raise PreflightError(f"runtime.tp = {tp}: {source or 'the checkpoint'} cannot be split over {tp} ranks "
                             f"({e}); it splits over {ok} (numerics={numerics})") from None


def check_fits(cfg: ModelConfig, tp: int, free_bytes: int, *, batch: int = 1, max_len: int = 32768,
               prompt_len: int = 4096, draft: str = "eagle", k: int = 2, numerics: str = "fp8", dtype: str = "bf16",
               mlp_split: str = "blocks", where: str = "GPU 0") -> None:
    """PreflightError unless `mtp-plan`'s per-rank peak (weights, KV cache for batch x max_len, engine buffers,
    step and prefill workspace, a fixed reserve) fits in `free_bytes`; names both numbers and the smallest power-of-two
    TP degree that would fit."""
    from .parallel.load import split_degrees
    from .parallel.memory import GIB, Workload, make_plan

    wl = Workload(batch=batch, max_len=max_len, prompt_len=min(prompt_len, max_len), draft=draft, k=k,
                  numerics=numerics, dtype=dtype)
    plan = make_plan(cfg, tp, free_bytes / GIB, 1, wl, mlp_split)
    if plan.fits:
        return
    smallest = next((w for w in split_degrees(cfg, mlp_split, numerics, up_to=1024) if w > tp
                     and make_plan(cfg, w, free_bytes / GIB, 1, wl, mlp_split).fits), None)
    hint = f"the smallest TP that fits is {smallest}" if smallest else "no TP degree up to 1024 fits"
    raise PreflightError(
        f"runtime.tp = {tp}: the model needs {plan.peak / GIB:.2f} GiB per rank (weights {plan.weights_max / GIB:.2f}, "
        f"KV cache {plan.kv_bytes / GIB:.2f} at batch {batch} x {max_len} positions, prefill peak "
        f"{plan.prefill_workspace / GIB:.2f}, reserve {plan.reserve_bytes / GIB:.0f}) but {where} has "
        f"{free_bytes / GIB:.2f} GiB free; {hint} (mtp-plan CONFIG --gpus N --gpu-mem-gib G for the details)")
