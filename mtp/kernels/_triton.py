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
    compute capability >= 9 (the interpreter and older GPUs run the kernel without it: its PDL branch is off).
    A kernel launched with it takes `PDL=pdl_mode(pdl, launch)` and follows the contract of `pdl_launch` /
    `pdl_wait`."""
    if not pdl or not t.is_cuda or torch.cuda.get_device_capability(t.device)[0] < 9:
        return {}
    return {"launch_pdl": True}


# The PDL contract every kernel of the decode step keeps when launched with `pdl_kwargs` (switch
# `FastPathOptions.pdl`). A kernel starts early only if the one before it let it (`launch_dependents`, or that
# kernel's end), so each calls `pdl_launch` first: the next launch then overlaps this one's whole run, not only
# its tail. Before `pdl_wait` a kernel reads only what no kernel of the step writes (weights, scales, constant
# tables; or asks L2 for them, `prefetch_l2`), and stores nothing: the previous kernel may still be reading a
# buffer this one writes (a freed and re-used allocation, a re-armed counter). Every program waits (before its
# first read of an earlier kernel's output and its first store or atomic), so no grid completes before the one
# it follows: completion is transitive along the chain, and a kernel may read what any earlier kernel wrote.
#
# Where the trigger goes is the kernel's PDL constexpr (`pdl_mode`): PDL_EARLY (1) at the kernel's start, as above;
# PDL_AFTER_WAIT (2) right after its own wait. Early, a successor may launch while this kernel still waits for its
# predecessor, and so may the successor's successor: a chain of launched grids can sit in their waits at once,
# holding SM slots and issuing their weight prefetches while one kernel works. After the wait, at most the running
# kernel and the next one are resident (the next launches only once this one's predecessor has finished). Either
# is correct: a trigger only allows the launch; the successor's own wait still waits for this grid to complete.
PDL_EARLY = 1
PDL_AFTER_WAIT = 2


def pdl_mode(pdl, launch: dict) -> int:
    """A kernel's PDL constexpr: 0 when launched without PDL (`launch` = `pdl_kwargs`'s empty dict), else
    PDL_AFTER_WAIT where the caller asked for it (pdl == PDL_AFTER_WAIT, `FastPathOptions.pdl_at`), else PDL_EARLY."""
    if not launch:
        return 0
    return PDL_AFTER_WAIT if pdl == PDL_AFTER_WAIT else PDL_EARLY


@triton.jit
def pdl_launch(PDL: tl.constexpr):
    """Let the next kernel in the stream launch now (`griddepcontrol.launch_dependents`) under PDL_EARLY;
    nothing without PDL or under PDL_AFTER_WAIT (`pdl_wait` triggers then)."""
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the previous kernel in the stream has finished and its writes are visible
    (`griddepcontrol.wait`), then under PDL_AFTER_WAIT let the next kernel launch; nothing without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        if PDL == 2:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte line holding each pointer (`prefetch.global.L2`, sm_70+): a hint with no result, so
    a later load of the same bytes reads what it would have read (bit-identical), only sooner. For constant
    weights a kernel reads after `pdl_wait` in a loop, requested while the previous kernel still runs. One
    instruction per element: give one pointer per line. Each caller guards it with a constexpr (PREFETCH, absorb's
    PF) that `FastPathOptions.prefetch_at` turns off, so that PDL can be timed without the prefetches."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def prefetch_rows_l2(rows, n, LINE: tl.constexpr):
    """`prefetch_l2` of the n elements from each pointer of `rows` (a tensor of row starts; n a number or a
    constexpr), one pointer per LINE elements (`line_elems`: 128 bytes), none past them: n / LINE instructions
    per row."""
    for i in range(0, n, LINE):
        prefetch_l2(rows + i)


@triton.jit
def prefetch_span_l2(base, n, LINE: tl.constexpr, BLOCK: tl.constexpr):
    """This program's share of n contiguous elements from `base` asked of L2 (`prefetch_l2`): the grid's programs
    take equal runs of its lines (LINE elements each), BLOCK lines per instruction. For a constant every program of
    the kernel will want some of, whoever reads it (the shared expert's weights in the experts' kernels)."""
    pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    lines = tl.cdiv(n, LINE)
    per = tl.cdiv(lines, tl.num_programs(0) * tl.num_programs(1))
    l0 = pid * per
    l1 = tl.minimum(l0 + per, lines)
    for j in range(l0, l1, BLOCK):
        line = j + tl.arange(0, BLOCK)
        prefetch_l2(base + tl.where(line < l1, line, j).to(tl.int64) * LINE)


def asm_ok(t: torch.Tensor) -> bool:
    """Whether kernels on `t` may run inline PTX outside PDL (`prefetch_l2`): on a CUDA device. The interpreter runs
    none; tests that make it a no-op there (`tests.interp.patch_interpreter_pdl`) grant this too."""
    return t.is_cuda


def line_elems(t: torch.Tensor) -> int:
    """Elements of `t` in one 128-byte cache line (`prefetch_rows_l2`' LINE)."""
    return max(1, 128 // t.element_size())


def device_lens(seq_lens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Row lengths as a kernel reads them (`tl.load(...).to(tl.int32)`): the cache's int64 [B] tensor as it is
    when it already lives on the device contiguously (no cast launch per layer), else an int32 copy."""
    if seq_lens.device == torch.device(device) and seq_lens.dtype in (torch.int32, torch.int64) \
            and seq_lens.is_contiguous():
        return seq_lens
    return seq_lens.to(device=device, dtype=torch.int32).contiguous()
