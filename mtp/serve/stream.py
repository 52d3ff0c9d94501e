"""A reply's tokens -> the text deltas an OpenAI client is sent, and the final message.

The text is decoded with its special tokens (`</think>`, the end-of-sentence token and DSML markers stay
visible, as `mtp.text.dsml.parse_completion` needs them) and split as DeepSeek-V3.2 writes a reply:
reasoning up to `</think>` (thinking mode), then the answer up to the end-of-sentence token, with DSML tool
calls after the answer. While streaming, text that may be the start of the tool-call block or of a stop string
is held back until it is known not to be; the calls themselves are read once the reply is complete
(`find_tool_calls`, the chat application's reader) and sent as one `tool_calls` delta. A reply whose calls do
not parse keeps its text as the answer, as mtp-chat does.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..text.dsml import CALLS_OPEN, CompletionFormatError, find_tool_calls
from ..text.tokenizer import END_THINK, EOS, StreamDecoder, Tokenizer


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


def _held(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of `text` that is the start of a marker (it may become one)."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


class ReplyText:
    """Feed token ids with `push`; each call returns what became safe to send. `stopped` turns True when a stop
    string appeared (the caller then ends generation); `finish()` returns the last delta and sets `message`."""

    def __init__(self, tok: Tokenizer, thinking: bool, tools: bool, stop: Sequence[str] = ()):
        self.decoder = StreamDecoder(tok, skip_special_tokens=False)
        self.thinking, self.tools, self.stop = thinking, tools, tuple(stop)
        self.text = ""  # the reply so far, special tokens included
        self.sent_reasoning = self.sent_content = 0
        self.stopped = False
        self.message: dict[str, Any] | None = None
        self.call_prefix = uuid.uuid4().hex[:12]

    def _split(self) -> tuple[str, str, bool]:
        """(reasoning, answer text, whether the reasoning has ended), the answer cut at EOS and a stop string."""
        reasoning, rest, ended = "", self.text, not self.thinking
        if self.thinking:
            reasoning, found, rest = self.text.partition(END_THINK)
            ended = bool(found)
        rest = rest.split(EOS, 1)[0]
        for s in self.stop:
            at = rest.find(s)
            if at >= 0:
                rest, self.stopped = rest[:at], True
        return reasoning, rest, ended

    def push(self, ids: Sequence[int]) -> Delta:
        for t in ids:
            self.text += self.decoder.push(t)
        return self._delta(final=False)

    def _delta(self, final: bool, cut_calls: bool = True) -> Delta:
        reasoning, content, _ = self._split()
        if cut_calls and self.tools and CALLS_OPEN in content:
            content = content[: content.find(CALLS_OPEN)]
        elif not final and not self.stopped:
            content = content[: len(content) - _held(content, (CALLS_OPEN,) * self.tools + self.stop)]
        d = Delta(reasoning=reasoning[self.sent_reasoning:], content=content[self.sent_content:])
        self.sent_reasoning = max(self.sent_reasoning, len(reasoning))
        self.sent_content = max(self.sent_content, len(content))
        return d

    def finish(self, interrupted: bool = False) -> Delta:
        """The rest of the text, and the tool calls of a complete reply (call ids `call_<prefix>_<i>`)."""
        self.text += self.decoder.flush()
        found = None
        if self.tools and not interrupted and not self.stopped:
            try:
                found = find_tool_calls(self.text, self.thinking)
            except CompletionFormatError:  # kept as text, as mtp-chat does
                found = None
        d = self._delta(final=True, cut_calls=found is not None)
        reasoning, content, _ = self._split()
        calls: list[dict[str, Any]] = []
        if found is not None:
            content = found[0]
            calls = [{"id": f"call_{self.call_prefix}_{i}", **c} for i, c in enumerate(found[1])]
            d.tool_calls = calls
        self.message = {"role": "assistant", "content": content, "reasoning_content": reasoning or None,
                        "tool_calls": calls}
        return d
