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
starting at row 192) would need two scales inside one local block; those raise `ReblockError` rather than
silently storing a different weight. The same rule applies to column slices (dim 1). The layout never
produces such cuts for the real DeepSeek-V3.2 config with W | 64 (see `mtp.parallel.layout`).
"""

from __future__ import annotations

import math

import torch

from ..model.config import BLOCK
from .layout import Shard


class ReblockError(ValueError):
    """A slice of a block-scaled FP8 weight cannot carry exact scales on its own 128-blocking."""


def block_map(start: int, stop: int, what: str = "slice") -> list[int]:
    """Parent block index of each local 128-block of [start, stop)."""
    out = []
    for b in range(math.ceil((stop - start) / BLOCK)):
        first, last = start + b * BLOCK, min(start + (b + 1) * BLOCK, stop) - 1
        if first // BLOCK != last // BLOCK:
            raise ReblockError(
                f"{what}: [{start}, {stop}) cannot be re-blocked exactly: its local 128-block {b} (global "
                f"[{first}, {last + 1})) straddles parent blocks {first // BLOCK} and {last // BLOCK}; "
                f"use a slice start that is a multiple of {BLOCK} or a slice inside one block")
        out.append(first // BLOCK)
    return out


def reblock_scale(scale: torch.Tensor, weight_shape: tuple[int, int], shard: Shard,
                  what: str = "weight") -> torch.Tensor:
    """The scale [ceil(n/128), ceil(k/128)] of `shard` of a weight of `weight_shape` whose full scale is `scale`."""
    N, K = weight_shape
    want = (math.ceil(N / BLOCK), math.ceil(K / BLOCK))
    if tuple(scale.shape) != want:
        raise ReblockError(f"{what}: scale shape {list(scale.shape)} does not match weight {[N, K]} "
                           f"(expected {list(want)})")
    rows = block_map(shard.start, shard.stop, what) if shard.dim == 0 else list(range(want[0]))
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
