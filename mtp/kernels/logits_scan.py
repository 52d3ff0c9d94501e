"""One pass over a step's logits: the argmax per row and the health flag, in one launch over many programs (Triton).

Reference: `logits_scan_ref` (torch.argmax and `unhealthy_ref`, plain PyTorch). Shape legend: R rows (1..4 a chain
step's verify or draft, up to a few hundred a tree's nodes), V vocabulary (129280 for DeepSeek-V3.2), C chunks of a
row, CHUNK elements each.

Why (measured on one H200, a simulated TP=8 rank's eagle k = 3 step, `mtp-bench --tp 8 --profile`, session 19):
torch.argmax over one 129280-wide fp32 row took 27.8 us (4 calls a step: the strict verify's and the 3 greedy
drafts'), and the health check (`mtp.decode.health.logits_nonfinite`: isfinite().all(), amax == amin per row) ~35 us
in 5-6 launches, ~150 us of an 8.9 ms step for ~0.5 MB a row (0.1-0.5 us of HBM time): torch's reduction runs a few
rows on one or a few blocks. Here a row is split into C chunks of CHUNK elements (1024 by default: 127 programs for
one row at V = 129280, about one per SM of an H100 / H200), each loaded at once; a program reduces its chunk to its
largest value with its first index, its smallest value and whether it holds a NaN, stores them, and the last program
of the row to arrive (an atomic counter per row, re-armed by that program: CUDA-graph safe) combines the C partials
in one load: the row's argmax and, with a flag, its health. Exact and order-free (a max, a min and the lowest index
are the same in any order), so deterministic.
Predicted (H200; to be measured by `python -m mtp.bench.small_kernels --only logits`): ~4-6 us per call at R = 1..4
(a DRAM round trip for the chunk, one for the counter, one for the partials, and the launch), against torch's
27.8 us argmax and ~35 us flag; an eagle k = 3 step ~150 -> ~20 us (the verify's argmax and flag in one launch, 3
draft argmaxes), a plain step ~60 -> ~5 us. Measured (H200, session 19, BENCHMARKS.md): argmax + flag 80.3 -> 4.6 us
at one row, 75.7 -> 5.4 at four, 142.8 -> 21.3 at 64; the eagle k = 3 step 8.821 -> 8.694 ms GPU, the plain step
4.973 -> 4.886.

The rules, those of torch:
- argmax: the first index of the row's maximum; a NaN counts as larger than everything (torch.argmax returns the first
  NaN's index); -inf rows give 0, ties the lower index, across chunk boundaries too.
- the flag (`unhealthy_ref`, the old `logits_nonfinite`): set when any logit is non-finite or some row's values are
  all equal (amax == amin). A row with a NaN has amax = amin = NaN, which compares unequal, but it is non-finite: the
  flag is set either way, so the kernel sets it for any NaN, any +-inf, or a NaN-free row whose max equals its min.
  The flag is only ever or-ed (stored when set): a clean scan leaves it as it was.
"""

from __future__ import annotations

import torch

from mtp.kernels._triton import require, tl, triton
from mtp.kernels.fp8_gemm import _COUNTER_SLOTS, _counters

__all__ = ["logits_scan", "logits_scan_ref", "unhealthy_ref", "collapsed", "scan_takes", "DTYPES", "CHUNK",
           "MAX_ROWS"]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # read as they are, compared in fp32 (exact for all three)
CHUNK = 1024  # elements per program: 127 programs for one row of 129280 (one per SM), 8 fp32 per thread at 4 warps
MAX_CHUNKS = 1024  # the last program's combine loads at most this many partials at once (V up to ~1M at CHUNK)
MAX_ROWS = min(_COUNTER_SLOTS // 4, 65535)  # one counter per row; the grid's second dimension


def collapsed(x: torch.Tensor) -> torch.Tensor:
    """Per vector (last dim): every value equal (a state collapsed to zero, logits that rank nothing)."""
    return x.amax(-1) == x.amin(-1)


def unhealthy_ref(logits: torch.Tensor) -> torch.Tensor:
    """0-d bool: some logit is non-finite, or some row's logits are all equal (`mtp.decode.health`'s check)."""
    return ~torch.isfinite(logits).all() | collapsed(logits).any()


def logits_scan_ref(logits: torch.Tensor, flag: torch.Tensor | None = None, argmax: bool = True) -> torch.Tensor | None:
    """Plain PyTorch: with `flag`, flag |= `unhealthy_ref(logits)` (in place); then torch.argmax(logits, -1) when
    `argmax` (else None). The old path's ops, in its order (the flag after the forward, then the verifier's argmax)."""
    if flag is not None:
        flag.logical_or_(unhealthy_ref(logits))
    return logits.argmax(dim=-1) if argmax else None


@triton.jit
def _scan_kernel(x_ptr, hi_ptr, lo_ptr, first_ptr, cnt_ptr, out_ptr, flag_ptr, V, n_chunks, stride_r,
                 CHUNK: tl.constexpr, CPAD: tl.constexpr, ARGMAX: tl.constexpr, FLAG: tl.constexpr):
    c = tl.program_id(0)
    r = tl.program_id(1)
    none = 2147483647  # above every index: a lane that holds no candidate
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < V
    x = tl.load(x_ptr + r.to(tl.int64) * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    # this chunk: its largest value and that value's first index, a NaN counting as the largest (torch's rule), and
    # its smallest value; NaNs are kept out of the max and the min (their order is no IEEE comparison)
    nan = mask & (x != x)
    num = mask & (x == x)
    has_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    xm = tl.where(num, x, float("-inf"))
    hi = tl.max(xm, axis=0)
    lo = tl.min(tl.where(num, x, float("inf")), axis=0)
    pick = tl.where(has_nan, nan, num & (xm == hi))
    part = r * n_chunks + c
    if ARGMAX:
        tl.store(first_ptr + part, tl.min(tl.where(pick, offs, none), axis=0))
    tl.store(hi_ptr + part, tl.where(has_nan, float("nan"), hi))
    tl.store(lo_ptr + part, lo)
    # the last program of the row to arrive combines the row's partials (the others' stores are visible to it: the
    # barrier orders them before this program's release, its acquire after every other's)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + r, 1, sem="acq_rel", scope="gpu")
    if arrived == n_chunks - 1:
        k = tl.arange(0, CPAD)
        km = k < n_chunks
        his = tl.load(hi_ptr + r * n_chunks + k, mask=km, other=float("-inf"), cache_modifier=".cg")
        nans = km & (his != his)
        any_nan = tl.max(nans.to(tl.int32), axis=0) > 0
        hv = tl.where(nans, float("-inf"), his)
        top = tl.max(hv, axis=0)
        if ARGMAX:  # chunks lie in index order, each partial its chunk's first: the lowest among the winners is the row's
            firsts = tl.load(first_ptr + r * n_chunks + k, mask=km, other=none, cache_modifier=".cg")
            win = tl.where(any_nan, nans, km & (hv == top))
            tl.store(out_ptr + r, tl.min(tl.where(win, firsts, none), axis=0).to(tl.int64))
        if FLAG:
            low = tl.min(tl.load(lo_ptr + r * n_chunks + k, mask=km, other=float("inf"), cache_modifier=".cg"), axis=0)
            bad = any_nan | (top == float("inf")) | (low == float("-inf")) | (top == low)
            tl.store(flag_ptr, tl.full((), 1, tl.uint8), mask=bad)
        tl.atomic_xchg(cnt_ptr + r, 0, sem="relaxed", scope="gpu")


def scan_chunk(V: int) -> int:
    """Elements per program: CHUNK, doubled while a row would have more than MAX_CHUNKS chunks."""
    chunk = CHUNK
    while triton.cdiv(V, chunk) > MAX_CHUNKS:
        chunk *= 2
    return chunk


def scan_takes(logits: torch.Tensor) -> bool:
    """Whether `logits_scan` takes these logits: a dtype of DTYPES, a non-empty last dim, at most MAX_ROWS rows."""
    V = logits.shape[-1] if logits.dim() else 0
    return logits.dtype in DTYPES and V > 0 and logits.numel() // V <= MAX_ROWS


def logits_scan(logits: torch.Tensor, flag: torch.Tensor | None = None, argmax: bool = True,
                chunk: int | None = None) -> torch.Tensor | None:
    """`logits_scan_ref` in one launch: logits [..., V] (fp32 / bf16 / fp16, the last dim contiguous; rows of any
    stride are read in place when they form one 2-D view), returns torch.argmax(logits, -1) (int64 [...]) when
    `argmax` (else None) and, with `flag` (one bool element on the logits' device), or-s the health check into it.
    chunk: elements per program (default `scan_chunk`; tests take small ones to put many chunk boundaries in a short
    row); a power of two."""
    require(logits, "logits_scan")
    if not scan_takes(logits):
        raise ValueError(f"logits_scan: takes logits [..., V] in {[str(d) for d in DTYPES]} with V > 0 and at most "
                         f"{MAX_ROWS} rows, got {logits.dtype} {list(logits.shape)}")
    if flag is not None and (flag.dtype != torch.bool or flag.numel() != 1 or flag.device != logits.device):
        raise ValueError(f"logits_scan: flag must be one bool element on {logits.device}, got {flag.dtype} "
                         f"{list(flag.shape)} on {flag.device}")
    V = logits.shape[-1]
    x = logits.reshape(-1, V)  # a view where the rows have one stride; a copy otherwise
    if x.stride(-1) != 1:
        x = x.contiguous()
    R = x.shape[0]
    out = torch.empty(R, dtype=torch.long, device=x.device) if argmax else None
    if R == 0 or not (argmax or flag is not None):
        return None if out is None else out.reshape(logits.shape[:-1])
    chunk = chunk or scan_chunk(V)
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"logits_scan: chunk must be a power of two, got {chunk}")
    C = triton.cdiv(V, chunk)
    hi = torch.empty(2, R, C, dtype=torch.float32, device=x.device)  # each chunk's max (NaN: holds a NaN) and min
    first = torch.empty(R, C, dtype=torch.int32, device=x.device) if argmax else hi
    flag_u8 = flag.view(torch.uint8) if flag is not None else hi
    _scan_kernel[(C, R)](x, hi[0], hi[1], first, _counters(x.device, R), out if argmax else hi, flag_u8, V, C,
                         x.stride(0), CHUNK=chunk, CPAD=triton.next_power_of_2(C), ARGMAX=argmax,
                         FLAG=flag is not None, num_warps=max(1, min(8, chunk // 256)))
    return None if out is None else out.reshape(logits.shape[:-1])
