"""Switch `FastPathOptions.moe_item_regs`: the persistent experts' work items without a dependent load before their
weight tiles (`moe.moe_experts(item_regs=True)`, `mtp.kernels.moe_items`), on the CPU.

- Compiled for sm_90 (triton's own ptxas, no GPU) at a TP=8 split rank's one-token shapes, with PDL: the item loop
  loads no id (no i32 load inside it; the switch off loads the ids per item), each K loop is still pipelined
  (cp.async) and issues no global load after its tiles' wait (off: the scales after each wgmma's wait), gate/up's
  fix-up is unrolled (2 x KS loads, no loop), the next item's L2 prefetches are there, and the PDL order holds
  (launch first, nothing stored or loaded before the wait but the shared expert's prefetch).
- Under the Triton interpreter (a subprocess; its e4m3 cast made CUDA's, its PDL branches and L2 prefetches run as
  no-ops, `tests.interp.patch_interpreter_pdl`): torch.equal to the switch off for the persistent layout with the
  shared slot at 1..4 tokens, -1 slots (a token with none routed here), experts repeated across tokens, default and
  'waves' slices and a short last K slice, grids of fewer programs than items and of more, PDL on (both trigger
  places) and off; the prefetched lines are exactly those of the items each program runs after its first, none with
  item_prefetch off; `FastMoE` hands item_regs to persistent calls only, with the switch.
GPU twin at the real shapes (PDL, CUDA graphs): tests/kernels/test_moe_items_gpu.py.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`
from tests.interp import interpreted_main, run_interpreted  # noqa: E402


def test_moe_item_regs_switch_and_variant():
    """On by default (timed on an H200, session 17); `mtp-bench --kernel-variants moe_item_regs_off` turns it off
    and moe_item_regs on (real switches)."""
    from mtp.bench.rank import KERNEL_VARIANTS
    from mtp.kernels.dispatch import FastPathOptions

    o = FastPathOptions()
    assert o.moe_item_regs
    flags, options = KERNEL_VARIANTS["moe_item_regs_off"]
    o.set(**flags)
    assert not o.moe_item_regs and options == {}
    flags, options = KERNEL_VARIANTS["moe_item_regs"]
    o.set(**flags)
    assert o.moe_item_regs and options == {}


def _item_loop(ttgir: str) -> str:
    """The TTGIR of the kernel's item loop: from the first scf.for over w to the end of the function."""
    start = re.search(r"scf\.for %w\w* = ", ttgir)
    assert start, "no item loop (scf.for %w) in the TTGIR"
    return ttgir[start.start():]


def _k_loops(ptx: str) -> list[str]:
    """The PTX of each loop that holds a wgmma (a K loop): from its header label to its back branch."""
    loops = []
    for m in re.finditer(r"^(\$L__BB\d+_\d+):[^\n]*Parent Loop[^\n]*\n(.*?)^\s*@%p\d+ bra\s+\1;", ptx, re.M | re.S):
        if "wgmma.mma_async" in m.group(2):
            loops.append(m.group(2))
    return loops


def _sass(k) -> tuple[str, dict]:
    """A compiled kernel's SASS and its resource use (REG, STACK, LOCAL) from triton's own cuobjdump."""
    import shutil
    import subprocess
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists() and not shutil.which("cuobjdump"):
        pytest.skip("no cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        run = [str(tool) if tool.exists() else "cuobjdump", f.name]
        res = subprocess.run(run[:1] + ["-res-usage"] + run[1:], capture_output=True, text=True).stdout
        sass = subprocess.run(run[:1] + ["-sass"] + run[1:], capture_output=True, text=True).stdout
    return sass, dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", res))


def test_item_regs_compile_for_hopper():
    """The structure the switch is for, on the sm_90 code (module docstring), against the switch off; no spills; and
    in the SASS, gate/up's fix-up issues all its KS slices' loads before its first add (at one token: 14 loads, where
    the loop of the switch off waits 7 times; at four tokens with TP = 4 columns a row: 4 vector loads)."""
    pytest.importorskip("triton")
    import mtp.kernels.moe as moe
    from tests.kernels.test_fused_kernels import _compile_for_hopper
    from tests.kernels.test_pdl import _order

    bf, f8, i32 = "*bf16", "*fp8e4nv", "*i32"
    # one token of a split rank: 8 routed + the shared slot (PPAD 16), 7 gate/up K slices (`wave_splits`); four
    # tokens: PPAD 64, 2 slices
    base = dict(TOPK=9, J=8, BM=16, KPAD=16, PPAD=16, PREFETCH=True, PDL=1)
    aligned = ("D", "I", "stride_xm", "stride_we", "stride_se")
    gu_ptrs = dict(x_ptr=bf, idx_ptr=i32, w1_ptr=f8, w3_ptr=f8, h8_ptr=f8, cnt_ptr=i32)
    gu_off = dict(TMA=False, w1_desc=None, w3_desc=None)  # the weight tiles by cp.async (test_moe_tma.py: by TMA)
    down_off = dict(TMA=False, w2_desc=None)
    kernels = {"gate_up": (moe._moe_gate_up_persistent, gu_ptrs, dict(KSU=7, TP=1, X8=False, **gu_off), 4),
               "gate_up T=4": (moe._moe_gate_up_persistent, gu_ptrs, dict(PPAD=64, KSU=2, TP=4, X8=False, **gu_off),
                               4),
               "down": (moe._moe_down_persistent, dict(h8_ptr=f8, idx_ptr=i32, w2_ptr=f8), down_off, 5)}
    for name, (kernel, ptrs, extra, stages) in kernels.items():
        k = _compile_for_hopper(kernel, ptrs, dict(base, ITEM_REGS=True, NEXT_PF=True, **extra), num_warps=4,
                                num_stages=stages, aligned=aligned)
        ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
        sass, use = _sass(k)
        assert use.get("STACK") == "0" and use.get("LOCAL") == "0", (name, use)
        if name.startswith("gate_up"):  # the fix-up: from the counter's atomic add to its re-arming exchange
            fix = sass[sass.index("ATOMG.E.ADD"):sass.index("ATOMG.E.EXCH")]
            loads = [m.start() for m in re.finditer(r"LDG\.E", fix)]
            # one load a thread per slice and tile: a float at TP = 1, a 16-byte vector at TP = 4
            assert len(loads) == 2 * extra["KSU"], (name, len(loads))
            assert max(loads) < fix.index("FADD"), f"{name}: a fix-up load after its first add"
        loop = _item_loop(ttgir)
        assert not re.search(r"tt\.load [^\n]*!tt\.ptr<i32>", loop), f"{name}: an id load in the item loop"
        assert "ttg.async_copy_global_to_local" in loop, f"{name}: the K loop is no longer pipelined"
        k_loops = _k_loops(ptx)
        assert k_loops, f"{name}: no K loop found in the PTX"
        for body in k_loops:
            after = body[body.index("cp.async.wait_group"):]
            assert "ld.global" not in after, f"{name}: a global load after the tiles' wait in the K loop"
        seq = _order(ptx)
        wait = seq.index("griddepcontrol.wait")
        assert seq[0] == "griddepcontrol.launch_dependents", f"{name}: {seq[:3]}"
        assert set(seq[1:wait]) == {"prefetch.global.L2"}, f"{name}: before the wait: {set(seq[1:wait])}"
        assert "prefetch.global.L2" in seq[wait:], f"{name}: no next-item prefetch after the wait"
        if name.startswith("gate_up"):  # the fix-up: KS slices x (gate, up) loads from L2, unrolled
            assert ttgir.count("cacheModifier = cg") == 2 * extra["KSU"], name
            assert not re.search(r"scf\.for %s\w* = ", ttgir), name
    # the switch off, for contrast: the ids loaded in the item loop, a load after the tiles' wait, the fix-up's loop
    k = _compile_for_hopper(moe._moe_down_persistent, kernels["down"][1], dict(base, ITEM_REGS=False, NEXT_PF=False,
                                                                                **down_off),
                            num_warps=4, num_stages=5, aligned=aligned)
    assert re.search(r"tt\.load [^\n]*!tt\.ptr<i32>", _item_loop(k.asm["ttgir"]))
    assert any("ld.global" in b[b.index("cp.async.wait_group"):] for b in _k_loops(k.asm["ptx"]))


def test_moe_items_interpreted():
    run_interpreted(__file__, 600)


# ----------------------------------------------------------------------------- run under TRITON_INTERPRET=1
def _items(idx: torch.Tensor, S: int, NB: int, KS: int) -> list[tuple[int, int, int]]:
    """The work items (expert, N-block, K slice) in `moe._work_item`'s order: distinct experts by their first pair
    (token-major, the shared slot S after each token's routed ones), then N-block, then slice."""
    leaders = []
    for t in range(idx.shape[0]):
        for e in [*idx[t].tolist(), S]:
            if e >= 0 and e not in leaders:
                leaders.append(e)
    return [(e, nb, ks) for e in leaders for nb in range(NB) for ks in range(KS)]


def _next_item_lines(idx, S, w: torch.Tensor, N: int, K: int, KS: int, programs: int) -> set[int]:
    """The 128-byte lines of weight w [E, N, K] (fp8) of every item a program runs after its first (round-robin
    over min(programs, items) programs): 128 rows of its N-block x its slice's K groups."""
    items = _items(idx, S, -(-N // 128), KS)
    G = K // 128
    gps = -(-G // KS)
    lines = set()
    for e, nb, ks in items[min(programs, len(items)):]:
        for g in range(ks * gps, min(ks * gps + gps, G)):
            for r in range(128):
                lines.add(w.data_ptr() + (e * N + nb * 128 + r) * K + g * 128)
    return lines


def _kernel_checks() -> None:
    from mtp.kernels.moe import moe_experts
    from tests.interp import PREFETCHED
    from tests.kernels.test_moe_grouped import _experts

    E, D, I, J = 4, 384, 256, 2  # 4 routed + the shared S = 4; gate/up 3 K groups (a short last slice of 2), down 2
    S = E
    ws = _experts(E + 1, D, I, seed=0)
    g = torch.Generator().manual_seed(3)
    kw = dict(out_dtype=torch.float32, layout="persistent", shared=True)

    def routing(T: int, kind: str) -> torch.Tensor:
        idx = torch.stack([torch.randperm(E, generator=g)[:J] for _ in range(T)]).int()
        if kind in ("skip", "both"):
            idx[0, 1] = -1  # a slot on another rank
            if T > 2:
                idx[2] = -1  # a token with no routed expert here: the shared one still
        if kind in ("same", "both"):  # token 1 routed as token 0 (an expert's rows: both tokens)
            idx[1] = idx[0]
        return idx

    # (tokens, routing, slices, grids (gate/up, down): None one / two programs per SM, more than the items; PDL)
    cases = [(1, "skip", None, None, 0), (2, "same", "waves", None, 1), (3, "skip", (2, 1), (2, 3), 0),
             (4, "both", (2, 2), (5, 7), 2)]
    for T, kind, splits, programs, pdl in cases:
        x = torch.randn(T, D, generator=g).bfloat16()
        idx = routing(T, kind)
        rw = torch.rand(T, J, generator=g)
        off = moe_experts(x, idx, rw, *ws, splits=splits, programs=programs, pdl=pdl, **kw)
        PREFETCHED.clear()
        on = moe_experts(x, idx, rw, *ws, splits=splits, programs=programs, pdl=pdl, item_regs=True,
                         item_prefetch=True, **kw)
        assert torch.equal(on, off), (T, kind, splits, programs, pdl, (on - off).abs().max().item())
        if programs and not pdl:  # the next items' prefetches (no PDL: no shared-expert prefetch): exactly their lines
            got = {int(a) for arr in PREFETCHED for a in arr}
            want = (_next_item_lines(idx, S, ws[0], I, D, splits[0], programs[0])
                    | _next_item_lines(idx, S, ws[2], I, D, splits[0], programs[0])
                    | _next_item_lines(idx, S, ws[4], D, I, splits[1], programs[1]))
            assert want and got == want, (len(got), len(want), len(got - want), len(want - got))
            PREFETCHED.clear()
            assert torch.equal(moe_experts(x, idx, rw, *ws, splits=splits, programs=programs, item_regs=True,
                                           item_prefetch=False, **kw), on) and not PREFETCHED, "item_prefetch=False"


def _knob_checks() -> None:
    """`moe_experts`' benchmark knobs: bad warps refused by name (their bits: test_moe_items_gpu.py, on the GPU)."""
    from mtp.kernels.moe import moe_experts
    from tests.kernels.test_moe_grouped import _experts

    ws = _experts(3, 256, 128, seed=5)
    x, idx, rw = torch.randn(1, 256).bfloat16(), torch.tensor([[0, 1]], dtype=torch.int32), torch.rand(1, 2)
    for bad in ((4, 16), 8, (8,)):
        try:
            moe_experts(x, idx, rw, *ws, layout="persistent", warps=bad)
        except ValueError as e:
            assert "warps" in str(e), (bad, e)
        else:
            raise AssertionError(f"accepted warps={bad!r}")


def persistent_switch_checks(option: str, kwarg: str, value=True) -> None:
    """`FastMoE` on a 'split' rank hands `kwarg`=value (True, or an integer option's) to its persistent calls (one
    token) with `option` = value, False / 0 with it off, and never value to the pair grid past persistent_tokens (a
    recorder stands in for the kernels); the option is left at its default."""
    import mtp.backends.fast_path as fp
    from mtp.kernels.dispatch import FastPathOptions
    from mtp.model.fp8 import act_quant
    from mtp.parallel import ParallelPlan
    from tests.parallel.test_moe_ep import fast_moe, layout_config, random_moe, rank_moes

    cfg = layout_config()
    ep = fast_moe(rank_moes(random_moe(cfg, seed=4), cfg, ParallelPlan(2, expert_layout="split"))[0])
    seen, kernel = [], fp.moe_experts

    def recorder(x, *a, **k):
        seen.append((k.get("layout"), k.get(kwarg)))
        return torch.zeros(x.shape, dtype=torch.float32)

    fp.moe_experts = recorder
    try:
        for T in (1, ep.persistent_tokens + 1):
            x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(T))
            for on in (True, False):
                setattr(ep.fast_options, option, value if on else type(value)())
                seen.clear()
                ep(x, act_quant(x), rounded=False, reduce=False)
                persistent = T <= ep.persistent_tokens
                want = value if on and persistent else type(value)()
                assert seen == [("persistent" if persistent else ep.expert_layout, want)], (T, on, seen)
    finally:
        fp.moe_experts = kernel
        setattr(ep.fast_options, option, getattr(FastPathOptions(), option))


def _module_checks() -> None:
    """The switch moe_item_regs reaches the persistent calls only (the kernels' bits: `_kernel_checks`)."""
    persistent_switch_checks("moe_item_regs", "item_regs")

if __name__ == "__main__":
    interpreted_main([_kernel_checks, _knob_checks, _module_checks], fp8_rounding=True, pdl=True)
