"""The engines `mtp.generate` and `generate_tree` keep across calls in graph / overlap mode: per model, per settings,
the few most recently used. An engine holds its decode buffers and the CUDA graphs captured on them, so a later
call with the same settings replays instead of capturing again. When the model's version changed since (a module
swap such as the fast path, new run-time options: `DeepseekV32.version`) every engine kept for it is dropped, its
buffers too (a cache's layout follows the numerics); `release(model)` drops them at once.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..model.deepseek import DeepseekV32
    from .config import GenerationConfig

MAX_ENGINES = 4  # per model; the least recently used past this is dropped (with its buffers and graphs)

# model -> {settings: engine}, and the model's version they were built at; weak, so they go with the model.
_ENGINES: "weakref.WeakKeyDictionary[DeepseekV32, dict]" = weakref.WeakKeyDictionary()
_VERSIONS: "weakref.WeakKeyDictionary[DeepseekV32, int]" = weakref.WeakKeyDictionary()


def kept(model: DeepseekV32, gcfg: GenerationConfig, build: Callable[[], object]):
    """The engine kept for `model` and the settings of `gcfg` that shape its captured step (all but
    max_new_tokens and seed, which are per call), built with `build()` when there is none."""
    if _VERSIONS.get(model) != model.version:
        _ENGINES.pop(model, None)
        _VERSIONS[model] = model.version
    per_model = _ENGINES.setdefault(model, {})
    key = dataclasses.replace(gcfg, max_new_tokens=1, seed=0)
    engine = per_model.pop(key, None) or build()
    per_model[key] = engine  # most recently used last
    while len(per_model) > MAX_ENGINES:
        del per_model[next(iter(per_model))]
    return engine


# Every CUDA graph captured in this process (`track`), so `release()` can free them whoever still refers to one.
_GRAPHS: "weakref.WeakSet[torch.cuda.CUDAGraph]" = weakref.WeakSet()


def track(graph: torch.cuda.CUDAGraph) -> torch.cuda.CUDAGraph:
    _GRAPHS.add(graph)
    return graph


def release(model: DeepseekV32 | None = None) -> None:
    """Drop the engines (decode buffers, captured CUDA graphs) kept for `model`, or for every model.
    With no model it also frees every graph captured in this process (`CUDAGraph.reset`), however it is still
    referred to: call it so before tearing down a process group. NCCL's teardown (destroy, and abort too) waits
    while captured graphs holding its collectives are alive -- seen: ranks hung in destroy_process_group, and
    rank 0 of mtp-eval in the abort at exit, where `gc.freeze()` had kept an engine's reference cycle alive."""
    if model is None:
        _ENGINES.clear()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for graph in list(_GRAPHS):
            graph.reset()
        _GRAPHS.clear()
    else:
        _ENGINES.pop(model, None)
