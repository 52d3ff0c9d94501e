"""The side-stream L2 prefetch kernel (`mtp.kernels.l2_prefetch`) on the CPU.

- `program_units`, the kernel's partition in plain Python: every line of a span in exactly one unit of one program,
  none past its end, whole groups but a span's last unit.
- `line_spans`: each tensor's bytes widened to whole 128-byte lines; empty tensors skipped, strided ones refused.
- Compiled for sm_90 (triton's own ptxas, no GPU), each hint (line / bulk, evict_normal / evict_last): its request
  is there, predicated, and the kernel neither loads nor stores global memory.
- Under the interpreter (requests recorded: `tests.interp.patch_interpreter_l2`): a call's requests are exactly
  `program_units`' units of every tensor's span, in ceil(spans / MAX_SPANS) launches, none for no bytes.
On a GPU (launches, capture on a forked side stream, replays): tests/kernels/test_l2_prefetch_gpu.py.
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`

from mtp.kernels.l2_prefetch import (BLOCK, BULK_BLOCK, BULK_LINES, LINE, MAX_SPANS, line_spans,  # noqa: E402
                                     program_units)
from tests.interp import run_interpreted  # noqa: E402


@pytest.mark.parametrize("lines,programs,group,block", [(1, 1, 1, 512), (2345, 3, 1, 512), (2345, 32, 1, 512),
                                                        (100, 7, 32, 4), (32 * 5, 2, 32, 2), (33, 40, 32, 128),
                                                        (70000, 32, 32, 128), (513, 1, 1, 512)])
def test_program_units_cover_each_line_once(lines, programs, group, block):
    units = program_units(lines, programs, group, block)
    assert len(units) == programs
    seen = Counter(line for per in units for first, n in per for line in range(first, first + n))
    assert sorted(seen) == list(range(lines)), "every line of the span, none past its end"
    assert set(seen.values()) == {1}, "each line in one unit of one program"
    flat = sorted(u for per in units for u in per)
    assert all(n == group for first, n in flat[:-1]) and 1 <= flat[-1][1] <= group, "whole groups but the last"
    assert all(first % group == 0 for first, _ in flat)


def expected_requests(tensors, programs: int, bulk: bool) -> Counter:
    """(address, bytes) of every request `l2_prefetch(tensors, programs, bulk=bulk)` must make: `program_units` of
    each span (the kernel's partition), one line (128 bytes) or one bulk unit each."""
    G, blk = (BULK_LINES, BULK_BLOCK) if bulk else (1, BLOCK)
    want = Counter()
    for start, lines in line_spans(tensors):
        for per in program_units(lines, programs, G, blk):
            want.update((start + first * LINE, n * LINE if bulk else LINE) for first, n in per)
    return want


def test_line_spans_widen_each_tensor_to_whole_lines():
    w = torch.zeros(1000, 300, dtype=torch.uint8)
    inner = w[3:5, 10:]  # strided
    view = w[3:5]  # starts 900 bytes in: inside a line
    one = torch.zeros(7)
    spans = line_spans([w, view, torch.zeros(0), one])
    assert len(spans) == 3, "the empty tensor has no span"
    for (start, lines), t in zip(spans, (w, view, one)):
        a, n = t.data_ptr(), t.numel() * t.element_size()
        assert start % LINE == 0 and start <= a < start + LINE, "starts at the line holding the first byte"
        assert start + (lines - 1) * LINE < a + n <= start + lines * LINE, "ends with the line holding the last byte"
    with pytest.raises(ValueError, match=r"l2_prefetch: tensor 1 \(\[2, 290\], torch.uint8, strides \(300, 1\)\) "
                                         r"must be contiguous"):
        line_spans([w, inner])


@pytest.mark.parametrize("bulk,evict_last,op", [
    (False, False, r"@p prefetch\.global\.L2 \["), (False, True, r"@p prefetch\.global\.L2::evict_last \["),
    (True, False, r"@p cp\.async\.bulk\.prefetch\.L2\.global \["),
    (True, True, r"createpolicy\.fractional\.L2::evict_last\.b64 .*@p cp\.async\.bulk\.prefetch\.L2\.global\."
                 r"L2::cache_hint \[")])
def test_compiles_for_hopper(bulk, evict_last, op):
    """Each hint assembles for sm_90 (ptxas: a cubin comes back), predicated, with no global load or store."""
    pytest.importorskip("triton")
    from mtp.kernels.l2_prefetch import _l2_prefetch_kernel

    from .test_fused_kernels import _compile_for_hopper

    G, blk = (BULK_LINES, BULK_BLOCK) if bulk else (1, BLOCK)
    k = _compile_for_hopper(_l2_prefetch_kernel, dict(starts=("i64", "i64"), ends=("i64", "i64")),
                            dict(N=2, G=G, BLK=blk, EVICT_LAST=evict_last, BULK=bulk), num_warps=4)
    ptx = k.asm["ptx"]
    assert k.asm["cubin"] and re.search(op, ptx), f"no {op} in the PTX"
    assert not re.search(r"\b(ld|st|atom|red)\.global", ptx), "the kernel touches memory besides its requests"


def test_l2_prefetch_interpreted():
    run_interpreted(__file__, 120)


def _interpreted_checks() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    from mtp.kernels.l2_prefetch import l2_prefetch
    from tests.interp import L2_REQUESTS, patch_interpreter_l2, patch_interpreter_loop_bounds

    patch_interpreter_loop_bounds()
    patch_interpreter_l2()
    launches = []
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    InterpretedFunction.run = counted
    w8 = torch.zeros(1000, 300, dtype=torch.uint8)  # 300,000 bytes: 2344 lines and 48 bytes
    scales = torch.zeros(9, 56)  # 2016 bytes
    tensors = [w8, w8[3:5], scales[2:4], torch.zeros(0), torch.zeros(5, 129, dtype=torch.bfloat16), torch.zeros(7)]
    bulk_op = "cp.async.bulk.prefetch.L2.global"
    ops = {(False, False): "prefetch.global.L2", (False, True): "prefetch.global.L2::evict_last",
           (True, False): bulk_op, (True, True): f"{bulk_op}.L2::cache_hint"}
    for programs in (1, 3, 7):
        for bulk in (False, True):
            for evict_last in (False, True):
                L2_REQUESTS.clear()
                launches.clear()
                l2_prefetch(tensors, programs=programs, evict_last=evict_last, bulk=bulk)
                got = Counter((int(a), int(n)) for _, addr, nb in L2_REQUESTS for a, n in zip(addr, nb))
                assert got == expected_requests(tensors, programs, bulk), (programs, bulk, evict_last)
                assert {op for op, _, _ in L2_REQUESTS} == {ops[bulk, evict_last]}, (bulk, evict_last)
                assert launches == ["_l2_prefetch_kernel"], launches
    many = [torch.zeros(3 + i, dtype=torch.float32) for i in range(MAX_SPANS + 2)]
    L2_REQUESTS.clear()
    launches.clear()
    l2_prefetch(many, programs=2)
    assert len(launches) == 2, f"{MAX_SPANS + 2} spans: 2 launches, got {launches}"
    assert Counter((int(a), int(n)) for _, addr, nb in L2_REQUESTS for a, n in zip(addr, nb)) == \
        expected_requests(many, 2, False)
    launches.clear()
    l2_prefetch([])
    l2_prefetch([torch.zeros(0)])
    assert not launches, "no bytes: no launch"


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    _interpreted_checks()
    print("interpreted checks ok")
