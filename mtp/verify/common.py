from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Verdict:
    accept_len_B: torch.Tensor  # int64 [B], drafts accepted (a prefix)
    next_token_B: torch.Tensor  # int64 [B], the target's token after the accepted prefix
    relaxed_only_B: torch.Tensor  # int64 [B], accepted drafts that were not the target argmax


def prefix_len(match_BK: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True per row (0 if the first is False)."""
    if match_BK.shape[1] == 0:
        return torch.zeros(match_BK.shape[0], dtype=torch.long, device=match_BK.device)
    return match_BK.cumprod(dim=1).sum(dim=1)  # a bool cumprod is int64 (no cast launch)
