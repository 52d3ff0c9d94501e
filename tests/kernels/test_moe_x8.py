"""Switch `FastPathOptions.moe_x8`: the experts' gate/up kernel on the block's pre-quantized input (`moe.moe_experts(
xq=(x8, sx))`), no FP8 quantization in its K loop, on the CPU.

Why the bits can be the same: the norm kernels (`norm_quant._add_norm_quant_row`, the one-shot all-reduce's add + norm
in `parallel.oneshot`) round y to the model dtype, store it, and quantize that stored y with `act_quant.ue8m0_scale`
(the row group's absmax) and `act_quant.quant_e4m3`; the gate/up loop (`moe_items._x_quant`) loads that y and runs the
same two helpers on the same values (an absmax is exact in any order). The torch fallback (`fp8.act_quant`) is
bit-exact with them (`mtp.kernels.act_quant`).
- Compiled for sm_90 (triton's own ptxas, no GPU) at a TP=8 split rank's one-token shapes (8 routed + the shared slot,
  7 K slices): with X8 the x8 tile is a cp.async into shared memory (as the weights') read by the wgmma through a
  transposed view (no register round trip, no convert, no cross-thread max in the K loop); with item_regs the loads
  after the tiles' wait (x8's row scales, in the PTX) feed only the next K group (loop-carried: nothing in this group
  waits on them); no spills; the SASS K loop at most 3/4 of the bf16 loop's instructions (230 vs 360 with triton
  3.6).
- Under the Triton interpreter (a subprocess; its e4m3 cast made CUDA's): torch.equal of xq given vs x quantized in the
  loop, xq from the norm kernel (`add_rms_norm_quant`) and from `fp8.act_quant`, for the persistent layout with the
  shared slot at 1..4 tokens, -1 slots (a token with none routed here), experts repeated across tokens, default and
  'waves' slices, item_regs on and off, PDL; the pair layout too; a bad xq refused by name; `FastMoE` on a 'split'
  rank (its x and xq from the block's norm kernel) gives the same bits with the switch as without, handing xq to its
  persistent calls only.
GPU twin at the real shapes (PDL, CUDA graphs): tests/kernels/test_moe_x8_gpu.py.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`
from tests.interp import interpreted_main, run_interpreted  # noqa: E402


def test_moe_x8_switch_and_variant():
    """On by default (timed on an H200, session 18); `mtp-bench --kernel-variants moe_x8_off` turns it off and moe_x8
    on (real switches)."""
    from mtp.bench.rank import KERNEL_VARIANTS
    from mtp.kernels.dispatch import FastPathOptions

    o = FastPathOptions()
    assert o.moe_x8
    flags, options = KERNEL_VARIANTS["moe_x8_off"]
    o.set(**flags)
    assert not o.moe_x8 and options == {}
    flags, options = KERNEL_VARIANTS["moe_x8"]
    o.set(**flags)
    assert o.moe_x8 and options == {}


def _sass_k_loop(sass: str) -> int:
    """Instructions of the SASS K loop: the backward branch whose body holds the FP8 wgmma (QGMMA)."""
    ins = [(int(a, 16), op, rest) for a, op, rest in
           re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", sass)]
    sizes = []
    for addr, op, rest in ins:
        m = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if m and int(m.group(1), 16) < addr:
            body = [o for a, o, _ in ins if int(m.group(1), 16) <= a <= addr]
            if any(o.startswith("QGMMA") for o in body):
                sizes.append(len(body))
    assert sizes, "no K loop (a backward branch over a QGMMA) in the SASS"
    return min(sizes)  # the innermost


def test_x8_compile_for_hopper():
    pytest.importorskip("triton")
    import mtp.kernels.moe as moe
    from tests.kernels.test_fused_kernels import _compile_for_hopper
    from tests.kernels.test_moe_items import _item_loop, _k_loops, _sass
    from tests.kernels.test_pdl import _order

    f8 = "*fp8e4nv"
    # the default item loop (item_regs; the other one's x8 path is held to its bits by the interpreter checks)
    consts = dict(TOPK=9, J=8, BM=16, KPAD=16, PPAD=16, PREFETCH=True, PDL=1, ITEM_REGS=True, NEXT_PF=False, KSU=7,
                  TP=1, TMA=False, w1_desc=None, w3_desc=None)
    aligned = ("D", "I", "stride_xm", "stride_sxm", "stride_we", "stride_se")
    ptrs = dict(idx_ptr="*i32", w1_ptr=f8, w3_ptr=f8, h8_ptr=f8, cnt_ptr="*i32")
    loops = {}
    for x8 in (True, False):
        k = _compile_for_hopper(moe._moe_gate_up_persistent, dict(ptrs, x_ptr=f8 if x8 else "*bf16"),
                                dict(consts, X8=x8), num_warps=4, num_stages=4, aligned=aligned)
        sass, use = _sass(k)
        assert use.get("STACK") == "0" and use.get("LOCAL") == "0", (x8, use)
        loops[x8] = _sass_k_loop(sass)
        if not x8:
            continue
        seq = _order(k.asm["ptx"])  # PDL: x8 / sx (the norm's output) read after the wait, as x was
        wait = seq.index("griddepcontrol.wait")
        assert seq[0] == "griddepcontrol.launch_dependents" and set(seq[1:wait]) == {"prefetch.global.L2"}, seq
        item = _item_loop(k.asm["ttgir"])
        # x8's tile: cp.async to shared memory, then the wgmma's operand as a transposed view of that buffer
        assert re.search(r"%xt\w* = ttg\.async_copy_global_to_local [^\n]*tensor<16x128x!tt\.ptr<f8E4M3FN>", item)
        assert re.search(r"ttg\.memdesc_trans %xt", item)
        assert not re.search(r"ttg\.local_alloc %", item), "a register tensor stored to shared memory in the loop"
        for body in _k_loops(k.asm["ptx"]):
            assert "shfl" not in body and "e4m3x2" not in body, "x still quantized in the K loop"
            # loads after the tiles' wait (x8's row scales, in the PTX) only feed the next K group: moved, not used
            after = body[body.index("cp.async.wait_group"):]
            for r in re.findall(r"ld\.global\.\w+ \{ (%r\d+) \}", after):
                uses = [ln for ln in body.splitlines() if re.search(re.escape(r) + r"\b", ln) and "ld." not in ln]
                assert all(ln.strip().startswith("mov.") for ln in uses), (r, uses)
    assert loops[True] <= 0.75 * loops[False], loops


def test_moe_x8_interpreted():
    run_interpreted(__file__, 600)


# ----------------------------------------------------------------------------- run under TRITON_INTERPRET=1
def _norm_x(T: int, D: int, g: torch.Generator, dtype=torch.bfloat16):
    """x (dtype) and its (x8, sx) as the block hands them to the MoE: the post-attention add + norm + quant kernel."""
    from mtp.kernels.norm_quant import add_rms_norm_quant

    h, d = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    w = 1 + 0.1 * torch.randn(D, generator=g)
    _, x, x8, sx = add_rms_norm_quant(h, d, w, 1e-6, dtype, quant=True, round_dtype=dtype)
    return x, (x8, sx)


def _kernel_checks() -> None:
    from mtp.kernels.moe import moe_experts
    from mtp.model.fp8 import act_quant
    from tests.kernels.test_moe_grouped import _experts

    E, D, I, J = 4, 384, 256, 2  # 4 routed + the shared S = 4; gate/up 3 K groups (a short last slice of 2), down 2
    ws = _experts(E + 1, D, I, seed=0)
    g = torch.Generator().manual_seed(5)

    def routing(T: int) -> torch.Tensor:
        idx = torch.stack([torch.randperm(E, generator=g)[:J] for _ in range(T)]).int()
        idx[0, 1] = -1  # a slot on another rank
        if T > 2:
            idx[2] = -1  # a token with no routed expert here: the shared one still
        if T > 3:
            idx[3] = idx[1]  # token 3 routed as token 1 (an expert's rows: both tokens)
        return idx

    # (tokens, slices, item_regs, PDL): each token count once (the interpreter is slow), both item loops, both slicings
    for T, splits, regs, pdl in ((1, None, True, 0), (2, "waves", False, 2), (3, (2, 1), False, 1), (4, "waves", True, 2)):
        x, xq = _norm_x(T, D, g)
        idx, rw = routing(T), torch.rand(T, J, generator=g)
        kw = dict(out_dtype=torch.float32, layout="persistent", shared=True, splits=splits, item_regs=regs, pdl=pdl)
        off = moe_experts(x, idx, rw, *ws, **kw)
        on = moe_experts(x, idx, rw, *ws, xq=xq, **kw)
        assert torch.equal(on, off), (T, splits, regs, pdl, (on - off).abs().max().item())
        if T == 2:  # the reference's quantization (torch): the same bits again
            assert torch.equal(moe_experts(x, idx, rw, *ws, xq=act_quant(x), **kw), off), (T, "fp8.act_quant")
    for T in (3,):  # the pair grid (the leader pair's programs): the same x operand
        x, xq = _norm_x(T, D, g)
        idx, rw = routing(T), torch.rand(T, J, generator=g)
        kw = dict(out_dtype=torch.float32, layout="pairs", shared=True)
        assert torch.equal(moe_experts(x, idx, rw, *ws, xq=xq, **kw), moe_experts(x, idx, rw, *ws, **kw)), T
    # a bad xq is refused by name, before any launch
    x, (x8, sx) = _norm_x(2, D, g)
    idx, rw = routing(2), torch.rand(2, J, generator=g)
    bad = [((x8[:1], sx), "xq's x8 must be"), ((x, sx), "xq's x8 must be"), ((x8, sx[:, :2]), "xq's sx must be"),
           ((x8, sx.half()), "xq's sx must be"), ((x8,), "xq must be a pair"), (x8, "xq must be a pair"),
           ((x8, sx.to("meta")), "xq's sx must be on x's device")]
    for xq, match in bad:
        with pytest.raises(ValueError, match=re.escape(match)):
            moe_experts(x, idx, rw, *ws, shared=True, layout="persistent", xq=xq)
    with pytest.raises(ValueError, match="xq .* is for the 'pairs' and 'persistent' layouts"):
        moe_experts(x, idx, rw, *ws[:6], layout="grouped", xq=(x8, sx))


def _module_checks() -> None:
    """`FastMoE` on a 'split' rank of 2 (the persistent layout up to 4 tokens, then the pair grid) and a TP=1 MoE with
    the layout by size: x and xq from the norm kernel, as `FastBlock` calls it; the switch on gives the switch off's
    bits, and hands xq to persistent calls only."""
    import mtp.backends.fast_path as fp
    from mtp.backends.fast_path import set_kernel_options
    from mtp.model.presets import tiny_config
    from mtp.parallel import ParallelPlan
    from tests.parallel.test_moe_ep import fast_moe, layout_config, random_moe, rank_moes

    cfg = layout_config()
    split = fast_moe(rank_moes(random_moe(cfg, seed=4), cfg, ParallelPlan(2, expert_layout="split"))[0])
    tp1 = fast_moe(random_moe(tiny_config(), seed=1))
    set_kernel_options(tp1, moe_layout=None)  # by size: persistent while T * (J + 1) <= 64
    seen, kernel = [], fp.moe_experts

    def spy(x, *a, **k):  # the pair grid (past persistent_tokens) never gets xq: recorded, not run (the interpreter)
        seen.append((k.get("layout"), k.get("xq") is not None))
        return kernel(x, *a, **k) if k.get("layout") != "pairs" else torch.zeros(x.shape, dtype=torch.float32)

    fp.moe_experts = spy
    g = torch.Generator().manual_seed(6)
    try:
        for name, moe, tokens in (("split", split, (1, 4, 5)), ("tp1", tp1, (2,))):
            assert moe.fast_options.moe_item_regs and moe.fast_options.moe_x8, name
            for T in tokens:
                x, xq = _norm_x(T, moe.gate.weight.shape[1], g)
                out = {}
                for on in (False, True):
                    moe.fast_options.moe_x8 = on
                    seen.clear()
                    out[on] = moe(x, xq, rounded=False, reduce=False)
                    persistent = T <= moe.persistent_tokens if name == "split" else True
                    layout = ("persistent" if persistent else moe.expert_layout) if name == "split" else None
                    assert seen == [(layout, on and persistent)], (name, T, on, seen)
                assert torch.equal(out[True], out[False]), (name, T, (out[True] - out[False]).abs().max().item())
    finally:
        fp.moe_experts = kernel
        for moe in (split, tp1):
            moe.fast_options.moe_x8 = True


if __name__ == "__main__":
    interpreted_main([_kernel_checks, _module_checks], fp8_rounding=True, pdl=True)
