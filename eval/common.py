"""Glue shared by `mtp-eval` and the chat CLI: config groups -> a loaded model and `mtp.generate` kwargs.

    cfg = compose("chat")                       # or the cfg given to a @hydra.main function
    model, tok = build(cfg)                     # model / runtime groups
    out = mtp.generate(model, [ids], cfg.max_new_tokens, **generate_kwargs(cfg, tok))

Both accept a composed DictConfig (validated against eval/schema.py first) or an already validated object.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from mtp.verify.registry import verifier

from .schema import RunMode, SchemaError, drafts, generation_options, validate, value


class NotAvailableError(RuntimeError):
    """A valid configuration whose implementation does not exist yet (or not on this machine)."""


def reachable(url: str, timeout_s: float = 3.0) -> bool:
    """Whether a TCP connection to the URL's host opens in time (decides online / offline up front, so
    W&B and the hub never sit in their own retry loops on a machine without network)."""
    u = urlparse(url)
    try:
        socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)), timeout_s).close()
        return True
    except OSError:
        return False


def model_path(model_cfg: Any) -> Path:
    """The checkpoint folder: model.path, or the bundled tiny checkpoint when it is null."""
    if model_cfg.path is None:
        from mtp.checkpoint.tiny import default_checkpoint

        return default_checkpoint()
    path = Path(model_cfg.path).expanduser()
    if not (path / "config.json").is_file():
        raise SchemaError(f"model.path = {str(path)!r} is invalid: expected a checkpoint folder with config.json")
    return path


def model_label(model_cfg: Any) -> str:
    """How tables, plots and banners name the model: the bundled checkpoint by its folder's name (the `tiny`
    option is a placeholder for whichever model ships), any other by its config option's name."""
    return model_path(model_cfg).name if model_cfg.path is None else model_cfg.name


def tokenizer_path(model_cfg: Any) -> Path:
    return Path(model_cfg.tokenizer).expanduser() if model_cfg.tokenizer else model_path(model_cfg)


def check_runtime(rt: Any) -> None:
    """Refuse settings that are valid config but cannot run here, before anything is loaded."""
    mode = value(rt.mode)
    if mode != RunMode.eager.value:
        if not rt.device.startswith("cuda"):
            raise NotAvailableError(f"runtime.mode={mode} captures CUDA graphs and needs runtime.device=cuda, "
                                    f"got {rt.device}; use runtime.mode=eager on the CPU")
    if rt.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise NotAvailableError(f"runtime.device={rt.device}: no CUDA device here; use runtime=cpu")


def build(cfg: Any):
    """(model, tokenizer) from the `model` and `runtime` groups of an eval or chat config."""
    import torch

    import mtp
    from mtp.preflight import preflight

    cfg = validate(cfg)
    rt = cfg.runtime
    check_runtime(rt)
    if rt.num_threads:
        torch.set_num_threads(rt.num_threads)
    path = model_path(cfg.model)
    numerics = value(cfg.model.numerics)
    # config.json, the draft settings, the split over runtime.tp ranks and the tokenizer first: minutes before
    # the weights would have told
    mcfg, tokenizer = preflight(path, tokenizer_path(cfg.model), draft=cfg.draft.name, k=cfg.draft.k,
                                reuse_modules=cfg.draft.reuse_modules, n_mtp=cfg.model.n_mtp, tp=rt.tp,
                                mlp_split=rt.mlp_split, expert_layout=rt.expert_layout, numerics=numerics)
    if rt.device.startswith("cuda"):
        check_memory(cfg, mcfg)
    if rt.tp > 1:
        from mtp.distributed.driver import LoadSpec, start

        peers = start(rt.tp, "cuda" if rt.device.startswith("cuda") else "cpu")
        try:
            model = peers.load(LoadSpec(str(path), dtype=value(rt.dtype), numerics=numerics, n_mtp=cfg.model.n_mtp,
                                        mlp_split=rt.mlp_split, expert_layout=rt.expert_layout, reader=rt.load_reader,
                                        fast_path=rt.fast_path, elementwise=rt.elementwise,
                                        allreduce=rt.allreduce))
        except BaseException:
            peers.close()
            raise
        return model, tokenizer
    model = mtp.load_model(path, device=rt.device, dtype=getattr(torch, value(rt.dtype)),
                           numerics=numerics, n_mtp=cfg.model.n_mtp, reader=rt.load_reader)
    if rt.fast_path:
        from mtp.backends.fast_path import enable_fast_path

        enable_fast_path(model, elementwise=rt.elementwise)
    return model, tokenizer


_PLAN_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def check_memory(cfg: Any, mcfg: Any) -> None:
    """Refuse (PreflightError) a run whose per-rank peak (`mtp-plan`'s model: weights, KV cache for runtime.batch_size
    x runtime.max_model_len positions -- 32k when unset --, workspace) exceeds the free memory of this rank's GPU."""
    import torch

    from mtp.preflight import check_fits

    rt = cfg.runtime
    gpu = torch.device(rt.device).index or 0
    free = torch.cuda.mem_get_info(gpu)[0]
    max_len = rt.max_model_len or min(32768, mcfg.max_position_embeddings)
    draft = cfg.draft.name
    check_fits(mcfg, rt.tp, free, batch=rt.batch_size, max_len=max_len, draft=draft,
               k=cfg.draft.k if drafts(draft) else 0, numerics=value(cfg.model.numerics),
               dtype=_PLAN_DTYPES[value(rt.dtype)], mlp_split=rt.mlp_split, where=f"GPU {gpu}")


def serve_other_ranks() -> None:
    """Under torchrun, a rank > 0 serves rank 0 (mtp.distributed.worker) instead of running the application -- no
    config, no files, no output -- and exits with the worker's status; rank 0 (or no torchrun) returns."""
    import os
    import sys

    if os.environ.get("RANK", "0") != "0":
        from mtp.distributed.worker import main

        sys.exit(main())


def generate_kwargs(cfg: Any, tokenizer: Any = None) -> dict:
    """`mtp.generate` keyword arguments of the `draft`, `verify` and `runtime` settings (everything but
    max_new_tokens: `schema.generation_options`, plus the draft vocabulary file's ids and think_ids); runtime.mode
    is passed only when it is not eager (see check_runtime).

    think_ids (for a verifier that needs them: relaxed) come from `tokenizer`, or from the model's tokenizer file when None."""
    cfg = validate(cfg)
    d = cfg.draft
    kw = generation_options(cfg)
    if drafts(d.name) and d.vocab_file is not None:
        from mtp.draft.vocab import load_ids

        try:
            kw["draft_vocab"] = load_ids(d.vocab_file, d.vocab_size)
        except ValueError as e:
            raise SchemaError(f"draft.vocab_file: {e}") from None
    if verifier(kw["verify"]).needs_think_ids:
        if tokenizer is None:
            from mtp.text.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_dir(tokenizer_path(cfg.model))
        kw["think_ids"] = (tokenizer.think_id, tokenizer.end_think_id)
    if "mode" in kw:
        check_runtime(cfg.runtime)
    return kw


def hydra_entry(config_name: str, run) -> None:
    """A console script's main: `run(cfg)` under Hydra with conf/<config_name>.yaml; its return value is the exit
    code."""
    import sys

    import hydra

    from . import conf_dir
    from . import schema  # noqa: F401  (registers the structured configs conf/ files build on)

    code = 0

    @hydra.main(config_path=str(conf_dir()), config_name=config_name, version_base=None)
    def _main(cfg) -> None:
        nonlocal code
        code = run(cfg)

    _main()
    sys.exit(code)


def check_launcher(argv: list[str]) -> None:
    """A sweep asking for the joblib launcher (`hydra/launcher=joblib`) without its plugin installed: one line naming
    the extra, instead of Hydra's list of the launchers it could find."""
    import importlib.util

    if not any(a.replace(" ", "") == "hydra/launcher=joblib" for a in argv):
        return
    try:
        found = importlib.util.find_spec("hydra_plugins.hydra_joblib_launcher") is not None
    except ModuleNotFoundError:  # no hydra_plugins namespace at all: no plugin installed
        found = False
    if not found:
        raise SystemExit("mtp-eval: hydra/launcher=joblib needs hydra-joblib-launcher, which is not installed: "
                         "pip install 'mtp[sweeps]' (in the repository: pip install -e \".[sweeps]\")")


def check_run_dirs(argv: list[str]) -> None:
    """A `hydra.run.dir=` / `hydra.sweep.dir=` override that cannot be created or written (a read-only folder, a
    path under a file): one line and exit 2, before Hydra creates the folder (its failure is a traceback)."""
    import os
    import sys
    from pathlib import Path

    for a in argv:
        key, _, val = a.partition("=")
        if key.strip() not in ("hydra.run.dir", "hydra.sweep.dir") or not val or "${" in val:
            continue
        p = Path(val).absolute()
        while not p.exists():
            p = p.parent
        if not p.is_dir() or not os.access(p, os.W_OK | os.X_OK):
            why = "is not a folder" if not p.is_dir() else "is not writable"
            print(f"mtp-eval: error: {key.strip()}={val}: {p} {why}", file=sys.stderr)
            raise SystemExit(2)
