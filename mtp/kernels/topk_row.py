"""The indexer's radix top-k after its histogram in one program per score row (switch topk_row).

Shape legend: B batch rows, T queries per row, S scored positions, R = B * T score rows, k the number kept (2048).

Why: `topk.radix_topk` runs its last two phases (split, write; read `mtp.kernels.topk`'s docstring) as two launches
over R x C programs that meet through an arrival counter: at S = 32768 on an H200 (session 21, one TP=8 rank, 61
layers, exposed us a layer) the split costs 11.8 and the write ~2.9 at one row, where the histogram is already in
the scores kernel's epilogue (radix_fused); at four rows the histogram launch 8.8 and the split 10.2 (+ the write).
The split's time is a chain of dependent steps, not work: its chunk's keys, the histograms, the prefix, the
candidates' appends, the arrival, then the last program's count, candidates, threshold and per-chunk offsets; then
the write launch reads the row again.

Design: once the row's histograms exist (the scores kernel's epilogue at up to `fused_hist_rows` rows, else
`topk._topk_hist_kernel` over R x C programs, as today), one program per row does the rest alone, with no
cross-program counter and no second launch:
1. the prefix P holding the k-th key, the keys above it and the candidates' count (keys with prefix P) from the two
   histograms (`topk.prefix_from`); with `rearm` it then zeroes what the call counted into the kept workspace: the
   16-bit bins only in the 256-bin ranges whose 8-bit bin is non-zero (a counted key adds to both; an indexer row's
   scores span a few exponents of each sign: tens of the 256 ranges, not 256 KB) and the 8-bit bins
   (`_zero_counted`);
2. one pass over the row in tiles of TILE keys, the next tile's load in flight: the positions whose score is at
   least flo, the smallest score of bin P (`key_float`: for scores, key >= kl is x >= flo, NaN and -inf never), are
   appended in ascending order with their scores to a list (~k + the candidates: ~2100 of 32k). Ascending order
   needs a scan; a scan over a tile where each thread holds keys 32 * warps apart costs a lane shuffle chain per
   key (Triton's layout for a load), so each tile goes once through shared memory (`_cols`: each thread then holds
   E consecutive keys, E adds, then one scan over the threads' counts: `_append_kept`). Every key of the row
   kept (fewer valid than k): the same pass straight to the output;
3. the list's candidates (scores below the next bin's flo) appended by an atomic each to their own list of (key,
   position), the list staying in registers (one tile: every decode row); the k-th (key, position) among them in a
   tile of 32 / 64 / 128 / 256, the smallest that holds them: a pairwise rank at 32 (`topk._rank_select`, as the
   split kernel's last program), a sort of (key, position) pairs above (its cost grows as N log^2 N, the rank's as
   N^2: 400 against 1700 instructions a warp at 128), more by `topk._threshold_radix` (key bytes; boundary ties by
   its walk over the row: exact, slow when thousands tie, as before);
4. the list's kept entries (key > Tk, or key == Tk and position <= Ts) to the output, in order, then -1 up to k.
The old objection to one program per row (a single SM histograms ~32k keys in ~10 us) does not apply: the
histogram comes from before; this program compares and compacts. Two passes over the row (the candidates first,
then the kept positions straight to the output) counted 0.60 + 0.73 warp-instructions a key (16 warps, sm_90 SASS)
against this pass's 0.53 and a list of ~2100 entries: one pass it is. The kept set and order are `topk_select_ref`'s
(and `radix_topk`'s) bit for bit: the same keys, bin, candidates (in another order: the threshold does not depend
on it) and threshold rule.

Cost, counted in sm_90 SASS (triton 3.6, compiled on the CPU, the common path of each loop and between them; 8
warps, TILE 8192, a 32k + 1 row): the pass 404 instructions a warp per whole tile (0.39 warp-instructions a key) and
130 for the rest, the list's steps (candidates 356, threshold ~300 in the 64 / 128 tiles, output 311) ~1000, the
prefix and zeroing ~370: ~3350 a warp, ~27k warp-instructions a row (16 warps: ~39k). Prediction (to be timed:
`python -m mtp.bench.topk_moe --only topk_row`), H200, S = 32768: at 2-2.5 instructions a cycle (two warps a
scheduler) ~5.5-6.5 us of issue, plus ~1.5 us of dependent round trips (the prefix's two loads, the list's, the
candidates' atomics and loads): **6-8 us at one row** for the row kernel against split 11.8 + write 2.9 today
(radix_fused); **at four rows** the histogram launch (8.8, unchanged) + the row kernel's 6-8 on four SMs against
split 10.2 + write ~3: ~-7 us a layer at one row, ~-5 at four (61 layers: ~-0.3 to -0.4 ms a step at 32k). The
issue's target (scores + top-k <= 10 us a layer at 32k) would still be missed (5.0 + 6-8).
"""

from __future__ import annotations

import torch

from mtp.kernels._triton import device_lens, pdl_kwargs, pdl_launch, pdl_mode, pdl_wait, tl, triton
from mtp.kernels.topk import (HIST, _rank_select, _threshold_radix, _topk_hist_kernel, check_topk_args,
                              chunk_plan, drop_kept_workspace, histograms, kept_workspace, prefix_from, score_keys,
                              sm_count, topk_workspace)

__all__ = ["ROW_TILE", "ROW_WARPS", "key_float", "radix_topk_row", "row_tile"]

# keys per tile of the pass: the next tile's load (an L2 round trip) is in flight while one is ranked; 8 warps: 32
# keys a thread, the fewest instructions a key of the settings counted (sm_90 SASS, a whole tile: 8 warps 0.39, 16
# warps 0.53 a key at 8192; 8 warps hold 255 registers, 16 warps 128), and the list of a decode row (~2100 entries)
# in one tile of TILE / 2; to be swept on a GPU (`mtp.bench.topk_moe --only topk_row`)
ROW_TILE = 8192
ROW_WARPS = 8


@triton.jit
def _zero_counted(h16_row, h8):
    """Zero the row's 16-bit bins that this call can have counted into: the 256-bin range d wherever the 8-bit bin d
    is non-zero (a counted key adds to both); 32 bins of every range per step, a masked-off range costs issue only."""
    ZC: tl.constexpr = 32
    d = tl.arange(0, 256)
    b = tl.arange(0, ZC)
    counted = tl.broadcast_to((h8 > 0)[:, None], (256, ZC))
    for b0 in range(0, 256, ZC):
        tl.store(h16_row + d[:, None] * 256 + b0 + b[None, :], tl.zeros((256, ZC), dtype=tl.int32), mask=counted)


@triton.jit
def key_float(k):
    """The float whose order-preserving key (`topk.score_keys`) is k: its inverse (a NaN for the keys no score has)."""
    return tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _whole_tile(x, row, p0, lim, TILE: tl.constexpr):
    """The row's scores at p0 .. p0 + TILE - 1 where they are all inside its length lim (loaded without a mask: a
    compare and a select fewer a key), else x unchanged."""
    if p0 + TILE <= lim:
        x = tl.load(row + p0 + tl.arange(0, TILE))  # (one 64-bit base, the keys at offsets from it)
    return x


@triton.jit
def _cols(x2):
    """x2 [N, E] (E a power of two) as a tuple of its E columns [N], in order. Each split needs its pair in one
    thread, so the first one moves the tile through shared memory once: then every thread holds E consecutive
    positions (a scan over them is E adds in registers, not a lane shuffle per element)."""
    N: tl.constexpr = x2.shape[0]
    E: tl.constexpr = x2.shape[1]
    if E == 1:
        return (tl.reshape(x2, (N,)),)
    else:
        ev, od = tl.split(tl.reshape(x2, (N, E // 2, 2)))
        a = _cols(ev)
        b = _cols(od)
        out = ()
        for i in tl.static_range(E // 2):
            out = out + (a[i], b[i])
        return out


@triton.jit
def _append_kept(x, pos, ftk, ts, dst, o, E: tl.constexpr, POS_DATA: tl.constexpr, GE: tl.constexpr,
                 PACK: tl.constexpr):
    """Append the kept ones of a tile (scores x at positions pos, -inf where none) at dst + o on, in tile order;
    returns the offset after them. Kept: x > ftk, or x == ftk and position <= ts (the keys' rule on the scores: ftk is
    the threshold key's float, `key_float`; NaN and -inf compare false); GE: x >= ftk (one compare: the pass over
    the row, whose threshold is a whole bin's, or every candidate). Each thread ranks E consecutive entries of
    the tile (`_cols`), then one scan over the threads' counts. POS_DATA: pos is the tile's positions, data to move
    with x (a list); else pos is a number, the tile's positions pos, pos + 1, ... (a stretch of the row) are computed,
    not moved. PACK: the entries appended are int64 (score bits << 32 | position, `_unpack`), else the positions."""
    NT: tl.constexpr = x.shape[0] // E
    xs = _cols(tl.reshape(x, (NT, E)))
    if POS_DATA:
        ps = _cols(tl.reshape(pos, (NT, E)))
    else:
        pb = pos + tl.arange(0, NT) * E
        ps = ()
        for e in tl.static_range(E):
            ps = ps + (pb + e,)
    run = tl.zeros((NT,), dtype=tl.int32)
    runs = ()
    for e in tl.static_range(E):
        if GE:
            run += (xs[e] >= ftk).to(tl.int32)
        else:
            run += ((xs[e] > ftk) | ((xs[e] == ftk) & (ps[e] <= ts))).to(tl.int32)
        runs = runs + (run,)
    base = dst + o - 1 + tl.cumsum(run, 0) - run
    prev = tl.zeros((NT,), dtype=tl.int32)
    for e in tl.static_range(E):
        if PACK:
            v = (xs[e].to(tl.int32, bitcast=True).to(tl.int64) << 32) | ps[e]
        else:
            v = ps[e]
        tl.store(base + runs[e], v, mask=runs[e] > prev)
        prev = runs[e]
    return o + tl.sum(run, 0)


@triton.jit
def _unpack(v):
    """(score, position) of a list entry of `_append_kept(PACK=True)`."""
    return (v >> 32).to(tl.int32).to(tl.float32, bitcast=True), (v & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def _select_pass(x, row, lim, fsel, dst, TILE: tl.constexpr, E: tl.constexpr, PACK: tl.constexpr):
    """The pass over the row: its positions with scores >= fsel appended to dst in ascending order (`_append_kept`,
    GE), their count returned. x: the first whole tile, already loaded (`_whole_tile`). Whole tiles with the next
    one's load in flight, then the rest (at decode, S = 2^15 + w: a few keys) in tiles of TILE / RD."""
    full = lim // TILE * TILE
    n = 0
    for p0 in range(0, full, TILE):
        x_next = _whole_tile(x, row, p0 + TILE, lim, TILE)
        n = _append_kept(x, p0, fsel, 0, dst, n, E, False, True, PACK)
        x = x_next
    RD: tl.constexpr = 8 if E >= 8 else E
    ar = tl.arange(0, TILE // RD)
    for p0 in range(full, lim, TILE // RD):
        xr = tl.load(row + p0 + ar, mask=ar < lim - p0, other=float("-inf"))
        n = _append_kept(xr, p0, fsel, 0, dst, n, E // RD, False, True, PACK)
    return n


@triton.jit
def _pairwise_threshold(ck, ci, n_c, need, N: tl.constexpr):
    """(Tk, Ts) of the need-th kept of n_c <= N candidates (keys ck, positions ci, any order) by one [N, N] rank
    (`topk._rank_select`): the cheapest at N = 32 (sm_90, 8 warps: ~150 instructions a warp), growing as N^2 (~540
    at 64, ~1700 at 128), where `_sorted_threshold` grows as N log^2 N."""
    i = tl.arange(0, N)
    m = i < n_c
    return _rank_select(tl.load(ck + i, mask=m, other=0, cache_modifier=".cg"),
                        tl.load(ci + i, mask=m, other=0, cache_modifier=".cg"), m, need)


@triton.jit
def _sorted_threshold(ck, ci, n_c, need, N: tl.constexpr):
    """(Tk, Ts) of the need-th kept of n_c <= N candidates by a sort of their (key, 2^24 - 1 - position) pairs as one
    int64, descending (the reference's order: higher key first, then lower position; positions < 2^24,
    `topk.check_topk_args`): sm_90, 8 warps, ~300 / 400 / 520 instructions a warp at N = 64 / 128 / 256."""
    i = tl.arange(0, N)
    m = i < n_c
    key = tl.load(ck + i, mask=m, other=0, cache_modifier=".cg")
    pos = tl.load(ci + i, mask=m, other=0, cache_modifier=".cg")
    v = tl.where(m, (key.to(tl.int64) << 32) | (0xFFFFFF - pos), -9223372036854775807 - 1)
    v = tl.sum(tl.where(i == need - 1, tl.sort(v, descending=True), 0), 0)
    return (v >> 32).to(tl.int32), (0xFFFFFF - (v & 0xFFFFFFFF)).to(tl.int32)


@triton.jit
def _candidates_threshold(ck, ci, n_c, P, need, sc_ptr, lens_ptr, r, S, T, NB: tl.constexpr):
    """(Tk, Ts) of the need-th kept of the n_c candidates (keys ck, positions ci, any order), in a tile of 32 / 64 /
    128 / 256, the smallest that holds them (an indexer row at 32k has ~30-100, BENCHMARKS.md session 14): pairwise at
    32, sorted above; more by `topk._threshold_radix` (key bytes; ties at the boundary by the walk over the row)."""
    if n_c <= 32:
        tk, ts = _pairwise_threshold(ck, ci, n_c, need, 32)
    elif n_c <= 64:
        tk, ts = _sorted_threshold(ck, ci, n_c, need, 64)
    elif n_c <= 128:
        tk, ts = _sorted_threshold(ck, ci, n_c, need, 128)
    elif n_c <= 256:
        tk, ts = _sorted_threshold(ck, ci, n_c, need, 256)
    else:
        tk, ts = _threshold_radix(ck, ci, n_c, P - 32768, need, sc_ptr, lens_ptr, r, S, T, NB, True)
    return tk, ts


@triton.jit
def _topk_row_kernel(sc_ptr, lens_ptr, h16_ptr, h8_ptr, ncand_ptr, lst_ptr, ck_ptr, ci_ptr, out_ptr, S, T, K,
                     TILE: tl.constexpr, E: tl.constexpr, KB: tl.constexpr, REARM: tl.constexpr, PDL: tl.constexpr):
    """Program r: score row r, after its histograms (module docstring, steps 1-4). The row is read up to its length
    lim (-inf past it: never selected, never kept), a tile at a time with the next tile's load in flight."""
    pdl_launch(PDL)
    pdl_wait(PDL)  # the scores and histograms; the workspace's zeroing and the lists' stores come after it
    r = tl.program_id(0)
    r64 = r.to(tl.int64)
    row = sc_ptr + r64 * S
    lim = tl.minimum(tl.load(lens_ptr + r // T).to(tl.int32) + r % T + 1, S)
    bins = tl.arange(0, 256)
    h8 = tl.load(h8_ptr + r * 256 + bins, cache_modifier=".cg")
    x = _whole_tile(tl.zeros((TILE,), dtype=tl.float32), row, 0, lim, TILE)  # in flight with the prefix's bins
    P, above, n_valid, n_c = prefix_from(h8, h16_ptr, r, K)
    if REARM:  # nothing reads the histograms after the prefix: the kept workspace zero again for the next call
        tl.debug_barrier()  # every thread's loads of them done
        _zero_counted(h16_ptr + r64 * 65536, h8)
        tl.store(h8_ptr + r * 256 + bins, tl.zeros((256,), dtype=tl.int32))
    out = out_ptr + r64 * K
    lst = lst_ptr + r64 * S
    kl = (P - 32768) << 16  # the keys of bin P: [kl, kl + 2^16)
    if n_valid > K:  # the pass selects the keys >= kl (flo, the smallest score of bin P) into the list, with scores
        n = _select_pass(x, row, lim, key_float(kl), lst, TILE, E, True)
    else:  # every candidate is kept (x > -inf: x >= the lowest finite float), straight to the output
        n = _select_pass(x, row, lim, -3.4028234663852886e38, out, TILE, E, False)
    if n_valid > K:
        # the list holds the keys above bin P (kept) and those in it (the candidates: scores below fhi, `key_float`;
        # NaN is never selected; above the largest finite keys fhi is NaN and !(x >= fhi) true), ascending, with their
        # scores. Its first CT entries stay in registers from the candidates' step to the output's (at decode all of
        # them: ~2100): one round trip to read the list, one to read the candidates (no gather of scores)
        fhi = key_float(kl + 65536)
        ck = ck_ptr + r64 * S
        ci = ci_ptr + r64 * S
        CT: tl.constexpr = TILE // 2
        i_ = tl.arange(0, CT)
        tl.debug_barrier()  # the list's stores before its loads (one CTA: the barrier orders them)
        NONE: tl.constexpr = -36028797018963968  # (-inf << 32 | 0: an entry past the list)
        v0 = tl.load(lst + i_, mask=i_ < n, other=NONE, cache_modifier=".cg")
        for i0 in range(0, n, CT):  # the candidates appended to their own list by an atomic each (few; any order)
            v = v0
            if i0 > 0:
                v = tl.load(lst + i0 + i_, mask=i0 + i_ < n, other=NONE, cache_modifier=".cg")
            xl, pos = _unpack(v)
            key, cand = score_keys(xl, ~(xl >= fhi))
            slot = tl.atomic_add(ncand_ptr + r + i_ * 0, 1, mask=cand, sem="relaxed")
            tl.store(ck + slot, key, mask=cand)
            tl.store(ci + slot, pos, mask=cand)
        tl.debug_barrier()  # every candidate's append returned and stored
        tl.store(ncand_ptr + r, 0)  # the counter zero for the next call (its count: the histogram's, hsub[P])
        tk, ts = _candidates_threshold(ck, ci, n_c, P, K - above, sc_ptr, lens_ptr, r, S, T, CT)
        ftk = key_float(tk)
        n_list = n
        n = 0
        for i0 in range(0, n_list, CT):  # the list's kept entries to the output, in order
            v = v0
            if i0 > 0:
                v = tl.load(lst + i0 + i_, mask=i0 + i_ < n_list, other=NONE, cache_modifier=".cg")
            xl, pos = _unpack(v)
            n = _append_kept(xl, pos, ftk, ts, out, n, E // 2, True, False, False)
    for j0 in range(0, K, KB):  # -1 after them
        j = j0 + tl.arange(0, KB)
        tl.store(out + j, -1, mask=(j >= n) & (j < K))


def row_tile(S: int, num_warps: int, tile: int = ROW_TILE) -> tuple[int, int]:
    """(TILE, E) for rows of S keys: keys per tile of the pass (`tile`, or the power of two covering S where that is
    smaller; two a thread at least: the list's tiles are half as long) and E = TILE / threads, the consecutive keys
    each thread ranks (`_append_kept`)."""
    threads = 32 * num_warps
    t = max(2 * threads, min(tile, triton.next_power_of_2(S)))
    return t, t // threads


def radix_topk_row(scores_BTS: torch.Tensor, seq_lens_B: torch.Tensor, k: int, workspace: torch.Tensor | None = None,
                   rearm: bool = False, pdl: bool = False, tile: int = ROW_TILE, num_warps: int = ROW_WARPS,
                   chunks: int | None = None) -> torch.Tensor:
    """`topk.radix_topk` with its split and write in one program per score row (`_topk_row_kernel`): the same
    [B, T, k] int32 kept positions (ascending, then -1), `topk_select_ref`'s bit for bit.

    workspace: one whose histograms the scores kernel already filled (`indexer_scores(hist=)`): no histogram launch,
    one launch in all; else the histogram launch over R x C programs first (chunks: as `radix_topk`'s). rearm: the
    kept workspace (`topk.kept_workspace`, taken here when workspace is None), left zeroed by the row kernel; off, a
    fresh `topk_workspace` unless given (one memset). pdl: both launches with programmatic dependent launch
    (`_triton.pdl_kwargs`; the memset stays a plain launch). tile, num_warps: the row program's keys per tile
    (`row_tile` fits it to S) and warps."""
    B, T, S = check_topk_args("radix_topk_row", scores_BTS, seq_lens_B, k, workspace)
    if num_warps not in (4, 8, 16, 32) or tile < 64 * num_warps or tile & (tile - 1):
        raise ValueError(f"radix_topk_row: want num_warps in (4, 8, 16, 32) and tile a power of two of two keys a "
                         f"thread at least, got num_warps = {num_warps}, tile = {tile}")
    dev = scores_BTS.device
    R = B * T
    sc = scores_BTS.contiguous()
    lens = device_lens(seq_lens_B, dev)
    filled = workspace is not None
    if workspace is None:
        workspace = kept_workspace(R, dev) if rearm else topk_workspace(R, dev)
    h16, h8 = histograms(workspace, R)
    ncand = workspace[R * (HIST + 256):R * (HIST + 257)]  # (zero between calls, as the rest)
    lst = torch.empty(R, S, dtype=torch.int64, device=dev)  # the selected positions with their scores
    cand = torch.empty(2, R, S, dtype=torch.int32, device=dev)  # the candidates' keys and positions
    out = torch.empty(B, T, k, dtype=torch.int32, device=dev)
    launch = pdl_kwargs(pdl, sc)
    mode = pdl_mode(pdl, launch)
    try:
        if not filled:
            blk, ch, C = chunk_plan(R, S, sm_count(dev), chunks)
            _topk_hist_kernel[(R, C)](sc, lens, h16, h8, S, T, ch, BLK=blk, PDL=mode, V2=True, num_warps=4, **launch)
        TILE, E = row_tile(S, num_warps, tile)
        _topk_row_kernel[(R,)](sc, lens, h16, h8, ncand, lst, cand[0], cand[1], out, S, T, k, TILE=TILE, E=E,
                               KB=1024, REARM=rearm, PDL=mode, num_warps=num_warps, **launch)
    except BaseException:
        if rearm:  # stopped between launches: the histograms may hold counts
            drop_kept_workspace(workspace)
        raise
    return out
