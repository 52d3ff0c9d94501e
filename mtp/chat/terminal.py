"""Terminal side of `mtp-chat`: where lines come from, how replies are drawn, how Ctrl-C reaches a reply.

Input sources (`read(prompt) -> str | None`, None at end of input; Ctrl-C at the prompt gives ""):
- `TerminalInput`: prompt_toolkit line editing and history on a terminal, plain `input()` otherwise (pipes);
- `ScriptedInput`: a fixed list of lines (tests, batch runs);

Views: `TerminalView` writes ANSI-styled text (reasoning dim, accepted drafts green with show_drafts) and
shows control characters from the model as visible symbols (`printable`) so gibberish cannot drive the
terminal. Several ranks: only rank 0 runs the chat (`eval/chat.py`).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import unicodedata
from collections.abc import Iterable, Iterator
from typing import TextIO

from .turn import View

DIM, GREEN, CYAN, RED, YELLOW, RESET = "\x1b[2m", "\x1b[32m", "\x1b[36m", "\x1b[31m", "\x1b[33m", "\x1b[0m"


def printable(text: str) -> str:
    """Text as the terminal shows it: newlines and tabs stay, C0 controls and DEL become their Unicode
    "control picture" (U+2400 + code, e.g. ESC -> '␛'), other control characters `<U+0085>`."""
    out = []
    for ch in text:
        if ch in "\n\t" or unicodedata.category(ch) != "Cc":
            out.append(ch)
        elif ord(ch) < 0x20:
            out.append(chr(0x2400 + ord(ch)))
        elif ord(ch) == 0x7F:
            out.append("\u2421")
        else:
            out.append(f"<U+{ord(ch):04X}>")
    return "".join(out)


class TerminalView:
    def __init__(self, out: TextIO | None = None, color: bool = True, show_drafts: bool = False):
        self.out = out or sys.stdout
        self.color, self.show_drafts = color, show_drafts

    def _write(self, text: str, style: str = "") -> None:
        self.out.write(f"{style}{text}{RESET}" if style and self.color else text)
        self.out.flush()

    def stream(self, text: str, reasoning: bool, drafted: bool) -> None:
        style = (DIM if reasoning else "") + (GREEN if drafted and self.show_drafts else "")
        self._write(printable(text), style)

    def end_reasoning(self) -> None:
        self._write("\n--- answer ---\n", DIM)

    def end_reply(self, interrupted: bool) -> None:
        self._write("\n")
        if interrupted:
            self._write("[interrupted]\n", YELLOW)

    def stats(self, line: str) -> None:
        self._write(f"[{line}]\n", CYAN)

    def notice(self, text: str) -> None:
        self._write(f"{text}\n", DIM)

    def error(self, text: str) -> None:
        self._write(f"error: {text}\n", RED)


class ScriptedInput:
    def __init__(self, lines: Iterable[str]):
        self._lines = iter(lines)

    def read(self, prompt: str) -> str | None:
        return next(self._lines, None)


class TerminalInput:
    """prompt_toolkit when stdin and stdout are terminals (line editing, Up/Down history of this session),
    plain `input()` otherwise, so `echo hi | mtp-chat` works too."""

    def __init__(self, interactive: bool | None = None):
        self.interactive = sys.stdin.isatty() and sys.stdout.isatty() if interactive is None else interactive
        self._prompt = None
        if self.interactive:
            from prompt_toolkit import PromptSession
            from prompt_toolkit.history import InMemoryHistory

            self._prompt = PromptSession(history=InMemoryHistory())

    def read(self, prompt: str) -> str | None:
        try:
            if self._prompt:
                return self._prompt.prompt(prompt)
            line = input()
            print(prompt + line, flush=True)  # echo: a piped session's output reads like a typed one
            return line
        except EOFError:
            return None
        except KeyboardInterrupt:  # Ctrl-C at the prompt clears the line, as in a shell
            if not self._prompt:
                print()
            return ""


class StopFlag:
    """Ctrl-C during a reply: the first press sets the flag (the reply stops after the current step), a
    second press raises KeyboardInterrupt at once (useful during a long prefill). `armed()` installs the
    handler for one reply and restores the previous one afterwards; outside it Ctrl-C behaves as usual."""

    def __init__(self, hard: bool = True):
        self._event = threading.Event()
        self.hard = hard  # False: a second press only sets the flag again (several ranks share every step)

    def is_set(self) -> bool:
        return self._event.is_set()

    def _on_sigint(self, signum, frame) -> None:
        if self._event.is_set() and self.hard:
            raise KeyboardInterrupt
        self._event.set()

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        self._event.clear()
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be set from the main thread
            return
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)
