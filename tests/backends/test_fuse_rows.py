"""`mtp.backends.fast_path.fuse_rows`: projections that read one input stacked into one FP8 weight (CPU, reference GEMM)."""

from __future__ import annotations

import torch

from mtp.backends.fast_path import fuse_rows
from mtp.model.fp8 import weight_quant
from mtp.model.layers import Linear


def _lin(n, k, seed, fp8=True):
    lin = Linear(k, n, fp8, torch.float64)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g, dtype=torch.float64) * 0.02
    if fp8:
        lin.weight.data, lin.weight_scale_inv.data = weight_quant(w)
    else:
        lin.weight.data = w
    return lin


def test_stacked_rows_equal_each_part_and_share_memory():
    parts = [_lin(256, 384, 0), _lin(128, 384, 1), _lin(200, 384, 2)]  # the last part may end mid-block
    x = torch.randn(5, 384, dtype=torch.float64)
    before = [p(x) for p in parts]
    n_params = sum(p.numel() for lin in parts for p in lin.parameters())
    w, s = fuse_rows(parts)
    assert w.shape == (584, 384) and s.shape == (2 + 1 + 2, 3)
    stacked = Linear(384, 584, True, torch.float64)
    stacked.weight.data, stacked.weight_scale_inv.data = w, s
    fused = stacked(x)  # float64 accumulation: row n of the stack is exactly row n of its part
    torch.testing.assert_close(fused, torch.cat(before, -1), rtol=1e-12, atol=1e-12)
    r = 0
    for lin, y in zip(parts, before):  # each part is a view of its rows: same outputs, no added memory
        assert lin.weight.data_ptr() == w[r:].data_ptr()
        r += lin.out_features
        torch.testing.assert_close(lin(x), y, rtol=0, atol=0)
    assert sum(p.numel() for lin in parts for p in lin.parameters()) == n_params


def test_unfusable_parts_are_left_alone():
    ragged = [_lin(200, 256, 0), _lin(128, 256, 1)]  # a scale block would straddle two parts
    ptrs = [lin.weight.data_ptr() for lin in ragged]
    assert fuse_rows(ragged) is None
    assert [lin.weight.data_ptr() for lin in ragged] == ptrs
    assert fuse_rows([_lin(128, 256, 0), _lin(128, 384, 1)]) is None  # different inputs
    assert fuse_rows([_lin(128, 256, 0), _lin(128, 256, 1, fp8=False)]) is None  # a bf16 part
