"""The router with one arrival (`router.moe_route_fused(impl="one")`, switch `FastPathOptions.router_one`), on the CPU.

Shape legend: T tokens, E experts, D hidden, NG groups.

- In-process: the switch (off by default) and its bench variant; `dispatch.route` takes impl "one" with the switch up
  to `ONE_MAX_TOKENS` tokens and 'auto' otherwise; `one_logits_ref` sums in the order it documents (an example
  where another order gives another fp32 result); compiled for sm_90 (no GPU): the PDL order (trigger first, the
  gate rows loaded before the wait, nothing stored before it), a rank's table read only with TABLE, no spill at
  T <= 8 with the default warps and tokens per pass.
- Under the Triton interpreter (a subprocess each, this file as a script; fp32 inputs):
  - logits: bit for bit `one_logits_ref` at T = 1..16 (DeepSeek's E = 256 / D = 7168 at T = 1 and 3), the same bits
    at every block_e and tokens per pass, and the fp32 product x @ W^T at the other router tests' tolerance;
  - routing: ids torch.equal to `route_from_logits_ref` on the kernel's own logits and weights within fp32 rounding
    of it (its sigmoid and normalizing sum are numpy's there, torch's here), T = 1..16 and the tiny models'
    configs; where the logits are equal (integer-valued inputs: every order sums them exactly) the split-K impls'
    logits, ids and weights bit for bit; ties (x = 0, the bias in steps of 0.25: equal experts, equal groups); an
    expert-parallel rank's range and table; the counter re-armed after each call; bad input refused by name;
  - PDL (`tests.interp.patch_interpreter_pdl`): the same bits with it, nothing prefetched;
  - the split tail (`split_tail=True`, switch `FastPathOptions.router_one_split`): logits, ids and weights torch.equal
    to the unsplit tail's, ids to `route_from_logits_ref` on its logits, T = 1..16 and the tiny models' configs, fewer
    programs than tokens (tail programs routing several), ties, a rank's range and table, the counter re-armed. The
    interpreter runs programs one after another, so where more than one program routes, the kernel runs as two
    launches (the dots and arrivals; then the tail programs, slot 0 last): the same tail code, whose waits find the
    counter complete; where one does (T = 1, or one program), the one launch of the GPU, its slot from its arrival.
GPU twin (bf16 at DeepSeek's shapes, warps 4 / 8, PDL, CUDA graphs): tests/kernels/test_router_one_gpu.py; the split
tail's: tests/kernels/test_router_split_gpu.py. Timing (not a test): `python -m mtp.bench.fused --only router`; in the
step: `mtp-bench --tp 8 --kernel-variants router_one` (router_split3, router_split_off).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`
from tests.interp import interpreted_main, run_interpreted  # noqa: E402

# (T, E, D, n_group, topk_group, topk): DeepSeek's routing on a short D, and the tiny models' configs
CASES = [(T, 256, 256, 8, 4, 8) for T in (1, 2, 3, 4, 8, 16)] + [
    (5, 64, 384, 4, 2, 6), (3, 32, 256, 1, 1, 3), (2, 16, 256, 4, 2, 4), (7, 8, 128, 2, 1, 2), (4, 8, 128, 4, 2, 3)]
BE = 16  # experts per program in most interpreted calls: the interpreter's time goes by programs (0.3 vs 0.6-2 s)


def test_option_and_variants():
    """Impl one up to 2 tokens by default (measured in the step, session 20); the variants widen it to 16 / turn it off."""
    from mtp.bench.rank import KERNEL_VARIANTS
    from mtp.kernels.dispatch import FastPathOptions

    o = FastPathOptions()
    assert o.router_one_tokens == 8 and o.router_one_split == 2
    for name, want, split in (("router_one", 16, 2), ("router_one_off", 0, 2), ("router_split3", 8, 3),
                              ("router_split_off", 2, 0)):
        flags, options = KERNEL_VARIANTS[name]
        o = FastPathOptions()
        o.set(**flags)
        assert (o.router_one_tokens, o.router_one_split) == (want, split) and options == {}, name
    for name in ("router_one_tokens", "router_one_split"):
        with pytest.raises(ValueError, match=name):
            FastPathOptions(**{name: -1})


def test_route_takes_one_up_to_its_limit(monkeypatch):
    """`dispatch.route`: impl "one" for 1..router_one_tokens tokens (at most ONE_MAX_TOKENS) of a gate it takes,
    'auto' above, and 'auto' at router_one_tokens 0; the rest of the call as before."""
    import mtp.kernels.router as rt
    from mtp.kernels.dispatch import FastPathOptions, route

    seen = []
    monkeypatch.setattr(rt, "moe_route_fused", lambda x, w, b, **kw: seen.append((x.shape[0], kw)) or (None, None))

    class Gate:
        n_experts, n_groups, topk_groups, topk, route_scale = 256, 8, 4, 8, 2.5
        weight, e_score_correction_bias = torch.zeros(256, 64), torch.zeros(256)

    on, off = FastPathOptions(router_one_tokens=64, router_one_split=0), FastPathOptions(router_one_tokens=0)
    dflt = FastPathOptions(router_one_tokens=2, router_one_split=0)  # session 20's default
    for n in (1, 2, 4, rt.ONE_MAX_TOKENS, rt.ONE_MAX_TOKENS + 1):
        route(torch.zeros(n, 64), Gate(), on, local=(32, 64))
        route(torch.zeros(n, 64), Gate(), off)
        route(torch.zeros(n, 64), Gate(), dflt)
    impls = [(n, kw["impl"]) for n, kw in seen]
    assert impls == [(1, "one"), (1, "auto"), (1, "one"), (2, "one"), (2, "auto"), (2, "one"), (4, "one"),
                     (4, "auto"), (4, "auto"), (16, "one"), (16, "auto"), (16, "auto"), (17, "auto"), (17, "auto"),
                     (17, "auto")], impls
    assert seen[0][1]["local"] == (32, 64) and seen[0][1]["topk"] == 8 and seen[0][1]["pdl"] == on.pdl_at(1)
    assert not any(kw["split_tail"] for _, kw in seen)  # router_one_split 0: never
    seen.clear()
    split = FastPathOptions(router_one_tokens=8, router_one_split=3)
    for n in (1, 2, 3, 8, 9):
        route(torch.zeros(n, 64), Gate(), split)
    assert [(n, kw["impl"], kw["split_tail"]) for n, kw in seen] == [
        (1, "one", False), (2, "one", False), (3, "one", True), (8, "one", True), (9, "auto", False)], seen
    seen.clear()
    for n in (1, 2, 8, 9):  # the default: impl one up to 8 tokens, split from 2
        route(torch.zeros(n, 64), Gate(), FastPathOptions())
    assert [(n, kw["impl"], kw["split_tail"]) for n, kw in seen] == [
        (1, "one", False), (2, "one", True), (8, "one", True), (9, "auto", False)], seen
    # as impl grouped: topk <= topk_group x the experts of a group
    assert rt.one_takes(1, 256, 8, 4, 9) and not rt.one_takes(1, 16, 8, 1, 3) and not rt.one_takes(0, 256, 8, 4, 8)


def test_one_logits_ref_sums_in_its_order():
    """K = 4, chunk 2: k = i * 2 + c sits at m = c * 2 + i, so the tree is (p0 + p2) + (p1 + p3); with p = (1e8, 1,
    -1e8, 1) that is 2 in fp32, where the sequential sum gives 1 and chunk 4's tree 0. And it is the fp32 product
    elsewhere."""
    from mtp.kernels.router import one_logits_ref

    x = torch.tensor([[1e8, 1.0, -1e8, 1.0]])
    w = torch.ones(1, 4)
    seq = torch.zeros(())
    for p in x[0]:
        seq = seq + p
    assert one_logits_ref(x, w, chunk=2).item() == 2.0 and seq.item() == 1.0
    assert one_logits_ref(x, w, chunk=4).item() == 0.0  # chunk 4: (p0 + p1) + (p2 + p3), each 1 lost in fp32
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 7168, generator=g), torch.randn(16, 7168, generator=g)
    ref = x.double() @ w.double().t()
    assert ((one_logits_ref(x, w).double() - ref).norm() / ref.norm()).item() < 1e-6


def _one_kernel_consts(T: int, warps: int, table: bool = False, pdl: int = 1, split: bool = False) -> dict:
    from mtp.kernels.router import ONE_CHUNK, one_tokens_per_pass

    btr = 1 << (T - 1).bit_length()
    return dict(E=256, NG=8, TOPK_GROUP=4, TOPK=8, KPAD=8, CPAD=8, EPB=2, BTR=btr,
                TB=min(btr, one_tokens_per_pass(warps)), CH=ONE_CHUNK, NCH=8192 // ONE_CHUNK, LOG2K=13, PDL=pdl,
                TABLE=table, SPLIT=split, PHASE=0)


def _after_arrival(ptx: str) -> list[str]:
    """The kernel's PTX instructions from its arrival (the acq_rel add on the counter) to its end."""
    import re

    body = ptx[ptx.index(".entry"):]
    lines = [ln.split("//")[0].strip() for ln in body.splitlines()]
    instr = [ln for ln in lines if ln and not ln.startswith((".", "$", "{", "}", ")", "("))]
    return instr[next(i for i, ln in enumerate(instr) if re.search(r"atom\.global\.gpu\.acq_rel\.add", ln)):]


def _normalizing_layout(ttgir: str) -> set[str]:
    """The layouts of the 2-D [rows, 8] fp32 sums over axis 1 in a TTGIR (the routing's one: the chosen weights'
    normalizing sum, whose fp32 order the layout sets: lanes, then registers)."""
    import re

    defs = dict(re.findall(r"^(#\w+) = (.*)$", ttgir, re.M))
    return {defs[m] for m in re.findall(r'"tt\.reduce"\(%\w+\) <\{axis = 1 : i32\}>.*?\}\) : '
                                        r'\(tensor<\d+x8xf32, (#\w+)>\)', ttgir, re.S)}


def test_kernel_compiles_for_hopper():
    """At DeepSeek's shapes (E = 256, D = 7168; the JIT's 16-divisibility of D and x's stride): with PDL the trigger is
    the first memory-ordering instruction, the gate rows (and only loads) come before the wait, and the wait before
    any store or atomic; with a rank's table the table is read and not the range, and without it the range and
    never the table; no spill at T = 1, 2, 4, 8 with the default warps (SASS resource use, where cuobjdump is)."""
    pytest.importorskip("triton")
    import shutil

    import triton

    from mtp.kernels.router import ONE_WARPS, _route_one_kernel

    from .test_fused_kernels import _compile_for_hopper

    ptrs = dict(x_ptr="*bf16", w_ptr="*bf16", cnt_ptr="*i32", idx_out_ptr="*i32", table_ptr="*i32")
    aligned = ("D", "stride_xm")
    cuobjdump = (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists() or \
        shutil.which("cuobjdump")
    bad = []
    for T, warps, table in ((1, ONE_WARPS, False), (1, 4, True), (2, ONE_WARPS, False), (4, ONE_WARPS, True),
                            (8, ONE_WARPS, False)):
        consts = _one_kernel_consts(T, warps, table)
        k = _compile_for_hopper(_route_one_kernel, ptrs, consts, num_warps=warps, aligned=aligned)
        bad += _compiled_checks(k, consts, table, f"T={T} warps={warps} table={table}", cuobjdump)
    assert not bad, "\n".join(bad)


def _compiled_checks(k, consts, table: bool, what: str, cuobjdump) -> list[str]:
    """A compiled impl one kernel's checks, split or not: only weight loads before the PDL wait (launch first), the
    table read only with TABLE (the range e0 / e1 without), and no spill (where cuobjdump reads the SASS)."""
    from mtp.kernels.router import _route_one_kernel

    from .test_fused_kernels import _params_read
    from .test_moe_items import _sass
    from .test_pdl import _order

    bad, ptx = [], k.asm["ptx"]
    seq = _order(ptx)
    wait = seq.index("griddepcontrol.wait")
    if seq[0] != "griddepcontrol.launch_dependents" or set(seq[1:wait]) != {"ld.global"}:
        bad.append(f"{what}: before the wait {seq[:wait]}")
    read = _params_read(_route_one_kernel, ptx, consts)
    if ("table_ptr" in read) != table or ({"e0", "e1"} <= read) == table:
        bad.append(f"{what}: reads {sorted(read)}")
    if cuobjdump:
        use = _sass(k)[1]
        if int(use.get("STACK", 0)) or int(use.get("LOCAL", 0)):
            bad.append(f"{what}: spills {use}")
    return bad


def test_split_tail_compiles_for_hopper():
    """The split tail at DeepSeek's shapes, 8 warps: the PDL order as the unsplit kernel's, a table read only with
    TABLE, no spill; after the arrival the same PTX at T = 1, 4 and 8 (one token's routing whatever the tokens:
    instructions and barriers), waits as acquire loads of the counter; and its weights' normalizing sum in the unsplit
    kernel's layout at the same T (every other step of the routing is exact or elementwise: the same bits follow)."""
    pytest.importorskip("triton")
    import re
    import shutil

    import triton

    from mtp.kernels.router import ONE_WARPS, _route_one_kernel

    from .test_fused_kernels import _compile_for_hopper

    ptrs = dict(x_ptr="*bf16", w_ptr="*bf16", cnt_ptr="*i32", idx_out_ptr="*i32", table_ptr="*i32")
    cuobjdump = (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists() or \
        shutil.which("cuobjdump")
    bad, tails = [], {}
    for T, table in ((1, False), (4, True), (8, False)):
        consts = _one_kernel_consts(T, ONE_WARPS, table, split=True)
        k = _compile_for_hopper(_route_one_kernel, ptrs, consts, num_warps=ONE_WARPS, aligned=("D", "stride_xm"))
        ptx, what = k.asm["ptx"], f"T={T} table={table}"
        bad += _compiled_checks(k, consts, table, what, cuobjdump)
        tail = _after_arrival(ptx)
        if not table:
            tails[T] = [re.sub(r"^@!?%\w+\s+", "", ln).split()[0] for ln in tail]  # opcodes (not the guards)
        if not any("ld.global.gpu.acquire" in ln for ln in tail) or not any(".relaxed.exch" in ln for ln in tail):
            bad.append(f"{what}: no acquire wait or no re-arm after the arrival")
        plain = _compile_for_hopper(_route_one_kernel, ptrs, _one_kernel_consts(T, ONE_WARPS, table),
                                    num_warps=ONE_WARPS, aligned=("D", "stride_xm"))
        layouts = _normalizing_layout(k.asm["ttgir"]), _normalizing_layout(plain.asm["ttgir"])
        if len(layouts[0]) != 1 or layouts[0] != layouts[1]:
            bad.append(f"{what}: the normalizing sum's layout {layouts[0]} vs the unsplit tail's {layouts[1]}")
    if not tails[1] == tails[8]:
        bad.append(f"the tail grows with T: {len(tails[1])} vs {len(tails[8])} instructions after the arrival")
    assert not bad, "\n".join(bad)


def test_logits_interpreted():
    run_interpreted(__file__, 300, "logits")


def test_routing_interpreted():
    run_interpreted(__file__, 300, "routing")


def test_pdl_interpreted():
    run_interpreted(__file__, 300, "pdl")


def test_split_tail_interpreted():
    run_interpreted(__file__, 300, "split")


# ----------------------------------------------------------------------------- run under TRITON_INTERPRET=1
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _kw(case) -> dict:
    return dict(n_group=case[3], topk_group=case[4], topk=case[5])


def _logits_checks() -> None:
    """Bit for bit `one_logits_ref` at every case, at D = 7168 (its 4 chunks of 2048, the last half padding) too, and
    the same bits at another block_e and tokens per pass (the default plan on two cases)."""
    from mtp.kernels.router import moe_route_fused, one_logits_ref

    g = torch.Generator().manual_seed(1)
    cases = [(1, 256, 7168, 8, 4, 8)] + CASES
    n = 0
    for case in cases:
        T, E, D = case[:3]
        x, wg, bias = torch.randn(T, D, generator=g), torch.randn(E, D, generator=g) * 0.05, torch.randn(E) * 0.05
        ref = one_logits_ref(x, wg)
        plans = [(min(BE, E), None)] + ([(None, None), (min(4, E), 4)] if case in (cases[0], cases[4]) else [])
        for block_e, tb in plans:
            lg = moe_route_fused(x, wg, bias, return_logits=True, impl="one", block_e=block_e, tokens_per_pass=tb,
                                 **_kw(case))[2]
            assert torch.equal(lg, ref), (case, block_e, tb, (lg - ref).abs().max().item())
            n += 1
        assert _rel(lg, x @ wg.t()) < 1e-5, case
    print(f"{n} logits calls")


def _routing_checks() -> None:
    from mtp.kernels.dispatch import expert_map, local_ids
    from mtp.kernels.fp8_gemm import _COUNTERS
    from mtp.kernels.router import SPLITK_IMPLS, moe_route_fused, moe_route_ref, route_from_logits_ref

    g = torch.Generator().manual_seed(2)
    for n, case in enumerate(CASES):
        T, E, D = case[:3]
        kw = dict(_kw(case), block_e=min(BE, E))
        x, wg, bias = torch.randn(T, D, generator=g), torch.randn(E, D, generator=g) * 0.05, torch.randn(E) * 0.05
        w, idx, lg = moe_route_fused(x, wg, bias, return_logits=True, impl="one", **kw)
        wr, ir = route_from_logits_ref(lg, bias, **_kw(case))  # the same logits: the same choice exactly
        assert torch.equal(idx, ir), (case, idx.tolist(), ir.tolist())
        assert _rel(w, wr) < 1e-6, case
        if n % 2:  # an expert-parallel rank's range, and a rank of scattered experts' table
            e0, e1 = E // 4, E // 2
            table = expert_map(sorted(set(range(1, E, 3)) | {0, E - 1}), E, "cpu").router
            wl, il = moe_route_fused(x, wg, bias, local=(e0, e1), impl="one", **kw)
            assert torch.equal(wl, w) and torch.equal(il, torch.where((idx >= e0) & (idx < e1), idx - e0, -1)), case
            wt, it = moe_route_fused(x, wg, bias, local=table, impl="one", **kw)
            assert torch.equal(wt, w) and torch.equal(it, local_ids(idx, table)), case
        else:
            # integer-valued x and W (W in steps of 2^-6): every product and partial sum exact, so every order gives
            # the same logits, and the choice on them must be the split-K impls', weights bit for bit
            xi = torch.randint(-4, 5, (T, D), generator=g).float()
            wi = torch.randint(-4, 5, (E, D), generator=g).float() / 64
            one = moe_route_fused(xi, wi, bias, return_logits=True, impl="one", **kw)
            for impl in SPLITK_IMPLS:
                other = moe_route_fused(xi, wi, bias, return_logits=True, impl=impl, **_kw(case))
                assert all(torch.equal(a, b) for a, b in zip(one, other)), (case, impl)
    # exact ties (x = 0: every sigmoid 0.5; the bias in steps of 0.25): equal experts in a group, equal group scores;
    # the lower index first at every step
    for T, E, ng, tg, k in ((4, 64, 4, 2, 6), (16, 256, 8, 4, 8), (3, 16, 4, 2, 4)):
        x, wg = torch.zeros(T, 256), torch.randn(E, 256, generator=g)
        bias = torch.randint(0, 3, (E,), generator=g).float() * 0.25
        wr, ir = moe_route_ref(x, wg, bias, n_group=ng, topk_group=tg, topk=k)
        w, idx = moe_route_fused(x, wg, bias, n_group=ng, topk_group=tg, topk=k, impl="one", block_e=min(BE, E))
        assert torch.equal(idx, ir) and _rel(w, wr) < 1e-6, (E, idx.tolist(), ir.tolist())
    counters = _COUNTERS[torch.device("cpu")][0]
    assert not counters.any(), "a counter was left armed"
    wg, bias = torch.randn(16, 256), torch.zeros(16)
    for bad, match in (
            (lambda: moe_route_fused(torch.randn(17, 256), wg, bias, n_group=4, topk_group=2, topk=4, impl="one"),
             "impl='one' takes 1..16 tokens"),
            (lambda: moe_route_fused(torch.randn(2, 256), wg, bias, n_group=4, topk_group=1, topk=5, impl="one"),
             "topk 5 <= topk_group 1"),
            (lambda: moe_route_fused(torch.randn(2, 256), wg, bias, n_group=4, topk_group=2, topk=4, impl="one",
                                     tokens_per_pass=3), "power of two")):
        try:
            bad()
        except ValueError as e:
            assert match in str(e), str(e)
        else:
            raise AssertionError(f"moe_route_fused accepted bad input ({match})")
    print(f"{len(CASES)} routing cases")


def _split_checks() -> None:
    """The split tail against the unsplit one (torch.equal: logits, ids, weights) and the reference's choice on its
    logits, at every case with BE experts a program (one program at E <= 16: it routes every token, in one launch; two
    for three tokens at E = 32: slot 0 routes tokens 0 and 2) and at 2 (E = 8: 4 programs for 4 and 7 tokens; 128 at
    E = 256 for T = 1, the one launch with its slot from its arrival, and for T = 16); ties; a rank's range and table; the counter re-armed; impl one only."""
    from mtp.kernels.dispatch import expert_map, local_ids
    from mtp.kernels.fp8_gemm import _COUNTERS
    from mtp.kernels.router import moe_route_fused, route_from_logits_ref

    g = torch.Generator().manual_seed(4)
    plans = [(case, min(BE, case[1])) for case in CASES] + [(CASES[0], 2), (CASES[-1], 2), (CASES[5], 2),
                                                           (CASES[-2], 2)]
    for n, (case, block_e) in enumerate(plans):
        T, E, D = case[:3]
        kw = dict(_kw(case), block_e=block_e, impl="one")
        x, wg, bias = torch.randn(T, D, generator=g), torch.randn(E, D, generator=g) * 0.05, torch.randn(E) * 0.05
        one = moe_route_fused(x, wg, bias, return_logits=True, **kw)
        split = moe_route_fused(x, wg, bias, return_logits=True, split_tail=True, **kw)
        assert all(torch.equal(a, b) for a, b in zip(split, one)), (case, block_e)
        wr, ir = route_from_logits_ref(split[2], bias, **_kw(case))
        assert torch.equal(split[1], ir) and _rel(split[0], wr) < 1e-6, (case, block_e)
        if n % 3 == 1:  # an expert-parallel rank's range, and a rank of scattered experts' table
            e0, e1 = E // 4, E // 2
            table = expert_map(sorted(set(range(1, E, 3)) | {0, E - 1}), E, "cpu").router
            w, idx = split[:2]
            wl, il = moe_route_fused(x, wg, bias, local=(e0, e1), split_tail=True, **kw)
            assert torch.equal(wl, w) and torch.equal(il, torch.where((idx >= e0) & (idx < e1), idx - e0, -1)), case
            wt, it = moe_route_fused(x, wg, bias, local=table, split_tail=True, **kw)
            assert torch.equal(wt, w) and torch.equal(it, local_ids(idx, table)), case
    for T, E, ng, tg, k, block_e in ((4, 64, 4, 2, 6, 16), (16, 256, 8, 4, 8, 16), (3, 16, 4, 2, 4, 2)):  # ties
        x, wg = torch.zeros(T, 256), torch.randn(E, 256, generator=g)
        bias = torch.randint(0, 3, (E,), generator=g).float() * 0.25
        kw = dict(n_group=ng, topk_group=tg, topk=k, impl="one", block_e=block_e)
        wr, ir = route_from_logits_ref(torch.zeros(T, E), bias, n_group=ng, topk_group=tg, topk=k)
        w, idx = moe_route_fused(x, wg, bias, split_tail=True, **kw)
        assert torch.equal(idx, ir) and _rel(w, wr) < 1e-6, (E, idx.tolist(), ir.tolist())
        assert all(torch.equal(a, b) for a, b in zip((w, idx), moe_route_fused(x, wg, bias, **kw))), E
    assert not _COUNTERS[torch.device("cpu")][0].any(), "a counter was left armed"
    try:
        moe_route_fused(torch.randn(2, 256), torch.randn(16, 256), torch.zeros(16), n_group=4, topk_group=2, topk=4,
                        impl="grouped", split_tail=True)
    except ValueError as e:
        assert "split_tail is impl 'one'" in str(e), str(e)
    else:
        raise AssertionError("moe_route_fused split a grouped tail")
    print(f"{len(plans)} split cases")


def _pdl_checks() -> None:
    from tests.interp import patch_interpreter_pdl

    from mtp.kernels.router import moe_route_fused

    patch_interpreter_pdl()
    from tests.kernels.test_pdl import _pdl_equal

    g = torch.Generator().manual_seed(3)
    for T in (1, 3):
        x, wg, bias = torch.randn(T, 384, generator=g), torch.randn(64, 384, generator=g) * 0.05, torch.randn(64) * 0.05
        for mode in (1, 2):  # the trigger at the start, after the wait
            for split in (False, True):  # the split tail: the interpreter's two launches where it waits (T > 1)
                _pdl_equal(f"router one T={T} pdl={mode} split={split}",
                           lambda p: moe_route_fused(x, wg, bias, n_group=4, topk_group=2, topk=6, impl="one",
                                                     return_logits=True, pdl=p and mode, split_tail=split),
                           launches=2 if split and T > 1 else 1)


if __name__ == "__main__":
    interpreted_main({"logits": _logits_checks, "routing": _routing_checks, "pdl": _pdl_checks, "split": _split_checks})
