"""Exact FP8 block scales for a slice of a 128x128-block-scaled weight ("re-blocking").

A checkpoint weight w8 [N, K] carries scale [ceil(N/128), ceil(K/128)]: W[n, k] = w8[n, k] * scale[n // 128,
k // 128]. `Linear` (and every kernel) assumes the same layout for whatever it holds, so a rank that holds rows
[r0, r1) needs scales on the slice's OWN 128-blocking: local block b = local rows [128 b, 128 b + 128).

Local block b gets the parent scale of the parent block its first row falls in, (r0 + 128 b) // 128. This is
exact -- W_local[i, k] = w8[r0 + i, k] * scale[(r0 + i) // 128, k // 128], the very same fp32 product -- iff
every local block lies inside one parent block, i.e. for every b:
    (r0 + 128 b) // 128 == (min(r0 + 128 b + 128, r1) - 1) // 128.
That holds when r0 is a multiple of 128 (any length), or when the whole slice sits inside one parent block
(halves, quarters, ... of a block: TP 32 cutting 2048 rows into 64-row slices). Other cuts (a 192-row slice
starting at row 192) would need two scales inside one local block. A row slice (the output channels of a
column-parallel projection: q_b_proj, kv_b_proj per head) then gets finer local blocks instead: `row_block` rows
each, the largest power of two dividing both its start and 128 (64 for a start at 192), so every local block
again lies inside one parent block and carries that block's scale -- still the very same fp32 products. The
`Linear` holding it knows its `scale_rows`. Column slices (dim 1) cut the input channels, which FP8 numerics
quantize per 128 anyway; their cuts must keep to the parent blocks (`ReblockError` otherwise). The layout never
cuts the real DeepSeek-V3.2 config that way for W | 64 (see `mtp.parallel.layout`); small models (4 heads of
96 query rows) need the finer row blocks at W = 2.
"""

from __future__ import annotations

import math

import torch

from ..model.config import BLOCK
from .layout import Shard


class ReblockError(ValueError):
    """A slice of a block-scaled FP8 weight cannot carry exact scales on its own 128-blocking."""


def block_map(start: int, stop: int, what: str = "slice", rows: int = BLOCK) -> list[int]:
    """Parent block index of each local `rows`-block of [start, stop)."""
    out = []
    for b in range(math.ceil((stop - start) / rows)):
        first, last = start + b * rows, min(start + (b + 1) * rows, stop) - 1
        if first // BLOCK != last // BLOCK:
            raise ReblockError(
                f"{what}: [{start}, {stop}) cannot be re-blocked exactly: its local {rows}-block {b} (global "
                f"[{first}, {last + 1})) straddles parent blocks {first // BLOCK} and {last // BLOCK}; "
                f"use a slice start that is a multiple of {BLOCK} or a slice inside one block")
        out.append(first // BLOCK)
    return out


def row_block(start: int, stop: int) -> int:
    """Rows per scale block of the row slice [start, stop): 128 where its own 128-blocks each lie inside one
    parent block, else the largest power of two dividing start and 128 (exact for any start)."""
    try:
        block_map(start, stop)
        return BLOCK
    except ReblockError:
        return math.gcd(start, BLOCK)


def reblock_scale(scale: torch.Tensor, weight_shape: tuple[int, int], shard: Shard,
                  what: str = "weight") -> torch.Tensor:
    """The scale [ceil(n/r), ceil(k/128)] of `shard` of a weight of `weight_shape` whose full scale is `scale`
    (r = `row_block` of a row slice, else 128)."""
    N, K = weight_shape
    want = (math.ceil(N / BLOCK), math.ceil(K / BLOCK))
    if tuple(scale.shape) != want:
        raise ReblockError(f"{what}: scale shape {list(scale.shape)} does not match weight {[N, K]} "
                           f"(expected {list(want)})")
    rows = (block_map(shard.start, shard.stop, what, row_block(shard.start, shard.stop)) if shard.dim == 0
            else list(range(want[0])))
    cols = block_map(shard.start, shard.stop, what) if shard.dim == 1 else list(range(want[1]))
    idx_r = torch.tensor(rows, dtype=torch.long, device=scale.device)
    idx_c = torch.tensor(cols, dtype=torch.long, device=scale.device)
    return scale.index_select(0, idx_r).index_select(1, idx_c).contiguous()


def shard_fp8(w8: torch.Tensor, scale: torch.Tensor, shard: Shard,
              what: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """(w8 slice, re-blocked scale) of an in-memory FP8 weight."""
    if shard.dim is None:
        return w8, scale
    w = w8.narrow(shard.dim, shard.start, shard.stop - shard.start).contiguous()
    return w, reblock_scale(scale, tuple(w8.shape), shard, what)


def scale_rows(layout, name: str) -> int:
    """Rows per scale block of this rank's part of checkpoint weight (or scale) `name` (`layout`: a RankLayout)."""
    shard = layout.shard(name.replace(".weight_scale_inv", ".weight"))
    return row_block(shard.start, shard.stop) if shard is not None and shard.dim == 0 else BLOCK
