"""Top-k positions of the indexer scores (Triton radix select over many SMs), with its plain-PyTorch reference.

Shape legend: B batch rows, T queries per row, S scored positions, R = B * T score rows, C chunks of a row
(one program each), k the number kept (2048).

Which positions a row keeps (`topk_select_ref`, the rule `Indexer.select` applies): the k largest scores
among its candidates, ties going to the lower position, as a stable descending sort gives. Candidates of
row (b, t): positions s < seq_lens[b] + t + 1 whose score is not -inf (and not NaN); -0.0 counts as +0.0.
With fewer than k candidates all are kept. The selection is one threshold on the pair (key, -position), where
key is the score's order-preserving int32 key: keep s iff key > Tk, or key == Tk and s <= Ts, with (Tk, Ts) the
pair of the k-th kept position. Output: [B, T, k] int32, the kept positions in ascending order, then -1.
mla_decode attends over the index set in any order; ascending order is deterministic (the attention sums in
that order) and walks the cache forward.

Kernels (a zeroed workspace, then three launches over R x C programs; no host sync, CUDA-graph capturable). The
workspace is a fresh one per call (one memset launch) or, with `rearm`, the one kept per (device, rows)
(`kept_workspace`), which the write kernel leaves zeroed for the next call: no memset launch.
1. `_topk_hist_kernel`: per candidate, its 16-bit key prefix (sign, exponent, 7 mantissa bits) into a
   65536-bin histogram of the row (global atomics, spread over many bins) and its top byte into a 256-bin
   one (tl.histogram per block, then one atomic per non-empty bin).
2. `_topk_split_kernel`: every program finds, from the two histograms, the prefix P holding the k-th key
   (two 256-bin scans), counts its chunk's keys above P and appends those with prefix P ("candidates",
   typically tens) to a list of the row. The last program of the row to arrive (atomic counter) finds the
   k-th key among the candidates alone (<= 128: ranked by one pairwise compare; more: radix select on key
   bits 15..8 and 7..0, then position bytes only when keys tie at the boundary), and turns per-chunk counts
   into each chunk's output offset. Its V2 (switch topk_split_v2, the default; V1 kept to time against) issues the
   loads that do not depend on each other together (the chunk's scores with the histograms; the last program's
   count, chunk counts and candidates), and resolves boundary ties over thousands of candidates by a walk over the
   row's scores (`_tied_position`): the same outputs.
3. `_topk_write_kernel`: each program writes its chunk's kept positions at its offset, in ascending order;
   with `rearm` it then zeroes its share of the row's workspace (nothing reads it after the split kernel), as
   `mtp.kernels.moe`'s persistent counters are re-armed by their last user.
One program per row would re-read the row for every pass on one SM; a single SM histograms ~32k keys per
~10 us (tl.histogram costs ~3 warp instructions per element): hence the spread over R x C programs.
The phases are jit functions (`add_to_histograms`, `_row_prefix`, `_split_block`, `_finish_row`, `_write_block`,
`_zero_row`) that `mtp.kernels.topk_one_launch` runs in one launch, its programs meeting at a barrier per row
between them (switch `topk_one_launch`).
"""

from __future__ import annotations

import torch

from mtp.kernels._triton import device_lens, pdl_kwargs, pdl_launch, pdl_mode, pdl_wait, require, tl, triton

__all__ = ["add_to_histograms", "check_topk_args", "drop_kept_workspace", "histograms", "kept_workspace", "radix_topk",
           "score_keys", "sm_count", "topk_select_ref", "topk_workspace"]

HIST = 65536  # bins of the 16-bit key prefix
SMALL = 128  # up to this many candidates, the last stage ranks them in one pairwise compare


def topk_select_ref(scores_BTS: torch.Tensor, seq_lens_B: torch.Tensor, k: int) -> torch.Tensor:
    """Reference of `radix_topk`: [B, T, k] int32, the kept positions ascending, -1 after them."""
    B, T, S = scores_BTS.shape
    s = scores_BTS.float()
    limit = seq_lens_B.to(s.device).long().view(B, 1, 1) + torch.arange(T, device=s.device).view(1, T, 1) + 1
    cand = (torch.arange(S, device=s.device).view(1, 1, S) < limit) & (s != float("-inf")) & ~s.isnan()
    order = torch.sort(s.masked_fill(~cand, float("-inf")), dim=-1, descending=True, stable=True).indices
    n = cand.sum(-1, keepdim=True).clamp(max=k)
    j = min(k, S)
    top = torch.where(torch.arange(j, device=s.device) < n, order[..., :j], S)  # S sorts after every position
    out = torch.sort(top, dim=-1).values
    out = torch.where(out == S, -1, out).to(torch.int32)
    return torch.cat([out, out.new_full((B, T, k - j), -1)], -1) if j < k else out


@triton.jit
def score_keys(x, inb):
    """Order-preserving int32 keys of scores x, and which are candidates: inb, not -inf, not NaN."""
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 -> +0.0: equal scores, equal keys
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF), inb & (x != float("-inf")) & (x == x)


@triton.jit
def add_to_histograms(h16_row, key, valid):
    """Count the candidates' 16-bit key prefixes into the row's 65536-bin histogram (atomics, spread over
    many bins); return their top bytes' 256-bin histogram, for one atomic per non-empty bin later."""
    pre = (key >> 16) + 32768  # [0, 65536), monotone in key
    tl.atomic_add(h16_row + pre, 1, mask=valid, sem="relaxed")
    return tl.histogram(pre >> 8, 256, mask=valid)


@triton.jit
def _row_keys(sc_ptr, lens_ptr, r, pos, S, T, V2: tl.constexpr):
    """Keys of row r at positions pos, and which of them are candidates. V2: the scores are loaded up to S, not up
    to the row's length, so that their load does not wait for the length's (two loads in flight at once instead of
    one after the other: one global round trip fewer); the keys of non-candidates are then of whatever the row holds
    there, and every user masks them by `valid` (the same kept sets)."""
    lim = tl.minimum(tl.load(lens_ptr + r // T).to(tl.int32) + r % T + 1, S)
    if V2:
        x = tl.load(sc_ptr + r.to(tl.int64) * S + pos, mask=pos < S, other=float("-inf"))
        return score_keys(x, pos < lim)
    inb = pos < lim
    return score_keys(tl.load(sc_ptr + r.to(tl.int64) * S + pos, mask=inb, other=float("-inf")), inb)


@triton.jit
def _pick(h, need):
    """For a 256-bin histogram of digits: the largest digit d whose bins d..255 hold >= need, the count in
    the bins above d, and the count in bin d."""
    d = tl.arange(0, 256)
    suffix = tl.cumsum(h, 0, reverse=True)  # keys with digit >= d
    dig = tl.max(tl.where(suffix >= need, d, -1), 0)
    at = tl.sum(tl.where(d == dig, h, 0), 0)
    above = tl.sum(tl.where(d > dig, h, 0), 0)
    return dig, above, at


@triton.jit
def _topk_hist_kernel(sc_ptr, lens_ptr, h16_ptr, h8_ptr, S, T, CH, BLK: tl.constexpr, PDL: tl.constexpr,
                      V2: tl.constexpr):
    pdl_launch(PDL)
    pdl_wait(PDL)  # the scores; the workspace's last user (the write kernel re-arming it) ended before
    r = tl.program_id(0)
    c = tl.program_id(1)
    h8 = tl.zeros((256,), dtype=tl.int32)
    for p0 in range(c * CH, tl.minimum(c * CH + CH, S), BLK):
        pos = p0 + tl.arange(0, BLK)
        key, valid = _row_keys(sc_ptr, lens_ptr, r, pos, S, T, V2)
        h8 += add_to_histograms(h16_ptr + r.to(tl.int64) * 65536, key, valid)
    bins = tl.arange(0, 256)
    tl.atomic_add(h8_ptr + r * 256 + bins, h8, mask=h8 > 0, sem="relaxed")


@triton.jit
def _cand_hist(ck_ptr, ci_ptr, n, key_sh, key_pref, pos_sh, pos_pref, dig_sh, FROM_POS: tl.constexpr,
               NB: tl.constexpr):
    """Histogram of one key or position byte over the candidates that match the prefixes found so far.
    Position bytes count as 255 - byte, so that the lower position ranks higher."""
    h = tl.zeros((256,), dtype=tl.int32)
    for i0 in range(0, n, NB):
        i = i0 + tl.arange(0, NB)
        m = i < n
        key = tl.load(ck_ptr + i, mask=m, other=0, cache_modifier=".cg")
        pos = tl.load(ci_ptr + i, mask=m, other=0, cache_modifier=".cg")
        m = m & ((key >> key_sh) == key_pref) & ((pos >> pos_sh) == pos_pref)
        if FROM_POS:
            dig = 255 - ((pos >> dig_sh) & 255)
        else:
            dig = (key >> dig_sh) & 255
        h += tl.histogram(dig, 256, mask=m)
    return h


@triton.jit
def _rank_select(key, pos, m, need):
    """(key, position) of the need-th kept of the candidates m of (key, pos) (at most SMALL): each one's rank is
    the number of candidates ahead of it (higher key, or equal key and lower position), in one [SMALL, SMALL]
    compare instead of the byte passes of `_threshold_radix`."""
    ahead = (key[None, :] > key[:, None]) | ((key[None, :] == key[:, None]) & (pos[None, :] < pos[:, None]))
    rank = tl.sum((ahead & m[None, :]).to(tl.int32), 1)
    sel = m & (rank == need - 1)
    return tl.sum(tl.where(sel, key, 0), 0), tl.sum(tl.where(sel, pos, 0), 0)


@triton.jit
def _threshold_rank(ck_ptr, ci_ptr, n, need, SMALL: tl.constexpr):
    """(key, position) of the need-th kept candidate, for n <= SMALL candidates (`_rank_select`)."""
    i = tl.arange(0, SMALL)
    m = i < n
    key = tl.load(ck_ptr + i, mask=m, other=0, cache_modifier=".cg")
    pos = tl.load(ci_ptr + i, mask=m, other=0, cache_modifier=".cg")
    return _rank_select(key, pos, m, need)


@triton.jit
def _tied_position(sc_ptr, lens_ptr, r, S, T, tk, need, NB: tl.constexpr):
    """The need-th lowest position of row r whose key is tk (need >= 1, and at least need such positions): a walk
    over the row's scores in ascending order that stops in the block holding it. Read past L1 (.cg): in
    `indexer_one_launch` other programs of this launch wrote the scores."""
    lim = tl.minimum(tl.load(lens_ptr + r // T).to(tl.int32) + r % T + 1, S)
    row = sc_ptr + r.to(tl.int64) * S
    seen = 0
    ts = -1
    p0 = 0
    while (seen < need) & (p0 < S):
        pos = p0 + tl.arange(0, NB)
        key, valid = score_keys(tl.load(row + pos, mask=pos < lim, other=float("-inf"), cache_modifier=".cg"),
                                pos < lim)
        tie = (valid & (key == tk)).to(tl.int32)
        run = seen + tl.cumsum(tie, 0)  # tied positions up to and including each one
        ts = tl.maximum(ts, tl.max(tl.where((tie > 0) & (run == need), pos, -1), 0))
        seen += tl.sum(tie, 0)
        p0 += NB
    return ts


@triton.jit
def _threshold_radix(ck, ci, n_c, kp, need, sc_ptr, lens_ptr, r, S, T, NB: tl.constexpr, V2: tl.constexpr):
    """(key, position) of the need-th kept candidate by radix select over the candidates, all of whose keys
    share the top 16 bits kp: key bits 15..8, 7..0, then (only if keys tie at the boundary) position bytes. V2:
    ties at the boundary are resolved by `_tied_position` (an ascending walk over the row's scores that stops at the
    threshold) where its longest walk, S / NB blocks, is no longer than the three position passes, 3 n_c / NB
    blocks: many tied candidates (e.g. every score equal: 32k candidates, the threshold in the row's first blocks)."""
    ts = 2147483647  # every candidate with the threshold key is kept
    hA = _cand_hist(ck, ci, n_c, 16, kp, 31, 0, 8, False, NB)
    dA, aboveA, _ = _pick(hA, need)
    need -= aboveA
    hB = _cand_hist(ck, ci, n_c, 8, kp * 256 + dA, 31, 0, 0, False, NB)
    dB, aboveB, atB = _pick(hB, need)
    need -= aboveB
    tk = (kp * 256 + dA) * 256 + dB
    if atB > need:  # keys tie at the boundary: keep the `need` lowest positions among them
        if V2 and 3 * tl.cdiv(n_c, NB) >= tl.cdiv(S, NB):
            ts = _tied_position(sc_ptr, lens_ptr, r, S, T, tk, need, NB)
        else:
            hI = _cand_hist(ck, ci, n_c, 0, tk, 24, 0, 16, True, NB)
            e1, a1, _ = _pick(hI, need)
            need -= a1
            p1 = 255 - e1
            hI = _cand_hist(ck, ci, n_c, 0, tk, 16, p1, 8, True, NB)
            e2, a2, _ = _pick(hI, need)
            need -= a2
            p2 = p1 * 256 + 255 - e2
            hI = _cand_hist(ck, ci, n_c, 0, tk, 8, p2, 0, True, NB)
            e3, _, _ = _pick(hI, need)
            ts = p2 * 256 + 255 - e3
    return tk, ts


@triton.jit
def _row_prefix(h16_ptr, h8_ptr, r, K):
    """From the row's two histograms: (P, above, n_valid), the 16-bit prefix holding the k-th key (two 256-bin
    scans; -1 when every candidate is kept), the candidates with a higher prefix, and all of the row's candidates.
    Read past L1 (.cg): in the one-launch kernel (`topk_one_launch`) other programs have just counted into them."""
    r64 = r.to(tl.int64)
    bins = tl.arange(0, 256)
    h8 = tl.load(h8_ptr + r * 256 + bins, cache_modifier=".cg")
    n_valid = tl.sum(h8, 0)
    P = -1  # 16-bit prefix holding the k-th key; -1: every candidate is kept
    above = n_valid
    if n_valid > K:
        d1, above1, _ = _pick(h8, K)
        hsub = tl.load(h16_ptr + r64 * 65536 + d1 * 256 + bins, cache_modifier=".cg")
        d2, above2, _ = _pick(hsub, K - above1)
        P = d1 * 256 + d2
        above = above1 + above2
    return P, above, n_valid


@triton.jit
def _split_block(key, valid, pos, P, ncand_row, ck, ci):
    """One block of a chunk: the number of its candidates above prefix P; those with prefix P ("candidates of the
    last stage") appended to the row's list (keys ck, positions ci)."""
    pre = (key >> 16) + 32768
    n_gt = tl.sum((valid & (pre > P)).to(tl.int32), 0)
    eq = valid & (pre == P)
    n_eq = tl.sum(eq.to(tl.int32), 0)
    if n_eq > 0:
        base = tl.atomic_add(ncand_row, n_eq, sem="relaxed")
        slot = base + tl.cumsum(eq.to(tl.int32), 0) - 1
        tl.store(ck + slot, key, mask=eq)
        tl.store(ci + slot, pos, mask=eq)
    return n_gt


@triton.jit
def _kept_per_chunk(ck, ci, n_c, tk, ts, CH, NB: tl.constexpr, CPAD: tl.constexpr):
    """Per chunk, its candidates kept by the threshold (Tk, Ts): one pass over the row's candidate list."""
    kept = tl.zeros((CPAD,), dtype=tl.int32)
    for i0 in range(0, n_c, NB):
        i = i0 + tl.arange(0, NB)
        m = i < n_c
        key = tl.load(ck + i, mask=m, other=0, cache_modifier=".cg")
        pos = tl.load(ci + i, mask=m, other=0, cache_modifier=".cg")
        m = m & ((key > tk) | ((key == tk) & (pos <= ts)))
        kept += tl.histogram(pos // CH, CPAD, mask=m)
    return kept


@triton.jit
def _finish_row(r, n_valid, above, P, ncand_ptr, ck, ci, gt_ptr, off_ptr, thr_ptr, out_ptr, sc_ptr, lens_ptr, S, T,
                CH, C, K, NB: tl.constexpr, CPAD: tl.constexpr, KB: tl.constexpr, SMALL: tl.constexpr,
                V2: tl.constexpr):
    """The last program of row r to end its split: every chunk's count and candidate is visible (read past L1).
    Finds the k-th key among the candidates alone (<= SMALL: pairwise rank; more: radix select), stores the
    threshold pair (Tk, Ts) and each chunk's offset in the output, and -1 after the kept positions.

    V2 (switch topk_split_v2; the same outputs): the candidate count, the chunks' counts above P and the list's
    first SMALL slots are loaded together, first thing, in one round trip (V1: the count, then the candidates, then
    the candidates again for the per-chunk counts, then the chunks' counts: four dependent round trips on the usual
    path of <= SMALL candidates). Why a plain load of the count is enough: every program of the row added to it
    (relaxed) before its acq_rel arrival, and this program's arrival, the last, acquired all of theirs (the
    arrivals are RMWs on one word: a release sequence), so the final count, like the candidates and the chunks'
    counts, happens-before these loads; V1 read it with an acq_rel atomic, a fence that holds back every later load
    until it returns. The slots past the count hold stale values (the list is not cleared) and are masked off."""
    r64 = r.to(tl.int64)
    tk = -2147483648  # keep every candidate (fewer than k)
    ts = 2147483647
    cc = tl.arange(0, CPAD)
    if V2:
        n_c = tl.load(ncand_ptr + r, cache_modifier=".cg")
        gt = tl.load(gt_ptr + r * C + cc, mask=cc < C, other=0, cache_modifier=".cg")
        i = tl.arange(0, SMALL)
        key0 = tl.load(ck + i, mask=i < S, other=0, cache_modifier=".cg")  # (the list holds S slots)
        pos0 = tl.load(ci + i, mask=i < S, other=0, cache_modifier=".cg")
        m0 = i < n_c
        key0 = tl.where(m0, key0, 0)
        pos0 = tl.where(m0, pos0, 0)
        if n_valid > K:
            need = K - above  # keys to keep among the candidates, >= 1
            if n_c <= SMALL:
                tk, ts = _rank_select(key0, pos0, m0, need)
            else:
                tk, ts = _threshold_radix(ck, ci, n_c, P - 32768, need, sc_ptr, lens_ptr, r, S, T, NB, V2)
        if n_c <= SMALL:  # the per-chunk counts from the candidates in registers: no second load
            kept = tl.histogram(pos0 // CH, CPAD, mask=m0 & ((key0 > tk) | ((key0 == tk) & (pos0 <= ts))))
        else:
            kept = _kept_per_chunk(ck, ci, n_c, tk, ts, CH, NB, CPAD)
    else:
        n_c = tl.atomic_add(ncand_ptr + r, 0, sem="acq_rel", scope="gpu")
        if n_valid > K:
            need = K - above  # keys to keep among the candidates, >= 1
            if n_c <= SMALL:
                tk, ts = _threshold_rank(ck, ci, n_c, need, SMALL)
            else:
                tk, ts = _threshold_radix(ck, ci, n_c, P - 32768, need, sc_ptr, lens_ptr, r, S, T, NB, V2)
        # kept candidates per chunk, then each chunk's offset in the output
        kept = _kept_per_chunk(ck, ci, n_c, tk, ts, CH, NB, CPAD)
        gt = tl.load(gt_ptr + r * C + cc, mask=cc < C, other=0, cache_modifier=".cg")
    tot = gt + kept
    tl.store(off_ptr + r * C + cc, tl.cumsum(tot, 0) - tot, mask=cc < C)
    tl.store(thr_ptr + r * 2, tk)
    tl.store(thr_ptr + r * 2 + 1, ts)
    n_keep = tl.sum(tot, 0)
    for j0 in range(0, K, KB):  # -1 after the kept positions
        j = j0 + tl.arange(0, KB)
        tl.store(out_ptr + r64 * K + j, -1, mask=(j >= n_keep) & (j < K))


@triton.jit
def _write_block(key, valid, pos, tk, ts, dst, o):
    """One block of a chunk: its kept positions (key > Tk, or key == Tk and position <= Ts) at dst + o on, in
    ascending order; returns the offset after them."""
    keep = valid & ((key > tk) | ((key == tk) & (pos <= ts)))
    k32 = keep.to(tl.int32)
    tl.store(dst + o + tl.cumsum(k32, 0) - 1, pos, mask=keep)
    return o + tl.sum(k32, 0)


@triton.jit
def _zero_row(h16_ptr, h8_ptr, ncand_ptr, r, c, C):
    """Program c's share of re-arming row r's workspace (its 16-bit bins in whole blocks; program 0 the 8-bit bins
    and the candidate count) once nothing reads them any more. The arrival counter is the caller's."""
    ZB: tl.constexpr = 4096
    span = tl.cdiv(tl.cdiv(65536, C), ZB) * ZB  # the row's 16-bit bins, whole blocks per program
    h16 = h16_ptr + r.to(tl.int64) * 65536
    for z0 in range(c * span, tl.minimum(c * span + span, 65536), ZB):
        z = z0 + tl.arange(0, ZB)
        tl.store(h16 + z, tl.zeros((ZB,), dtype=tl.int32), mask=z < 65536)
    if c == 0:
        tl.store(h8_ptr + r * 256 + tl.arange(0, 256), tl.zeros((256,), dtype=tl.int32))
        tl.store(ncand_ptr + r, 0)


@triton.jit
def _topk_split_kernel(sc_ptr, lens_ptr, h16_ptr, h8_ptr, ncand_ptr, arrive_ptr, ck_ptr, ci_ptr, gt_ptr,
                       off_ptr, thr_ptr, out_ptr, S, T, CH, C, K,
                       BLK: tl.constexpr, NB: tl.constexpr, CPAD: tl.constexpr, KB: tl.constexpr,
                       SMALL: tl.constexpr, PDL: tl.constexpr, V2: tl.constexpr):
    """V2 (switch topk_split_v2; the same outputs): the chunk's first block of scores (and the row's length) is
    loaded before the histograms, which it does not depend on, so its round trips overlap the two histogram loads
    (V1: after the prefix, two more dependent round trips); at decode shapes (S ~ 32k, 1..4 rows: CH = BLK = 1024)
    that block is the whole chunk. Then `_finish_row`'s V2."""
    pdl_launch(PDL)
    pdl_wait(PDL)  # the histograms and scores; counters and candidates are written after it
    r = tl.program_id(0)
    c = tl.program_id(1)
    r64 = r.to(tl.int64)
    ck = ck_ptr + r64 * S
    ci = ci_ptr + r64 * S
    start = c * CH
    if V2:
        pos = start + tl.arange(0, BLK)  # (c * CH < S: every program has a first block)
        key, valid = _row_keys(sc_ptr, lens_ptr, r, pos, S, T, V2)
        P, above, n_valid = _row_prefix(h16_ptr, h8_ptr, r, K)
        n_gt = _split_block(key, valid, pos, P, ncand_ptr + r, ck, ci)
        start += BLK
    else:
        P, above, n_valid = _row_prefix(h16_ptr, h8_ptr, r, K)
        n_gt = 0
    for p0 in range(start, tl.minimum(c * CH + CH, S), BLK):
        pos = p0 + tl.arange(0, BLK)
        key, valid = _row_keys(sc_ptr, lens_ptr, r, pos, S, T, V2)
        n_gt += _split_block(key, valid, pos, P, ncand_ptr + r, ck, ci)
    tl.store(gt_ptr + r * C + c, n_gt)
    tl.debug_barrier()
    if tl.atomic_add(arrive_ptr + r, 1, sem="acq_rel", scope="gpu") == C - 1:
        _finish_row(r, n_valid, above, P, ncand_ptr, ck, ci, gt_ptr, off_ptr, thr_ptr, out_ptr, sc_ptr, lens_ptr, S,
                    T, CH, C, K, NB, CPAD, KB, SMALL, V2)


@triton.jit
def _topk_write_kernel(sc_ptr, lens_ptr, off_ptr, thr_ptr, out_ptr, h16_ptr, h8_ptr, ncand_ptr, arrive_ptr,
                       S, T, CH, C, K, BLK: tl.constexpr, REARM: tl.constexpr, PDL: tl.constexpr,
                       V2: tl.constexpr):
    pdl_launch(PDL)
    pdl_wait(PDL)  # the split kernel's thresholds and offsets (and the workspace it read: re-armed after it)
    r = tl.program_id(0)
    c = tl.program_id(1)
    tk = tl.load(thr_ptr + r * 2)
    ts = tl.load(thr_ptr + r * 2 + 1)
    o = tl.load(off_ptr + r * C + c)
    dst = out_ptr + r.to(tl.int64) * K
    for p0 in range(c * CH, tl.minimum(c * CH + CH, S), BLK):
        pos = p0 + tl.arange(0, BLK)
        key, valid = _row_keys(sc_ptr, lens_ptr, r, pos, S, T, V2)
        o = _write_block(key, valid, pos, tk, ts, dst, o)
    if REARM:  # the workspace's last reader (the split kernel ended before this launch): zero it for the next call
        _zero_row(h16_ptr, h8_ptr, ncand_ptr, r, c, C)
        if c == 0:
            tl.store(arrive_ptr + r, 0)


def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device; 132 (an H100 / H200) elsewhere: the interpreter plans the grids of those GPUs."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def topk_workspace(rows: int, device) -> torch.Tensor:
    """The zeroed workspace of `radix_topk` for `rows` score rows (one memset), cut flat: 16-bit and 8-bit
    histograms, candidate and arrival counters per row."""
    return torch.zeros(rows * (HIST + 256 + 2), dtype=torch.int32, device=device)


_KEPT: dict[tuple[torch.device, int], torch.Tensor] = {}


def kept_workspace(rows: int, device) -> torch.Tensor:
    """The workspace kept for (device, rows), zero between calls: `radix_topk(..., rearm=True)` leaves it zeroed
    (its write kernel, the last reader, clears what the call used), so a call, or a CUDA graph replay, needs no
    memset launch. Calls in one stream run one after the other (layers, draft and verify steps, graph replays):
    each finds it zeroed by the one before. Not safe for two calls with the same rows in flight at once on two
    streams (the engine's graphs and warm-ups are ordered on one). First asked for during a graph capture, it is
    a fresh zeroed workspace captured with its memset and not kept (the memset has not run yet, so keeping it
    would hand an eager call non-zero memory); the engine's warm-up runs first and creates it outside the capture.
    A call interrupted between its launches (an exception in `radix_topk` / `indexer_topk`) drops it
    (`drop_kept_workspace`), so the next call starts from a fresh one; a device fault ends the CUDA context anyway."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    ws = _KEPT.get((device, rows))
    if ws is None:
        ws = topk_workspace(rows, device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return ws
        _KEPT[(device, rows)] = ws
    return ws


def drop_kept_workspace(ws: torch.Tensor | None = None) -> None:
    """Forget the kept workspace `ws` (all of them for None): the next call allocates a zeroed one."""
    for key in [k for k, v in _KEPT.items() if ws is None or v is ws]:
        del _KEPT[key]


def histograms(ws: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (16-bit, 8-bit) histogram views of a `topk_workspace`, for a scores kernel that fills them."""
    return ws[:rows * HIST], ws[rows * HIST:rows * (HIST + 256)]


def check_topk_args(name: str, scores_BTS: torch.Tensor, seq_lens_B: torch.Tensor, k: int,
                    workspace: torch.Tensor | None) -> tuple[int, int, int]:
    """(B, T, S) of a top-k call's scores, after checking what the kernels assume (errors name `name`)."""
    require(scores_BTS, name)
    if scores_BTS.dim() != 3 or scores_BTS.dtype != torch.float32:
        raise ValueError(f"{name}: scores must be float32 [B, T, S], got {scores_BTS.dtype} {list(scores_BTS.shape)}")
    B, T, S = scores_BTS.shape
    if tuple(seq_lens_B.shape) != (B,):
        raise ValueError(f"{name}: seq_lens must be [B] = [{B}], got {list(seq_lens_B.shape)}")
    if not 0 < k < 2 ** 24 or S >= 2 ** 24:
        raise ValueError(f"{name}: want 0 < k < 2^24 and S < 2^24 (position bytes), got k = {k}, S = {S}")
    R = B * T
    if workspace is not None and workspace.numel() != R * (HIST + 256 + 2):
        raise ValueError(f"{name}: workspace must hold {R} rows ({R * (HIST + 256 + 2)} int32), got "
                         f"{workspace.numel()}")
    return B, T, S


def radix_topk(scores_BTS: torch.Tensor, seq_lens_B: torch.Tensor, k: int, chunks: int | None = None,
               block: int = 1024, workspace: torch.Tensor | None = None, rearm: bool = False,
               pdl: bool = False, split_v2: bool = True) -> torch.Tensor:
    """Kernel twin of `topk_select_ref`: [B, T, k] int32 kept positions (ascending, then -1).

    chunks: programs per score row (default: about two per SM over all rows, at least one block each).
    workspace: a workspace whose histograms the scores kernel already filled (`indexer_scores(hist=)`): the
    histogram launch is skipped. rearm: the workspace is the kept one (`kept_workspace`, taken here when
    workspace is None) and the write kernel zeroes it after use: no memset launch; off, a fresh `topk_workspace`
    per call unless given (one memset). pdl: the three kernels with programmatic dependent launch
    (`_triton.pdl_kwargs`; the memset stays a plain launch). split_v2: the kernels' V2 (switch topk_split_v2: fewer
    dependent round trips on the split kernel's path, ties at the boundary over thousands of candidates resolved by
    a walk over the scores; the same outputs bit for bit); off: V1, the code before (to time one against the other)."""
    B, T, S = check_topk_args("radix_topk", scores_BTS, seq_lens_B, k, workspace)
    dev = scores_BTS.device
    R = B * T
    blk = max(64, min(block, triton.next_power_of_2(S)))
    if chunks is None:
        chunks = max(1, min(triton.cdiv(S, blk), 2 * sm_count(dev) // max(1, R)))
    ch = triton.cdiv(triton.cdiv(S, chunks), blk) * blk  # positions per program, whole blocks
    C = triton.cdiv(S, ch)
    sc = scores_BTS.contiguous()
    lens = device_lens(seq_lens_B, dev)  # int32 or int64 (the cache's): read as is, no conversion launch
    filled = workspace is not None
    if workspace is None:
        workspace = kept_workspace(R, dev) if rearm else topk_workspace(R, dev)
    h16, h8 = histograms(workspace, R)
    ncand, arrive = workspace[R * (HIST + 256):R * (HIST + 257)], workspace[R * (HIST + 257):]
    ck = torch.empty(R, S, dtype=torch.int32, device=dev)  # candidates: keys and positions
    ci = torch.empty(R, S, dtype=torch.int32, device=dev)
    small = torch.empty(R * (2 * C + 2), dtype=torch.int32, device=dev)
    gt, off, thr = small[:R * C], small[R * C:2 * R * C], small[2 * R * C:]  # per chunk: n above P, offset; (Tk, Ts)
    out = torch.empty(B, T, k, dtype=torch.int32, device=dev)
    grid = (R, C)
    launch = pdl_kwargs(pdl, sc)
    kw = dict(PDL=pdl_mode(pdl, launch), V2=split_v2, num_warps=4, **launch)
    try:
        if not filled:
            _topk_hist_kernel[grid](sc, lens, h16, h8, S, T, ch, BLK=blk, **kw)
        _topk_split_kernel[grid](sc, lens, h16, h8, ncand, arrive, ck, ci, gt, off, thr, out, S, T, ch, C, k,
                                 BLK=blk, NB=1024, CPAD=max(32, triton.next_power_of_2(C)), KB=1024, SMALL=SMALL, **kw)
        _topk_write_kernel[grid](sc, lens, off, thr, out, h16, h8, ncand, arrive, S, T, ch, C, k, BLK=blk,
                                 REARM=rearm, **kw)
    except BaseException:
        if rearm:  # stopped between launches: the histograms may hold counts
            drop_kept_workspace(workspace)
        raise
    return out
