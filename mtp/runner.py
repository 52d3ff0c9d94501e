"""Whole-step CUDA graph and the overlap scheduler.

`Engine._step` is device work only, on buffers allocated once (`DecodeState`), with every update done in place
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

import time

import torch

from .health import raise_nonfinite
from .metrics import SpecMetrics


def _capture(engine, st, W: int, max_n: int) -> tuple[torch.cuda.CUDAGraph, float, int]:
    saved = st.finished_B.clone()
    st.finished_B.fill_(True)
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: lazy inits, allocator, Triton autotune, outside the capture
            engine._step(st, W, max_n)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    if engine.gen is not None and hasattr(graph, "register_generator_state"):
        graph.register_generator_state(engine.gen)  # sampling draws advance correctly on every replay
    with torch.cuda.graph(graph):
        engine._step(st, W, max_n)
    torch.cuda.synchronize()
    capture_s = time.perf_counter() - t0
    graph_bytes = max(free0 - torch.cuda.mem_get_info()[0], 0)
    st.finished_B.copy_(saved)
    return graph, capture_s, graph_bytes


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


def run_captured(engine, st, met: SpecMetrics, emit, host: torch.Tensor, W: int) -> None:
    """Every step after the prefill (the draft caches were filled over the prompt) replays one graph."""
    mode = engine.g.mode
    if bool(host[1].all()):
        return
    max_n = engine._bound(st, host)  # static on CUDA: the verify forward may touch every slot
    key = (st.B, st.max_len)
    if key not in engine.graphs:  # captured once per (batch, buffer length); later calls replay it
        engine.graphs[key] = _capture(engine, st, W, max_n)
    graph, met.graph_capture_s, met.graph_pool_bytes = engine.graphs[key]
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
            raise_nonfinite(engine.model, st.tokens, st.n_B, f"step {met.target_forwards}")
        emit(slot.new.tolist(), slot.keep.tolist(), slot.acc.tolist())
        return bool(slot.finished.all())

    slots = [_Slot(st), _Slot(st)]
    if mode == "graph":
        while True:
            launch(slots[0])
            if consume(slots[0]):
                break
    else:  # overlap
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
