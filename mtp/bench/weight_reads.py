"""How fast the split rank's expert weight tiles stream from HBM, by the weights' memory layout (H200 probe).

The persistent gate / up kernel (`mtp.kernels.moe`) reads, per work item, a [128, 128] fp8 tile of the gate and of
the up weight per K group: 128 rows of 128 bytes, each row K bytes after the last in the checkpoint's row-major
[E, N, K] stack. On one TP=8 split rank it runs at 45-60% of the copy bandwidth at T = 1..4 tokens and no launch
setting moves it (BENCHMARKS.md sessions 17-19). One thing the settings cannot change is that access pattern: 128
separate 128-byte segments per tile, 7168 bytes apart (gate / up) or 256 apart (down). This probe streams the same
bytes in the same work items (expert, N-block, K slice; round-robin over one program per SM; a 16-row fp8 dot per
tile, as the kernel's wgmma with one token) from two layouts:
- rows: the row-major stack the kernels read today;
- tiles: each [128, 128] tile stored as one contiguous 16 KB block, a work item's K groups one after the other
  ([E, N / 128, K / 128, 128, 128]: what a loader-side re-layout of the experts would store).
No fix-up, no scales, no stores beyond one value per program: the floor each layout leaves the kernel. If tiles
stream clearly faster, a re-layout of the expert weights is worth building; if not, the pattern is not the limit.
Then the down projection's items (7168 rows of K = 256: 2 K groups an item) with the real kernel's per-item work
added one part at a time (`_down_probe_kernel`: h gathered by slot, scales, the weighted store; LATE: the scales
and route weights loaded at the item's start).

Measured (H200, session 19, BENCHMARKS.md): gate / up streams at 2.9-3.9 TB/s in either layout (tiles within
0-5%), within ~10% of the real kernel in the step: the layout is not the limit. Down alone streams at 3.25 TB/s
at T = 4 (18.7 us); with the real kernel's scales (+3.4 us), the weighted store (+3.2) and both with the gather
27.9 us, ~ the real kernel's 29.4: the per-item work, not the bytes, is what down loses at T = 4.

    python -m mtp.bench.weight_reads [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from mtp.kernels._triton import tl, triton

TILE = 128
TL_TILE = tl.constexpr(TILE)  # the kernel's name for it (a jit function reads constexpr globals only)


@triton.jit
def _stream_kernel(w1_ptr, w3_ptr, x_ptr, out_ptr, n_items, NB, KS, G, K, TILED: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, TWO: tl.constexpr):
    """Work items w = (expert a, N-block nb of BN rows, K slice ks) round-robin over the programs; per K group the
    [BN, 128] tile of (a, nb) of w1 (and of w3 where TWO: gate and up; layout TILED: BN = 128) times x's [128, BM]
    tile, summed into one value per program."""
    r = tl.arange(0, TL_TILE)
    n = tl.arange(0, BN)
    xt = tl.load(x_ptr + r[:, None] * BM + tl.arange(0, BM)[None, :])
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    gps = tl.cdiv(G, KS)
    for w in range(tl.program_id(0), n_items, tl.num_programs(0)):
        a = w // (NB * KS)
        nb = (w // KS) % NB
        ks = w % KS
        g0 = ks * gps
        g1 = tl.minimum(g0 + gps, G)
        if TILED:  # tile (a, nb, g) at ((a * NB + nb) * G + g) * 16 KB, its rows 128 bytes apart
            base = ((a * NB + nb) * G).to(tl.int64) * (TL_TILE * TL_TILE) + n[:, None] * TL_TILE + r[None, :]
            step = TL_TILE * TL_TILE
        else:  # row-major [E, N, K]: rows K bytes apart, group g at column g * 128
            base = (a * NB * BN).to(tl.int64) * K + (nb * BN + n).to(tl.int64)[:, None] * K + r[None, :]
            step = TL_TILE
        for g in range(g0, g1):
            acc += tl.dot(tl.load(w1_ptr + base + g * step), xt)
            if TWO:
                acc += tl.dot(tl.load(w3_ptr + base + g * step), xt)
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _down_probe_kernel(w_ptr, x_ptr, h8_ptr, hs_ptr, s2_ptr, rw_ptr, out_ptr, sum_ptr, n_items, NB, D, I, T,
                       BM: tl.constexpr, GATHER: tl.constexpr, SCALES: tl.constexpr, STORE: tl.constexpr,
                       LATE: tl.constexpr, GI_C: tl.constexpr):
    """The down projection's work items (expert a, 128-row N-block nb, all of K = I) as `_stream_kernel` runs them,
    with the real kernel's per-item work added one part at a time: GATHER: each group's [BM, 128] h tile loaded from
    the expert's token rows of h8 [E * T, I] (slot a * T + m, rows m >= T masked) instead of one x tile held in
    registers; SCALES: h's row scales hs [E * T, GI] and the weight's block scale s2 [E, NB, GI] loaded per group and
    applied; STORE: the item's [128, BM] result times its rows' route weights stored to out [E * T, D] (else summed
    into one value per program). LATE (with SCALES and STORE; GI_C = I / 128 groups, unrolled): every group's
    scales and the route weights loaded at the item's start, each group's product kept apart and scaled at the end
    (no load between a product and the next), the same sums up to the sign of an exact zero."""
    r = tl.arange(0, TL_TILE)
    m = tl.arange(0, BM)
    GI = I // TL_TILE
    xt = tl.load(x_ptr + r[:, None] * BM + m[None, :])
    total = tl.zeros((TL_TILE, BM), dtype=tl.float32)
    for w in range(tl.program_id(0), n_items, tl.num_programs(0)):
        a = w // NB
        nb = w % NB
        base = (a * NB * TL_TILE).to(tl.int64) * I + (nb * TL_TILE + r).to(tl.int64)[:, None] * I + r[None, :]
        slot = a * T + m
        active = m < T
        acc = tl.zeros((TL_TILE, BM), dtype=tl.float32)
        if LATE:
            rw = tl.load(rw_ptr + slot, mask=active, other=0.0)
            for g in tl.static_range(GI_C):
                sc = tl.load(hs_ptr + slot * GI_C + g, mask=active, other=0.0) * tl.load(s2_ptr + (a * NB + nb) * GI_C + g)
                ht = tl.trans(tl.load(h8_ptr + slot.to(tl.int64)[:, None] * I + g * TL_TILE + r[None, :],
                                      mask=active[:, None], other=0.0))
                acc += tl.dot(tl.load(w_ptr + base + g * TL_TILE), ht) * sc[None, :]
            tl.store(out_ptr + slot.to(tl.int64)[None, :] * D + (nb * TL_TILE + r)[:, None], acc * rw[None, :],
                     mask=active[None, :])
        for g in range(0, GI * (1 - LATE)):
            wt = tl.load(w_ptr + base + g * TL_TILE)
            if GATHER:
                ht = tl.trans(tl.load(h8_ptr + slot.to(tl.int64)[:, None] * I + g * TL_TILE + r[None, :],
                                      mask=active[:, None], other=0.0))
            else:
                ht = xt
            if SCALES:
                hs = tl.load(hs_ptr + slot * GI + g, mask=active, other=0.0)
                s = tl.load(s2_ptr + (a * NB + nb) * GI + g)
                acc += tl.dot(wt, ht) * (hs * s)[None, :]
            else:
                acc += tl.dot(wt, ht)
        if STORE and not LATE:
            rw = tl.load(rw_ptr + slot, mask=active, other=0.0)
            tl.store(out_ptr + slot.to(tl.int64)[None, :] * D + (nb * TL_TILE + r)[:, None], acc * rw[None, :],
                     mask=active[None, :])
        elif not LATE:
            total += acc
    tl.store(sum_ptr + tl.program_id(0), tl.sum(tl.sum(total, 1), 0))


def down_probe(w: torch.Tensor, x: torch.Tensor, h8: torch.Tensor, hs: torch.Tensor, s2: torch.Tensor,
               rw: torch.Tensor, out: torch.Tensor, T: int, programs: int, gather: bool, scales: bool, store: bool,
               num_warps: int = 4, num_stages: int = 3, late: bool = False) -> torch.Tensor:
    """`_down_probe_kernel` over every (expert, N-block) of the [E, D, I] stack w; one fp32 value per program."""
    E, D, I = w.shape
    sums = torch.empty(programs, dtype=torch.float32, device=w.device)
    _down_probe_kernel[(programs,)](w, x, h8, hs, s2, rw, out, sums, E * (D // TILE), D // TILE, D, I, T,
                                    BM=x.shape[1], GATHER=gather, SCALES=scales, STORE=store, LATE=late,
                                    GI_C=I // TILE, num_warps=num_warps, num_stages=num_stages)
    return sums


def tiled(w: torch.Tensor) -> torch.Tensor:
    """A row-major [E, N, K] stack as [E, N / 128, K / 128, 128, 128] contiguous tiles."""
    E, N, K = w.shape
    return w.view(E, N // TILE, TILE, K // TILE, TILE).permute(0, 1, 3, 2, 4).contiguous()


def stream(w1: torch.Tensor, w3: torch.Tensor | None, x: torch.Tensor, ks: int, programs: int, layout: str,
           num_warps: int = 4, num_stages: int = 4, bn: int = TILE) -> torch.Tensor:
    """Every (expert, N-block of bn rows) of the [E, N, K] stack w1 (and w3: gate and up; None: one projection, as
    down) given in `layout` ('rows' [E, N, K] or 'tiles' as `tiled` returns, bn = 128) in ks K slices over
    `programs` programs; one fp32 value per program."""
    if layout not in ("rows", "tiles"):
        raise ValueError(f"stream: layout must be 'rows' or 'tiles', got {layout!r}")
    E, N, K = (w1.shape[0], w1.shape[1] * TILE, w1.shape[2] * TILE) if layout == "tiles" else w1.shape
    G = K // TILE
    if N % bn or K % TILE or bn % TILE or (layout == "tiles" and bn != TILE) or not 1 <= ks <= G:
        raise ValueError(f"stream: N = {N} a multiple of bn = {bn} (a multiple of {TILE}; {TILE} for tiles), K = {K} "
                         f"of {TILE}, 1 <= ks = {ks} <= {G}")
    out = torch.empty(programs, dtype=torch.float32, device=w1.device)
    _stream_kernel[(programs,)](w1, w1 if w3 is None else w3, x, out, E * (N // bn) * ks, N // bn, ks, G, K,
                                TILED=layout == "tiles", BM=x.shape[1], BN=bn, TWO=w3 is not None,
                                num_warps=num_warps, num_stages=num_stages)
    return out


# the split rank's experts at T tokens: 8 T routed experts (distinct at random) + the shared one; gate / up 256 rows
# (2048 / 8) of K = 7168 in K slices as `moe.wave_splits` gives them (7 / 4 / 2 / 2); down 7168 rows of K = 256
CASES = {1: (9, 7), 2: (17, 4), 3: (25, 2), 4: (33, 2)}
L2_BYTES = 60 * 2**20
# down: (rows per work item, programs per SM, warps, stages); the kernel's today: 128 rows, 2 per SM, 4 warps, 3
DOWN = ((128, 2, 4, 3), (128, 1, 4, 4), (256, 1, 4, 3), (256, 2, 8, 2), (512, 1, 8, 2), (512, 1, 4, 2))


def _timed(res: dict, label: str, key: str, nbytes: int, fns) -> None:
    from mtp.bench import kernels as gk

    us = gk.graph_us(fns)
    res[key] = {"us": us, "TBps": nbytes / us / 1e6}
    print(f"{label}  {key:32s} {us:8.2f} us {res[key]['TBps']:.2f} TB/s", flush=True)


def _stacks(shape: tuple, n: int, copies: int, dev) -> list:
    return [[torch.randint(0, 64, shape, device=dev, dtype=torch.uint8).view(torch.float8_e4m3fn) for _ in range(n)]
            for _ in range(copies)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for weight_reads.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    I, D = 256, 7168
    x = (torch.randn(TILE, 16, device=dev) * 0.1).to(torch.float8_e4m3fn)
    res = {"device": torch.cuda.get_device_name(dev), "gate_up": {}, "down": {}}
    for T, (E, ks) in CASES.items():
        nbytes = 2 * E * I * D
        rows = _stacks((E, I, D), 2, max(2, -(-3 * L2_BYTES // nbytes)), dev)  # > 3 x L2 rotated: HBM every replay
        tiles = [[tiled(w) for w in pair] for pair in rows]
        row = res["gate_up"][T] = {"experts": E, "ks": ks, "MB": nbytes / 1e6}
        label = f"gate/up T={T} ({E} experts, {ks} slices, {nbytes / 1e6:.1f} MB)"
        for name, stacks in (("rows", rows), ("tiles", tiles)):
            for nw, st in ((4, 4), (8, 4)):
                if name == "tiles":  # the same bytes in the same order per program: the same sums
                    got = stream(*tiles[0], x, ks, sms, "tiles", nw, st)
                    assert torch.equal(got, stream(*rows[0], x, ks, sms, "rows", nw, st)), f"T={T}: tiles differ"
                _timed(row, label, f"{name} warps={nw} stages={st}", nbytes,
                       [lambda a=a, b=b, nw=nw, st=st, name=name: stream(a, b, x, ks, sms, name, nw, st)
                        for a, b in stacks])
        del rows, tiles
        nbytes = E * D * I
        stacks = _stacks((E, D, I), 1, max(2, -(-3 * L2_BYTES // nbytes)), dev)
        row = res["down"][T] = {"experts": E, "MB": nbytes / 1e6}
        label = f"down T={T} ({E} experts, {nbytes / 1e6:.1f} MB)"
        for bn, per_sm, nw, st in DOWN:
            try:
                _timed(row, label, f"rows={bn} per_sm={per_sm} warps={nw} stages={st}", nbytes,
                       [lambda a=a[0], bn=bn, p=per_sm * sms, nw=nw, st=st: stream(a, None, x, 1, p, "rows", nw, st, bn)
                        for a in stacks])
            except Exception as e:  # a setting that does not fit (shared memory): said, the others still run
                print(f"{label}  rows={bn} per_sm={per_sm} warps={nw} stages={st}: {type(e).__name__}: {e}"[:300])
        # the real kernel's per-item work, one part at a time, at today's down settings
        h8 = _stacks((E * T, I), 1, 1, dev)[0][0]
        hs = torch.rand(E * T, I // TILE, device=dev) + 0.5
        s2 = torch.rand(E, D // TILE, I // TILE, device=dev) + 0.5
        rw = torch.rand(E * T, device=dev)
        out = torch.empty(E * T, D, device=dev)
        for gather, scales, store, late in ((0, 0, 0, 0), (1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (1, 1, 0, 0),
                                            (1, 1, 1, 0), (1, 1, 1, 1)):
            _timed(row, label, f"probe gather={gather} scales={scales} store={store} late={late}", nbytes,
                   [lambda a=a[0], g=gather, sc=scales, st=store, lt=late:
                    down_probe(a, x, h8, hs, s2, rw, out, T, 2 * sms, bool(g), bool(sc), bool(st), late=bool(lt))
                    for a in stacks])
        del stacks
        torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "weight_reads.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
