"""Option `FastPathOptions.mla_channel_splits`: `mla_decode`'s stage 1 with CS programs per (row, head block, key
split), each the whole softmax and the output on 512 / CS channels (`mla_decode(channel_splits=)`), on the CPU.

- The option and its variants: 1 by default, one of `mla_decode.CHANNEL_SPLITS` or refused by name (constructor,
  `set`, mtp-bench's --kernels); variants mla_cs2 / mla_cs4 set it; the fast path hands it to `mla_decode`.
- Compiled for sm_90 (triton's own ptxas, no GPU) at a TP=8 rank's shapes (16 heads, one token, 8 warps, PDL) at
  CS = 1, 2, 4 dense and 1, 4 top-k: no spills, fewer registers and instructions than CS = 1 at CS > 1, and P.V's
  MMAs cut by CS (the score MMAs are all still there). CS = 1 is the kernel as before, instruction for instruction
  (its SASS compared once by hand, dense / top-k / tree, 1 and 4 tokens, 16 and 64 heads; not kept as a test: the
  old source is gone).
- Under the Triton interpreter (a subprocess): CS = 2, 4, 8 against CS = 1, dense, top-k (with -1 padding) and a
  tree's visibility, 1..3 tokens, odd head counts, forced and default key splits, several key tiles per split, with
  stage 2 and with stage 2 + W_vb (`mla_out.stage2_absorb`). Held within fp32 rounding, not bit for bit: the
  interpreter's dots are numpy matmuls, whose blocking may follow the output's width (P.V is [BH, 64] x [64, 512 /
  CS]); an element of a sum that cancels moves by more than 1e-6 of itself, so the bound is 1e-6 of the element
  plus 1e-6 of its row's largest. On a GPU the outputs are bit-identical (tests/kernels/test_mla_channel_splits_gpu.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`
from tests.interp import interpreted_main, run_interpreted  # noqa: E402

from mtp.kernels.dispatch import FastPathOptions  # noqa: E402


def test_option_and_variants():
    from mtp.bench.cli import parse_switches
    from mtp.bench.rank import KERNEL_VARIANTS
    from mtp.kernels.mla_decode import CHANNEL_SPLITS

    assert FastPathOptions().mla_channel_splits == 0 and CHANNEL_SPLITS == (1, 2, 4, 8)  # 0: by rows
    for bad in (3, 16, -4, True, 2.0, "4"):
        with pytest.raises(ValueError, match=r"mla_channel_splits must be 0 \(by rows\) or one of"):
            FastPathOptions(mla_channel_splits=bad)
        with pytest.raises(ValueError, match=r"mla_channel_splits must be 0 \(by rows\) or one of"):
            FastPathOptions().set(mla_channel_splits=bad)
    assert parse_switches(["mla_channel_splits=4"]) == {"mla_channel_splits": 4}  # mtp-bench --kernels
    with pytest.raises(ValueError, match=r"mla_channel_splits must be 0 \(by rows\) or one of"):
        parse_switches(["mla_channel_splits=3"])
    o = FastPathOptions()
    for name, cs in (("mla_cs1", 1), ("mla_cs2", 2), ("mla_cs4", 4)):
        flags, options = KERNEL_VARIANTS[name]
        old = o.set(**flags)
        assert o.mla_channel_splits == cs and old.mla_channel_splits == 0 and options == {}, name
        o.set(**vars(old))


def test_fast_path_hands_channel_splits(monkeypatch):
    """`mla_attend_fast` passes the model's option to `mla_decode`, and for 0 the rule by score rows
    (`mla_decode.channel_splits_for`: 4 at one row, 2 at two, 1 past; 1 for more than 16 heads) (a recorder here; no
    indexer: S <= top-k)."""
    from types import SimpleNamespace

    import mtp.backends.fast_path as fp

    seen = []

    def recorder(q_lat, *args, **kw):
        seen.append(kw["channel_splits"])
        return torch.zeros(*q_lat.shape, dtype=torch.bfloat16)

    monkeypatch.setattr(fp, "mla_decode", recorder)
    H, P, S = 3, 8, 16
    for B, T, cs in ((1, 2, 1), (1, 2, 4), (1, 1, 0), (1, 2, 0), (2, 1, 0), (1, 3, 0), (2, 2, 0)):
        cache = SimpleNamespace(seq_lens=torch.full((B,), S - T), kv=torch.zeros(B, 32, 512),
                                kv_scale=torch.ones(B, 32, 4), pe=torch.zeros(B, 32, 64))
        mla = SimpleNamespace(indexer=SimpleNamespace(topk=64), fast_options=FastPathOptions(absorb=False,
                                                                                             mla_channel_splits=cs),
                              w_kb=torch.zeros(H, P, 512, dtype=torch.bfloat16),
                              w_vb=torch.zeros(H, 4, 512, dtype=torch.bfloat16), softmax_scale=0.1)
        o = fp.mla_attend_fast(mla, torch.zeros(B, T, 32), None, torch.zeros(B, T, H, P), torch.zeros(B, T, H, 64),
                               cache, S)
        assert o.shape == (B, T, H, 4)
    assert seen == [1, 4, 4, 2, 2, 1, 1]
    from mtp.kernels.mla_decode import channel_splits_for

    # more heads than a TP=8 rank's 16 (a wider tile): 1 at every width (the 64-head tile's CS = 2 / 4 did not fit an
    # SM's shared memory: TP=1's bench failed at one row until session 24)
    assert [channel_splits_for(1, h) for h in (16, 17, 32, 64, 128)] == [4, 1, 1, 1, 1]
    assert [channel_splits_for(2, h) for h in (3, 16, 64)] == [2, 2, 1]


def test_channel_splits_compile_for_hopper():
    """sm_90 at the rank's one-token shapes (16 heads, one 64-key tile, 8 warps, PDL at its start), dense and top-k:
    no spills at CS = 1, 2, 4 (top-k: 1, 4); at CS > 1 fewer registers and SASS instructions than CS = 1; the PTX has the 36
    score MMAs a thread (q . k over 512, q_pe . k_pe over 64) and 32 / CS for P.V (m16n8k16); PDL's trigger and wait
    come first."""
    pytest.importorskip("triton")
    import re

    import triton.language as tl

    from mtp.kernels.mla_decode import _mla_stage1_fused
    from tests.kernels.test_fused_kernels import _compile_for_hopper
    from tests.kernels.test_moe_items import _sass
    from tests.kernels.test_pdl import _order

    ptrs = dict(q_ptr="*bf16", qpe_ptr="*bf16", kv_ptr="*fp8e4nv", kvs_ptr="*fp32", pe_ptr="*bf16", lens_ptr="*i32",
                idx_ptr="*i32", vis_ptr="*i32", o_ptr="*fp32", lse_ptr="*fp32", qk_scale="fp32")
    # what the JIT specializes as multiples of 16 at the rank's call (T = 1 is a constant; s_scs = 4 is not)
    aligned = ("H", "J", "s_qb", "s_qt", "s_qh", "s_pb", "s_pt", "s_ph", "s_kvb", "s_kvs", "s_scb", "s_peb", "s_pes")
    for sparse, channel_splits in ((False, (1, 2, 4)), (True, (1, 4))):  # 2-5 s a compile
        base = None
        for cs in channel_splits:
            consts = dict(T=1, SPARSE=sparse, VIS=False, DOT=tl.bfloat16, BH=16, BN=64, PDL=1, CS=cs)
            k = _compile_for_hopper(_mla_stage1_fused, ptrs, consts, num_warps=8, num_stages=2 if sparse else 3,
                                    aligned=aligned)
            sass, use = _sass(k)
            assert use.get("STACK") == "0" and use.get("LOCAL") == "0", (sparse, cs, use)
            n = (int(use["REG"]), len(re.findall(r"^\s+/\*[0-9a-f]{4}\*/", sass, re.M)))
            assert k.asm["ptx"].count("mma.sync.aligned.m16n8k16") == 36 + 32 // cs, (sparse, cs)
            seq = _order(k.asm["ptx"])  # PDL: the trigger first, then the wait, before any load
            assert seq[:2] == ["griddepcontrol.launch_dependents", "griddepcontrol.wait"], (sparse, cs, seq[:3])
            if base is None:
                base = n
            else:
                assert n[0] < base[0] and n[1] < base[1], (sparse, cs, n, base)


def test_channel_splits_interpreted():
    run_interpreted(__file__, 300)


# ----------------------------------------------------------------------------- run under TRITON_INTERPRET=1
def _close(got: torch.Tensor, want: torch.Tensor, what) -> None:
    """Within fp32 rounding: |diff| <= 1e-6 (|want| + the largest |want| of its last-dim row)."""
    row = want.abs().amax(dim=-1, keepdim=True)
    bad = (got - want).abs() > 1e-6 * (want.abs() + row)
    assert not bad.any(), f"{what}: {int(bad.sum())} of {got.numel()} differ, e.g. {got[bad][:3]} vs {want[bad][:3]}"


def _kernel_checks() -> None:
    from mtp.kernels.mla_decode import mla_decode
    from tests.kernels.test_fused_kernels import mla_decode_inputs

    g = torch.Generator().manual_seed(3)
    S = 40
    # (B, T, H, kind, splits, block_n, w_vb, CS to try): forced and default key splits, 16-key tiles (several per split:
    # the online softmax rescales the accumulator), stage 2 and stage 2 + W_vb. The interpreter runs the programs one
    # after the other, CS x as many: each case tries few
    cases = [(1, 1, 3, "dense", None, 64, False, (2, 4, 8)), (1, 2, 5, "topk", 3, 16, False, (2,)),
             (1, 3, 2, "vis", 2, 16, False, (4,)), (1, 2, 3, "dense", 1, 16, True, (4,)),
             (2, 1, 3, "topk", None, 64, True, (8,))]
    for B, T, H, kind, splits, bn, absorb, try_cs in cases:
        q, qpe, kv8, kvs, pe, L, kw = mla_decode_inputs(B, T, H, S, kind, 9, g)  # top-k: 9 picks
        kw.update(splits=splits, block_n=bn)
        if absorb:  # fp32 W_vb: the interpreter's IEEE dot (its bf16 one is wrong)
            kw["w_vb"] = torch.randn(H, 128, 512, generator=g) * 0.05
        want = mla_decode(q, qpe, kv8, kvs, pe, L, 0.07, **kw)
        for cs in try_cs:
            got = mla_decode(q, qpe, kv8, kvs, pe, L, 0.07, channel_splits=cs, **kw)
            assert got.shape == want.shape and got.dtype == want.dtype
            _close(got, want, (B, T, H, kind, splits, bn, absorb, cs))
    for bad in (3, True, 16, 4.0):
        with pytest.raises(ValueError, match="channel_splits must be one of"):
            mla_decode(q, qpe, kv8, kvs, pe, L, 0.07, channel_splits=bad)
    with pytest.raises(ValueError, match="needs variant 'fused'"):
        mla_decode(q, qpe, kv8, kvs, pe, L, 0.07, channel_splits=2, variant="split4")


if __name__ == "__main__":
    interpreted_main([_kernel_checks], seed=None)
