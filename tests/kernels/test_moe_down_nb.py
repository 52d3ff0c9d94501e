"""Switch `FastPathOptions.moe_down_nb`: the experts' down projection by output block, every expert of the call in one
pipelined loop, y stored directly (`moe.moe_experts(down_nb=True)`, `mtp.kernels.moe_down_nb`), on the CPU.

- Compiled for sm_90 (triton's own ptxas, no GPU) at a TP=8 split rank's shapes (8 routed + the shared slot, I = 256:
  2 K groups an expert, D = 7168): one loop (no nested one) holds the dot, pipelined across expert boundaries: the
  weight tile (cp.async, or a TMA copy) and h's tile issued (stages + 1) // 2 - 1 iterations ahead of their dot
  (the prologue's copies, the buffers (stages + 1) // 2 deep), the expert id and the token slots they depend on
  issued as cp.async a stage before them, the only synchronous load in the loop the next iteration's column scales
  (carried to it); at most 4 barriers an iteration with cp.async tiles, 3 with TMA; no spills; PDL's order (launch
  first, before the wait only the shared expert's L2 prefetch; with option moe_down_pf_experts, `down_nb(pf_experts=)`,
  also the plan's loads of the ids, scales and route weights and the routed experts' prefetches, no store).
- Under the Triton interpreter (a subprocess per group of checks, each a few seconds; the e4m3 cast made CUDA's, PDL
  branches and prefetches as no-ops): the kernel alone (`moe_down_nb.down_nb` on h8 / hs made here) against a float64
  reference of its sum at T = 1..4, with and without the shared slot, -1 slots, a token with no expert, experts
  repeated across tokens, add, every BN and D not a multiple of it; a token's row bit-identical alone and among
  others (T = 1 vs T = 4, at two positions); TMA and PDL the same bits; the shared expert's prefetched lines exactly
  its rows of each program's block. Then `moe_experts` end to end against `moe_experts_ref` (the tolerance of fp32
  reordering in `test_moe_grouped`: 1e-5 relative) and the switch off, its down slices not applying, a token's row
  the same alone and among others with the K slices fixed, bad arguments refused by name, and `FastMoE` handing
  down_nb to persistent calls only, with the switch (and gate_up_after_wait, down_pf_experts with theirs).
- Option moe_down_pf_experts (`down_nb(pf_experts=)`, interpreted): the plan's ids / scales / ranks before the wait and
  the loop's first experts' rows asked of L2 there: the same bits, exactly those lines asked, compiled out without
  PDL or prefetch; `moe_experts` passes it only where gate/up triggers after its wait (`_early_checks`).
GPU twin at the real shapes (CUDA graphs, PDL): tests/kernels/test_moe_down_nb_gpu.py.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`
from tests.interp import interpreted_main, run_interpreted  # noqa: E402


def test_moe_down_nb_switch_and_variant():
    """On by default (measured in the step, session 20); `mtp-bench --kernel-variants moe_down_nb_off` turns it off,
    moe_down_nb on (real switches)."""
    from mtp.bench.rank import KERNEL_VARIANTS
    from mtp.kernels.dispatch import FastPathOptions

    o = FastPathOptions()
    assert o.moe_down_nb
    o.set(moe_down_nb=False)
    flags, options = KERNEL_VARIANTS["moe_down_nb"]
    o.set(**flags)
    assert o.moe_down_nb and options == {}
    flags, options = KERNEL_VARIANTS["moe_down_nb_off"]
    o.set(**flags)
    assert not o.moe_down_nb and options == {}


def compile_down_nb(T: int = 1, rows: int = 64, groups: int = 2, tma: bool = False, stages: int | None = None,
                    pdl: int = 1, pf: int = 0):
    """`moe_down_nb._moe_down_nb_kernel` compiled for sm_90 as `moe_experts(down_nb=True)` launches it on a TP=8 split
    rank at T tokens (8 routed + the shared slot, I = 256: GI = 2), BN = rows, `groups` K groups an iteration; pf:
    its PF (`down_nb(pf_experts=)`: the routed experts' rows asked of L2 before the wait; 0: not)."""
    import mtp.kernels.moe_down_nb as nbm
    from tests.kernels.test_fused_kernels import _compile_for_hopper

    f8 = "*fp8e4nv"
    ptrs = dict(h8_ptr=f8, idx_ptr="*i32", w2_ptr=f8, plan_ptr="*i32")
    consts = dict(TOPK=9, J=8, GI=2, GPAD=2, BN=rows, GU=groups, TP=16, PPAD=triton_next_pow2(9 * T), PDL=pdl,
                  PREFETCH=True, PF=pf, PFP=triton_next_pow2(max(pf, 1)), ADD=False, TMA=tma)
    if tma:
        ptrs["w2_desc"] = f"tensordesc<fp8e4nv[{rows}, 128]>"
    else:
        consts["w2_desc"] = None
    return _compile_for_hopper(nbm._moe_down_nb_kernel, ptrs, consts, num_warps=4,
                               num_stages=stages or nbm.DEFAULT_STAGES[groups], aligned=("D", "stride_we", "stride_se"))


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _flat_loop(ttgir: str) -> tuple[str, str]:
    """(the TTGIR before the loop that holds the dot, that loop's body to its yield, the yield included)."""
    for m in re.finditer(r"scf\.for [^\n]*iter_args[^\n]*\{\n", ttgir):
        end = ttgir.index("scf.yield", m.end())
        body = ttgir[m.end():ttgir.index("\n", end)]
        if "ttng.warp_group_dot" in body or "tt.dot" in body:
            return ttgir[:m.start()], body
    raise AssertionError("no loop with a dot in the TTGIR")


def loop_barriers(ptx: str) -> list[int]:
    """bar.sync instructions in each PTX loop that holds an MMA, and whether it is nested (Depth > 1)."""
    out = []
    for m in re.finditer(r"^(\$L__BB\d+_\d+):[^\n]*Loop Header: Depth=(\d+)[^\n]*\n(.*?)^\s*@%p\d+ bra\s+\1;", ptx,
                         re.M | re.S):
        if "wgmma.mma_async" in m.group(3) or "mma.sync" in m.group(3):
            out.append((int(m.group(2)), m.group(3).count("bar.sync")))
    return out


def test_down_nb_compile_for_hopper():
    """The loop structure of the module docstring, at one and four tokens, BN = 64 and 128, one and two K groups an
    iteration, cp.async and TMA tiles."""
    pytest.importorskip("triton")
    from mtp.kernels.moe_down_nb import DEFAULT_STAGES
    from tests.kernels.test_moe_items import _sass
    from tests.kernels.test_moe_x8 import _sass_k_loop
    from tests.kernels.test_pdl import _order

    # pf: the plan's ids, scales and ranks and the routed experts' prefetch before the wait (`down_nb(pf_experts=)`)
    for T, rows, groups, tma, pf in ((1, 64, 2, False, 0), (4, 64, 2, True, 0), (1, 64, 1, False, 0),
                                     (4, 128, 2, False, 0), (1, 128, 1, True, 0), (1, 64, 2, True, 8),
                                     (4, 64, 2, False, 64)):
        k = compile_down_nb(T, rows, groups, tma, pf=pf)
        name = f"T={T} BN={rows} groups={groups} tma={tma} pf={pf}"
        bufs = (DEFAULT_STAGES[groups] + 1) // 2  # the indirection (id -> tile) takes half the stages
        pre, loop = _flat_loop(k.asm["ttgir"])
        # per K group of an iteration a weight tile and an h tile, each in a buffer `bufs` deep
        for tile in (rf"{rows}x128xf8E4M3FN", r"16x128xf8E4M3FN"):
            found = re.findall(rf"ttg\.local_alloc : \(\) -> !ttg\.memdesc<{bufs}x{tile}", pre)
            assert len(found) == groups, (name, tile, found)
        w_copy = ("ttng.async_tma_copy_global_to_local" if tma else
                  rf"ttg\.async_copy_global_to_local [^\n]*tensor<{rows}x128x!tt\.ptr")
        # in the loop: this iteration's copies of a later iteration's tiles; before it, the first bufs - 1 iterations'
        assert len(re.findall(w_copy, loop)) == groups and len(re.findall(w_copy, pre)) == groups * (bufs - 1), name
        assert len(re.findall(r"async_copy_global_to_local [^\n]*tensor<16x128x!tt\.ptr", loop)) == groups, name
        # the expert id and the token slots: cp.async too, a stage before the tiles whose addresses they form
        assert len(re.findall(r"async_copy_global_to_local [^\n]*tensor<1x!tt\.ptr<i32>", loop)) == 1, name
        assert len(re.findall(r"async_copy_global_to_local [^\n]*tensor<16x!tt\.ptr<i32>", loop)) == 1, name
        # the only synchronous loads: the next iteration's column scales, carried to it by the yield
        loads = re.findall(r"(%\w+) = tt\.load [^\n]*tensor<16x!tt\.ptr<f32>", loop)
        assert len(loads) == groups and len(re.findall(r"= tt\.load ", loop)) == groups, (name, loads)
        yielded = loop[loop.index("scf.yield"):]
        assert all(v in yielded for v in loads), f"{name}: a column scale not carried to the next iteration"
        ptx = k.asm["ptx"]
        nest = loop_barriers(ptx)
        assert len(nest) == 1 and nest[0][0] == 1, (name, nest)  # one loop, not nested in another
        assert nest[0][1] <= 4, (name, nest)  # bar.sync an iteration (triton 3.6: 2 with cp.async tiles, 3-4 TMA)
        sass, use = _sass(k)
        assert use.get("STACK") == "0" and use.get("LOCAL") == "0", (name, use)
        # SASS instructions of the loop per 8 KB of weight (triton 3.6: 168 at BN = 64 and one group, 132 at two, 101
        # at BN = 128 and two; the item kernel's K loop 88 per 8 KB, 176 a [128, 128] group)
        assert _sass_k_loop(sass) / (groups * rows / 64) <= 180, (name, _sass_k_loop(sass))
        seq = _order(ptx)
        wait = seq.index("griddepcontrol.wait")
        assert seq[0] == "griddepcontrol.launch_dependents" and "prefetch.global.L2" not in seq[wait:], name
        # before the wait: the shared expert's rows (2 lines a thread's row); with pf the ids, scales and route
        # weights' loads too, and this thread's share of the pf experts' rows ([next_pow2(pf), BN] rows of 2 lines on
        # 128 threads), never a store
        n_pf = 2 + (triton_next_pow2(pf) * rows * 2 // 128 if pf else 0)
        assert seq[1:wait].count("prefetch.global.L2") == n_pf, (name, seq[1:wait].count("prefetch.global.L2"))
        assert set(seq[1:wait]) == ({"prefetch.global.L2", "ld.global"} if pf else {"prefetch.global.L2"}), name


def test_down_nb_kernel_interpreted():
    run_interpreted(__file__, 120, "kernel")


def test_down_nb_experts_interpreted():
    run_interpreted(__file__, 120, "experts")


def test_down_nb_module_interpreted():
    run_interpreted(__file__, 120, "module")


def test_down_nb_early_plan_interpreted():
    run_interpreted(__file__, 120, "early")


def test_down_pf_switches_and_variants():
    """Option moe_down_pf_experts (8 on a tensor-parallel rank since session 25, 0 in one process) and switch
    moe_gate_up_aw (on there, off in one process): integers >= 0 / a bool, set by the variants moe_down_pf_off (both
    off), moe_down_pf (8 experts, gate/up's trigger after its wait at one token too), moe_down_pf_noaw,
    moe_down_pf_all (64) and moe_gate_up_aw (the trigger alone)."""
    from mtp.bench.rank import KERNEL_VARIANTS
    from mtp.kernels.dispatch import FastPathOptions

    o = FastPathOptions()
    assert o.moe_down_pf_experts == 8 and o.moe_gate_up_aw
    one = FastPathOptions.for_world(1)
    assert one.moe_down_pf_experts == 0 and not one.moe_gate_up_aw
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="moe_down_pf_experts must be an integer >= 0"):
            FastPathOptions(moe_down_pf_experts=bad)
    want = {"moe_down_pf_off": (0, False), "moe_down_pf": (8, True), "moe_down_pf_noaw": (8, False), "moe_down_pf_all": (64, True),
            "moe_gate_up_aw": (0, True)}
    for name, (pf, aw) in want.items():
        flags, options = KERNEL_VARIANTS[name]
        o = FastPathOptions()
        o.set(**flags)
        assert (o.moe_down_pf_experts, o.moe_gate_up_aw, options) == (pf, aw, {}), name


# ----------------------------------------------------------------------------- run under TRITON_INTERPRET=1
TOL = 1e-5  # fp32 summation order against a float64 sum / the reference (`test_moe_grouped.TOL`)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def down_ref(h8, hs, idx, rw, w_down, s_down, shared: bool, add=None) -> torch.Tensor:
    """float64 [T, D]: per token, its pairs' route weight x `fp8_gemm_ref` of the pair's h row (the shared slot J
    weighing 1.0 on stack entry E - 1), + add."""
    from mtp.model.fp8 import fp8_gemm_ref

    T, J = idx.shape
    E, D, _ = w_down.shape
    topk = J + shared
    y = torch.zeros(T, D, dtype=torch.float64, device=h8.device)
    for t in range(T):
        for j in range(topk):
            e, w = (E - 1, 1.0) if j == J else (int(idx[t, j]), float(rw[t, j]))
            if e < 0:
                continue
            q = t * topk + j
            y[t] += w * fp8_gemm_ref(h8[q:q + 1], hs[q:q + 1], w_down[e], s_down[e], acc=torch.float64)[0]
    return y if add is None else y + add.double()


def down_inputs(T: int, J: int, E: int, I: int, shared: bool, g: torch.Generator, device="cpu"):
    """h8 [P, I] / hs [P, I / 128] of random h for the P = T * slots pairs, with NaN where a pair is no expert's (a
    -1 slot's row, never written by gate/up: must never be read); ids [T, J] of distinct experts of the E - shared
    routed ones."""
    from mtp.model.fp8 import act_quant

    idx = torch.stack([torch.randperm(E - shared, generator=g)[:J] for _ in range(T)]).int()
    h8, hs = act_quant(torch.randn(T * (J + shared), I, generator=g))
    return idx.to(device), h8.to(device), hs.to(device)


def down_stack(E: int, D: int, I: int, seed: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """E random experts' FP8 down weights [E, D, I] and block scales [E, ceil(D / 128), I / 128] (any D)."""
    from mtp.model.fp8 import weight_quant

    g = torch.Generator().manual_seed(seed)
    w8, s = zip(*[weight_quant(torch.randn(D, I, generator=g) * I ** -0.5) for _ in range(E)])
    return torch.stack(w8).to(device), torch.stack(s).to(device)


def poison_pairs(h8, hs, idx, shared: bool):
    """NaN (0x7f in e4m3, NaN in fp32) in the rows of the pairs of -1 slots."""
    T, J = idx.shape
    topk = J + shared
    for t, j in (idx < 0).nonzero().tolist():
        q = t * topk + j
        h8[q] = torch.full_like(h8[q].view(torch.uint8), 0x7F).view(h8.dtype)
        hs[q] = float("nan")


def _kernel_checks(device: str = "cpu") -> None:
    """`down_nb` alone (module docstring)."""
    from mtp.kernels.moe import weight_desc
    from mtp.kernels.moe_down_nb import DOWN_NB_ROWS, down_nb
    from tests.interp import PREFETCHED

    E, J, I = 6, 3, 256  # 5 routed + the shared one (or 6 routed); GI = 2
    D = 208  # a multiple of no BN but 16: the last block's rows masked
    wd, sd = down_stack(E, D, I, seed=1, device=device)
    g = torch.Generator().manual_seed(11)
    # (tokens, shared slot, (BN, K groups an iteration), PDL (its branches no-ops here, the shared expert's prefetch
    # recorded))
    for T, shared, tile, pdl in ((1, True, (64, 2), 1), (2, False, (128, 1), 0), (3, True, (32, 2), 0),
                                 (4, True, (64, 1), 2), (4, False, (32, 2), 0)):
        idx, h8, hs = down_inputs(T, J, E, I, shared, g, device)
        idx[0, 1] = -1  # a slot on another rank
        if T > 2:
            idx[2] = -1  # a token with no routed expert here (the shared one still, where shared)
        if T > 3:
            idx[3] = idx[1]  # token 3 routed as token 1: those experts serve two rows
        poison_pairs(h8, hs, idx, shared)
        rw = torch.rand(T, J, generator=g).to(device)
        add = torch.randn(T, D, generator=g).to(device) if T == 2 else None
        PREFETCHED.clear()
        y = down_nb(h8, hs, idx, rw, wd, sd, T, shared, torch.float32, add=add, tile=tile, pdl=pdl)
        ref = down_ref(h8, hs, idx, rw, wd, sd, shared, add)
        assert _rel(y, ref) < TOL, (T, shared, tile, _rel(y, ref))
        if T > 2 and not shared:
            assert not y[2].any(), "a token with no expert: exactly 0"
        if add is not None:  # added after the experts' sum
            assert torch.equal(y, down_nb(h8, hs, idx, rw, wd, sd, T, shared, torch.float32, tile=tile) + add)
        if pdl:  # the same bits without PDL; the shared expert's lines asked of L2: each row of it, once a line
            lines = {int(a) for arr in PREFETCHED for a in arr}
            want = {wd[E - 1].data_ptr() + r * I + c for r in range(D) for c in range(0, I, 128)}
            assert lines == want, (T, tile, len(lines), len(want))
            assert torch.equal(y, down_nb(h8, hs, idx, rw, wd, sd, T, shared, torch.float32, add=add, tile=tile))
        if T == 3:  # one K group an iteration or two: the same sums in the same order
            assert torch.equal(y, down_nb(h8, hs, idx, rw, wd, sd, T, shared, torch.float32, tile=(32, 1)))
    # batch invariance: a token's row alone = among others (at positions 0 and 2), at every BN
    idx, h8, hs = down_inputs(4, J, E, I, True, g, device)
    idx[1, 0] = -1
    rw = torch.rand(4, J, generator=g).to(device)
    topk = J + 1
    for rows, groups, p in zip(DOWN_NB_ROWS, (2, 1, 2), (0, 2, 2)):
        tile = (rows, groups)
        one = down_nb(h8[p * topk:(p + 1) * topk], hs[p * topk:(p + 1) * topk], idx[p:p + 1], rw[p:p + 1], wd, sd,
                      1, True, torch.float32, tile=tile)
        four = down_nb(h8, hs, idx, rw, wd, sd, 4, True, torch.float32, tile=tile)
        assert torch.equal(one[0], four[p]), (tile, p, (one[0] - four[p]).abs().max().item())
    # TMA ([BN, 128] blocks of the [E * D, I] view; D a multiple of 128): the same tiles, the same bits
    wd, sd = down_stack(E, 256, I, seed=2, device=device)
    for T, tile in ((1, (64, 2)), (4, (128, 1))):
        idx, h8, hs = down_inputs(T, J, E, I, True, g, device)
        rw = torch.rand(T, J, generator=g).to(device)
        ptr = down_nb(h8, hs, idx, rw, wd, sd, T, True, torch.float32, tile=tile)
        tma = down_nb(h8, hs, idx, rw, wd, sd, T, True, torch.float32, tile=tile,
                      desc=weight_desc("w_down", wd, tile[0]))
        assert torch.equal(tma, ptr), (T, tile)


def _experts_checks() -> None:
    """`moe_experts(down_nb=True)` end to end (module docstring), as the step calls it (x8, item_regs), with one gate/up
    K slice (the interpreter's time is gate/up's programs)."""
    from mtp.kernels.moe import moe_experts, moe_experts_ref
    from mtp.model.fp8 import act_quant
    from tests.kernels.test_moe_grouped import _experts

    E, D, I, J = 5, 256, 256, 2  # 5 routed + the shared S = 5: gate/up 2 K groups, down 2; 2 N-blocks a side
    S = E
    ws = _experts(E + 1, D, I, seed=0)
    g = torch.Generator().manual_seed(2)
    kw = dict(out_dtype=torch.float32, layout="persistent", item_regs=True, splits=(1, 1))

    def call(x, idx, rw, **k):
        return moe_experts(x, idx, rw, *ws, xq=act_quant(x), **dict(kw, **k))

    def ref(x, idx, rw, shared: bool) -> torch.Tensor:
        T = x.shape[0]
        ids = torch.cat([idx, torch.full((T, 1), S, dtype=torch.int32)], 1) if shared else idx
        w = torch.cat([rw, torch.ones(T, 1)], 1) if shared else rw
        return moe_experts_ref(x, ids, w, *ws, out_dtype=torch.float32)

    # one token with the shared slot and a -1 slot; add, summed after the experts
    x, idx, rw = torch.randn(1, D, generator=g).bfloat16(), torch.tensor([[3, -1]]).int(), torch.rand(1, J, generator=g)
    on = call(x, idx, rw, shared=True, down_nb=True)
    assert _rel(on, ref(x, idx, rw, True)) < TOL, _rel(on, ref(x, idx, rw, True))
    add = torch.randn(1, D, generator=g)
    assert torch.equal(call(x, idx, rw, shared=True, down_nb=True, add=add), on + add)
    # three tokens without it, one with no expert here: exactly 0
    x, idx, rw = torch.randn(3, D, generator=g).bfloat16(), torch.tensor([[0, 4], [4, 1], [-1, -1]]).int(), \
        torch.rand(3, J, generator=g)
    on = call(x, idx, rw, down_nb=True)
    assert _rel(on, ref(x, idx, rw, False)) < TOL, _rel(on, ref(x, idx, rw, False))
    assert not on[2].any()
    # four tokens, the shared slot, experts repeated across tokens, a -1 slot: the reference and the switch off; the
    # down slices do not apply ((1, 1) and (1, 2) the same bits); token 2 alone has the bits of its row among the four
    # (batch invariance end to end, the gate/up slices fixed: `default_splits` depends on T)
    x, idx, rw = torch.randn(4, D, generator=g).bfloat16(), torch.tensor([[1, 2], [2, 4], [1, -1], [0, 3]]).int(), \
        torch.rand(4, J, generator=g)
    on = call(x, idx, rw, shared=True, down_nb=True, down_tile=(128, 2))
    off = call(x, idx, rw, shared=True)
    assert _rel(on, ref(x, idx, rw, True)) < TOL and _rel(on, off) < TOL, (_rel(on, ref(x, idx, rw, True)),
                                                                           _rel(on, off))
    assert torch.equal(call(x, idx, rw, shared=True, down_nb=True, down_tile=(128, 2), splits=(1, 2)), on)
    one = call(x[2:3], idx[2:3], rw[2:3], shared=True, down_nb=True, down_tile=(128, 2))
    assert torch.equal(one[0], on[2]), (one[0] - on[2]).abs().max().item()
    for bad, match in ((dict(down_nb=True, layout="pairs"), "down_nb must be a bool, and True only with the "
                                                            "'persistent' layout"),
                       (dict(down_nb=1, layout="persistent"), "down_nb must be a bool"),
                       (dict(down_tile=(64, 2), layout="persistent"), "down_tile is down_nb's"),
                       (dict(down_nb=True, down_tile=(48, 2), layout="persistent"), "rows one of (32, 64, 128)"),
                       (dict(down_nb=True, down_tile=(64, 4), layout="persistent"), "1 or 2 groups dividing")):
        with pytest.raises(ValueError, match=re.escape(match)):
            moe_experts(x, idx, rw, *ws, **bad)


def _module_checks() -> None:
    """`FastMoE` on a 'split' rank hands down_nb=True to its persistent calls (one token) with the switch, never to the
    pair grid past persistent_tokens (a recorder stands in for the kernels); so too gate_up_after_wait (switch
    moe_gate_up_aw) and down_pf_experts (option moe_down_pf_experts, with moe_down_nb on)."""
    from tests.kernels.test_moe_items import persistent_switch_checks

    persistent_switch_checks("moe_down_nb", "down_nb")
    persistent_switch_checks("moe_gate_up_aw", "gate_up_after_wait")
    persistent_switch_checks("moe_down_pf_experts", "down_pf_experts", value=8)


def _early_checks() -> None:
    """Option moe_down_pf_experts (`down_nb(pf_experts=)`): the plan's ids, scales and ranks before the PDL wait and
    each program's rows of its loop's first pf experts asked of L2 there. At a split rank's slots (8 routed + the
    shared slot or not, I = 256) at T = 1..4 (-1 slots, a token with none, experts repeated across tokens, a call with
    no expert at all): the same bits as pf 0, and the lines asked of L2 exactly the shared expert's rows and the loop's
    first min(pf, A) experts' (ascending id), every row of each; none past them, none without PDL or prefetch. Then
    which calls take it (`moe_experts`, recorders for the two kernels): gate/up's trigger after its wait (pdl 2, or
    gate_up_after_wait) and prefetch, never gate/up's trigger at its start or no PDL."""
    import mtp.kernels.moe as moe
    import mtp.kernels.moe_down_nb as nbm
    from mtp.kernels.moe_down_nb import down_nb
    from tests.interp import PREFETCHED

    E, J, I, D = 12, 8, 256, 160  # 11 routed + the shared one; D a multiple of no BN: the last block's rows clamped
    wd, sd = down_stack(E, D, I, seed=3)
    g = torch.Generator().manual_seed(13)

    def lines(experts) -> set:
        return {wd[e].data_ptr() + r * I + c for e in experts for r in range(D) for c in range(0, I, 128)}

    # (tokens, shared slot, pf, tile, PDL mode)
    for T, shared, pf, tile, pdl in ((1, True, 8, (64, 2), 1), (1, False, 3, (128, 1), 2), (2, False, 5, (128, 2), 2),
                                     (3, True, 64, (64, 2), 2), (4, True, 6, (128, 2), 2), (1, False, 8, (128, 2), 2)):
        idx, h8, hs = down_inputs(T, J, E, I, shared, g)
        idx[0, 1] = -1
        if T > 2:
            idx[2] = -1
        if T > 3:
            idx[3, :4] = idx[1, :4]  # experts repeated across tokens
        if T == 1 and pf == 8 and not shared:
            idx[0] = -1  # no expert at all: nothing asked of L2, y exactly 0
        poison_pairs(h8, hs, idx, shared)
        rw = torch.rand(T, J, generator=g)
        off = down_nb(h8, hs, idx, rw, wd, sd, T, shared, torch.float32, tile=tile, pdl=pdl)
        PREFETCHED.clear()
        on = down_nb(h8, hs, idx, rw, wd, sd, T, shared, torch.float32, tile=tile, pdl=pdl, pf_experts=pf)
        assert torch.equal(on, off), (T, shared, pf, tile)
        loop = sorted({int(e) for e in idx.flatten() if e >= 0} | ({E - 1} if shared else set()))
        got = {int(a) for arr in PREFETCHED for a in arr}
        want = lines(loop[:pf]) | lines([E - 1] if shared else [])
        assert got == want, (T, shared, pf, len(got - want), len(want - got))
        if not loop:
            assert not on.any()
        for kw in (dict(pdl=0), dict(pdl=pdl, prefetch=False)) if T == 3 else ():  # compiled out: nothing asked
            PREFETCHED.clear()
            assert torch.equal(down_nb(h8, hs, idx, rw, wd, sd, T, shared, torch.float32, tile=tile, pf_experts=pf,
                                       **kw), off)
            assert not PREFETCHED, kw
    # which calls take it: recorders stand in for the kernels (their launch constexprs)
    from mtp.model.fp8 import act_quant
    from tests.kernels.test_moe_grouped import _experts

    ws = _experts(E, 256, I, seed=1)
    seen = {}

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **k: seen.__setitem__(self.name, (k["PDL"], k.get("PF")))

    kernels = (moe._moe_gate_up_persistent, nbm._moe_down_nb_kernel)
    moe._moe_gate_up_persistent, nbm._moe_down_nb_kernel = Recorder("gate_up"), Recorder("down")
    try:
        x = torch.randn(1, 256, generator=g).bfloat16()
        idx, rw = torch.tensor([[0, 2, 4, 6, 8, 1, 3, 5]]).int(), torch.rand(1, J, generator=g)
        kw = dict(layout="persistent", shared=True, xq=act_quant(x), down_nb=True)
        # (pdl, gate_up_after_wait, prefetch, down_pf_experts) -> (gate/up's PDL, the down kernel's PDL and PF)
        for args, want in (((1, False, True, 8), (1, 1, 0)), ((1, True, True, 8), (2, 1, 8)),
                           ((2, False, True, 8), (2, 2, 8)), ((2, False, False, 8), (2, 2, 0)),
                           ((0, True, True, 8), (0, 0, 0)), ((2, True, True, 64), (2, 2, 16)),
                           ((2, False, True, 0), (2, 2, 0))):
            pdl, aw, pf_on, n = args
            seen.clear()
            moe.moe_experts(x, idx, rw, *ws, pdl=pdl, gate_up_after_wait=aw, prefetch=pf_on, down_pf_experts=n, **kw)
            assert (seen["gate_up"][0], *seen["down"]) == want, (args, seen)
        for bad in (dict(down_pf_experts=8, down_nb=False), dict(down_pf_experts=-1), dict(down_pf_experts=True)):
            with pytest.raises(ValueError, match="down_pf_experts must be an integer >= 0, and > 0 only with down_nb"):
                moe.moe_experts(x, idx, rw, *ws, **dict(kw, **bad))
        with pytest.raises(ValueError, match="gate_up_after_wait must be a bool"):
            moe.moe_experts(x, idx, rw, *ws, gate_up_after_wait=1, **kw)
    finally:
        moe._moe_gate_up_persistent, nbm._moe_down_nb_kernel = kernels


if __name__ == "__main__":
    interpreted_main(
        {"kernel": _kernel_checks, "experts": _experts_checks, "module": _module_checks, "early": _early_checks},
        fp8_rounding=True, pdl=True)
