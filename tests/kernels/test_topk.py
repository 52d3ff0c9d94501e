"""The indexer's radix top-k (`mtp.kernels.topk`) on the CPU: its reference against the stable-sort rule of
`Indexer.select`, and the kernels under the Triton interpreter (a subprocess started with TRITON_INTERPRET=1,
this file as a script: the interpreter is chosen when the kernels are decorated). tests/kernels/test_kernels_gpu.py
holds the kernels to the reference on a GPU at full sizes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from mtp.kernels.topk import topk_select_ref

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`
from tests.interp import patch_interpreter_loop_bounds, run_interpreted  # noqa: E402


def tie_scores(B, T, S, g):
    """Scores with many exact ties (5 values, -0.0 beside +0.0), a -inf and some negatives."""
    sc = torch.randint(0, 5, (B, T, S), generator=g).float() * 0.5 - 1.0
    sc[..., ::3] = torch.where(sc[..., ::3] == 0, -0.0, sc[..., ::3])
    sc[..., 5] = float("-inf")
    return sc


def brute(sc_S: torch.Tensor, limit: int, k: int) -> list[int]:
    """Kept positions by the rule written out: sort candidates by (score desc, position asc), keep k."""
    cand = [s for s in range(min(limit, sc_S.numel())) if sc_S[s] != float("-inf")]
    return sorted(sorted(cand, key=lambda s: (-float(sc_S[s]), s))[:k])


def test_topk_select_ref_is_the_stable_sort_rule():
    g = torch.Generator().manual_seed(0)
    B, T, S, k = 2, 3, 200, 37
    lens = torch.tensor([150, 20])
    sc = tie_scores(B, T, S, g)
    out = topk_select_ref(sc, lens, k)
    assert out.shape == (B, T, k) and out.dtype == torch.int32
    for b in range(B):
        for t in range(T):
            want = brute(sc[b, t], int(lens[b]) + t + 1, k)
            assert out[b, t].tolist() == want + [-1] * (k - len(want)), (b, t)


def test_radix_topk_interpreted():
    run_interpreted(__file__)


def test_set_kernel_options_switches_and_refuses_unknown():
    from mtp.backends.fast_path import FastMLA, _swap, disable_fast_path, fast_module, set_kernel_options
    from mtp.model.presets import tiny_config
    from mtp.model.attention import MLA
    from mtp.model.moe import MoE

    cfg = tiny_config()
    model = torch.nn.ModuleList([MLA(cfg, torch.float32), MoE(cfg, torch.float32)])
    set_kernel_options(model, indexer_topk="torch", moe_layout=None)  # reference modules hold no switch
    assert not hasattr(model[0], "topk_impl") and not hasattr(model[1], "expert_layout")
    _swap(model[0], FastMLA)  # (the tiny MLA is too small for fast_module's kernels; the switch is the same)
    fast_module(model[1])
    assert model[0].topk_impl == "radix" and model[1].expert_layout == "pairs"  # a whole MoE keeps pairs
    set_kernel_options(model, indexer_topk="torch", moe_layout=None)
    assert model[0].topk_impl == "torch" and model[1].expert_layout is None
    set_kernel_options(model, indexer_topk="radix")  # the layout is kept
    assert model[0].topk_impl == "radix" and model[1].expert_layout is None
    assert model[0].scores_tune == {}  # the scores kernel's `SCORES_DEFAULT`
    set_kernel_options(model, indexer_scores=dict(programs=264, num_stages=2))
    set_kernel_options(model, indexer_topk="torch")  # the settings are kept
    assert model[0].scores_tune == dict(programs=264, num_stages=2) and model[0].topk_impl == "torch"
    with pytest.raises(ValueError, match="indexer_scores"):
        set_kernel_options(model, indexer_scores=dict(stages=2))
    with pytest.raises(ValueError, match="indexer_topk"):
        set_kernel_options(model, indexer_topk="bitonic")
    with pytest.raises(ValueError, match="moe_layout"):
        set_kernel_options(model, moe_layout="grouped")
    disable_fast_path(model)
    assert type(model[0]) is MLA and type(model[1]) is MoE


def _interpreted_checks() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_interpreter_loop_bounds()
    from mtp.kernels.topk import radix_topk

    g = torch.Generator().manual_seed(1)
    few = torch.randn(1, 1, 4000, generator=g)
    few[..., :100] = 1.0 + torch.randint(0, 4, (1, 1, 100), generator=g).float() * 1e-7  # one prefix bin, ties
    few[..., 100:] = few[..., 100:].clamp(max=0.9)
    cases = [  # (scores, lens, k, chunks): ties across chunks, the candidate list over several blocks, k > S,
        (few, [3999], 60, 5),  # <= 128 candidates with ties at the boundary (the pairwise-rank path)
        (tie_scores(2, 2, 3000, g), [2999, 100], 256, 5),
        (1.0 + torch.randint(0, 3000, (1, 2, 4000), generator=g).float() * 1e-7, [3998], 512, 4),
        (torch.randn(1, 3, 2001, generator=g), [1500], 300, None),
        (torch.randn(1, 4, 300, generator=g), [0], 512, None),
        (torch.full((1, 1, 500), float("-inf")), [499], 64, 2),
    ]
    for sc, lens, k, chunks in cases:
        L = torch.tensor(lens)
        got, want = radix_topk(sc, L, k, chunks=chunks), topk_select_ref(sc, L, k)
        assert torch.equal(got, want), f"S={sc.shape[-1]} k={k} chunks={chunks}: {(got != want).sum()} entries differ"
    # the histogram pass in the indexer scores kernel's epilogue instead of its own launch
    from mtp.model.fp8 import act_quant
    from mtp.kernels.indexer import indexer_topk

    q8, qs = act_quant(torch.randn(2, 3, 16, 128, generator=g))
    k8, ks = act_quant(torch.randn(2, 300, 128, generator=g))
    L = torch.tensor([100, 297], dtype=torch.int32)
    w = torch.randn(2, 3, 16, generator=g)
    idx, sc = indexer_topk(q8, qs[..., 0], w, k8, ks[..., 0], L, 64, impl="radix_fused")
    assert torch.equal(idx, topk_select_ref(sc, L, 64)), "radix_fused"
    print("interpreted checks ok")


if __name__ == "__main__":
    _interpreted_checks()
