"""Start a device on a background thread while a loader does host-only work, so the two overlap.

    dev = DeviceInit(device)    # the thread starts here (nothing happens for a CPU or meta device)
    ...                         # read shard headers, build the model on meta, read the first tensor
    dev.wait()                  # before the first copy to the device
    t.to(device)

Starting CUDA (the driver, then the device's context at its first allocation) is part of the 4.7-6.1 s "load" of
the 18 MB bundled model in BENCHMARKS.md's start-up table on an H100 (reading it takes 0.1 s; the rest was this and an
import of torch._dynamo, now gone) and needs nothing a loader computes, so the loaders start it first.
`python -m mtp.bench.startup --no-overlap-cuda-init` measures it alone (cuda_init_s). What makes this safe:
- torch's lazy CUDA init takes a lock (`torch.cuda._lazy_init`, double-checked): a main thread that reaches its
  first CUDA op while the thread initializes waits for it and finds the work done, never initializes twice.
- The device the thread touches is the one the loader copies to. The current CUDA device is per thread, so the
  index is resolved here, in the caller's thread: the given index; else torch's current device when torch has
  initialized CUDA (`torch.cuda.set_device` and `torch.cuda.device(i)` initialize it first, so a rank's
  `set_device` is seen here); else 0, the current device of every thread that nobody set (CUDA_VISIBLE_DEVICES
  renumbers for the whole process, so both threads agree).
- An error of the init (no GPU, a CPU-only torch, a forked process) is raised by `wait`, the same exception object
  the thread caught, at the point where the loader's first copy would have raised it before.
- The thread is not a daemon: a daemon thread still inside CUDA init when the interpreter exits would be killed
  inside C++ (SIGABRT). A loader that fails first (a checkpoint error) does not wait for it: its error comes at
  once, and the process exits after the thread ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


def _init_cuda(device: torch.device) -> None:
    torch.empty(1, device=device)  # lazy init + the device's context (its first allocation); no kernel launched


# device type -> what starts it; a device type not listed (cpu, meta) needs nothing
STARTERS: dict[str, Callable[[torch.device], None]] = {"cuda": _init_cuda}


def resolve(device: str | torch.device) -> torch.device:
    """`device` with its index, as the calling thread would resolve it (module docstring)."""
    device = torch.device(device)
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_initialized() else 0)


class DeviceInit:
    """Starts `device` on a thread when made (nothing for a device type without a starter); `wait()` joins it and
    raises its error."""

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        start = STARTERS.get(self.device.type)
        if start is not None:
            self.device = resolve(self.device)
            self._thread = threading.Thread(target=self._run, args=(start,), name=f"mtp-init-{self.device}",
                                            daemon=False)
            self._thread.start()

    def _run(self, start: Callable[[torch.device], None]) -> None:
        try:
            start(self.device)
        except BaseException as e:  # noqa: BLE001  (raised again by wait, in the loader's thread)
            self._error = e

    def wait(self) -> None:
        """Block until the device is started; raise what starting it raised. Cheap after the first call."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error
