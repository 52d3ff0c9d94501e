"""The persistent layout's down projection and combine in one launch (`moe_experts(down_fused=True)`,
`mtp.kernels.moe_down_fused`), switch `moe_down_fused`.

Under the Triton interpreter (a subprocess: the interpreter is chosen when a kernel is decorated):
- bit for bit (torch.equal) the persistent layout's down + combine launches with the same K slices where the
  program's tile has the item kernel's 128 rows (the interpreter's numpy matmul sums a column of a 64-row tile in
  another order: at the default 64 rows within 1e-6; the GPU test holds 64 rows to torch.equal), at 1..4 and 7
  tokens with the shared slot (J = 8 routed + 1), 8 tokens without it (64 pairs, the persistent limit), -1 slots
  (a token with none routed here too), `add` or not, 1 and 2 K slices, an uneven slice (I = 384: 3 groups in
  slices of 2 and 1), tokens sharing an expert, a bf16 output; and the reference within the expert kernels'
  tolerance. D must be a multiple of 128 (`moe_experts` refuses others), so no odd D.
- under PDL (the interpreter's PDL patch): the same bits, and the shared expert's rows asked of L2 before the wait.
On the CPU compiler for sm_90 (no GPU): the weight tiles are pipelined (shared-memory buffers, the loop's async
wait leaves several copies in flight), and the route weight's product is `mul.rn.f32` (not fused into the add).
The switch's wiring (`FastMoE`) and the launch count: tests/kernels/test_moe_down_fused_wiring.py.
GPU twin at the TP=8 split rank's shapes: tests/kernels/test_moe_down_fused_gpu.py.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`
from tests.interp import run_interpreted  # noqa: E402


def test_moe_down_fused_interpreted():
    run_interpreted(__file__, 900)


def test_moe_down_fused_pdl_interpreted():
    run_interpreted(__file__, 300, "pdl")


@pytest.mark.slow
def test_switch_on_a_tiny_split_rank_interpreted():
    run_interpreted(__file__, 900, "model")


def test_plan_counts_one_launch_fewer():
    """`plan.kernels`: with moe_down_fused the persistent experts are 2 launches, not 3: a TP=8 'split' rank at 1..4
    tokens (persistent_tokens), a 'contiguous' rank while tokens x 8 slots <= 64; the pair grid (split at 5+ tokens,
    one process) and the grouped GEMM keep theirs."""
    import dataclasses

    from mtp.model.presets import real_config
    from mtp.plan.kernels import Limits, StepShape, per_layer

    cfg = real_config(layers=61, dense_layers=3)
    lim = Limits.current()
    assert not lim.moe_down_fused and lim.split_persistent == 4 and lim.persistent_pairs == 64
    on = dataclasses.replace(lim, moe_down_fused=True)
    for layout, fewer in (("split", (1, 2, 3, 4)), ("contiguous", (1, 2, 3, 4, 5, 8))):
        for N in (1, 2, 3, 4, 5, 8, 9, 16, 17):
            sh = StepShape(1, N, 1024 + N, tp=8, expert_layout=layout)
            d = per_layer(cfg, sh, lim)["moe"] - per_layer(cfg, sh, on)["moe"]
            assert d == (1 if N in fewer else 0), (layout, N, d)
    sh = StepShape(1, 1, 1025, tp=1)
    assert per_layer(cfg, sh, on) == per_layer(cfg, sh, lim)


def _compile_fused(T: int, stages: int):
    from mtp.kernels.moe_down_fused import BN, _moe_down_fused_kernel
    from tests.kernels.test_fused_kernels import _compile_for_hopper

    consts = dict(TOPK=9, J=8, BN=BN, BM=max(16, 1 << (T - 1).bit_length()), ADD=True, PDL=1, PREFETCH=True,
                  ASM=True)
    return _compile_for_hopper(_moe_down_fused_kernel, dict(h8_ptr="*fp8e4nv", w2_ptr="*fp8e4nv", idx_ptr="*i32"),
                               consts, num_warps=4, num_stages=stages, aligned=("D", "I", "stride_we", "stride_se"))


@pytest.mark.parametrize("T", [1, 4])
def test_weight_tiles_pipelined_on_sm90(T):
    """sm_90 TTGIR at the default depth: the loop's weight tiles go through shared-memory buffers by cp.async
    (`ttg.async_copy_global_to_local`), (num_stages - 1) / 2 + 1 = 5 of them, and the loop's wait leaves copies in
    flight (num > 0); the expert id they depend on is copied ahead too. PTX: the route weight's product is
    mul.rn.f32 (`_mul_rn`), the scaled dot's add an fma, as in `_moe_down_persistent`."""
    pytest.importorskip("triton")
    from mtp.kernels.moe_down_fused import BN, DEFAULT_STAGES

    k = _compile_fused(T, DEFAULT_STAGES)
    ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
    assert re.search(rf"local_alloc : \(\) -> !ttg\.memdesc<5x{BN}x128xf8E4M3FN", ttgir), "weight tiles not buffered"
    assert re.search(r"local_alloc : \(\) -> !ttg\.memdesc<\d+x1xi32", ttgir), "the expert id is not copied ahead"
    loop = ttgir[ttgir.index("scf.for %"):]  # the prologue's loops (prefetches) have no iter_args
    loop = loop[loop.index("iter_args"):]
    waits = [int(n) for n in re.findall(r"ttg\.async_wait [^\n]*\{num = (\d+)", loop.split("scf.yield")[0])]
    assert waits and min(waits) > 0, f"the loop waits for every copy: {waits}"
    assert "mul.rn.f32" in ptx and "fma.rn.f32" in ptx and "wgmma.mma_async" in ptx


# ----------------------------------------------------------------------------- run under TRITON_INTERPRET=1
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _routing(T: int, E: int, J: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.stack([torch.randperm(E, generator=g)[:J] for _ in range(T)]).int()
    return idx, torch.rand(T, J, generator=g)


def _kernel_checks() -> None:
    import mtp.kernels.moe_down_fused as mdf
    from mtp.kernels.moe import moe_experts, moe_experts_ref
    from tests.kernels.test_moe_grouped import TOL, _experts

    E, D, J = 10, 256, 8  # 10 routed experts + the shared one at S = 10
    S = E
    g = torch.Generator().manual_seed(3)
    stacks = {I: _experts(E + 1, D, I, seed=I) for I in (256, 384)}
    bn = mdf.BN
    cases = [  # (T, shared, I, splits, add, out dtype)
        (1, True, 256, None, False, torch.float32), (2, True, 256, (2, 1), True, torch.float32),
        (3, True, 256, (1, 2), False, torch.float32), (4, True, 256, None, True, torch.float32),
        (7, True, 256, (1, 1), False, torch.float32), (8, False, 256, (2, 2), True, torch.float32),
        (2, True, 384, (1, 2), True, torch.float32), (3, False, 384, (2, 3), False, torch.bfloat16),
        (1, False, 256, (1, 1), False, torch.bfloat16),
    ]
    for T, shared, I, splits, with_add, dt in cases:
        ws = stacks[I]
        x = torch.randn(T, D, generator=g).bfloat16()
        idx, rw = _routing(T, E, J, g)
        idx[0, 1] = -1  # a slot on another rank
        if T > 2:
            idx[2] = -1  # a token with no routed expert here
        if T > 3:
            idx[3] = idx[1].flip(0)  # tokens sharing every expert (distinct within each): tiles read twice
        add = torch.randn(T, D, generator=g) if with_add else None
        kw = dict(out_dtype=dt, layout="persistent", shared=shared, splits=splits, add=add)
        want = moe_experts(x, idx, rw, *ws, **kw)
        case = (T, shared, I, splits, with_add, dt)
        mdf.BN = 128  # the item kernel's tile: numpy sums each column as it does there
        try:
            same = moe_experts(x, idx, rw, *ws, down_fused=True, **kw)
        finally:
            mdf.BN = bn
        assert same.dtype == dt and torch.equal(same, want), (case, (same.float() - want.float()).abs().max().item())
        got = moe_experts(x, idx, rw, *ws, down_fused=True, **kw)  # 64 rows: numpy's sums in another order
        assert got.dtype == dt and _rel(got, want) < 1e-6, (case, _rel(got, want))
        if dt == torch.float32:
            ids, ws_ = (torch.cat([idx, torch.full((T, 1), S, dtype=torch.int32)], 1),
                        torch.cat([rw, torch.ones(T, 1)], 1)) if shared else (idx, rw)
            ref = moe_experts_ref(x, ids, ws_, *ws, out_dtype=torch.float32) + (0 if add is None else add)
            assert _rel(got, ref) < TOL, (case, _rel(got, ref))
    x, idx, rw = torch.randn(2, D), *_routing(2, E, J, g)
    for layout in ("pairs", "grouped"):
        try:
            moe_experts(x, idx, rw, *stacks[256], layout=layout, down_fused=True)
        except ValueError as e:
            assert "down_fused is the persistent layout's" in str(e), str(e)
        else:
            raise AssertionError(f"down_fused must refuse layout {layout!r}")


def _pdl_checks() -> None:
    """With PDL (the interpreter runs the PDL branches: `patch_interpreter_pdl`): the same bits as without, and the
    shared expert's weight asked of L2 before the wait by the grid, all of it (`prefetch_span_l2`)."""
    from mtp.kernels.moe import moe_experts
    from tests.interp import PREFETCHED, patch_interpreter_pdl
    from tests.kernels.test_moe_grouped import _experts

    patch_interpreter_pdl()
    E, D, I, J = 10, 256, 256, 8
    ws = _experts(E + 1, D, I, seed=5)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, D, generator=g).bfloat16()
    idx, rw = _routing(2, E, J, g)
    kw = dict(out_dtype=torch.float32, layout="persistent", shared=True)
    plain = moe_experts(x, idx, rw, *ws, down_fused=True, **kw)
    PREFETCHED.clear()
    with_pdl = moe_experts(x, idx, rw, *ws, down_fused=True, pdl=True, **kw)
    assert torch.equal(with_pdl, plain)
    w_s = ws[4][E]  # the shared expert's down weight: stack entry S = E
    lo = w_s.data_ptr()
    got = {int(a) // 128 for arr in PREFETCHED for a in arr if lo <= int(a) < lo + w_s.numel()}
    assert len(got) == D * I // 128, \
        f"the shared expert's {D * I // 128} lines of down weight not all asked of L2: {len(got)}"


def _model_checks() -> None:
    """A tiny 'split' rank of 2 (the persistent experts up to 4 tokens, the shared one their last slot): switch
    moe_down_fused takes one launch per MoE layer off at 1 and 3 tokens (the pair grid at 6 keeps its count), the
    output is bit-equal with 128-row tiles (as `_kernel_checks`) and the greedy tokens are the same with 64."""
    import mtp.kernels.moe_down_fused as mdf
    from mtp.backends import fast_path as fp
    from mtp.checkpoint.synthetic import fill_cache_random
    from mtp.parallel.layout import ParallelPlan
    from mtp.parallel.simulate import simulated_rank
    from mtp.parallel.synthetic import random_parallel_model
    from mtp.plan.launches import counting
    from tests.plan.test_kernel_count import _tiny

    cfg = _tiny(2)
    g = torch.Generator().manual_seed(0)
    bn = mdf.BN
    with simulated_rank(2, 0) as comm:
        model = random_parallel_model(cfg, comm, ParallelPlan(2, expert_layout="split"), device="cpu",
                                      dtype=torch.bfloat16)
        fp.install_fast_modules(model)
        fp.set_elementwise(model, "triton")
        moes = [m for m in model.model.layers.modules() if isinstance(m, fp.FastMoE)]  # the trunk's
        assert moes and all(m.persistent_tokens == 4 for m in moes)
        for w in (1, 3, 6):
            cache = fill_cache_random(model.new_cache(1, 8 + max(w, 4)), 8)
            base = cache.seq_lens.clone()
            ids = torch.randint(0, cfg.vocab_size, (1, w), generator=g)
            outs, counts = {}, {}
            for on, rows in ((False, bn), (True, 128), (True, bn)):
                fp.set_kernels(model, moe_down_fused=on)
                mdf.BN = rows
                try:
                    with torch.no_grad():  # a first forward allocates the kernels' counters (a launch, once)
                        cache.truncate(base)
                        model(ids, cache, kv_len=8 + w)
                    cache.truncate(base)
                    with torch.no_grad(), counting(model) as c:
                        outs[on, rows] = model(ids, cache, kv_len=8 + w).logits.float()
                finally:
                    mdf.BN = bn
                counts[on, rows] = c.per_kind()["moe"]
            fp.set_kernels(model, moe_down_fused=False)
            fewer = counts[False, bn] - counts[True, bn]
            assert fewer == (len(moes) if w <= 4 else 0), (w, counts)
            if w <= 4:
                assert torch.equal(outs[True, 128], outs[False, bn]), (w, "128-row tiles: the same bits")
            assert torch.equal(outs[True, bn].argmax(-1), outs[False, bn].argmax(-1)), (w, "greedy tokens")


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from tests.interp import patch_interpreter_fp8_rounding, patch_interpreter_loop_bounds

    patch_interpreter_loop_bounds()
    patch_interpreter_fp8_rounding()
    {"kernels": _kernel_checks, "pdl": _pdl_checks, "model": _model_checks}[sys.argv[1] if len(sys.argv) > 1 else "kernels"]()
    print("interpreted checks ok")
