"""The logic of `mtp-chat`: conversation state, slash commands, streamed generation, statistics.

No terminal, no Hydra, no process group here, so it is testable with a scripted list of lines and usable on
every rank of a multi-GPU run. A `Session` meets the outside world at three points:
- lines come in through `Session.handle(line)`, which returns False when the session should end; who reads
  them (prompt_toolkit, `input()`, a test script, rank 0 broadcasting to the other ranks) is the caller's
  business (`mtp.chat.terminal`);
- what a person should see goes to a `View` (streamed text tagged reasoning / accepted-draft, notices,
  errors, stats lines); rank 0 prints it, other ranks pass a view that drops everything;
- `should_stop()` is polled after every committed step; True ends the reply as interrupted. A
  KeyboardInterrupt raised anywhere inside generation does the same, so Ctrl-C never loses the session.

Context vs transcript: `turns` keeps every reply ever made (saved by `/save`); the model sees only the turns
from `context_start` on. `/reset` and trimming to `max_model_len` move `context_start` forward; nothing is
deleted. Earlier assistant turns enter the prompt with their answer only (`mtp.text.prompt` drops reasoning).

Tools (`mtp.chat.tools`): `/tools FILE` puts tool schemas into every prompt; a reply with DSML tool calls
leaves them pending, `/result TEXT` answers them one by one, and after the last one the model continues in a
turn of its own (`Turn.user` None). A message typed while calls are pending is refused (/reset drops them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .tools import TOOLS_HELP, describe_calls, load_tools, read_tool_calls, tool_names
from ..decode.config import GenerationConfig
from ..decode.engine import StepEvent, stops
from ..decode.metrics import SpecMetrics
from ..draft.modes import DRAFTERS, drafts
from ..spec.options import MAX_K, OptionError, draft_room
from ..verify.registry import VERIFIER_REGISTRY, verifier
from ..draft.config import DraftConfig
from ..text.dsml import CompletionFormatError
from ..text.prompt import encode_chat
from ..text.tokenizer import Tokenizer
from ..utils import write_json_atomic
from .terminal import StopFlag
from .turn import TRANSCRIPT_FORMAT, ReplyStream, StepLog, Turn, View, stats_line


_HELP = """\
commands:
  /think on|off                thinking mode (reasoning, then </think>, then the answer)
  /draft {drafts:<21} MTP drafting mode (none = plain autoregressive decoding)
  /k N                         drafts per step, 1..{max_k} (remembered while /draft none)
  /verify {verifiers}
  /max N                       max new tokens per reply
  /temperature T               sampling temperature, T > 0 (used by /verify sample)
  /stats                       session totals, one line per (draft, k, verify) setting, with the
                               speedup over this session's /draft none turns
  /save FILE                   transcript with stats as JSON
  /reset                       start a new conversation (transcript and stats are kept)
{tools}
  /help                        this text
  /exit                        quit (Ctrl-D too)
Ctrl-C stops a reply (press twice to stop at once, even mid-prefill). A line starting with // sends a
message that starts with /. A line ending with \\ continues the message on the next line."""


def help_text() -> str:
    """The /help text with the drafters and verifiers registered now (mtp.draft.modes, mtp.verify.registry), not
    those of import time: one a plugin registers after this module is imported is listed too."""
    return _HELP.format(tools=TOOLS_HELP, drafts="|".join(DRAFTERS), max_k=MAX_K,
                        verifiers="|".join(VERIFIER_REGISTRY))


# generate()'s option -> the command that sets it: how an OptionError from mtp's validation is reported
COMMANDS = {"draft": "/draft", "k": "/k", "verify": "/verify", "max_new_tokens": "/max", "temperature": "/temperature"}


class CommandError(ValueError):
    """A bad command or value: shown as one line, the session goes on."""


@dataclass
class Settings:
    """What slash commands change. `k` is remembered while drafting is off (`/draft none`), so switching
    back restores it; the k actually used is `effective_k`. `options` are the other `mtp.generate`
    keyword arguments from the config (top_n, delta, temperature, reuse_modules, ...)."""

    max_new_tokens: int = 256
    thinking: bool = False
    draft: str = "eagle"
    k: int = 1
    verify: str = "strict"
    max_model_len: int | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def effective_k(self) -> int:
        return self.k if drafts(self.draft) else 0

    def label(self) -> str:
        spec = f"{self.draft} k={self.k}" if drafts(self.draft) else "no draft"
        return f"{spec} {self.verify}" + (" think" if self.thinking else "")

    @classmethod
    def from_generate_kwargs(cls, kwargs: Mapping[str, Any], **overrides: Any) -> "Settings":
        """Split `generate(model, prompts, **kwargs)` arguments into the settings commands change and the
        rest (passed through untouched)."""
        kw = dict(kwargs)
        known = {f.name for f in dataclasses.fields(cls)} - {"options"}
        picked = {name: kw.pop(name) for name in list(kw) if name in known}
        picked.update(overrides)
        if picked.get("k") is None or picked.get("k") == 0:
            picked["k"] = 1  # k for when drafting is switched on; draft='none' ignores it
        return cls(**picked, options=kw)


class _Stop(Exception):
    """Raised from the step callback to leave `generate` when `should_stop()` says so."""


class Session:
    def __init__(self, model, tokenizer: Tokenizer, settings: Settings, view: View,
                 generate: Callable | None = None, should_stop: Callable[[], bool] = lambda: False,
                 system: str = "", meta: Mapping[str, Any] | None = None):
        """`generate` defaults to `mtp.generate` (tests pass a fake); `meta` (model path, config) is saved
        with the transcript."""
        if generate is None:
            from ..decode.engine import generate
        self.model, self.tok, self.settings, self.view = model, tokenizer, settings, view
        self.generate, self.should_stop = generate, should_stop
        self.system, self.meta = system, dict(meta or {})
        self.turns: list[Turn] = []
        self._pending: list[str] = []  # lines of a message continued with a trailing backslash
        self.context_start = 0
        self.conversation = 0
        self.tools: list | None = None  # OpenAI-style tool schemas from /tools
        self.pending = 0  # tool calls of the last reply still waiting for /result
        self.check_settings(settings)

    # ------------------------------------------------------------------ input
    @property
    def continuing(self) -> bool:
        """A message is being continued: the next line joins it (the caller may show another prompt)."""
        return bool(self._pending)

    def handle(self, line: str) -> bool:
        """One line from the person: a command or a message. Returns False when the session should end.
        Nothing raised by a command or by generation escapes (one line on the view instead)."""
        clean = line.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        if clean != line:  # lone surrogates: bytes that were not UTF-8, which the tokenizer cannot take
            self.view.notice("the input had invalid UTF-8; those bytes became \ufffd")
            line = clean
        if line.rstrip().endswith("\\") and (self._pending or not line.lstrip().startswith("/")):  # not a command
            self._pending.append(line.rstrip()[:-1])
            return True
        if self._pending:
            line = "\n".join(self._pending + [line])
            self._pending = []
        line = line.strip()
        if not line:
            return True
        try:
            if line.startswith("/") and not line.startswith("//"):
                return self.command(line)
            self.chat(line[1:] if line.startswith("//") else line)
        except CommandError as e:
            self.view.error(str(e))
        except Exception as e:  # a library error or a bug costs one line, never the conversation
            self.view.error(f"{type(e).__name__}: {e}")
        return True

    def command(self, line: str) -> bool:
        name, _, arg = line[1:].partition(" ")
        name, arg = name.lower(), arg.strip()
        if name in ("exit", "quit"):
            return False
        handler = getattr(self, f"_cmd_{name}", None)
        if handler is None:
            raise CommandError(f"unknown command /{name}; /help lists the commands")
        handler(arg)
        return True

    # ------------------------------------------------------------------ commands
    def _cmd_help(self, arg: str) -> None:
        self.view.notice(help_text())

    def _cmd_reset(self, arg: str) -> None:
        self.context_start = len(self.turns)
        self.conversation += 1
        self.pending = 0
        self.view.notice("new conversation (transcript and stats kept)")

    def _cmd_tools(self, arg: str) -> None:
        if arg.lower() == "off":
            self.tools, self.pending = None, 0
        elif arg:
            try:
                self.tools = load_tools(arg)
            except ValueError as e:
                raise CommandError(f"/tools: {e}") from None
        self.view.notice(f"tools: {tool_names(self.tools)}" if self.tools else "no tools")

    def _cmd_result(self, arg: str) -> None:
        if not self.pending:
            raise CommandError("/result: no tool call is waiting for a result")
        turn = self.turns[-1]
        turn.tool_results.append(arg)
        self.pending -= 1
        if self.pending:
            self.view.notice(f"{self.pending} more result(s) to go")
        else:
            self.chat(None)

    def _cmd_think(self, arg: str) -> None:
        value = _on_off(arg, "/think")
        if value is not None:
            self.settings.thinking = value
        self.view.notice(f"thinking {'on' if self.settings.thinking else 'off'}")

    def _cmd_draft(self, arg: str) -> None:
        if arg:
            self._change(draft=arg)
        self.view.notice(f"now: {self.settings.label()}")

    def _cmd_k(self, arg: str) -> None:
        if arg:
            self._change(k=_parse(arg, int))
        on = "|".join(name for name in DRAFTERS if drafts(name))
        note = f" (applies when drafting is on: /draft {on})" if not drafts(self.settings.draft) else ""
        self.view.notice(f"k={self.settings.k}{note}")

    def _cmd_max(self, arg: str) -> None:
        if arg:
            n = _parse(arg, int)
            if isinstance(n, int) and n >= self.context_limit():
                raise CommandError(f"/max {n} leaves no room for a prompt in max_model_len {self.context_limit()}")
            self._change(max_new_tokens=n)
        self.view.notice(f"max_new_tokens {self.settings.max_new_tokens}")

    def _cmd_temperature(self, arg: str) -> None:
        if arg:
            self._change(options={**self.settings.options, "temperature": _parse(arg, float)})
        t = self.settings.options.get("temperature", 1.0)
        note = "" if verifier(self.settings.verify).samples else " (applies with /verify sample)"
        self.view.notice(f"temperature {t}{note}")

    def _cmd_verify(self, arg: str) -> None:
        if arg:
            self._change(verify=arg)
        self.view.notice(f"now: {self.settings.label()}")

    def _cmd_stats(self, arg: str) -> None:
        if not self.turns:
            self.view.notice("no turns yet")
            return
        n_int = sum(t.interrupted for t in self.turns)
        no_base = any(t.metrics.k for t in self.turns) and not any(t.metrics.k == 0 for t in self.turns)
        self.view.notice(f"session: {len(self.turns)} turns ({n_int} interrupted)"
                         + ("; no baseline yet: a turn with /draft none gives the speedup" if no_base else ""))
        for line in self.totals():
            self.view.stats(line)

    def _cmd_save(self, arg: str) -> None:
        if not arg:
            raise CommandError("usage: /save FILE")
        path = Path(arg).expanduser()
        if not path.parent.is_dir():
            raise CommandError(f"/save: folder {path.parent} does not exist")
        if path.is_dir():
            raise CommandError(f"/save: {path} is a folder; give a file name")
        try:
            write_json_atomic(path, self.transcript())
        except OSError as e:
            raise CommandError(f"/save: cannot write {path}: {e.strerror or e}") from None
        self.view.notice(f"saved {len(self.turns)} turns to {path}")

    def _change(self, **changes: Any) -> None:
        """Apply setting changes only if the result is valid, so a bad value leaves the session as it was."""
        new = dataclasses.replace(self.settings, **changes)
        self.check_settings(new)
        self.settings = new

    def generation_config(self, s: Settings) -> GenerationConfig:
        """The settings as the engine's options (think ids from the tokenizer: relaxed needs them)."""
        kwargs = {"think_ids": (self.tok.think_id, self.tok.end_think_id), **s.options}
        return GenerationConfig.from_options(s.max_new_tokens, s.draft, s.effective_k, s.verify, **kwargs)

    def check_settings(self, s: Settings) -> None:
        """The engine's own validation (`GenerationConfig`, with `validate` for what needs the model), its error
        shown as a command error naming the command of the option it refuses."""
        try:
            self.generation_config(s).validate(self.model)
            if not drafts(s.draft):  # the k kept for when drafting is switched back on
                DraftConfig(mode="eagle", k=s.k)
        except OptionError as e:
            raise CommandError(e.say(COMMANDS[e.name], "needs") if e.name in COMMANDS else str(e)) from None
        except (ValueError, TypeError) as e:
            raise CommandError(str(e)) from None

    # ------------------------------------------------------------------ statistics and transcript
    def totals(self) -> list[str]:
        """One stats line per (draft, k, verify) setting used, all turns of the session summed; drafting
        settings get their decode speedup over this session's no-draft turns (the baseline), when it has any."""
        groups: dict[tuple, SpecMetrics] = {}
        for t in self.turns:
            key = (t.metrics.draft, t.metrics.k, t.metrics.verify)
            groups[key] = groups[key].merge(t.metrics) if key in groups else t.metrics
        base = [m.decode_tok_s for m in groups.values() if m.k == 0 and m.decode_tok_s > 0]
        lines = []
        for m in groups.values():
            line = f"{stats_line(m)} turns={m.n_rows}"
            if m.k and base:  # several verifiers without drafts: the fastest is the baseline
                line += f" speedup={m.decode_tok_s / max(base):.2f}x vs no draft"
            lines.append(line)
        return lines

    def _settings_record(self) -> dict[str, Any]:
        d = dataclasses.asdict(self.settings)
        vocab = d["options"].get("draft_vocab")
        if vocab is not None:  # tens of thousands of ids: the transcript keeps how many
            d["options"]["draft_vocab"] = {"size": len(vocab)}
        return d

    def transcript(self) -> dict[str, Any]:
        return {
            "format": TRANSCRIPT_FORMAT,
            "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "meta": self.meta,
            "system": self.system,
            "tools": self.tools,
            "settings": self._settings_record(),
            "turns": [t.to_dict() for t in self.turns],
            "totals": self.totals(),
        }

    # ------------------------------------------------------------------ generation
    def warmup(self) -> None:
        """One short untimed generate, so the first turn's TTFT does not include one-time setup (CUDA
        context, kernel selection, first-touch allocations)."""
        ids = encode_chat([{"role": "user", "content": "hi"}], self.tok, self.settings.thinking)
        s = self.settings
        kwargs = {"think_ids": (self.tok.think_id, self.tok.end_think_id), **s.options}
        self.generate(self.model, [ids], 2, draft=s.draft, k=s.effective_k, verify=s.verify, **kwargs)

    def context_limit(self) -> int:
        """Most prompt + max_new_tokens tokens a turn may take: runtime.max_model_len, and the engine's own
        bound (its buffers hold prompt + max_new_tokens + draft room, within max_position_embeddings)."""
        engine_limit = self.model.cfg.max_position_embeddings - draft_room(self.settings.effective_k)
        s = self.settings.max_model_len
        return engine_limit if s is None else min(s, engine_limit)

    def messages(self, start: int, user: str | None) -> list[dict[str, Any]]:
        """The conversation from turn `start` on, then `user` (None: the model continues after tool results)."""
        msgs: list[dict[str, Any]] = [{"role": "system", "content": self.system}] if self.system else []
        for t in self.turns[start:]:
            if t.user is not None:
                msgs.append({"role": "user", "content": t.user})
            msgs.append({"role": "assistant", "content": t.content, "reasoning_content": t.reasoning,
                         "tool_calls": t.tool_calls})
            msgs += [{"role": "tool", "content": r} for r in t.tool_results]
        if user is not None:
            msgs.append({"role": "user", "content": user})
        return msgs

    def fit(self, user: str | None) -> tuple[list[int], int]:
        """Prompt ids for `user` after the conversation, leaving out the earliest turns until prompt +
        max_new_tokens fits `context_limit()`. Returns (ids, first turn kept)."""
        limit, max_new = self.context_limit(), self.settings.max_new_tokens
        start = self.context_start
        while True:
            ids = encode_chat(self.messages(start, user), self.tok, self.settings.thinking, tools=self.tools)
            if len(ids) + max_new <= limit:
                return ids, start
            if start == len(self.turns) - (user is None):  # a continuation keeps the turn with the calls
                raise CommandError(f"input too long: the prompt is {len(ids)} tokens, + max_new_tokens {max_new} "
                                   f"exceeds max_model_len {limit}; shorten it or lower /max")
            start += 1

    def chat(self, user: str | None) -> Turn:
        """A reply to `user`, or (None) the reply that continues after the results of its tool calls."""
        s = self.settings
        if user is not None and self.pending:
            raise CommandError(f"{self.pending} tool call(s) wait for /result (or /reset to drop them)")
        ids, start = self.fit(user)
        trimmed = start - self.context_start
        if trimmed:
            self.view.notice(f"history trimmed: left out the {trimmed} earliest turn(s) to fit max_model_len "
                             f"{self.context_limit()} (prompt {len(ids)} + max_new_tokens {s.max_new_tokens})")
        self.context_start = start
        reply = ReplyStream(self.tok, self.view, reasoning=s.thinking)
        log = StepLog(s.draft, s.effective_k, s.verify, len(ids))

        @stops  # Ctrl-C ends the reply after this step, on every rank of a split model
        def on_step(event: StepEvent) -> None:
            log.add(event)
            reply.step(event.new_tokens[0], event.accepted[0])
            if self.should_stop():
                raise _Stop

        kwargs = {"think_ids": (self.tok.think_id, self.tok.end_think_id), **s.options}  # relaxed needs them
        try:
            result = self.generate(self.model, [ids], s.max_new_tokens, draft=s.draft, k=s.effective_k,
                                   verify=s.verify, on_step=on_step, **kwargs)
            metrics, reason = result.metrics, result.finish_reasons[0]
        except (_Stop, KeyboardInterrupt):
            metrics, reason = log.metrics(), "interrupted"
        except Exception:
            if log.t_first is not None:  # failed mid-reply: end the streamed line before the error shows
                self.view.end_reply(interrupted=True)
            raise
        reply.finish()
        interrupted = reason == "interrupted"
        self.view.end_reply(interrupted)
        turn = Turn(user=user, reasoning=reply.text[True], content=reply.text[False], thinking=s.thinking,
                    interrupted=interrupted, finish_reason=reason,
                    settings={"draft": s.draft, "k": s.effective_k, "verify": s.verify,
                              "max_new_tokens": s.max_new_tokens},
                    metrics=metrics, conversation=self.conversation, trimmed=trimmed)
        self.turns.append(turn)
        self.view.stats(turn.stats_line)
        self._take_tool_calls(turn, reply.ids)
        return turn

    def _take_tool_calls(self, turn: Turn, reply_ids: list[int]) -> None:
        """Tool calls in a finished reply become pending; the turn keeps the text before them as its answer
        (the prompt builder writes the calls again from `tool_calls`)."""
        if turn.interrupted:
            return
        try:
            found = read_tool_calls(self.tok, reply_ids, turn.thinking)
        except CompletionFormatError as e:
            self.view.notice(f"the reply's tool calls could not be read, kept as text: {e}")
            return
        if found is not None:
            turn.content, turn.tool_calls = found
            self.pending = len(turn.tool_calls)
            self.view.notice(describe_calls(turn.tool_calls))


def _parse(arg: str, kind: type):
    """`arg` as an int or float, or as typed when it is not one (the validation then names it)."""
    try:
        return kind(arg)
    except ValueError:
        return arg


def _on_off(arg: str, cmd: str) -> bool | None:
    if not arg:
        return None
    if arg.lower() in ("on", "true", "1", "yes"):
        return True
    if arg.lower() in ("off", "false", "0", "no"):
        return False
    raise CommandError(f"{cmd} takes on or off, got {arg!r}")


def loop(session: Session, source, stop: StopFlag) -> None:
    """Read a line, handle it, until end of input or /exit. Ctrl-C is the reply's business while armed
    (see `StopFlag`); a second Ctrl-C that lands between steps is caught here, so the session survives."""
    while True:
        line = source.read("... " if session.continuing else f"[{session.settings.label()}] > ")
        if line is None:
            break
        try:
            with stop.armed():
                if not session.handle(line):
                    break
        except KeyboardInterrupt:
            session.view.notice("interrupted")
