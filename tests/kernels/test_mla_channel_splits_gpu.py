"""`mla_decode(channel_splits=CS)` (`FastPathOptions.mla_channel_splits`) against CS = 1 on the GPU (pytest -m gpu):
bit for bit. Each output element gets the same scores, softmax, keys in the same order and the same MMA chain over
the keys (an m16n8k16 per 16 keys, whatever the output's width), the lse the same in every channel slice.
One TP=8 rank (16 heads, latent 512, V 128): dense and top-k (with -1 padding), 1..4 tokens, a tree's visibility,
stage 2 and stage 2 + W_vb (`mla_out.stage2_absorb`), PDL as the fast path launches it; the 64-head tile (wgmma,
min_block_h 64) where it fits (top-k); and the fast path with the option set, verify logits and greedy tokens.
Past 16 heads (TP=4 / 2 / 1 ranks) the rule by rows gives CS = 1: it runs and matches the reference.
CPU twin (interpreter, fp32 rounding; sm_90 compile): tests/kernels/test_mla_channel_splits.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from mtp.kernels import available

pytestmark = pytest.mark.gpu
DEV = os.environ.get("MTP_TEST_DEVICE", "cuda")
if not (available() or (DEV == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")):
    pytest.skip("needs triton and a CUDA device", allow_module_level=True)

from mtp.kernels.mla_decode import mla_decode  # noqa: E402

from .test_kernels_gpu import mla_inputs, poison  # noqa: E402

H = 16


def _case(B, T, S, lens, J, tree):
    """bf16 queries, the FP8 cache, and the top-k (J > 0; some rows keep -1 padding) or a tree's visibility."""
    q, qpe, kv8, kvs, pe, L = mla_inputs(B, T, H, S, lens)
    kw = {}
    if J:
        idx = torch.full((B, T, J), -1, dtype=torch.int32, device=DEV)
        for b in range(B):
            for t in range(T):
                n = min(J, lens[b] + t + 1) - (t % 2)
                idx[b, t, :n] = torch.randperm(lens[b] + t + 1, device=DEV)[:n].int()
        kw["topk_idx"] = idx
    if tree:
        kw["visible"] = torch.rand(B, T, S, device=DEV) < 0.5
    return (q.bfloat16(), qpe.bfloat16(), kv8, kvs, pe, L), kw


# (B, T, S, lens, J, tree, pdl): the rank's 1k dense and top-2048 of 32k at 1 and 4 tokens, odd lengths, several
# rows, trees; pdl as `FastPathOptions.pdl_at` gives it (1: trigger at the start, one token; 2: after the wait)
CASES = [(1, 1, 1025, [1024], 0, False, 1), (1, 4, 1028, [1024], 0, False, 2), (1, 1, 32769, [32768], 2048, False, 1),
         (1, 4, 32772, [32768], 2048, False, 2), (1, 2, 9000, [8990], 2048, False, 0), (1, 3, 700, [500], 0, False, 0),
         (2, 2, 3000, [100, 2990], 2048, False, 2), (3, 4, 1200, [7, 600, 1190], 0, True, 2),
         (1, 2, 300, [290], 0, True, 0)]


@pytest.mark.parametrize("B,T,S,lens,J,tree,pdl", CASES)
@pytest.mark.parametrize("absorb", [False, True])
def test_mla_channel_splits_bit_identical(B, T, S, lens, J, tree, pdl, absorb):
    args, kw = _case(B, T, S, lens, J, tree)
    if absorb:
        kw["w_vb"] = (torch.randn(H, 128, 512, device=DEV) * 0.05).bfloat16()
    want = mla_decode(*args, 0.0723, out_dtype=torch.bfloat16, pdl=pdl, **kw)
    for cs in (2, 4, 8):
        poison()  # an output channel or lse no slice stored reads NaN
        got = mla_decode(*args, 0.0723, out_dtype=torch.bfloat16, pdl=pdl, channel_splits=cs, **kw)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got, want), (f"CS={cs}: {int((got != want).sum())} of {got.numel()} differ, max |diff| "
                                        f"{(got.float() - want.float()).abs().max().item():.3g}")


@pytest.mark.parametrize("T", [1, 4])
def test_mla_channel_splits_wgmma_tile(T):
    """The 64-head tile (min_block_h 64: wgmma, 48 heads masked) at CS = 4, top-2048: a wgmma's per-element sum
    over the keys should not depend on its N either. (Dense calls at CS > 1 take more shared memory than an SM has
    in this tile: not run.)"""
    args, kw = _case(1, T, 9000, [8990], 2048, False)
    want = mla_decode(*args, 0.0723, out_dtype=torch.bfloat16, min_block_h=64, **kw)
    poison()
    got = mla_decode(*args, 0.0723, out_dtype=torch.bfloat16, min_block_h=64, channel_splits=4, **kw)
    assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} differ"


def test_fast_path_channel_splits_bit_identical():
    """The fast path with mla_channel_splits 2 / 4 (and 4 with stage 2 + absorb_out fused) gives CS = 1's verify
    logits bit for bit at widths 1..5 past the indexer's top-k (dense and top-k calls), and its greedy tokens, eager
    and from CUDA graphs."""
    if DEV != "cuda":
        pytest.skip("CUDA graphs")
    from mtp.backends.fast_path import FastMLA, disable_fast_path, enable_fast_path, set_kernels
    from mtp.checkpoint.synthetic import random_model
    from mtp.decode.engine import generate
    from mtp.model.presets import gpu_test_config

    from ..decode.test_engine_gpu import _verify_logits

    model = random_model(gpu_test_config(layers=3, mtp_modules=1), device=DEV, dtype=torch.bfloat16, seed=5)
    ids = torch.randint(0, 2048, (1, 70), device=DEV, generator=torch.Generator(device=DEV).manual_seed(2))
    prompts = [list(range(3, 40)), list(range(50, 61))]
    enable_fast_path(model)
    try:
        assert any(isinstance(m, FastMLA) for m in model.modules()), "the MLA kernels must run in this model"
        out, toks = {}, {}
        for key in ((1, False), (2, False), (4, False), (4, True), (1, True)):
            set_kernels(model, mla_channel_splits=key[0], fuse_absorb_out=key[1])
            out[key] = [_verify_logits(model, ids, w) for w in range(1, 6)]
            toks[key] = generate(model, prompts, 12, mode="eager").tokens
        for key in ((2, False), (4, False)):
            set_kernels(model, mla_channel_splits=key[0], fuse_absorb_out=key[1])
            assert generate(model, prompts, 12, mode="graph").tokens == toks[key], key
        for key, base in (((2, False), (1, False)), ((4, False), (1, False)), ((4, True), (1, True))):
            for w, (a, b) in enumerate(zip(out[base], out[key]), start=1):
                assert torch.equal(a, b), f"{key} w={w}: max |diff| {(a - b).abs().max().item():.3g}"
            assert toks[key] == toks[base], key
    finally:
        disable_fast_path(model)


@pytest.mark.parametrize("heads", [32, 64, 128])
@pytest.mark.parametrize("T", [1, 2])
def test_default_channel_splits_at_wider_ranks(heads, T):
    """The rule by rows (`channel_splits_for`) at a TP=4 / 2 / 1 rank's heads, dense 1k, where the fast path asks it:
    mla_decode compiles and runs (until session 24 the rule gave the 64-head tile CS = 4 at one row, 264 KB of
    shared memory: triton's OutOfResources, `mtp-bench` at TP=1) and matches the reference."""
    from mtp.kernels.mla_decode import channel_splits_for, mla_decode_ref

    from .test_kernels_gpu import check_close

    q, qpe, kv8, kvs, pe, L = mla_inputs(1, T, heads, 1024 + T, [1024])
    poison()
    o = mla_decode(q, qpe, kv8, kvs, pe, L, 0.0723, channel_splits=channel_splits_for(T, heads))
    check_close(f"mla dense T={T} H={heads}", o, mla_decode_ref(q, qpe, kv8, kvs, pe, L, 0.0723), 1e-2)
