"""Index tensors a decode step reads on every call, made once per (length, device) and kept, so that a step (and a
captured step graph) launches no `arange` for them.

Why: a CUDA-graph decode step pays for each small launch, not for its bytes (~1 us of GPU and its gap each in the
graph). The eagle k = 3 step ran 10 aranges (positions of its four forwards, the draft window, its rows, the accept
and commit bookkeeping): 8.9 us of exposed time a step (one H200, session 20's `mtp-bench --tp 8 --profile`).

A kept tensor is read-only: nothing may write into it (every caller adds it to something, or indexes with it).
"""

from __future__ import annotations

import torch

_ARANGES: dict[tuple[torch.device, int, int], torch.Tensor] = {}


def arange(n: int, device: torch.device | str, start: int = 0) -> torch.Tensor:
    """torch.arange(start, start + n, device=device) (int64), the same tensor on every call once made. First asked for
    while a CUDA graph is captured, it is made by a captured launch and not kept (its memory is the graph's, and its
    values are there only once the graph runs); the engine's warm-up runs the step first, outside the capture, and
    makes it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    t = _ARANGES.get((device, start, n))
    if t is None:
        t = torch.arange(start, start + n, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return t
        _ARANGES[(device, start, n)] = t
    return t
