"""The persistent experts' down projection as one flattened loop per program (`moe_experts(down_flat=True)`,
`mtp.kernels.moe_down_flat`, switch `FastPathOptions.moe_down_flat`), on the CPU.

- Under the Triton interpreter (a subprocess: the interpreter is chosen when a kernel is decorated): `moe_experts`
  gives the same bits with and without down_flat at 1..4 tokens, with and without the implicit shared slot, with -1
  slots, on a 'split' rank's ids (every routed slot local) and a contiguous expert-parallel rank's (few local
  experts, most slots -1), with 1 and 2 down K slices (also a short last slice: 3 K groups in 2 slices), on the
  default grid and on a few programs, so that each program's loop runs through several work items; and
  `FastMoE` hands down_flat to the persistent layout only, with the switch, the same bits.
- Compiled for sm_90 (no GPU: triton's own ptxas): the flattened loop is software-pipelined across work items, its
  tile loads issued stages ahead of the loop and inside it, its epilogue's store inside the same loop.
GPU twin at the TP=8 split rank's shapes: tests/kernels/test_moe_down_flat_gpu.py.
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


def test_moe_down_flat_interpreted():
    run_interpreted(__file__, 600)


def test_moe_down_flat_variant():
    """`mtp-bench --kernel-variants moe_down_flat` turns the switch on (off by default until measured)."""
    from mtp.bench.rank import KERNEL_VARIANTS
    from mtp.kernels.dispatch import FastPathOptions

    flags, options = KERNEL_VARIANTS["moe_down_flat"]
    o = FastPathOptions()
    assert not o.moe_down_flat
    o.set(**flags)
    assert o.moe_down_flat and options == {}


def test_flat_loop_pipelines_on_hopper():
    """The sm_90 TTGIR of `_moe_down_flat` (a TP=8 split rank's one token: 8 routed + the shared slot, BM = 16):
    one loop, software-pipelined over (item, K group) iterations: num_stages - 1 = 4 weight tiles and h tiles asked
    (cp.async) before it, one more of each per iteration inside it, which waits for the oldest 2 groups only, and the
    epilogue's store inside the same loop, so a program's next items' tiles are in flight while it finishes one.
    `_moe_down_persistent`, for contrast, issues its tiles in a loop nested in the item loop."""
    pytest.importorskip("triton")
    from mtp.kernels.moe import _moe_down_persistent
    from mtp.kernels.moe_down_flat import _moe_down_flat
    from tests.kernels.test_fused_kernels import _compile_for_hopper

    ptrs = dict(h8_ptr="*fp8e4nv", hs_ptr="*fp32", idx_ptr="*i32", rw_ptr="*fp32", w2_ptr="*fp8e4nv",
                s2_ptr="*fp32", out_ptr="*fp32")
    consts = dict(TOPK=9, J=8, BM=16, PPAD=16, KPAD=16, PDL=False, PREFETCH=False)
    aligned = ("D", "I", "stride_we", "stride_se", "stride_sn")

    def loops(kernel) -> tuple[list[tuple[int, int, list[str]]], list[str]]:
        ir = _compile_for_hopper(kernel, ptrs, consts, num_warps=4, num_stages=5, aligned=aligned).asm["ttgir"]
        return _ttgir_loops(ir), ir.splitlines()

    flat, lines = loops(_moe_down_flat)
    assert len(flat) == 1, flat  # one loop: none nested in an item loop
    _, first, ops = flat[0]
    ahead = sum("ttg.async_copy_global_to_local" in s for s in lines[:first])
    assert ahead == 2 * 4, f"{ahead} tile copies before the loop: want 4 stages of (w, h)"
    assert ops.count("ttg.async_copy_global_to_local") == 2 and "tt.store" in ops, ops
    assert "ttg.async_wait 6" in ops, ops  # 3 stages of 2 copies stay in flight while one is consumed
    old, _ = loops(_moe_down_persistent)
    assert [depth for depth, _, ops in old if "ttg.async_copy_global_to_local" in ops] == [1, 2], old


def _ttgir_loops(ir: str) -> list[tuple[int, int, list[str]]]:
    """Each scf.for of a TTGIR listing: (its depth among the loops, its line, the tile copies, stores and waits
    ('ttg.async_wait N': until N copies are left in flight) in its body, nested regions included). Regions open on a line ending in '{' and close on one starting with '}'."""
    loops, stack = [], []  # stack: per open region, its loop's index or None
    for n, line in enumerate(ir.splitlines()):
        s = line.strip()
        if s.startswith("}"):
            stack.pop()
            if s.endswith("{"):  # '} else {'
                stack.append(None)
            continue
        op = re.search(r"ttg\.async_copy_global_to_local|tt\.store |ttg\.async_wait [^{]*\{num = (\d+)", s)
        if op:
            name = f"ttg.async_wait {op.group(1)}" if op.group(1) else op.group(0).strip()
            for i in stack:
                if i is not None:
                    loops[i][2].append(name)
        if s.endswith("{"):
            if "scf.for " in s:
                loops.append((1 + sum(i is not None for i in stack), n, []))
            stack.append(len(loops) - 1 if "scf.for " in s else None)
    return loops


# ----------------------------------------------------------------------------- run under TRITON_INTERPRET=1
def _routes(T: int, E: int, J: int, pattern: str, g: torch.Generator) -> torch.Tensor:
    """Router ids [T, J] as a rank sees them: 'split' every slot a local expert (distinct within a token, shared
    across tokens); 'contiguous' a rank holding a few experts: most slots -1, the local ids repeating across tokens."""
    if pattern == "split":
        return torch.stack([torch.randperm(E, generator=g)[:J] for _ in range(T)]).int()
    idx = torch.full((T, J), -1, dtype=torch.int32)
    for t in range(T):
        local = torch.randperm(3, generator=g)[: 1 + t % 2]  # experts 0..2 of the stack, 1 or 2 per token
        idx[t, torch.randperm(J, generator=g)[: local.numel()]] = local.int()
    return idx


def _kernel_checks() -> None:
    from mtp.kernels.moe import moe_experts
    from tests.kernels.test_moe_grouped import _experts

    E, D, J = 6, 256, 3  # 6 routed experts + the shared one (stack entry 6); 2 N-blocks
    g = torch.Generator().manual_seed(3)
    # (I, T, down K slices, ids, shared slot, (gate/up, down) programs): 2-4 down programs loop over up to 9 items
    # each; None is the default grid, where a contiguous rank's few experts leave programs without an item. I = 384:
    # 3 K groups in 2 slices, the second one group short
    cases = ((256, 1, 1, "split", True, (3, 2)), (256, 2, 2, "contiguous", False, None),
             (256, 4, 1, "split", True, (3, 2)), (384, 3, 2, "contiguous", True, (3, 4)))
    for I, T, ks, pattern, shared, programs in cases:
        ws = _experts(E + 1, D, I, seed=I)
        x = torch.randn(T, D, generator=g).bfloat16()
        idx = _routes(T, E, J, pattern, g)
        if pattern == "split" and T > 1:
            idx[1, 0] = -1  # one slot on another rank
        rw = torch.rand(T, J, generator=g)
        opt = dict(out_dtype=torch.float32, layout="persistent", shared=shared, splits=(2, ks), programs=programs)
        old = moe_experts(x, idx, rw, *ws, **opt)
        new = moe_experts(x, idx, rw, *ws, down_flat=True, **opt)
        where = (I, T, ks, pattern, shared, programs)
        assert torch.equal(new, old), (where, (new - old).abs().max().item())
        assert bool(old.abs().sum() > 0), where  # a case with work in it
    x, idx, rw = torch.randn(1, D), torch.tensor([[0, 1, -1]], dtype=torch.int32), torch.rand(1, J)
    for bad in (dict(layout="pairs", down_flat=True), dict(layout="persistent", down_flat=1)):
        try:
            moe_experts(x, idx, rw, *_experts(E, D, 256, seed=0), **bad)
        except ValueError as e:
            assert "down_flat must be a bool, True only with the 'persistent' layout" in str(e), (bad, str(e))
        else:
            raise AssertionError(f"moe_experts must refuse {bad}")


def _module_checks() -> None:
    """A 'split' rank's FastMoE (persistent layout up to persistent_tokens, the pair grid above): switch
    moe_down_flat hands down_flat=True to its persistent calls only; the same bits as off."""
    import mtp.backends.fast_path as fp
    from mtp.backends.fast_path import fast_module
    from mtp.model.fp8 import act_quant
    from mtp.parallel import ParallelPlan
    from tests.parallel.test_moe_ep import layout_config, random_moe, rank_moes

    cfg = layout_config()
    ep = rank_moes(random_moe(cfg, seed=4), cfg, ParallelPlan(2, expert_layout="split"))[0]
    fast_module(ep)
    for mod in ep.modules():
        if mod is not ep:
            fast_module(mod, ep.fast_options)
    seen, kernel = [], fp.moe_experts

    def spy(*a, **k):
        seen.append((k.get("layout"), k.get("down_flat")))
        return kernel(*a, **k)

    fp.moe_experts = spy
    try:
        for T in (1, ep.persistent_tokens + 1):
            x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(T))
            out = {}
            for on in (False, True):
                ep.fast_options.moe_down_flat = on
                seen.clear()
                out[on] = ep(x, act_quant(x), rounded=False, reduce=False)
                persistent = T <= ep.persistent_tokens
                assert seen == [("persistent" if persistent else "pairs", on and persistent)], (T, on, seen)
            assert torch.equal(out[True], out[False]), T
    finally:
        fp.moe_experts = kernel
        ep.fast_options.moe_down_flat = False


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from tests.interp import patch_interpreter_loop_bounds

    patch_interpreter_loop_bounds()
    torch.manual_seed(0)
    _kernel_checks()
    _module_checks()
    print("interpreted checks ok")
