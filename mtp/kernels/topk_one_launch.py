"""The indexer's radix top-k in one launch: `topk.radix_topk`'s three phases in one cooperative grid.

Shape legend: B batch rows, T queries per row, S scored positions, R = B * T score rows, C chunks of a row
(one program each, TILE positions), k the number kept (2048).

Why: `radix_topk` runs its phases (histogram, split, write; read `mtp.kernels.topk`'s docstring) as three launches
over R x C programs, ~22-27 us at S = 32768 on an H200 where the work is a few microseconds: each launch boundary
in a CUDA graph costs ~3-5 us (launch gap, DRAM ramp, tail). Here one launch runs all three; between the phases the
C programs of a row meet at a barrier in global memory, and each program keeps its chunk's keys in registers from
the first phase to the last (one read of the scores instead of three).

What makes the barriers safe:
- every program of the grid is resident at once: the grid is R x C <= the SM count (one program per SM at most, so
  the launch fits whatever the kernel's registers), launched cooperatively (`launch_cooperative_grid`: the driver
  runs the whole grid at once or fails the launch, never a partial grid spinning on absent programs). Which shapes
  take it is decided on the host from the shapes and the SM count only (`one_launch_grid`); others, and chunks
  too long to hold in registers, fall back to `radix_topk`'s three launches;
- a barrier is one arrival counter per row in the workspace (its `arrive` word): a program arrives (`_arrive`: a
  CTA barrier, its threads' writes done, then a release add) and waits (`_wait`: a spin on an acquire load of the
  counter) until every program of the row has arrived; what other programs wrote is then read past L1 (.cg). The counter
  only grows during a call: arrivals after the histogram (C), after the split (C, the last of which finds the
  threshold, `topk._finish_row`, then publishes it: + 1), after the write (C, with `rearm`: the last to leave zeroes
  the counter, so the kept workspace needs no memset for the next call; the histograms and the candidate count are
  zeroed in the write phase, after the split's barrier, when nothing reads them any more).
Under the Triton interpreter (CPU tests) programs run one after another and a spinning program would wait for ever:
there the same kernel runs as three launches, one per phase (constexpr PHASE 1, 2, 3: the chunk's keys are read
again in each, and no program waits), the three-launch structure of `radix_topk` on the same phase functions
(`topk._row_prefix`, `_split_block`, `_finish_row`, `_write_block`, `_zero_row`); PHASE 0, the one launch with
its barriers, is only compiled for GPUs (`split_phases` forces the phased launches there too, for tests).
Outputs are `topk_select_ref`'s bit for bit, as `radix_topk`'s: one kept set and one order (positions ascending,
then -1) whatever the chunking.
"""

from __future__ import annotations

import torch

from mtp.kernels._triton import device_lens, interpreting, tl, triton
from mtp.kernels.topk import (HIST, SMALL, _finish_row, _row_keys, _row_prefix, _split_block, _write_block, _zero_row,
                              add_to_histograms, check_topk_args, drop_kept_workspace, histograms, kept_workspace,
                              radix_topk, sm_count, topk_workspace)

__all__ = ["MAX_TILE", "MIN_TILE", "launch_phases", "one_launch_grid", "phase_buffers", "radix_topk_one_launch"]

MIN_TILE = 1024  # positions per program at least (default chunking): as `radix_topk`'s default block
MAX_TILE = 8192  # at most (16 warps, 16 keys a thread kept in registers); longer chunks take the three launches


def one_launch_grid(rows: int, S: int, sms: int, chunks: int | None = None) -> tuple[int, int] | None:
    """(TILE, C): positions per program and programs per row of the one-launch kernel, or None where it cannot run
    (R x C would exceed the SMs, or a chunk would exceed MAX_TILE): the caller then takes `radix_topk`. chunks: the
    programs per row wanted (rounded so that the tile is a power of two); default: as many as the SMs allow over
    the rows, MIN_TILE positions each at least. A host decision from shapes and the SM count only."""
    if rows < 1 or S < 1 or rows > sms:
        return None
    want = chunks if chunks is not None else sms // rows
    tile = triton.next_power_of_2(triton.cdiv(S, max(1, want)))
    if chunks is None:
        tile = max(tile, MIN_TILE)
    tile = max(64, min(tile, triton.next_power_of_2(S)))
    C = triton.cdiv(S, tile)
    if tile > MAX_TILE or rows * C > sms:
        return None
    return tile, C


def default_warps(tile: int) -> int:
    """Warps of a program holding `tile` keys: 4 up to 1024 keys, then 8 keys a thread or more, 16 warps at most."""
    return max(4, min(16, tile // 256))


@triton.jit
def _arrive(cnt_ptr):
    """Arrive at a row's barrier: a CTA barrier first (every thread's writes done), then one release add."""
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _wait(cnt_ptr, target):
    """Wait until the row's counter reaches `target`: a spin on an acquire load (Triton issues a scalar atomic from
    one thread and broadcasts its value through shared memory after a CTA barrier: every thread leaves together)."""
    while tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu") < target:
        pass


@triton.jit
def _topk_one_launch_kernel(sc_ptr, lens_ptr, h16_ptr, h8_ptr, ncand_ptr, arrive_ptr, ck_ptr, ci_ptr, gt_ptr,
                            off_ptr, thr_ptr, out_ptr, S, T, C, K, TILE: tl.constexpr, HIST: tl.constexpr,
                            PHASE: tl.constexpr, REARM: tl.constexpr, NB: tl.constexpr, CPAD: tl.constexpr,
                            KB: tl.constexpr, SMALL: tl.constexpr, V2: tl.constexpr):
    """Program (r, c): positions c * TILE .. of row r. PHASE 0: histogram, barrier, split, barrier, write, in one
    launch (GPU only: co-resident grid); 1, 2, 3: that phase alone (the interpreter's launches). HIST off: the
    scores kernel filled the histograms (`indexer_scores(hist=)`), no histogram phase and no first barrier. V2: as
    `topk._topk_split_kernel`'s (the keys are in registers before the prefix here anyway)."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    r64 = r.to(tl.int64)
    pos = c * TILE + tl.arange(0, TILE)
    key, valid = _row_keys(sc_ptr, lens_ptr, r, pos, S, T, V2)  # PHASE 0: in registers until the write
    cnt = arrive_ptr + r
    base = C if HIST else 0  # arrivals of the histogram phase
    if HIST and PHASE <= 1:
        h8 = add_to_histograms(h16_ptr + r64 * 65536, key, valid)
        bins = tl.arange(0, 256)
        tl.atomic_add(h8_ptr + r * 256 + bins, h8, mask=h8 > 0, sem="relaxed")
        _arrive(cnt)
        if PHASE == 0:  # (a phase of its own: the next launch starts after this one)
            _wait(cnt, C)
    ck = ck_ptr + r64 * S
    ci = ci_ptr + r64 * S
    if PHASE == 0 or PHASE == 2:
        P, above, n_valid = _row_prefix(h16_ptr, h8_ptr, r, K)
        n_gt = _split_block(key, valid, pos, P, ncand_ptr + r, ck, ci)
        tl.store(gt_ptr + r * C + c, n_gt)
        tl.debug_barrier()
        if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == base + C - 1:
            _finish_row(r, n_valid, above, P, ncand_ptr, ck, ci, gt_ptr, off_ptr, thr_ptr, out_ptr, sc_ptr, lens_ptr,
                        S, T, TILE, C, K, NB, CPAD, KB, SMALL, V2)
            _arrive(cnt)  # the threshold and the offsets are out
        if PHASE == 0:
            _wait(cnt, base + C + 1)
    if PHASE == 0 or PHASE == 3:
        tk = tl.load(thr_ptr + r * 2, cache_modifier=".cg")
        ts = tl.load(thr_ptr + r * 2 + 1, cache_modifier=".cg")
        o = tl.load(off_ptr + r * C + c, cache_modifier=".cg")
        if PHASE == 3:  # a launch of its own: the keys again
            key, valid = _row_keys(sc_ptr, lens_ptr, r, pos, S, T, V2)
        _write_block(key, valid, pos, tk, ts, out_ptr + r64 * K, o)
        if REARM:  # every program of the row is past the split: nothing reads the histograms or the candidates
            _zero_row(h16_ptr, h8_ptr, ncand_ptr, r, c, C)
            if tl.atomic_add(cnt, 1, sem="relaxed", scope="gpu") == base + 2 * C:  # the last to leave
                tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")


def phase_buffers(ws: torch.Tensor, R: int, S: int, C: int) -> tuple:
    """The buffers the top-k's phases share, for R rows of S keys in C chunks: the row histograms, candidate counts
    and barrier words (views of the workspace `ws`), the last stage's candidate keys and positions [R, S], and per
    chunk its count above the prefix and its output offset, then each row's threshold (Tk, Ts)."""
    h16, h8 = histograms(ws, R)
    ncand, arrive = ws[R * (HIST + 256):R * (HIST + 257)], ws[R * (HIST + 257):]
    ck = torch.empty(R, S, dtype=torch.int32, device=ws.device)
    ci = torch.empty(R, S, dtype=torch.int32, device=ws.device)
    small = torch.empty(R * (2 * C + 2), dtype=torch.int32, device=ws.device)
    return h16, h8, ncand, arrive, ck, ci, small[:R * C], small[R * C:2 * R * C], small[2 * R * C:]


def launch_phases(kernel, grid, args, meta: dict, phases, split: bool, ws: torch.Tensor, rearm: bool) -> None:
    """`kernel` as one launch per phase of `phases` (split: the interpreter, or a forced check) or as one
    cooperative launch (PHASE 0: every phase, barriers between); a kept workspace is dropped when anything stops
    the launches (between them it may hold counts, which the next call must not inherit)."""
    try:
        if split:
            for phase in phases:
                kernel[grid](*args, PHASE=phase, **meta)
        else:
            kernel[grid](*args, PHASE=0, launch_cooperative_grid=True, **meta)
    except BaseException:
        if rearm:
            drop_kept_workspace(ws)
        raise


def radix_topk_one_launch(scores_BTS: torch.Tensor, seq_lens_B: torch.Tensor, k: int, chunks: int | None = None,
                          workspace: torch.Tensor | None = None, rearm: bool = False,
                          split_phases: bool | None = None, num_warps: int | None = None,
                          split_v2: bool = True) -> torch.Tensor:
    """`radix_topk` in one launch where the grid fits (`one_launch_grid`), else `radix_topk` itself (three
    launches): the same [B, T, k] int32 kept positions (ascending, then -1), `topk_select_ref`'s bit for bit.

    chunks: programs per row (default: as many as the SMs allow, at least MIN_TILE positions each). workspace: one
    whose histograms the scores kernel already filled (`indexer_scores(hist=)`): no histogram phase. rearm: the
    kept workspace (`topk.kept_workspace`, taken here when workspace is None), left zeroed for the next call; off,
    a fresh `topk_workspace` unless given (one memset). split_phases: run the phases as three launches of the same
    kernel (default: only under the Triton interpreter, where the barriers would never open). num_warps: default
    by the tile (`default_warps`). split_v2: as `radix_topk`'s."""
    B, T, S = check_topk_args("radix_topk_one_launch", scores_BTS, seq_lens_B, k, workspace)
    dev = scores_BTS.device
    R = B * T
    grid_plan = one_launch_grid(R, S, sm_count(dev), chunks)
    if grid_plan is None:
        return radix_topk(scores_BTS, seq_lens_B, k, chunks=chunks, workspace=workspace, rearm=rearm,
                          split_v2=split_v2)
    tile, C = grid_plan
    split = interpreting() if split_phases is None else split_phases
    if interpreting() and not split:
        raise ValueError("radix_topk_one_launch: split_phases=False under the Triton interpreter, which runs programs "
                         "one after another: the first program would wait at its row's barrier for ever")
    sc = scores_BTS.contiguous()
    lens = device_lens(seq_lens_B, dev)
    filled = workspace is not None
    if workspace is None:
        workspace = kept_workspace(R, dev) if rearm else topk_workspace(R, dev)
    out = torch.empty(B, T, k, dtype=torch.int32, device=dev)
    args = (sc, lens, *phase_buffers(workspace, R, S, C), out, S, T, C, k)
    meta = dict(TILE=tile, HIST=not filled, REARM=rearm, NB=1024, CPAD=max(32, triton.next_power_of_2(C)), KB=1024,
                SMALL=SMALL, V2=split_v2, num_warps=num_warps or default_warps(tile))
    launch_phases(_topk_one_launch_kernel, (R, C), args, meta, (1, 2, 3) if not filled else (2, 3), split, workspace,
                  rearm)
    return out
