"""Checks that need only config.json and the tokenizer files, run before any weight is read.

Loading the real checkpoint reads ~690 GB; a draft setting it cannot serve or a broken tokenizer must not
wait for that. `preflight` parses the config (every field validated), resolves the number of MTP modules,
validates the draft settings against it with the engine's own rules (`DraftConfig.validate`) and loads the
tokenizer, checking it against the config's vocabulary. Entry points (mtp-eval, mtp-chat, a parallel launch)
call it first and pass the loader only what it accepted.
"""

from __future__ import annotations

import os
from pathlib import Path

from .checkpoint.files import resolve_n_mtp
from .decode.options import OptionError
from .draft.config import DraftConfig
from .model.config import ModelConfig
from .text.tokenizer import Tokenizer


class PreflightError(ValueError):
    """config.json or the tokenizer files make the requested run impossible (found before loading weights)."""


def preflight(path: str | os.PathLike, tokenizer_dir: str | os.PathLike | None = None, *, draft: str = "none",
              k: int = 0, reuse_modules: bool = False, n_mtp: int | None = None) -> tuple[ModelConfig, Tokenizer]:
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
    tok_dir = path if tokenizer_dir is None else Path(tokenizer_dir)
    try:
        tok = Tokenizer.from_dir(tok_dir)
    except (OSError, ValueError) as e:
        raise PreflightError(str(e)) from None
    if tok.vocab_size > cfg.vocab_size:
        raise PreflightError(f"{tok.source} has {tok.vocab_size} ids, more than the model's vocab_size "
                             f"{cfg.vocab_size} ({path / 'config.json'}): tokenizer and checkpoint do not match")
    return cfg, tok
