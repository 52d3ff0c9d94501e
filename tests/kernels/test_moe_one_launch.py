"""The persistent experts in one launch (`moe.moe_experts(one_launch=True)`, `kernels.moe_one_launch`, switch
`FastPathOptions.moe_one_launch`), on the CPU.

- Compiled for sm_90 (triton's own ptxas, no GPU): with PDL it triggers its successor first and stores nothing before
  the wait; the down items' spin is an acquire load in a loop, h's readiness a release add, the arrivals acq_rel.
- Under the Triton interpreter (`interpreted_checks`, run in tests/kernels/test_moe_shared.py's subprocess: one
  interpreter start for both files): y equals the three-launch persistent path's bit for bit at 1..4 tokens, with and
  without the shared slot, -1 slots, a token without a routed expert, no expert at all (nobody arrives: y = add),
  `add` given or not, bf16 output (and splits='waves' through the switch below); its counters are left at 0 (the
  next call, a graph replay, finds them armed); and the switch hands one_launch=True to a split rank's persistent
  experts, same bits. The interpreter runs programs one after another, so there the grid is ONE program, whose gate /
  up items all precede its down items (no wait can block): the many-program grid, its spin and its races run on the
  GPU only (tests/kernels/test_moe_one_launch_gpu.py).
"""

from __future__ import annotations

import pytest
import torch


def test_moe_one_launch_kernel_variant():
    """`mtp-bench --kernel-variants moe_one_launch` turns the switch on (off by default), and names a real switch."""
    from mtp.bench.rank import KERNEL_VARIANTS
    from mtp.kernels.dispatch import FastPathOptions

    flags, options = KERNEL_VARIANTS["moe_one_launch"]
    o = FastPathOptions()
    assert not o.moe_one_launch
    o.set(**flags)
    assert o.moe_one_launch and options == {}


def test_one_launch_grid():
    """At most one program per SM (the kernel spins: all resident), never more than the longer phase's items; more
    programs than SMs refused by name."""
    from mtp.kernels.moe_one_launch import one_launch_grid

    # a TP=8 split rank at one token: 9 experts x 2 N-blocks x 7 slices = 126 gate / up, 9 x 56 down items
    assert one_launch_grid(9, 257, 7168, 256, (7, 1), 132) == 132
    assert one_launch_grid(9, 257, 7168, 256, (7, 1), 132, programs=16) == 16
    assert one_launch_grid(1, 4, 256, 256, (1, 1), 132) == 2  # one expert: 2 down items
    with pytest.raises(ValueError, match="programs must be in"):
        one_launch_grid(9, 257, 7168, 256, (7, 1), 132, programs=133)


def test_one_launch_compiles_for_hopper():
    """sm_90 PTX of the kernel with PDL: launch_dependents first, no store or atomic before the wait, the shared
    expert's L2 prefetches before it; the spin an acquire load in a loop, h's readiness a release add, the arrivals
    acq_rel adds, the counters re-armed by exchanges."""
    pytest.importorskip("triton")
    import re

    import mtp.kernels.moe_one_launch as ol

    from .test_fused_kernels import _compile_for_hopper
    from .test_pdl import _order

    bf, f8, i32 = "*bf16", "*fp8e4nv", "*i32"
    ptrs = dict(x_ptr=bf, idx_ptr=i32, w1_ptr=f8, w3_ptr=f8, w2_ptr=f8, h8_ptr=f8, gu_cnt_ptr=i32, ready_ptr=i32,
                comb_ptr=i32, done_ptr=i32)
    consts = dict(KS_DOWN=1, TOPK=9, J=8, BM=16, PPAD=16, KPAD=16, ADD=False, PDL=True, PREFETCH=True)
    ptx = _compile_for_hopper(ol._moe_one_launch_kernel, ptrs, consts, num_warps=4, num_stages=4).asm["ptx"]
    seq = _order(ptx)
    wait = seq.index("griddepcontrol.wait")
    assert seq[0] == "griddepcontrol.launch_dependents", seq[:4]
    assert not any(op.startswith(("st.", "atom.", "red.", "ld.")) for op in seq[:wait]), seq[:wait]
    assert "prefetch.global.L2" in seq[:wait]
    spin = re.search(r"(\$L__BB0_\d+):[^\n]*\n(?:(?!\$L__BB)[^\n]*\n)*?[^\n]*ld\.global\.gpu\.acquire\.b32"
                     r"(?:(?!\$L__BB)[^\n]*\n)*?[^\n]*bra\s+\1;", ptx)
    assert spin, "no loop around an acquire load (the down items' wait for h)"
    assert len(re.findall(r"atom\.global\.gpu\.release\.add", ptx)) == 1  # h of (a, nb) ready
    assert len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", ptx)) == 3  # gate / up slices, block arrivals, done
    assert len(re.findall(r"atom\.global\.gpu\.relaxed\.exch", ptx)) >= 4  # gu_cnt, comb, ready, done re-armed


# ----------------------------------------------------------------------------- run under TRITON_INTERPRET=1
def interpreted_checks() -> None:
    """Under TRITON_INTERPRET=1, e4m3 rounding patched (`tests.interp`): see the module docstring."""
    import mtp.kernels.fp8_gemm as fg
    from mtp.kernels.moe import moe_experts
    from tests.kernels.test_moe_grouped import _experts

    E, D, I, J = 6, 256, 256, 3  # 6 routed experts + the shared one; 2 N-blocks and 2 K slices each way
    ws = _experts(E + 1, D, I, seed=3)
    g = torch.Generator().manual_seed(7)
    # (T, shared, add, what): 2 K slices both ways (`default_splits` at G = 2), so the combine's slice order counts
    cases = ((1, True, False, ""), (2, False, True, "no expert at all"),
             (3, True, True, "a token without a routed expert"), (4, False, False, "bf16"))
    for T, shared, with_add, what in cases:
        x = torch.randn(T, D, generator=g).bfloat16()
        idx = torch.stack([torch.randperm(E, generator=g)[:J] for _ in range(T)]).int()
        idx[0, 1] = -1  # a slot on another rank
        if what == "a token without a routed expert":
            idx[2] = -1
        if what == "no expert at all":
            idx[:] = -1
        rw = torch.rand(T, J, generator=g)
        kw = dict(layout="persistent", shared=shared, add=torch.randn(T, D, generator=g) if with_add else None,
                  out_dtype=torch.bfloat16 if what == "bf16" else torch.float32)
        # the three-launch path on 4 programs a kernel: its grid moves no bit, and 132 cost seconds here
        want = moe_experts(x, idx, rw, *ws, programs=(4, 4), **kw)
        got = moe_experts(x, idx, rw, *ws, one_launch=True, **kw)
        assert got.dtype == want.dtype and torch.equal(got, want), (T, shared, with_add, what)
        if what == "no expert at all":
            assert torch.equal(got, kw["add"]), "no expert: y = add"
        buf = fg._COUNTERS[x.device][0]
        assert not buf.any(), (T, what, "counters not re-armed", torch.nonzero(buf).flatten()[:8].tolist())
    x, idx, rw = torch.randn(2, D), torch.tensor([[0, 1, -1], [2, 3, 4]], dtype=torch.int32), torch.rand(2, J)
    for bad in (dict(layout="pairs"), dict(layout="persistent", down_stages=3), dict(layout="persistent",
                                                                                     one_launch=1)):
        try:
            moe_experts(x, idx, rw, *ws, **{"one_launch": True, **bad})
        except ValueError as e:
            assert "one_launch" in str(e), (bad, str(e))
        else:
            raise AssertionError(f"moe_experts(one_launch=True) must refuse {bad}")
    _switch_checks()


def _switch_checks() -> None:
    """Switch moe_one_launch: a split rank's persistent experts (T <= persistent_tokens; their K slices 'waves')
    get one_launch=True, the same bits as the switch off. (The pair grid above would be refused by name.)"""
    import mtp.backends.fast_path as fp
    from mtp.model.fp8 import act_quant
    from mtp.parallel import ParallelPlan
    from tests.parallel.test_moe_ep import layout_config, random_moe, rank_moes

    cfg = layout_config()
    moe = rank_moes(random_moe(cfg, seed=4), cfg, ParallelPlan(2, expert_layout="split"))[0]
    fp.fast_module(moe)
    for mod in moe.modules():
        if mod is not moe:
            fp.fast_module(mod, moe.fast_options)
    assert moe.persistent_tokens >= 1 and moe.expert_layout == "pairs"
    seen, kernel = [], fp.moe_experts

    def spy(*a, **k):
        seen.append((k.get("layout"), k.get("one_launch")))
        return kernel(*a, **k)

    fp.moe_experts = spy
    try:
        x = torch.randn(1, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
        out = {}
        for on in (False, True):
            moe.fast_options.moe_one_launch = on
            seen.clear()
            out[on] = moe(x, act_quant(x), rounded=False, reduce=False)
            assert seen == [("persistent", on)], (on, seen)
        assert torch.equal(out[True], out[False])
    finally:
        fp.moe_experts = kernel
        moe.fast_options.moe_one_launch = False
