"""The grouped routed-expert layout (`mtp.kernels.moe_grouped`) on the CPU: the sort / padding step against its
plain-Python twin, and the kernels against `moe_experts_ref` under the Triton interpreter.

The interpreter is chosen when a kernel is decorated (at import), so the kernel checks run in a subprocess started
with TRITON_INTERPRET=1 (this file as a script). Its fp32 -> fp8 cast is not CUDA's (it rounds the truncated bits
half up, with no carry past an odd exponent), so the reference runs with that same cast (`interp_act_quant`: the
reference's scales, the interpreter's own conversion function) and what is left between kernel and reference is
fp32 summation order: held to 1e-5 relative (norm over the output; the measured gap is ~1e-7). The GPU holds the
kernels to the true reference: tests/kernels/test_moe_grouped_gpu.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mtp.kernels.moe import GROUPED_ABOVE, PERSISTENT_MAX_PAIRS, default_layout
from mtp.kernels.moe_grouped import BLOCK_MS, max_blocks, moe_align_ref

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`
from tests.interp import interpreted_main, run_interpreted  # noqa: E402

TOL = 1e-5


def test_align_ref_by_hand():
    """Pairs p = t * J + j sorted by expert (pair order within one), each segment padded to the block, -1 skipped."""
    idx = torch.tensor([[2, -1, 0], [2, 1, -1]])
    assert moe_align_ref(idx, 4, 2) == ([2, -1, 4, -1, 0, 3], [0, 1, 2])
    assert moe_align_ref(idx, 4, 1) == ([2, 4, 0, 3], [0, 1, 2, 2])
    assert moe_align_ref(torch.full((3, 2), -1), 4, 16) == ([], [])


def routings(T: int, E: int, J: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Routings the checks run on: random distinct experts with ~1/3 of the slots -1 (another rank's); the same
    with expert 3 in every token's slot 0 (one expert holding all tokens); one expert for all and every other
    slot -1 (every other expert empty); every slot -1; a token naming one expert twice."""
    rnd = torch.stack([torch.randperm(E, generator=g)[:J] for _ in range(T)])
    rnd = torch.where(torch.rand(T, J, generator=g) < 0.3, -1, rnd)
    hot = torch.where(rnd == 3, -1, rnd)
    hot[:, 0] = 3
    one = torch.full((T, J), -1)
    one[:, J - 1] = E - 1
    dup = rnd.clone()
    dup[0, :2] = 5
    return {"random": rnd.int(), "hot": hot.int(), "one": one.int(), "none": torch.full((T, J), -1).int(),
            "dup": dup.int()}


@pytest.mark.parametrize("bm", BLOCK_MS)
def test_max_blocks_bounds_every_routing(bm):
    """The static block bound covers every routing the checks use, and is reached (one pair per expert)."""
    g = torch.Generator().manual_seed(0)
    E, J = 16, 4
    for T in (1, 5, 17, 40, 100):
        for name, idx in routings(T, E, J, g).items():
            assert len(moe_align_ref(idx, E, bm)[1]) <= max_blocks(T * J, E, bm), (T, name)
    idx = torch.arange(E).view(E // J, J)
    assert len(moe_align_ref(idx, E, bm)[1]) == max_blocks(E, E, bm) == E


def test_default_layout_by_size():
    assert PERSISTENT_MAX_PAIRS // 8 == 8 and default_layout(1, 8) == default_layout(8, 8) == "persistent"
    assert default_layout(9, 8) == "pairs" and default_layout(GROUPED_ABOVE, 8) == "pairs"
    assert default_layout(GROUPED_ABOVE + 1, 8) == "grouped" and default_layout(4096, 8) == "grouped"


def test_grouped_kernels_compile_for_hopper():
    """The align and grouped GEMM kernels compile for sm_90 (the interpreter runs none through the compiler); the
    GEMMs' products are wgmma, and with the device's alignment the K loop is pipelined (one shared-memory buffer
    per stage) within an SM's 227 KB at every M-block and the default stages (`grouped_partials`)."""
    pytest.importorskip("triton")
    from mtp.kernels import moe_grouped as mg

    from .test_fused_kernels import _compile_for_hopper

    i32, f8 = "*i32", "*fp8e4nv"
    _compile_for_hopper(mg._moe_count_kernel, dict(idx_ptr=i32, cnt_ptr=i32), dict(CH=1024), 4)
    _compile_for_hopper(mg._moe_align_kernel, dict(idx_ptr=i32, cnt_ptr=i32, rows_ptr=i32, blk_e_ptr=i32,
                                                   nblk_ptr=i32), dict(BM=16, EPAD=32, CH=1024), 4)
    blocks = dict(rows_ptr=i32, blk_e_ptr=i32, nblk_ptr=i32)
    for bm in (16, 128):
        nw = 8 if bm >= 64 else 4
        shared = {}
        for stages in (1, 3):
            gu = _compile_for_hopper(mg._grouped_gate_up_kernel,
                                     dict(x8_ptr=f8, w1_ptr=f8, w3_ptr=f8, h8_ptr=f8, **blocks), dict(TOPK=8, BM=bm),
                                     nw, stages, aligned=("D", "I", "stride_we", "stride_se"))
            dn = _compile_for_hopper(mg._grouped_down_kernel, dict(h8_ptr=f8, w2_ptr=f8, **blocks), dict(BM=bm), nw,
                                     stages + 1, aligned=("D", "I", "stride_we", "stride_se"))
            assert "wgmma" in gu.asm["ptx"] and "wgmma" in dn.asm["ptx"], bm
            shared[stages] = (gu.metadata.shared, dn.metadata.shared)
        tiles_gu, tiles_dn = 2 * 128 * 128 + bm * 128, 128 * 128 + bm * 128  # bytes one K step loads
        assert shared[3][0] >= 3 * tiles_gu and shared[3][1] >= 4 * tiles_dn, (bm, shared)  # pipelined
        assert max(shared[3]) <= 227 * 1024, (bm, shared)


def test_align_interpreted():
    run_interpreted(__file__, 300, "align")


@pytest.mark.slow
def test_grouped_experts_interpreted():
    run_interpreted(__file__, 900, "experts")


@pytest.mark.slow
def test_fast_moe_grouped_interpreted():
    run_interpreted(__file__, 900, "module")


# ----------------------------------------------------------------------------- run under TRITON_INTERPRET=1
def interp_act_quant(x: torch.Tensor, block: int = 128, scale_fmt: str | None = "ue8m0"):
    """`mtp.model.fp8.act_quant` with the interpreter's fp32 -> e4m3 cast instead of torch's (CUDA's) one."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import _convert_float, _ir

    from mtp.model import fp8

    K = x.shape[-1]
    xg = x.to(torch.float32).unflatten(-1, (K // block, block))
    s = fp8.round_scale_ue8m0(xg.abs().amax(-1).clamp_min(fp8.AMAX_FLOOR) / fp8.FP8_MAX)
    v = (xg / s.unsqueeze(-1)).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).contiguous()
    u8 = _convert_float(v.numpy(), tl.float32, tl.float8e4nv, _ir.ROUNDING_MODE.RTNE)
    q = torch.from_numpy(np.ascontiguousarray(u8).view(np.uint8).reshape(v.shape)).view(fp8.FP8_DTYPE)
    return q.flatten(-2), s


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _experts(E: int, D: int, I: int, seed: int) -> list[torch.Tensor]:
    from mtp.model.fp8 import weight_quant

    g = torch.Generator().manual_seed(seed)
    ws = []
    for N, K in ((I, D), (I, D), (D, I)):
        w8, s = zip(*[weight_quant(torch.randn(N, K, generator=g) * K ** -0.5) for _ in range(E)])
        ws += [torch.stack(w8), torch.stack(s)]
    return ws


def _align_checks() -> None:
    from mtp.kernels.moe_grouped import moe_align

    g = torch.Generator().manual_seed(1)
    E, J = 16, 4
    for T in (1, 17, 100):
        for name, idx in routings(T, E, J, g).items():
            for bm in (16, 64):
                rows, blk_e, nblk = moe_align(idx, E, bm)
                want_rows, want_blk = moe_align_ref(idx, E, bm)
                n = int(nblk)
                assert n == len(want_blk) and blk_e.numel() == max_blocks(T * J, E, bm), (T, name, bm)
                assert rows[:n * bm].tolist() == want_rows, (T, name, bm, rows[:n * bm].tolist(), want_rows)
                assert blk_e[:n].tolist() == want_blk, (T, name, bm)
    # E not a power of two, more experts than pairs
    idx = torch.tensor([[11, 0, -1], [4, 11, 2]], dtype=torch.int32)
    rows, blk_e, nblk = moe_align(idx, 12, 16)
    assert (rows[:int(nblk) * 16].tolist(), blk_e[:int(nblk)].tolist()) == moe_align_ref(idx, 12, 16)


def _experts_checks() -> None:
    import mtp.kernels.moe as moe_mod
    from mtp.kernels.moe import moe_experts, moe_experts_ref

    E, D, I, J = 16, 256, 256, 4
    ws = _experts(E, D, I, seed=0)
    g = torch.Generator().manual_seed(2)
    moe_mod.act_quant_ref = interp_act_quant  # the reference with the interpreter's fp8 cast (module docstring)
    kw = dict(out_dtype=torch.float32, layout="grouped")
    # T = 70: past 64 tokens (the pair layout's limit) and more than one M-block at every block_m; the
    # interpreter is slow (this check is the CPU suite's longest): the routing cases at the small T only
    for T in (1, 5, 17, 70):
        x = torch.randn(T, D, generator=g).bfloat16()
        rw = torch.rand(T, J, generator=g)
        cases = routings(T, E, J, g)
        for name, idx in cases.items():
            if T >= 40 and name in ("one", "dup"):
                continue
            y = moe_experts(x, idx, rw, *ws, **kw)
            if name == "none":
                assert torch.equal(y, torch.zeros_like(y)), f"T={T}: every slot -1 must give exactly 0"
                continue
            ref = moe_experts_ref(x, idx, rw, *ws, out_dtype=torch.float32)
            assert _rel(y, ref) < TOL, (T, name, _rel(y, ref))
            assert torch.equal((y != 0).any(1), (idx >= 0).any(1)), f"T={T} {name}: only tokens without experts get 0"
        idx = cases["random"]
        y = moe_experts(x, idx, rw, *ws, **kw)
        assert torch.equal(moe_experts(x, idx, rw, *ws, **kw), y), f"T={T}: not the same bits twice"
        if T in (17, 70):  # the persistent grids change which program computes what, not the sums: the same bits;
            # the M-block changes the interpreter's matmul shapes, whose BLAS (numpy's, by CPU) may sum a row in
            # another order (an AMD EPYC runner: 1e-8, session 15; on the GPU the bits: test_moe_grouped_gpu.py)
            for bm, programs in ((16, (1, 1)), (16, (3, 5)), (64, None)):
                got = moe_experts(x, idx, rw, *ws, block_m=bm, programs=programs, **kw)
                if bm == 16:
                    assert torch.equal(got, y), (T, bm, programs, _rel(got, y))
                else:
                    assert _rel(got, y) < 1e-6, (T, bm, programs, _rel(got, y))
            add = torch.randn(T, D, generator=g)
            assert torch.equal(moe_experts(x, idx, rw, *ws, add=add, **kw), y + add), f"T={T}: add is summed last"
        if T == 17:  # the pair layout: the same formulas (and the interpreter's same cast)
            y_pairs = moe_experts(x, idx, rw, *ws, out_dtype=torch.float32, layout="pairs")
            assert _rel(y, y_pairs) < TOL, (T, _rel(y, y_pairs))
        if T in (5, 70):  # one rank's experts [e0, e1), the others' slots -1: the full stack with those zeroed
            for e0, e1 in ((0, 6), (6, 16)):
                loc = torch.where((idx >= e0) & (idx < e1), idx - e0, -1).int()
                mine = moe_experts(x, loc, rw, *[w[e0:e1].contiguous() for w in ws], **kw)
                masked = moe_experts(x, idx, rw * (loc >= 0), *ws, **kw)
                assert torch.equal(mine, masked), (T, e0, e1, _rel(mine, masked))
    x, idx, rw = torch.randn(20, D), routings(20, E, J, g)["random"], torch.rand(20, J)
    for bad, match in ((dict(layout="pairs", x=torch.randn(65, D)), "'pairs' for T <= 64"),
                       (dict(layout="grouped", block_m=8), "block_m"), (dict(layout="pairs", block_m=16), "block_m"),
                       (dict(x=torch.randn(4097, D)), "1..4096 tokens")):
        xx = bad.pop("x", x)
        ii, rr = (idx, rw) if xx.shape[0] == 20 else (torch.zeros(xx.shape[0], J).int(), torch.rand(xx.shape[0], J))
        try:
            moe_experts(xx, ii, rr, *ws, **bad)
        except ValueError as e:
            assert match in str(e), (bad, str(e))
        else:
            raise AssertionError(f"moe_experts must refuse {bad}")


def _module_checks() -> None:
    """FastMoE above grouped_above tokens (the grouped kernels; the router kernel in 64-token chunks, or the
    reference router) against the reference MoE with the interpreter's cast, and chunked experts (max_tokens)
    against one call."""
    from mtp.backends.fast_path import FastMoE, disable_fast_path, fast_module
    from mtp.model import fp8
    from mtp.model.presets import tiny_config
    from tests.parallel.test_moe_ep import ep_modules, random_moe

    cfg = tiny_config()
    moe = random_moe(cfg, seed=4)
    g = torch.Generator().manual_seed(3)
    quant = fp8.act_quant
    fp8.act_quant = interp_act_quant  # the reference Linear's quantizer (routed and shared experts)
    try:
        for world in (1, 2):
            mods = [moe] if world == 1 else ep_modules(moe, cfg, world)
            # 17 tokens (one router chunk) in one process, 70 (two chunks of 64, past the pair layout) on both:
            # the interpreter is slow
            xs = [torch.randn(T, cfg.hidden_size, generator=g) for T in ((17, 70) if world == 1 else (70,))]
            for m in mods:
                disable_fast_path(m)
            wants = [sum(m(x) for m in mods) for x in xs]
            for m in mods:
                fast_module(m)
                assert isinstance(m, FastMoE)
            for x, want in zip(xs, wants):
                got = sum(m(x) for m in mods)
                assert _rel(got, want) < TOL, (world, x.shape[0], _rel(got, want))
                for m in mods:
                    m.max_tokens = 32  # up to 3 chunks: the same bits
                chunked = sum(m(x) for m in mods)
                for m in mods:
                    m.kernel_route_tokens = 16  # the reference router
                ref_router = sum(m(x) for m in mods)
                for m in mods:
                    del m.max_tokens, m.kernel_route_tokens
                assert torch.equal(chunked, got), (world, x.shape[0], _rel(chunked, got))
                assert _rel(ref_router, want) < TOL, (world, x.shape[0], _rel(ref_router, want))
    finally:
        fp8.act_quant = quant


if __name__ == "__main__":
    interpreted_main({"align": _align_checks, "experts": _experts_checks, "module": _module_checks}, seed=None)
