"""Where a request's generation runs: one function, `Backend.generate`, so a multi-GPU runtime can take its place
(rank 0 receives the call and broadcasts it to the other ranks, which run the same `mtp.generate`).

Requests run one at a time at batch 1 (the regime MTP drafting targets): `Worker` is a queue with one thread,
and a request waits there until the one before it ends. A request whose client went away is stopped at the next
committed step (`should_stop`), or skipped if it had not started.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from ..chat.turn import StepLog
from ..decode.config import GenerationConfig
from ..decode.engine import StepEvent, stops
from ..decode.metrics import SpecMetrics

OnTokens = Callable[[list[int], int], None]  # (tokens committed by a step, how many of them were accepted drafts)


@dataclass
class Outcome:
    tokens: list[int]
    finish_reason: str  # 'stop' | 'length' | 'interrupted'
    metrics: SpecMetrics
    queue_s: float = 0.0  # time the request waited for the one before it


class Backend(Protocol):
    def generate(self, prompt_ids: Sequence[int], config: GenerationConfig, on_tokens: OnTokens,
                 should_stop: Callable[[], bool]) -> Outcome: ...


class _Stop(Exception):
    """Raised from the step callback to leave `generate` when `should_stop()` says so."""


class LocalBackend:
    """`mtp.generate` on a model in this process."""

    def __init__(self, model, generate: Callable | None = None):
        if generate is None:
            from ..decode.engine import generate
        self.model, self._generate = model, generate

    def generate(self, prompt_ids: Sequence[int], config: GenerationConfig, on_tokens: OnTokens,
                 should_stop: Callable[[], bool]) -> Outcome:
        log = StepLog(config.draft.mode, config.draft.k, config.verify, len(prompt_ids))
        tokens: list[int] = []

        @stops  # a disconnect ends the request after this step, on every rank of a split model
        def on_step(event: StepEvent) -> None:
            log.add(event)
            tokens.extend(event.new_tokens[0])
            on_tokens(event.new_tokens[0], event.accepted[0])
            if should_stop():
                raise _Stop

        try:
            r = self._generate(self.model, [list(prompt_ids)], config=config, on_step=on_step)
        except _Stop:
            return Outcome(tokens, "interrupted", log.metrics())
        return Outcome(r.tokens[0], r.finish_reasons[0], r.metrics)


class Worker:
    """The request queue: one thread runs `backend.generate` for one request after another."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtp-serve")

    def submit(self, prompt_ids: Sequence[int], config: GenerationConfig, on_tokens: OnTokens,
               should_stop: Callable[[], bool]) -> Future:
        queued = time.perf_counter()

        def run() -> Outcome:
            waited = time.perf_counter() - queued
            if should_stop():  # the client left while the request waited
                return Outcome([], "interrupted", SpecMetrics(k=config.draft.k, draft=config.draft.mode,
                                                              verify=config.verify), waited)
            out = self.backend.generate(prompt_ids, config, on_tokens, should_stop)
            out.queue_s = waited
            return out

        return self._pool.submit(run)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
