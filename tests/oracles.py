"""Independent float64 implementations of reference formulas, shared by the oracle tests."""

import math

import torch

F64 = torch.float64


def yarn_inv_freq64(cfg) -> tuple[torch.Tensor, int, int]:
    """Facts section 3, float64: (inv_freq [R/2], low, high)."""
    dim, base, rs = cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling
    freqs = base ** (-torch.arange(0, dim, 2, dtype=F64) / dim)

    def corr(rot):
        return dim * math.log(rs.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(corr(rs.beta_fast)), 0), min(math.ceil(corr(rs.beta_slow)), dim - 1)
    smooth = 1 - ((torch.arange(dim // 2, dtype=F64) - low) / (high - low)).clamp(0, 1)
    return freqs / rs.factor * (1 - smooth) + freqs * smooth, low, high
