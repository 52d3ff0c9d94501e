"""Ask L2 for the bytes of a few constant tensors (weights, their scales) ahead of the kernel that will read them.

Terms: a span is one tensor's bytes widened to whole 128-byte lines, (start, lines) with start 128-aligned
(`line_spans`); a unit is the G lines one lane asks for with one instruction: G = 1 for `prefetch.global.L2` (or
its `::evict_last` form), G = BULK_LINES for `cp.async.bulk.prefetch.L2` (sm_90, one bulk request of up to 4 KB;
with evict_last its `L2::cache_hint` carries an evict_last policy). A launch (`l2_prefetch`) takes up to MAX_SPANS
spans; its `programs` programs (tens, not hundreds: it runs beside the decode chain and must not take its SMs) each
take a strided share of every span's units, BLOCK of them per instruction (`program_units` is the same partition in
plain Python). Nothing is loaded into registers and nothing is written: a prefetch is a hint, so what the later
kernels compute is bit for bit what they computed without it, only their loads may find the lines in L2.

Why (issue 25, one TP=8 'split' rank of DeepSeek-V3.2, H200, 1k context, w = 1, per layer): the FP8 GEMVs read
their weights in ~7.75 us at ~35-45% of HBM bandwidth (q_a | wk | kv_a 2240 x 7168 = 16.1 MB, o_proj 7168 x 2048 =
14.7 MB: ~3.5-4 us of HBM time each; q_b's 3072 rows of q_b | wq_b, 4.7 MB, where the indexer does not score, all
11264, 17.3 MB, where it does); the router reads its bf16 gate (256 x 7168 = 3.7 MB, ~0.9 us) in 9.8 us. They pay
the DRAM ramp, waves and split-K tails, while the ~30 us of small kernels before them (kv prologue, q absorb, mla
stages 1 / 2, absorb, norms, combine) leave HBM idle. The fast path (`backends.side_prefetch`, switch
`FastPathOptions.l2_prefetch`) launches this kernel on a side stream at two points of each layer: its tail (o_proj
+ scales, the router's gate, the shared expert's slot of the stacked experts: 14.7 + 3.7 + 5.5 = 23.9 MB) at the
layer's start or (`l2_prefetch_tail_late`) right after its q_b GEMV, when only small kernels run until o_proj; and
the next layer's head (q_a | wk | kv_a and q_b: 20.8 MB at 1k, 34.3 MB with wq_b and the head weights from 2k) at
the start of the MoE half.

Prediction (H200, 1k, w = 1; to be measured: `mtp-bench --tp 8 --kernel-variants l2_prefetch defaults ...`):
- a GEMV whose weight is in L2 when it starts: 14.7-16.1 MB at ~7-8 TB/s of L2 is ~2-2.3 us, plus ~1.5-2 us of
  launch, fix-up and tail: ~4-4.5 us instead of 7.75 (-3.3 us) for o_proj and q_a | wk | kv_a; q_b (4.7 MB) -1.5;
- the router: its GEMV part (~3 of its 9.8 us) to ~1.5 us, the routing tail unchanged: -1.5 us;
- the experts: the shared slot is 1/9 of their ~50 MB and not on the persistent grid's critical path: 0 to -1 us;
  the head's 20.8 MB asked while they stream theirs takes HBM time from them: +1 to +2 us;
- the side kernel itself (32 programs of 4 warps, no registers held per request) takes no SM the chain needs.
Sum, if every line survives until read: tail -3.3 - 1.5 - 0.5, head -3.3 - 1.5 + 1.5: ~-8.5 us a MoE layer, ~-0.5
ms a step over 58 MoE + 3 dense layers (5.57 -> ~5.05 ms); w = 2..4 read the same weights: similar savings.
Whether lines survive is the doubt. L2 is 50 MB (two 25 MB halves on Hopper; a line read by SMs of both halves may
be held twice), the decode kernels load with evict_normal, and between a point and its readers other weights
stream through: ~25 MB (q_a, q_b, W_kb / W_vb, the cache) between the early tail and o_proj, ~5 MB after the late
tail, ~45 MB (the routed experts) between the head and q_a. So: the late tail should keep most of its gain and the
early one a third or less; the head, without evict_last, little or a loss (+1 to +2 us of slower experts); with
evict_last (if this L2 honours the hint outside the persisting set-aside, 0 bytes unless
`cudaLimitPersistingL2CacheSize` is set) both points near the sum above.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch

from mtp.kernels._triton import interpreting, require, tl, triton

__all__ = ["l2_prefetch", "line_spans", "program_units", "LINE", "BULK_LINES", "MAX_SPANS", "PROGRAMS"]

LINE = 128  # bytes of an L2 line (what one `prefetch.global.L2` asks for)
BULK_LINES = 32  # lines of one `cp.async.bulk.prefetch.L2` (4 KB: a 16-byte multiple, as the instruction needs)
MAX_SPANS = 12  # spans per launch (the kernel unrolls its loop over them); `l2_prefetch` launches again past it
PROGRAMS = 32  # default grid: ~a quarter of an H100's / H200's 132 SMs, one block of 4 warps each
BLOCK = 512  # units per program and instruction with one line each (4 per lane at 4 warps)
BULK_BLOCK = 128  # units per program and instruction with bulk requests (1 per lane: 512 KB per program and step)


@triton.jit
def _ask_l2(addr, nbytes, EVICT_LAST: tl.constexpr, BULK: tl.constexpr):
    """One L2 request per element: the nbytes from addr (a 128-aligned int64 address), none where nbytes is 0 (the
    predicate is off: masked lanes ask for nothing). BULK: one `cp.async.bulk.prefetch.L2` of nbytes (a multiple of
    16), else one `prefetch.global.L2` of the line at addr (nbytes is only the predicate)."""
    ptr = addr.to(tl.pointer_type(tl.int8))
    if BULK:
        if EVICT_LAST:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; .reg .b64 q; setp.ne.s32 p, $2, 0; "
                "createpolicy.fractional.L2::evict_last.b64 q, 1.0; "
                "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, q; }",
                "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; }",
                "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)
    else:
        if EVICT_LAST:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; }",
                "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; }",
                "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_kernel(starts, ends, N: tl.constexpr, G: tl.constexpr, BLK: tl.constexpr,
                        EVICT_LAST: tl.constexpr, BULK: tl.constexpr):
    """Span s (of N: the lines from `starts[s]` to `ends[s]`, 128-aligned addresses, so that no value is ever
    specialized as 1 and every call of N spans runs one compiled kernel) in units of G lines: program p asks for
    units p * BLK .. + BLK, then (p + P) * BLK .., P the programs (`program_units`' partition), the last unit of a
    span clipped to its end."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    for s in tl.static_range(N):
        n = ((ends[s] - starts[s]) // 128).to(tl.int32)
        units = (n + G - 1) // G
        for b in range(pid * BLK, units, P * BLK):
            u = b + tl.arange(0, BLK)
            on = u < units
            first = tl.where(on, u, 0).to(tl.int64) * G
            cnt = tl.minimum(n - first, G)
            _ask_l2(starts[s] + first * 128, tl.where(on, cnt * 128, 0).to(tl.int32), EVICT_LAST, BULK)


def line_spans(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """(start, lines) per non-empty tensor: its bytes widened to whole 128-byte lines, start 128-aligned (a view
    that starts inside a line, e.g. one projection's scale rows of a stacked weight, asks for that whole line: a
    line holding a byte of the tensor is mapped memory). Each tensor must be contiguous (one run of bytes)."""
    out = []
    for i, t in enumerate(tensors):
        if t.numel() == 0:
            continue
        if not t.is_contiguous():
            raise ValueError(f"l2_prefetch: tensor {i} ({list(t.shape)}, {t.dtype}, strides {t.stride()}) must be "
                             f"contiguous: a span is one run of bytes")
        a = t.data_ptr()
        start = a - a % LINE
        out.append((start, (a + t.numel() * t.element_size() - start + LINE - 1) // LINE))
    return out


def program_units(lines: int, programs: int, group: int, block: int) -> list[list[tuple[int, int]]]:
    """The kernel's partition of one span in plain Python: per program, the (first line, lines) of each unit it
    asks for, in its order (units of `group` lines, `block` units per step, programs taking steps in turn, the
    last unit clipped). Every line of [0, lines) is in exactly one unit of one program."""
    units = -(-lines // group)
    out: list[list[tuple[int, int]]] = [[] for _ in range(programs)]
    for p in range(programs):
        for b in range(p * block, units, programs * block):
            out[p] += [(u * group, min(lines - u * group, group)) for u in range(b, min(b + block, units))]
    return out


def l2_prefetch(tensors: Sequence[torch.Tensor], programs: int = PROGRAMS, evict_last: bool = False,
                bulk: bool = False) -> None:
    """Ask L2 for every byte of `tensors` (constant ones: weights, scales; contiguous) on the current stream, in
    ceil(spans / MAX_SPANS) launches of `programs` programs; empty tensors are skipped, and nothing at all is
    launched for none. evict_last: the `::evict_last` hint (lines kept over evict_normal ones, if this L2 honours it);
    bulk: `cp.async.bulk.prefetch.L2` requests of BULK_LINES lines (Hopper) instead of one line per lane. The
    bytes must stay allocated until the kernel ran: weights do (a caller prefetching from another stream need not
    `record_stream` them)."""
    spans = line_spans(tensors)
    if not spans:
        return
    if isinstance(programs, bool) or not isinstance(programs, int) or programs < 1:
        raise ValueError(f"l2_prefetch: programs must be an integer >= 1, got {programs!r}")
    t0 = next(t for t in tensors if t.numel())
    for t in tensors:
        require(t, "l2_prefetch")
        if t.device != t0.device:
            raise ValueError(f"l2_prefetch: every tensor must be on {t0.device}, one is on {t.device}")
    if bulk and t0.is_cuda and torch.cuda.get_device_capability(t0.device)[0] < 9:
        raise ValueError("l2_prefetch: bulk=True needs cp.async.bulk.prefetch (sm_90+), this device is "
                         f"sm_{''.join(map(str, torch.cuda.get_device_capability(t0.device)))}")
    G, blk = (BULK_LINES, BULK_BLOCK) if bulk else (1, BLOCK)
    with torch.cuda.device(t0.device) if t0.is_cuda and not interpreting() else nullcontext():
        for i in range(0, len(spans), MAX_SPANS):
            part = spans[i:i + MAX_SPANS]
            _l2_prefetch_kernel[(programs,)](tuple(s for s, _ in part), tuple(s + n * LINE for s, n in part),
                                             N=len(part), G=G, BLK=blk, EVICT_LAST=bool(evict_last), BULK=bool(bulk),
                                             num_warps=4)

