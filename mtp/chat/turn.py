"""One chat turn's pieces: the `View` it is shown on, the token stream turned into shown text (`ReplyStream`),
the metrics of an interrupted reply (`StepLog`), the `Turn` record with its stats line, and the atomic JSON
write behind `/save`."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Protocol

from ..decode.engine import StepEvent
from ..decode.metrics import SpecMetrics
from ..text.tokenizer import StreamDecoder, Tokenizer

TRANSCRIPT_FORMAT = "mtp-chat-transcript/1"


class View(Protocol):
    """What a person sees. Chunks arrive in order; `reasoning` marks text before </think> in thinking mode,
    `drafted` text that came from an accepted MTP draft (rather than from the target's own token)."""

    def stream(self, text: str, reasoning: bool, drafted: bool) -> None: ...
    def end_reasoning(self) -> None: ...
    def end_reply(self, interrupted: bool) -> None: ...
    def stats(self, line: str) -> None: ...
    def notice(self, text: str) -> None: ...
    def error(self, text: str) -> None: ...


@dataclass
class Turn:
    user: str | None  # None: the reply that continues after tool results (mtp.chat.tools)
    reasoning: str  # text before </think> (thinking mode), exactly as streamed
    content: str  # the answer, exactly as streamed (with tool calls: the text before them)
    thinking: bool
    interrupted: bool
    finish_reason: str  # 'stop' | 'length' | 'interrupted'
    settings: dict[str, Any]
    metrics: SpecMetrics
    conversation: int  # bumped by /reset
    trimmed: int  # earlier turns left out of this prompt to fit max_model_len
    tool_calls: list = dataclasses.field(default_factory=list)  # OpenAI-style calls the reply made
    tool_results: list = dataclasses.field(default_factory=list)  # their results as typed, in order

    @property
    def stats_line(self) -> str:
        """The line shown after the reply."""
        return stats_line(self.metrics) + (" interrupted" if self.interrupted else "")

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "metrics"}
        d["stats_line"] = self.stats_line
        d["stats"] = self.metrics.to_dict()
        return d


def stats_line(m: SpecMetrics) -> str:
    """One pasteable line. TTFT and TPOT are means over turns (per-request samples, `SpecMetrics.ttft`);
    `acc` is P(draft j accepted) per draft position j = 1..k (`SpecMetrics.accept_cum`)."""
    acc = " ".join(f"{x:.2f}" for x in m.accept_cum)
    spec = "none" if m.k == 0 else f"{m.draft} k={m.k}"
    ttft, tpot = m.ttft["mean"] or 0.0, m.tpot["mean"] or 0.0
    return (f"in={m.prompt_tokens} out={m.new_tokens} ttft={ttft * 1e3:.1f}ms "
            f"tpot={tpot * 1e3:.1f}ms prefill={m.prefill_tok_s:.1f}tok/s decode={m.decode_tok_s:.1f}tok/s "
            f"AL={m.mean_accepted_len:.2f} acc=[{acc}] ({spec} {m.verify})")


class StepLog:
    """Metrics of a reply that never returned from `generate` (interrupted), rebuilt from its step events.
    Counts as the engine does: the first event is the prefill's token, each later one a verify step."""

    def __init__(self, draft: str, k: int, verify: str, prompt_tokens: int):
        self.met = SpecMetrics(k=k, draft=draft, verify=verify, n_rows=1, prompt_tokens=prompt_tokens)
        self.t0 = time.perf_counter()
        self.t_first = self.t_last = None

    def add(self, event: StepEvent) -> None:
        now = time.perf_counter()
        m = self.met
        m.new_tokens += len(event.new_tokens[0])
        if self.t_first is None:
            self.t_first = now
            m.time_prefill_s = now - self.t0
            m.ttft_s_rows = [m.time_prefill_s]
        else:
            m.accepted_hist[min(event.accepted[0], m.k)] += 1
            m.row_steps += 1
            m.target_forwards += 1
        self.t_last = now

    def metrics(self) -> SpecMetrics:
        if self.t_first is not None:
            self.met.time_decode_s = self.t_last - self.t_first
            if self.met.new_tokens > 1:
                self.met.tpot_s_rows = [self.met.time_decode_s / (self.met.new_tokens - 1)]
        return self.met


class ReplyStream:
    """Streams one reply's tokens to the view as text, splitting reasoning from answer at </think> and
    tagging chunks that came from accepted drafts. `text[True]`/`text[False]` collect exactly what was shown
    (reasoning / answer), so the saved transcript equals the screen."""

    def __init__(self, tok: Tokenizer, view: View, reasoning: bool):
        self.tok, self.view, self.reasoning = tok, view, reasoning
        self.decoder = StreamDecoder(tok, skip_special_tokens=True)
        self.text = {True: "", False: ""}
        self.ids: list[int] = []  # every token of the reply (tool calls are parsed from them)

    def _show(self, chunk: str, drafted: bool) -> None:
        if chunk:
            self.text[self.reasoning] += chunk
            self.view.stream(chunk, self.reasoning, drafted)

    def step(self, new_tokens: list[int], accepted: int) -> None:
        self.ids += new_tokens
        for i, t in enumerate(new_tokens):
            if t == self.tok.end_think_id and self.reasoning:
                self._show(self.decoder.flush(), drafted=False)
                self.reasoning = False
                self.view.end_reasoning()
                continue
            self._show(self.decoder.push(t), drafted=i < accepted)

    def finish(self) -> None:
        self._show(self.decoder.flush(), drafted=False)
