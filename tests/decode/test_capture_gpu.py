"""`capture_graph` holds while the cyclic garbage collector would free a dead graph mid-capture.

Seen on an H200 (tests/decode/test_tree_graph_reuse_gpu.py, eagle 3x1, overlap): an engine dropped by `release(model)`
lives on in a reference cycle with its captured graphs; when the collector ran inside the next capture, the dead
graph's `reset` on the capturing stream invalidated it ("operation not permitted when stream is capturing")."""

from __future__ import annotations

import gc

import pytest
import torch

from mtp.decode.graphs import capture_graph

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


class _Cycle:
    def __init__(self, graph):
        self.graph, self.me = graph, self


def test_a_dead_graph_in_a_cycle_is_not_freed_during_a_capture():
    x = torch.zeros(8, device="cuda")
    keep = [_Cycle(capture_graph(lambda: x.add_(1)))]
    calls = []

    def step():
        calls.append(1)
        if len(calls) == 3:  # the capture itself (after 2 warm-up runs): the cycle becomes garbage here
            keep.clear()
            _ = [[] for _ in range(1000)]  # enough allocations for the collector to run at threshold 1
        x.mul_(2)

    old = gc.get_threshold()
    gc.set_threshold(1)
    try:
        graph = capture_graph(step)
    finally:
        gc.set_threshold(*old)
    assert len(calls) == 3 and not keep
    gc.collect()  # the dead graph goes now, outside any capture
    x.fill_(1)
    graph.replay()
    torch.cuda.synchronize()
    assert x.tolist() == [2.0] * 8
