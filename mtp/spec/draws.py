"""Counter-based random numbers for sampling: every draw is a pure function of (row seed, row position, stream).

A row's draws then depend on nothing but its own seed and how far it has got, never on its batch-mates, its
place in the batch or how many draws other rows made, and they need no generator state: the hash is a few int64
tensor ops on the device, so a captured CUDA graph replays them with fresh values (the position tensor it reads
has moved on) and eager, graph and overlap runs draw the same numbers.

    u = top 24 bits of splitmix64(splitmix64(splitmix64(seed) ^ position) ^ stream) / 2^24   in [0, 1)

`position` is the row's committed length when the draw is made (it grows by at least one per step, so no two
steps share it); `stream` tells the draws of one step apart: draft j, the acceptance test of draft j, and the
token after the accepted drafts. splitmix64 (Steele et al., 2014) is a bijection with full avalanche; 24 bits is
what a float32 uniform holds (as torch.rand). torch's int64 arithmetic wraps on overflow and its right shift
is arithmetic, so logical shifts are masked; `splitmix64_ref` is the same function on Python ints (tested equal).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DRAFT, ACCEPT, NEXT = 0, 1 << 16, 2 << 16  # stream bases: draft j and the acceptance of draft j add j

_M64 = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 value with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> on int64 is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    z = x + _signed(_GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    return z ^ _shr(z, 31)


def splitmix64_ref(x: int) -> int:
    """The same function on Python ints (unsigned 64-bit), the reference the tensor version is held to."""
    z = (x + _GOLDEN) & _M64
    z = ((z ^ (z >> 30)) * _MIX1) & _M64
    z = ((z ^ (z >> 27)) * _MIX2) & _M64
    return z ^ (z >> 31)


def seed_tensor(seeds, device: torch.device | str) -> torch.Tensor:
    """Row seeds (any Python ints, taken modulo 2^64) as an int64 tensor."""
    return torch.tensor([_signed(int(s) & _M64) for s in seeds], dtype=torch.long, device=device)


@dataclass
class RowDraws:
    """The random numbers of one batch of rows: `seed_B` (int64) and `position_B` (int64, read when a draw is
    made, so it may be a buffer that a captured step updates in place)."""

    seed_B: torch.Tensor
    position_B: torch.Tensor

    def uniform(self, stream: int, n: int) -> torch.Tensor:
        """[B, n] float32 uniforms in [0, 1) of streams stream .. stream + n - 1."""
        key_B = splitmix64(splitmix64(self.seed_B) ^ self.position_B)
        streams = torch.arange(stream, stream + n, device=key_B.device)
        bits = splitmix64(key_B.unsqueeze(1) ^ streams)
        return _shr(bits, 40).float() * (1.0 / (1 << 24))


def uniforms(rng: RowDraws | torch.Generator | None, shape: tuple[int, ...], stream: int,
             device: torch.device) -> torch.Tensor:
    """Uniforms of `shape` from a torch.Generator (None: torch's default), or from per-row counter-based draws,
    where `shape` must be (B, n)."""
    if isinstance(rng, RowDraws):
        if len(shape) != 2 or shape[0] != rng.seed_B.shape[0]:
            raise ValueError(f"per-row draws give [B, n] with B = {rng.seed_B.shape[0]} rows, asked for {shape}")
        return rng.uniform(stream, shape[1])
    return torch.rand(shape, generator=rng, device=device)


def filter_probs(logits: torch.Tensor, sp) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p (nucleus; the token crossing p is kept)."""
    x = logits.float() / sp.temperature
    if sp.top_k and sp.top_k < x.shape[-1]:
        kth = x.topk(sp.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = x.softmax(dim=-1)
    if sp.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly before each token
        drop_sorted = before >= sp.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, rng: RowDraws | torch.Generator | None, stream: int = NEXT) -> torch.Tensor:
    """One draw per row of probs [..., V] ([B, V] with per-row draws) by inverse CDF with a uniform from `rng`
    (device-side, no sync)."""
    u = uniforms(rng, probs.shape[:-1] + (1,), stream, probs.device)
    cdf = probs.float().cumsum(dim=-1)
    idx = torch.searchsorted(cdf, u * cdf[..., -1:], right=True)
    return idx.clamp_max(probs.shape[-1] - 1).squeeze(-1)
