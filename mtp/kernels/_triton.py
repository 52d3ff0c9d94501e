"""Optional Triton import: the kernels' modules import `triton` and `tl` from here.

Without Triton (CPU-only machines, CI) the names are stand-ins so that the modules still import and their
plain-PyTorch references stay usable; calling a kernel then raises. `available()` says whether the fast
path can run here: Triton importable and a CUDA device present.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only install: keep the module importable
    HAS_TRITON = False

    class _Missing:
        """Stands in for triton / triton.language: attribute access works, calling raises."""

        def __getattr__(self, name):
            return _Missing()

        def __call__(self, *args, **kwargs):
            if len(args) == 1 and callable(args[0]) and not kwargs:
                return _Unavailable(args[0].__name__)  # used as a decorator: @triton.jit
            if not args and "do_not_specialize" in kwargs:  # @triton.jit(do_not_specialize=[...])
                return lambda fn: _Unavailable(fn.__name__)
            raise RuntimeError("triton is not installed: use the reference path (mtp.kernels.available() is False)")

    class _Unavailable:
        def __init__(self, name: str):
            self.name = name

        def __getitem__(self, grid):
            raise RuntimeError(f"kernel {self.name} needs triton, which is not installed")

        def __call__(self, *args, **kwargs):
            raise RuntimeError(f"kernel {self.name} needs triton, which is not installed")

    triton = _Missing()
    tl = _Missing()


def available() -> bool:
    """True when the Triton kernels can run: triton imports and a CUDA device is visible."""
    return HAS_TRITON and torch.cuda.is_available()


def require(t: torch.Tensor, name: str) -> None:
    """Raise a clear error when a kernel is called on a tensor it cannot run on."""
    if not HAS_TRITON:
        raise RuntimeError(f"{name}: triton is not installed; use the reference function instead")
    if not t.is_cuda and not interpreting():
        raise ValueError(f"{name}: expected a CUDA tensor, got one on {t.device}")


def interpreting() -> bool:
    """Whether kernels run under the Triton interpreter (TRITON_INTERPRET=1: CPU tests)."""
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pdl_kwargs(pdl: bool, t: torch.Tensor) -> dict:
    """Launch options for programmatic dependent launch (Hopper+): the kernel may start while the previous one
    in the stream finishes, and must `gdc_wait` before touching anything that kernel writes (the fused kernels
    load only constant weights before it, and store nothing). Empty unless asked for and on a CUDA device of
    compute capability >= 9 (the interpreter and older GPUs run the kernel without it: its PDL branch is off)."""
    if not pdl or not t.is_cuda or torch.cuda.get_device_capability(t.device)[0] < 9:
        return {}
    return {"launch_pdl": True}


def device_lens(seq_lens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Row lengths as a kernel reads them (`tl.load(...).to(tl.int32)`): the cache's int64 [B] tensor as it is
    when it already lives on the device contiguously (no cast launch per layer), else an int32 copy."""
    if seq_lens.device == torch.device(device) and seq_lens.dtype in (torch.int32, torch.int64) \
            and seq_lens.is_contiguous():
        return seq_lens
    return seq_lens.to(device=device, dtype=torch.int32).contiguous()
