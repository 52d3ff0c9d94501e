"""The lightning indexer's scores and its radix top-k in one cooperative launch (switch `indexer_one_launch`).

Shape legend: B batch rows, T queries per row (<= MAX_T), H indexer heads, D head dim, S keys, R = B * T score rows,
C chunks of a batch row (one program each, TILE keys), k the number kept (2048).

Today's fastest path is two launches or more: the scores kernel (`indexer.indexer_scores`, with the top-k's
histograms in its epilogue for 'radix_fused'), then the top-k (`topk.radix_topk`: two launches more;
`topk_one_launch.radix_topk_one_launch`: one). Here program (b, c) scores its TILE keys for the T queries of batch
row b (the scores kernel's per-key code, `indexer._key_tile` + `indexer._score_query`, on the default kernel's
64-key tiles and 4 warps: the same bits), counts them into the rows' histograms, and then runs the top-k's split
and write phases for each of the T rows over the same chunk (`topk._row_prefix`, `_split_block`, `_finish_row`,
`_write_block`, `_zero_row`), meeting the row's other programs at the barriers of `topk_one_launch` (`_arrive`,
`_wait`: one counter per score row; arrivals C after the scores, C after the split + 1 when the threshold is out,
C after the write, the last of which re-arms the counter with `rearm`). A program handles the rows in one order,
and waits for a row only on arrivals every program makes before waiting at all (the scores phase) or after the
same row's split, so the barriers cannot wait on each other. The scores still go out (`indexer_topk` returns them,
and the split and write phases read them back past L1, from L2: 128 KB a row at S = 32768); the keys are read once.
Co-residency as in `topk_one_launch`: B x C <= the SM count, a cooperative launch, decided on the host from the
shapes and the SM count (`indexer_grid`); shapes that do not fit take `indexer.indexer_topk(impl='radix_fused',
one_launch=True)`. Under the Triton interpreter the phases run as three launches of the same kernel (PHASE 1
scores, 2 split, 3 write), as in `topk_one_launch`.
Outputs: `indexer.indexer_topk`'s (radix impls): the index sets of `topk_select_ref` over the scores, which are the
default scores kernel's bit for bit wherever the compiler keeps the head sum's order (held on a GPU by
tests/kernels/test_topk_one_launch_gpu.py; the interpreter computes them exactly alike).
"""

from __future__ import annotations

import torch

from mtp.kernels._triton import device_lens, interpreting, tl, triton
from mtp.kernels.indexer import SCORES_DEFAULT, _key_tile, _score_query, check_indexer_args, indexer_topk
from mtp.kernels.topk import (SMALL, _finish_row, _row_prefix, _split_block, _write_block, _zero_row,
                              kept_workspace, score_keys, sm_count, topk_workspace)
from mtp.kernels.topk_one_launch import _arrive, _wait, launch_phases, phase_buffers

__all__ = ["MAX_T", "MAX_TILE", "indexer_grid", "indexer_topk_one_launch"]

BS = SCORES_DEFAULT["block_s"]  # keys per score tile, as the default scores kernel (its bits)
WARPS = SCORES_DEFAULT["num_warps"]
MAX_T = 8  # the queries' loop unrolls (a constexpr), as the looping scores kernel's
MAX_TILE = 4096  # keys per program at most (32 a thread at 4 warps); longer chunks take the fallback


def indexer_grid(B: int, T: int, S: int, sms: int, chunks: int | None = None) -> tuple[int, int] | None:
    """(TILE, C): keys per program and programs per batch row of the one-launch kernel, or None where it does not
    run (B x C past the SMs, a chunk past MAX_TILE, T past MAX_T): the caller then takes the fallback. chunks:
    programs per batch row wanted (default: as many as the SMs allow). A host decision from shapes and SMs only."""
    if not 1 <= B <= sms or not 1 <= T <= MAX_T or S < 1:
        return None
    want = chunks if chunks is not None else sms // B
    tile = max(BS, triton.next_power_of_2(triton.cdiv(S, max(1, want))))
    tile = min(tile, max(BS, triton.next_power_of_2(S)))
    C = triton.cdiv(S, tile)
    if tile > MAX_TILE or B * C > sms:
        return None
    return tile, C


@triton.jit
def _scored_keys(sc_ptr, lens_ptr, r, pos, S, T):
    """Keys of score row r at positions pos (read past L1: this launch wrote them), and which are candidates."""
    inb = pos < tl.minimum(tl.load(lens_ptr + r // T).to(tl.int32) + r % T + 1, S)
    x = tl.load(sc_ptr + r.to(tl.int64) * S + pos, mask=inb, other=float("-inf"), cache_modifier=".cg")
    return score_keys(x, inb)


@triton.jit
def _indexer_topk_kernel(q_ptr, qs_ptr, w_ptr, k_ptr, ks_ptr, lens_ptr, vis_ptr, sc_ptr, h16_ptr, h8_ptr, ncand_ptr,
                         arrive_ptr, ck_ptr, ci_ptr, gt_ptr, off_ptr, thr_ptr, out_ptr, S, C, K,
                         T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr,
                         VIS: tl.constexpr, PHASE: tl.constexpr, REARM: tl.constexpr, NB: tl.constexpr,
                         CPAD: tl.constexpr, KB: tl.constexpr, SMALL: tl.constexpr, V2: tl.constexpr):
    """Program (b, c): keys c * TILE .. of batch row b, for its T score rows. PHASE 0: scores + histograms, then per
    row split and write with the barriers between (GPU only: a co-resident grid); 1, 2, 3: one phase (the
    interpreter's launches)."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    b64 = b.to(tl.int64)
    if PHASE <= 1:
        L = tl.load(lens_ptr + b).to(tl.int32)
        for p0 in range(c * TILE, tl.minimum(c * TILE + TILE, S), BS):
            offs_s = p0 + tl.arange(0, BS)
            smask = offs_s < S
            kt, ks = _key_tile(k_ptr, ks_ptr, b64, offs_s, smask, S, D)
            for t in tl.static_range(T):
                _score_query(q_ptr, qs_ptr, w_ptr, vis_ptr, sc_ptr, h16_ptr, h8_ptr, kt, ks, L, b64 * T + t, t,
                             offs_s, smask, S, H, D, True, VIS)
        for t in tl.static_range(T):
            _arrive(arrive_ptr + b * T + t)
    pos = c * TILE + tl.arange(0, TILE)
    if PHASE == 0 or PHASE == 2:
        for t in range(T):
            r = b * T + t
            cnt = arrive_ptr + r
            if PHASE == 0:
                _wait(cnt, C)  # every program's scores of row r are counted
            key, valid = _scored_keys(sc_ptr, lens_ptr, r, pos, S, T)
            P, above, n_valid = _row_prefix(h16_ptr, h8_ptr, r, K)
            ck = ck_ptr + r.to(tl.int64) * S
            ci = ci_ptr + r.to(tl.int64) * S
            n_gt = _split_block(key, valid, pos, P, ncand_ptr + r, ck, ci)
            tl.store(gt_ptr + r * C + c, n_gt)
            tl.debug_barrier()
            if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == 2 * C - 1:
                _finish_row(r, n_valid, above, P, ncand_ptr, ck, ci, gt_ptr, off_ptr, thr_ptr, out_ptr, sc_ptr,
                            lens_ptr, S, T, TILE, C, K, NB, CPAD, KB, SMALL, V2)
                _arrive(cnt)  # row r's threshold and offsets are out
    if PHASE == 0 or PHASE == 3:
        for t in range(T):
            r = b * T + t
            cnt = arrive_ptr + r
            if PHASE == 0:
                _wait(cnt, 2 * C + 1)
            tk = tl.load(thr_ptr + r * 2, cache_modifier=".cg")
            ts = tl.load(thr_ptr + r * 2 + 1, cache_modifier=".cg")
            o = tl.load(off_ptr + r * C + c, cache_modifier=".cg")
            key, valid = _scored_keys(sc_ptr, lens_ptr, r, pos, S, T)
            _write_block(key, valid, pos, tk, ts, out_ptr + r.to(tl.int64) * K, o)
            if REARM:  # every program is past row r's split: nothing reads its histograms or candidates
                _zero_row(h16_ptr, h8_ptr, ncand_ptr, r, c, C)
                if tl.atomic_add(cnt, 1, sem="relaxed", scope="gpu") == 3 * C:  # the last to leave row r
                    tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")


def indexer_topk_one_launch(q8, q_scale, w, k8, k_scale, seq_lens, topk: int = 2048,
                            visible: torch.Tensor | None = None, rearm: bool = False, chunks: int | None = None,
                            split_phases: bool | None = None, split_v2: bool = True):
    """`indexer.indexer_topk(impl='radix')`'s (idx [B, T, topk] int32, -1 padded; scores [B, T, S]) in one launch
    where the grid fits (`indexer_grid`), else `indexer_topk(impl='radix_fused', one_launch=True)`: the same index
    sets, and the default scores kernel's scores. visible, rearm: as `indexer_topk`. chunks: programs per batch row
    (default: as many as the SMs allow). split_phases: the phases as three launches (default: only under the
    Triton interpreter, where the barriers would never open). split_v2: the top-k's last stage as
    `topk.radix_topk(split_v2=)`."""
    B, T, H, D, S = check_indexer_args("indexer_topk_one_launch", q8, q_scale, w, k8, k_scale, visible)
    if not 0 < topk < 2 ** 24 or S >= 2 ** 24:
        raise ValueError(f"indexer_topk_one_launch: want 0 < topk < 2^24 and S < 2^24 (position bytes), got topk = "
                         f"{topk}, S = {S}")
    dev = q8.device
    plan = indexer_grid(B, T, S, sm_count(dev), chunks)
    if plan is None:
        return indexer_topk(q8, q_scale, w, k8, k_scale, seq_lens, topk, impl="radix_fused", visible=visible,
                            rearm=rearm, one_launch=True, split_v2=split_v2)
    tile, C = plan
    split = interpreting() if split_phases is None else split_phases
    if interpreting() and not split:
        raise ValueError("indexer_topk_one_launch: split_phases=False under the Triton interpreter, which runs "
                         "programs one after another: the first program would wait at its row's barrier for ever")
    R = B * T
    sc = torch.empty(B, T, S, dtype=torch.float32, device=dev)
    vis = visible.contiguous().view(torch.uint8) if visible is not None else sc  # (unused pointer: no tree)
    lens = device_lens(seq_lens, dev)
    ws = kept_workspace(R, dev) if rearm else topk_workspace(R, dev)
    out = torch.empty(B, T, topk, dtype=torch.int32, device=dev)
    args = (q8.contiguous(), q_scale.float().contiguous(), w.float().contiguous(), k8.contiguous(),
            k_scale.float().contiguous(), lens, vis, sc, *phase_buffers(ws, R, S, C), out, S, C, topk)
    meta = dict(T=T, H=H, D=D, BS=BS, TILE=tile, VIS=visible is not None, REARM=rearm, NB=1024,
                CPAD=max(32, triton.next_power_of_2(C)), KB=1024, SMALL=SMALL, V2=split_v2, num_warps=WARPS)
    launch_phases(_indexer_topk_kernel, (B, C), args, meta, (1, 2, 3), split, ws, rearm)
    return out, sc
