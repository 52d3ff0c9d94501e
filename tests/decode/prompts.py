"""Prompts of the tree decoding tests."""

from __future__ import annotations

import torch


def random_prompts(*lengths: int, seed: int = 1) -> list[list[int]]:
    """Prompts of these lengths (index_topk 16: up to 16 tokens dense attention, longer sparse)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 500, (n,), generator=g).tolist() for n in lengths]
