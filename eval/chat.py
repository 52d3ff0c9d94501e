"""`mtp-chat`: multi-turn chat with the target model and MTP drafting, streamed to a terminal.

    python -m mtp_eval.chat                      # (or `mtp-chat`) the bundled model (MODEL_CARD.md) on the CPU
    mtp-chat model=dsv32 model.path=/ckpt runtime=cuda draft=eagle draft.k=2 verify=relaxed thinking=true
    mtp-chat max_new_tokens=64 show_drafts=true runtime.max_model_len=8192

Configuration is `conf/chat.yaml` with the groups of `mtp-eval` (model, draft, verify, runtime), turned into a
model and `generate` arguments by `eval.common`, so every override works the same in both tools. A chat run
writes nothing to disk on its own: conf/chat.yaml sets hydra.run.dir=., hydra.output_subdir=null and logs to
stdout (no outputs/ folder, .hydra or log file).

Who does what: the application is `mtp/chat/` (no Hydra there): `session.Session` holds the conversation, the
commands and the statistics and `session.loop` reads and handles lines; `turn` streams one reply; `terminal`
reads lines and draws replies. This file (the experiment layer, beside `mtp-eval`) builds them from the config.

Several ranks (`runtime.tp=N`, or every rank started by torchrun): rank 0 runs the chat -- terminal, session,
commands -- and the other ranks serve its `mtp.generate` calls (`mtp.distributed.driver` / `worker`): each reply's
every step ends with rank 0's stop verdict broadcast, so Ctrl-C stops all ranks at the same step. A second
Ctrl-C does not break out of a step there (the other ranks are inside it); a rank that fails ends the session
with one line naming it.
"""

from __future__ import annotations

import os
import sys
import time

from mtp.chat.session import Session, Settings, help_text, loop
from mtp.chat.terminal import StopFlag, TerminalInput, TerminalView

from . import conf_dir


def run(cfg) -> int:
    """The chat; its exit status. A closed stdin or stdout ends it with one line and status 2."""
    if sys.stdin is None:  # `mtp-chat <&-`: found before the model loads
        print("mtp-chat: error: standard input is closed: there is nothing to read the chat from", file=sys.stderr)
        return 2
    try:
        return _run(cfg)
    except BrokenPipeError:  # `mtp-chat | head -c 100`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at interpreter exit
        print("mtp-chat: error: standard output was closed (broken pipe); the session ends", file=sys.stderr)
        return 2


def _run(cfg) -> int:
    from omegaconf import OmegaConf

    from mtp.provenance import provenance

    from .common import build, generate_kwargs, model_label, model_path

    view = TerminalView(color=sys.stdout.isatty() and "NO_COLOR" not in os.environ,
                        show_drafts=bool(cfg.show_drafts))
    view.notice(f"loading {model_label(cfg.model)} on {cfg.runtime.device} ...")
    try:
        t0 = time.perf_counter()
        model, tokenizer = build(cfg)
        startup = {"load_s": time.perf_counter() - t0, "warmup_s": None}
        settings = Settings.from_generate_kwargs(generate_kwargs(cfg, tokenizer), max_new_tokens=cfg.max_new_tokens,
                                                 thinking=cfg.thinking, max_model_len=cfg.runtime.max_model_len)
        # with ranks, a second Ctrl-C must not break out of a step the others are in: the reply stops at the next step
        stop = StopFlag(hard=cfg.runtime.tp == 1)
        session = Session(model, tokenizer, settings, view, should_stop=stop.is_set,
                          meta={"model_path": str(model_path(cfg.model)),
                                "provenance": provenance(model_path(cfg.model), cfg.runtime.device),
                                "config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)})
        if cfg.runtime.warmup:
            t0 = time.perf_counter()
            session.warmup()
            startup["warmup_s"] = time.perf_counter() - t0  # first calls: compile, graph capture
        session.meta["startup"] = startup
    except Exception as e:  # bad path, bad value, no GPU: one line, no traceback
        view.error(f"cannot start: {type(e).__name__}: {e}")
        return 2
    except KeyboardInterrupt:  # Ctrl-C while the model loads
        return 130
    where = f"{model.device}" + (f" x {cfg.runtime.tp} ranks" if cfg.runtime.tp > 1 else "")
    view.notice(f"mtp-chat: {session.meta['model_path']} on {where} | {settings.label()} | "
                f"max_new_tokens {settings.max_new_tokens} | max_model_len {session.context_limit()} | "
                "/help for commands, Ctrl-D quits")
    warm = "" if startup["warmup_s"] is None else f", warm-up {startup['warmup_s']:.1f} s"
    view.notice(f"started: load {startup['load_s']:.1f} s{warm}")
    from mtp.distributed.group import RankFailure

    try:
        loop(session, TerminalInput(), stop)
    except RankFailure as e:  # a rank died or failed mid-reply: the group cannot go on, say so and leave
        view.error(f"{e}; the session cannot go on without it")
        return 1
    finally:
        peers = getattr(model, "peers", None)
        if peers is not None:
            peers.close()
    return 0


CHAT_GROUPS = ("model", "draft", "verify", "runtime")  # the groups conf/chat.yaml composes


def chat_help() -> str:
    """`mtp-chat --help`: the config groups a chat uses (Hydra's own help lists every group of conf/, most of
    them mtp-eval's) and the slash commands."""
    groups = "\n".join(f"  {g}: {', '.join(sorted(p.stem for p in (conf_dir() / g).glob('*.yaml')))}"
                       for g in CHAT_GROUPS)
    return (f"{__doc__.splitlines()[0]}\n\nusage: mtp-chat [group=option ...] [key=value ...]\n\n"
            f"config groups (conf/chat.yaml picks one option each):\n{groups}\n\n"
            "settings: max_new_tokens, thinking, show_drafts, and any key of a group\n"
            "  (draft.k=3, runtime.max_model_len=8192, ...); --hydra-help for Hydra's own flags\n\n"
            f"in the chat, {help_text()}\n")


def main() -> None:
    from .common import serve_other_ranks

    serve_other_ranks()  # under torchrun ranks > 0 serve rank 0, which owns the terminal
    if any(a in ("--help", "-h") for a in sys.argv[1:]):
        print(chat_help())
        sys.exit(0)
    from .common import hydra_entry

    hydra_entry("chat", run)


if __name__ == "__main__":
    main()
