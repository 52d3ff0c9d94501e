"""An FP8 copy of an MTP module's head for the drafts only (`draft_head_fp8=True`, `DraftConfig.head_fp8`).

Shape legend: B batch, T positions, D width, N head rows (the vocabulary, a rank's shard of it, or a draft vocabulary's
kept rows), G = D / 128 channel groups, M entries after the gather.

Why: each draft forward reads its module's bf16 head in full to pick one token. At TP=8 a rank's shard is [16160, 7168]
bf16, 232 MB: cuBLAS's bf16 GEMM took ~59 us a call on an H200 (at its byte floor, 48 us at 4.8 TB/s), 4 calls in an
eagle k = 3 step (the verify's and the 3 drafts'; eval/results/s20/h200a/base.json, the step's profile). The copy here
holds the same rows in DeepSeek's weight format, e4m3 with one fp32 scale per 128 x 128 block (`fp8.weight_quant`, the
quantizer the checkpoint writers use): 116 MB a rank at TP=8, read by the drafts' calls instead. Predicted: ~30 us a
draft call, ~-0.09 ms an eagle k = 3 step. Measured (H200, session 20, BENCHMARKS.md): ~54 us a draft call through the
split-K FP8 GEMV (`_gemv_fma_kernel`, not tuned for 16160 rows), the step's GPU time 8.025 -> 7.979 ms: so an option. The verify keeps the model's bf16 head, so strict
decoding stays lossless and the sampling verifier exact (rejection sampling corrects any draft distribution); only
acceptance can change, by the drafts the FP8 rounding flips.

The product is the other FP8 projections' formula: the head's input quantized per 128 channels (ue8m0 scales), one
fp32 dot per 128-group scaled by s_x * s_w, the groups summed in fp32. On the fast path (the model's `fast_options`,
read at call time, as the decode step reads them) it runs on their kernels (`kernels.dispatch.linear`: the split-K
GEMV at 1..gemv_rows rows, the weight-streaming GEMV above); on the reference path it is an FP8 `Linear`'s own
product (`Linear.matmul`: act_quant + `fp8_gemm_ref` under 'fp8' numerics, x times the dequantized weight under
'dequant'), the formula the fast path's tests hold it to.
Vocabulary-parallel head (rank r of W holds rows [r V/W, (r+1) V/W)): each rank quantizes its own shard, blocks from
its first row (the same blocks as one process's where V/W is a multiple of 128: the tiny TP tests; at V = 129280,
W = 8 the shards start 32 rows into a block, so the grid differs from one process's, an FP8 copy as good), and the
logits are all-gathered in rank order as the bf16 head's are. With a draft vocabulary (`vocab.SubHead`) the copy is of
the rank's rows in SubHead's layout (balanced by default: ceil(N / W) rows a rank in list order, 4096 at N = 32768,
W = 8, 29.4 MB of e4m3 where the by-shard layout kept 16160 rows on rank 0, 115.8 MB; and as n is a multiple of 128
there, the blocks are those of one process's copy of the list), with the same gather and -inf padding.
The copy is made once per (head, vocabulary), when the first proposer asks, and shared by every proposer after (an
engine keeps one per batch bucket); `_FP8_HEADS.clear()` drops them (after weights changed in place).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import nn

from ..model import fp8
from ..model.layers import Linear
from .vocab import SubHead, by_shard, kept_per_head, parallel_world

# rows quantized per call of `fp8.weight_quant` (a multiple of its 128-row blocks, so the blocks are those of one call):
# its fp32 copy of the rows and their quotient stay ~2 x 235 MB at D = 7168, where the whole TP=1 head at once
# (129280 rows) would take ~7.4 GB of transient memory
QUANT_ROWS = 8192


def check_model(model, modules: Sequence[int]) -> None:
    """Refuse a model whose MTP heads cannot be copied into FP8: the width must be a multiple of the 128-channel
    block (the input is quantized per 128), and each module's `shared_head.head` must hold a float weight [rows, D]."""
    D = model.cfg.hidden_size
    if D % fp8.BLOCK:
        raise ValueError(f"draft_head_fp8: the FP8 head quantizes its input per {fp8.BLOCK} channels, and the model's "
                         f"hidden_size {D} is not a multiple of {fp8.BLOCK}")
    for j in modules:
        where = f"model.mtp[{j}].shared_head.head"
        w = getattr(getattr(model.mtp[j].shared_head, "head", None), "weight", None)
        if not isinstance(w, torch.Tensor):
            raise ValueError(f"draft_head_fp8: {where} has no weight to copy into FP8 (got "
                             f"{type(model.mtp[j].shared_head.head).__name__})")
        if w.dim() != 2 or w.shape[1] != D or not w.is_floating_point() or w.dtype == fp8.FP8_DTYPE or w.is_meta:
            raise ValueError(f"draft_head_fp8: {where}.weight must be a float [rows, {D}] tensor with values to "
                             f"copy into FP8, got {w.dtype} {list(w.shape)} on {w.device}")


def quantize_rows(w_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8.weight_quant(w_ND)` ((e4m3 [N, D], scales fp32 [ceil(N/128), G])), QUANT_ROWS rows at a time: the same
    tensors, a bounded transient."""
    if w_ND.shape[0] <= QUANT_ROWS:
        return fp8.weight_quant(w_ND)
    parts = [fp8.weight_quant(w_ND[r:r + QUANT_ROWS]) for r in range(0, w_ND.shape[0], QUANT_ROWS)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


class Fp8Head:
    """Draft logits `self(x [..., D]) -> [..., M]` from an FP8 copy of head rows w_ND: M = N for one process; W * N
    under a vocabulary-parallel `comm` (rank order), with entries whose `ids_M` is -1 (a draft vocabulary's per-rank
    padding) at -inf. `ids_M` (draft vocabulary): entry -> model id, as `SubHead.ids_M`; None for the whole head."""

    def __init__(self, model, w_ND: torch.Tensor, comm=None, ids_M: torch.Tensor | None = None):
        N, D = w_ND.shape
        w8, sw = quantize_rows(w_ND)
        with torch.device("meta"):  # no allocation: the copy's tensors go in below
            self.linear = Linear(D, N, True)
        self.linear.weight = nn.Parameter(w8, requires_grad=False)
        self.linear.weight_scale_inv = nn.Parameter(sw, requires_grad=False)
        self.comm, self.ids_M = comm, ids_M
        self._model = weakref.ref(model)  # for its switches at call time; a strong one would keep the model alive

    @property
    def nbytes(self) -> int:
        """Bytes of the copy: the e4m3 rows and their fp32 block scales."""
        return sum(p.numel() * p.element_size() for p in (self.linear.weight, self.linear.weight_scale_inv))

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This process's [..., N] logits in x's dtype, before any gather."""
        model = self._model()
        opts = getattr(model, "fast_options", None)
        if opts is not None:  # the fast path's kernels for the FP8 projections (`kernels.dispatch`, loaded with it)
            from ..kernels.dispatch import linear

            return linear(x, self.linear.weight, self.linear.weight_scale_inv, opts)
        self.linear.numerics = model.runtime.numerics
        return self.linear.matmul(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        if self.comm is None:
            return y
        y = self.comm.all_gather_last(y)
        return y if self.ids_M is None else y.masked_fill(self.ids_M < 0, float("-inf"))


_FP8_HEADS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple | None, Fp8Head]]" = weakref.WeakKeyDictionary()


def shared_fp8_head(model, j: int, ids: tuple[int, ...] | None = None) -> Fp8Head:
    """The FP8 copy of MTP module j's head (of the rows of `ids`, a draft vocabulary, when given), one per (head, ids)
    shared by every proposer that asks; the last two per head are kept, for as long as the head lives."""
    head = model.mtp[j].shared_head.head
    key = None if ids is None else (ids, by_shard(head))
    return kept_per_head(_FP8_HEADS, head, key, lambda: _build(model, head, ids))


def _build(model, head, ids: tuple[int, ...] | None) -> Fp8Head:
    """The copy's rows: a draft vocabulary's (`SubHead`, a transient bf16 copy), else the head's own (a whole
    vocabulary or a vocabulary-parallel shard, gathered by the head's comm)."""
    V = model.cfg.vocab_size
    if ids is not None:
        sub = SubHead(head, ids, V, model.device, by_shard(head))
        return Fp8Head(model, sub.weight, sub.comm, sub.ids_M)
    w = head.weight
    if w.shape[0] == V:
        return Fp8Head(model, w)
    parallel_world(head, V, "draft_head_fp8")
    return Fp8Head(model, w, head.comm)
