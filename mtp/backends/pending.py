"""A residual stream with one addend not yet summed over the tensor-parallel ranks (the fast path's hand-off).

Shape legend: B batch, T tokens, D width.

A row-parallel sublayer (o_proj; the FFN: dense `ParallelMLP`'s down_proj, the expert-parallel MoE's routed +
shared sum) ends in an all-reduce, and what reads its output first is the residual add + RMSNorm (+ FP8 quant) of
the next sublayer. Under allreduce='oneshot' `Comm.all_reduce_add_norm` does all of it in one kernel, so the
fast path carries the sublayer's un-reduced partial to that norm instead of reducing it in place: o_proj's inside
`FastBlock`, the FFN's from one block to the next (`FastTrunk`). `Pending` is that hand-off, explicit in the
trunk loop: h_BTD + sum_ranks(partial), rounded to `round_dtype` before the add exactly where the unfused
sublayer rounds its reduced output (the dense MLP's / o_proj's `.to(x.dtype)`, the MoE's fp32 sum to the model
dtype), so the residual stream gets the same bits as the unfused path.

Where the one-shot kernel does not take the call (`Comm.fuses`: a message over its slots, NCCL, gloo) the
all-reduce runs alone and the add + norm + quant is the fast path's own kernel (`kernels.norm_quant`), the one
the unfused path runs, which also rounds the fp32 sum (switch `fuse_out_cast`; off: a cast launch before it): the
same bits as the unfused fast path. Under NCCL `FastBlock` hands o_proj's partial to a `Pending` for this alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.norm_quant import add_rms_norm_quant, add_rounded
from ..model.layers import RMSNorm
from ..parallel.comm import AddNorm, Comm


@dataclass(frozen=True)
class Pending:
    """h_BTD + sum_ranks(partial).to(round_dtype).to(h_BTD.dtype), not yet computed.

    h_BTD: the fp32 residual stream [B, T, D]; partial: this rank's share [B, T, D] in the accumulation dtype
    (overwritten when resolved); round_dtype: the dtype the reduced sum is rounded to first (None: none);
    comm: the group that sums it; fold (switch `fuse_out_cast`): where the one-shot kernel does not take it, the
    rounding happens in the kernel that adds the sum (no cast launch), else as a `.to` before it; pdl: the PDL mode
    of that kernel where `resolve` launches it (`FastPathOptions.pdl_at` of the block that handed it off)."""

    h_BTD: torch.Tensor
    partial: torch.Tensor
    round_dtype: torch.dtype | None
    comm: Comm
    fold: bool = True
    pdl: int = 0

    def __post_init__(self) -> None:
        if self.partial.shape != self.h_BTD.shape:
            raise ValueError(f"Pending: partial {list(self.partial.shape)} must match the residual "
                             f"{list(self.h_BTD.shape)}")

    def add_norm(self, norm: RMSNorm, out_dtype: torch.dtype, quant: bool, pdl: bool = False,
                 num_warps: int | None = None) -> AddNorm:
        """The new residual, its RMSNorm in out_dtype and (quant) that norm's FP8 quant per 128 channels. num_warps:
        the add + norm + quant kernel's where the one-shot kernel does not take the call (`add_rms_norm_quant`: the
        fast path's `FastPathOptions.norm_warps`, as its unfused norms take, so both give the same bits); the
        one-shot kernel's fused norm runs its own programs."""
        if self.comm.fuses(self.partial, self.h_BTD):
            return self.comm.all_reduce_add_norm(self.partial, self.h_BTD, norm.weight, norm.eps, out_dtype,
                                                 round_dtype=self.round_dtype, quant=quant)
        if self.fold:  # the reduced fp32 sum, rounded inside the add + norm + quant kernel
            h, y, x8, sx = add_rms_norm_quant(self.h_BTD, self._summed(), norm.weight, norm.eps, out_dtype,
                                              quant=quant, pdl=pdl, round_dtype=self.round_dtype, num_warps=num_warps)
        else:
            h, y, x8, sx = add_rms_norm_quant(self.h_BTD, self._reduced(), norm.weight, norm.eps, out_dtype,
                                              quant=quant, pdl=pdl, num_warps=num_warps)
        return AddNorm(y, h, x8, sx)

    def resolve(self) -> torch.Tensor:
        """The new residual alone (where no norm follows: the trunk's last block, whose residual the final norm
        and the MTP modules read)."""
        if self.comm.fuses(self.partial, self.h_BTD):
            return self.comm.all_reduce_add_norm(self.partial, self.h_BTD, None, 0.0,
                                                 round_dtype=self.round_dtype).residual
        if self.fold and self.h_BTD.dtype == self.partial.dtype == torch.float32:  # one kernel, rounding inside
            return add_rounded(self.h_BTD, self._summed(), self.round_dtype or torch.float32, self.pdl)
        return self.h_BTD + self._reduced().to(self.h_BTD.dtype)

    def _summed(self) -> torch.Tensor:
        return self.comm.all_reduce(self.partial.contiguous())

    def _reduced(self) -> torch.Tensor:
        s = self._summed()
        return s if self.round_dtype is None else s.to(self.round_dtype)


def resolved(h: torch.Tensor | Pending) -> torch.Tensor:
    """The residual stream itself, summing a pending addend if there is one."""
    return h.resolve() if isinstance(h, Pending) else h
