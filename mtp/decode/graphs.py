"""The graph runner: the whole speculative step as one CUDA graph, replayed, optionally overlapped with the host.

The engine's `step` is device work only, on buffers allocated once (`DecodeState`), with every update done in place
and a static bound on the cache positions it touches. So one speculative step -- K drafts, the target verify
forward over K+1 tokens, verification, commit and cache rollback -- is captured as ONE CUDA graph and replayed.

Capturing needs a step that changes nothing: we mark every row finished for the warm-up and capture runs.
A finished row commits nothing, and everything else a step writes is either past the row's length (drafts,
verify K/V, hidden states) or recomputed from unchanged inputs (the draft windows), so the state after
capture equals the state before. The flags are restored afterwards.

graph:   replay step n, copy its outputs to the host, read them, replay step n+1.
overlap: replay step n+1 BEFORE the host reads step n (outputs staged in two pinned host slots with events).
         A row that finished at step n is frozen on the device, so the surplus step the host launched before
         it saw the finish commits nothing: outputs are identical to the non-overlapped run.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch

from ..model.deepseek import DeepseekV32
from .health import raise_nonfinite
from .keep import track
from .metrics import SpecMetrics
from .state import DecodeState


def capture_graph(fn: Callable[[], None], warmup: int = 2) -> torch.cuda.CUDAGraph:
    """`fn` captured as one CUDA graph, after `warmup` runs on a side stream (lazy inits, allocator, Triton
    autotune happen outside the capture). Sampling inside a step needs no generator: its draws hash (row seed,
    position, stream) (mtp/spec/draws.py), so a replay draws what an eager step would."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = track(torch.cuda.CUDAGraph())
    # A graph that died in a reference cycle (a dropped engine's) is destroyed when the cyclic collector runs;
    # if that happens mid-capture, its `reset` on the capturing stream invalidates the capture ("operation not
    # permitted when stream is capturing (function reset)", seen on an H200: the tree graph-reuse test, overlap).
    # The collector stays off until the capture ends (no gc.collect() before: 30-70 ms a capture at start-up).
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph):
            fn()
    finally:
        if was_enabled:
            gc.enable()
    return graph


class _Slot:
    """Pinned host copies of one step's outputs + the event that says they have landed."""

    def __init__(self, st):
        B, K1 = st.new_BK1.shape
        self.finished = torch.empty(B, dtype=torch.bool, pin_memory=True)
        self.new = torch.empty(B, K1, dtype=torch.long, pin_memory=True)
        self.keep = torch.empty(B, dtype=torch.long, pin_memory=True)
        self.acc = torch.empty(B, dtype=torch.long, pin_memory=True)
        self.nonfinite = torch.empty((), dtype=torch.bool, pin_memory=True)
        self.ready = torch.cuda.Event()

    def stage(self, st) -> None:
        self.finished.copy_(st.finished_B, non_blocking=True)
        self.new.copy_(st.new_BK1, non_blocking=True)
        self.keep.copy_(st.keep_B, non_blocking=True)
        self.acc.copy_(st.acc_B, non_blocking=True)
        self.nonfinite.copy_(st.nonfinite, non_blocking=True)
        self.ready.record()


class GraphRunner:
    """Owns one engine's captured steps: one graph per (batch, buffer length), captured on first use, dropped
    with its buffers (`drop`) or when the model's modules were swapped since (`model.version`).

    `step(st, W, max_n)` is the engine's device-only step; `run` replays it until every row is finished,
    reading each step's outputs from pinned host slots (graph), or one step late (overlap)."""

    def __init__(self, model: DeepseekV32, step: Callable[[DecodeState, int, int], None]):
        self.model, self.step = model, step
        self.graphs: dict[tuple[int, int], tuple] = {}  # (batch, buffer length) -> (graph, capture s, pool bytes)
        self.version = model.version

    def drop(self, key: tuple[int, int]) -> None:
        self.graphs.pop(key, None)

    def check_version(self) -> None:
        """Drop every graph when the model's modules were swapped since capture (fast path on/off, ...): they
        hold the old modules' kernels and weight pointers."""
        if self.version != self.model.version:
            self.graphs.clear()
            self.version = self.model.version

    def capture(self, st: DecodeState, W: int, max_n: int) -> tuple[torch.cuda.CUDAGraph, float, int]:
        """Capture needs a step that changes nothing: every row is marked finished for the warm-up and capture
        runs, then the flags are restored."""
        saved = st.finished_B.clone()
        st.finished_B.fill_(True)
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        graph = capture_graph(lambda: self.step(st, W, max_n))
        torch.cuda.synchronize()
        capture_s = time.perf_counter() - t0
        graph_bytes = max(free0 - torch.cuda.mem_get_info()[0], 0)
        st.finished_B.copy_(saved)
        return graph, capture_s, graph_bytes

    def run(self, st: DecodeState, met: SpecMetrics, emit, W: int, max_n: int, overlap: bool) -> None:
        """Every step after the prefill (the draft caches were filled over the prompt) replays one graph.
        `max_n`: the static bound on the cache positions a step touches; `emit(new, keep, acc)` per step."""
        self.check_version()
        key = (st.B, st.max_len)
        met.graph_captures = int(key not in self.graphs)
        if key not in self.graphs:  # captured once per (batch, buffer length); later calls replay it
            self.graphs[key] = self.capture(st, W, max_n)
        graph, met.graph_capture_s, met.graph_pool_bytes = self.graphs[key]
        starts, ends = [], []

        def launch(slot: _Slot) -> None:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graph.replay()
            e.record()
            starts.append(s)
            ends.append(e)
            slot.stage(st)

        def consume(slot: _Slot) -> bool:
            slot.ready.synchronize()
            met.target_forwards += 1
            if bool(slot.nonfinite):
                raise_nonfinite(self.model, st.tokens, st.n_B, f"step {met.target_forwards}")
            emit(slot.new.tolist(), slot.keep.tolist(), slot.acc.tolist())
            return bool(slot.finished.all())

        slots = [_Slot(st), _Slot(st)]
        if not overlap:
            while True:
                launch(slots[0])
                if consume(slots[0]):
                    break
        else:
            launch(slots[0])
            i = 0
            while True:
                launch(slots[1 - i])  # step n+1 goes to the GPU before the host looks at step n
                if consume(slots[i]):
                    break
                i = 1 - i
        torch.cuda.synchronize()
        step_ms = [s.elapsed_time(e) for s, e in zip(starts, ends)]
        gaps = [max(ends[j].elapsed_time(starts[j + 1]), 0.0) for j in range(len(starts) - 1)]
        met.gpu_busy_ms = sum(step_ms)
        met.gpu_idle_ms = sum(gaps)
        met.graph_replays = len(starts)
