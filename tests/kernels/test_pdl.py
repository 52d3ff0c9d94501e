"""Programmatic dependent launch on every Triton kernel of the decode step (switch `FastPathOptions.pdl`), on the CPU.

The contract each kernel keeps (`mtp.kernels._triton`, above `pdl_launch`): trigger its successor first, read only
constants (or ask L2 for them) before the wait, and wait before reading an earlier kernel's output or storing.
- Compiled for sm_90 (triton's own ptxas, no GPU): with PDL the PTX triggers before its first memory access, waits
  before its first store or atomic, and loads nothing before the wait except where it means to (constant weights);
  without PDL it holds no `griddepcontrol` nor prefetch. (Its instructions are then the kernel's before PDL: every
  decode kernel's PTX was compared once against the main checkout's when this was written, identical.)
- Under the Triton interpreter with the PDL branches run (`tests.interp.patch_interpreter_pdl`: the wait and the
  prefetches no-ops, PDL granted on the CPU), each kernel gives the same bits as without, every launch of the call
  took PDL, and its L2 prefetches lie inside the weight they are for and cover all of it.
- A tiny simulated TP=2 'split' rank's decode forward with the indexer and its top-k (every kernel a dense step
  runs, and more): with the switch on every Triton kernel launched took PDL but the final and the MTP module's head
  norms (`NOT_CHAINED`), the forward's glue kernels included (switch glue_pdl, on; with it off they alone launch
  without), and logits, hidden and the cache's bytes equal the switch off's.
- pdl_prefetch_tokens 0: the prefetching kernels compiled for sm_90 hold no prefetch and otherwise the same
  griddepcontrol / memory instruction order; under the interpreter each such entry point gives the same bits at 1..4
  rows with no prefetch launched or run, and the decode forward above neither launches nor runs one, same bits.
Real launches, CUDA-graph replays and races: tests/kernels/test_pdl_gpu.py.
"""

from __future__ import annotations

import re
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`

from tests.interp import interpreted_main, run_interpreted  # noqa: E402

# Triton kernels a decode forward of the fast path launches without PDL, with the switch on (the chain restarts
# after each): the final norm and an MTP module's head norm (elementwise ops called through the model's ops object,
# which knows no switch; once per forward, next to cuBLAS / torch launches that break the chain anyway)
NOT_CHAINED = {"_rms_norm_kernel"}
# the forward's glue kernels (session 21: the slots and angles, the vocabulary-parallel lookup, an MTP module's
# enorm + hnorm pair), chained since session 22 unless switch glue_pdl is off
GLUE = {"_rope_slots_kernel", "_embed_kernel", "_rms_norm_pair_kernel"}
CACHE = ("kv", "kv_scale", "pe", "idx_k", "idx_k_scale")
# the Triton kernels of that decode forward (`_step_checks`: one token, default switches) that ask L2 for their
# constant weights before the wait (`prefetch_at`): the router's gate slice, W_kb in the fused q prologue, W_vb
# in absorb_out, the shared expert's span in the persistent experts' kernels (down by output block: moe_down_nb, on
# since session 20). The one-token router (impl one, router_one_tokens) loads its gate rows before the wait: a load,
# not a prefetch the option compiles out
STEP_PREFETCHING = {"_q_absorb_kernel", "_absorb_kernel", "_moe_gate_up_persistent", "_moe_down_nb_kernel"}


# ----------------------------------------------------------------------------- compiled for sm_90
def _kernels() -> dict:
    """name -> (kernel, pointer types, constexprs but PDL, warps, loads allowed before the wait): the decode step's
    kernels at a TP=8 rank's shapes with more than a wait at the top (weights loaded or prefetched before it,
    counters, atomics, last-program fix-ups), and a few with only the wait (add_rounded, the scores, the combine).
    The others run under the interpreter here and were compiled the same way when this was written: the norm
    kernels, the kv / q prologues, the cache write, mla_decode's stages, the experts' pair kernels, act_quant,
    silu * up (~1 s each on the CPU)."""
    import mtp.kernels.absorb as ab
    import mtp.kernels.fp8_gemm as fg
    import mtp.kernels.gemv_splitk as gv
    import mtp.kernels.index_weights as iw
    import mtp.kernels.indexer as ix
    import mtp.kernels.mla_out as mo
    import mtp.kernels.mla_prologue_fused as mpf
    import mtp.kernels.moe as moe
    import mtp.kernels.norm_quant as nq
    import mtp.kernels.router as rt
    import mtp.kernels.topk as tk

    bf, f8, i32, i64 = "*bf16", "*fp8e4nv", "*i32", "*i64"
    # a split rank's 8 routed + the shared slot, one token; the item loop of sessions 12-16 (its PDL order with
    # item_regs: tests/kernels/test_moe_items.py)
    mo_ = dict(TOPK=9, J=8, BM=16, KPAD=16, ITEM_REGS=False, NEXT_PF=False)
    hs = 128 ** -0.5
    return {
        "gemv": (gv._gemv_fma_kernel, dict(x_ptr=f8, w_ptr=f8, y_ptr=bf, cnt_ptr=i32),
                 dict(M=1, PREQUANT=True, SPLIT=True, BN=16, GPS=8, SPAD=8), 8, True),
        "add_rounded": (nq._add_rounded_kernel, {}, dict(ROUND=0, BLOCK_N=2048), 4, False),
        "router": (rt._route_grouped_kernel, dict(x_ptr=bf, w_ptr=bf, ci_ptr=i32, cnt_ptr=i32, idx_out_ptr=i32,
                                                  table_ptr=i32),
                   dict(E=256, NG=8, TOPK_GROUP=4, TOPK=8, KPAD=8, CPAD=8, BE=32, BT=16, BTR=1, GPS=4, SPLITS=14,
                        BF16=True, STORE_LOGITS=False, TABLE=False, LINE=64, PREFETCH=True), 4, False),
        "router_one": (rt._route_one_kernel, dict(x_ptr=bf, w_ptr=bf, cnt_ptr=i32, idx_out_ptr=i32, table_ptr=i32),
                       dict(E=256, NG=8, TOPK_GROUP=4, TOPK=8, KPAD=8, CPAD=8, EPB=2, BTR=1, TB=1, CH=2048, NCH=4,
                            LOG2K=13, TABLE=False, SPLIT=False, PHASE=0), 8, True),
        # its routing split over its last programs to arrive (`moe_route_fused(split_tail=True)`), four tokens
        "router_one_split": (rt._route_one_kernel, dict(x_ptr=bf, w_ptr=bf, cnt_ptr=i32, idx_out_ptr=i32,
                                                        table_ptr=i32),
                             dict(E=256, NG=8, TOPK_GROUP=4, TOPK=8, KPAD=8, CPAD=8, EPB=2, BTR=4, TB=2, CH=2048,
                                  NCH=4, LOG2K=13, TABLE=False, SPLIT=True, PHASE=0), 8, True),
        "q_absorb": (mpf._q_absorb_kernel, dict(qq_ptr=bf, qpe_ptr=bf, iq8_ptr=f8, w_ptr=bf, ql_ptr=bf),
                     dict(H=16, P=128, R=64, HI=64, DK=128, HSCALE=hs, INDEX=True, HQ=64, C=512, BO=64, BK=128,
                          BT=16, IEEE=False, PF=1, LINE=64), 4, False),
        "absorb_out": (ab._absorb_kernel, dict(x_ptr=bf, w_ptr=bf, y_ptr=bf),
                       dict(H=16, KD=512, OD=128, BO=16, BK=128, BT=16, IEEE=False, PF=2, LINE=64), 4, False),
        "stage2_absorb": (mo._stage2_absorb_kernel, dict(w_ptr=bf, y_ptr=bf),
                          dict(H=16, V=128, BO=16, BK=128, BT=16, NSP=8, IEEE=False, PF=2, LINE=64), 4, False),
        "index_weights": (iw._index_weights_kernel, dict(x_ptr=bf, w_ptr=bf, scale="fp32"),
                          dict(H=64, K=7168, BM=1, BH=1, KV=1024, VEC=8), 16, True),
        "scores": (ix._indexer_kernel, dict(q_ptr=f8, k_ptr=f8, lens_ptr=i64, vis_ptr="*u8", h16_ptr=i32,
                                            h8_ptr=i32), dict(H=64, D=128, BS=64, HIST=False, VIS=False), 4, False),
        "topk_hist": (tk._topk_hist_kernel, dict(lens_ptr=i64, h16_ptr=i32, h8_ptr=i32), dict(BLK=1024, V2=True), 4,
                      False),
        "topk_split": (tk._topk_split_kernel, dict(lens_ptr=i64, **{f"{n}_ptr": i32 for n in (
            "h16", "h8", "ncand", "arrive", "ck", "ci", "gt", "off", "thr", "out")}),
            dict(BLK=1024, NB=1024, CPAD=32, KB=1024, SMALL=128, V2=True), 4, False),
        "topk_write": (tk._topk_write_kernel, dict(lens_ptr=i64, **{f"{n}_ptr": i32 for n in (
            "off", "thr", "out", "h16", "h8", "ncand", "arrive")}), dict(BLK=1024, REARM=True, V2=True), 4, False),
        "moe_gate_up": (moe._moe_gate_up_persistent, dict(x_ptr=bf, idx_ptr=i32, w1_ptr=f8, w3_ptr=f8, h8_ptr=f8,
                                                          cnt_ptr=i32),
                        dict(PPAD=16, PREFETCH=True, KSU=1, TP=1, X8=False, TMA=False, w1_desc=None, w3_desc=None,
                             **mo_), 4, False),
        "moe_down": (moe._moe_down_persistent, dict(h8_ptr=f8, idx_ptr=i32, w2_ptr=f8),
                     dict(PPAD=16, PREFETCH=True, TMA=False, w2_desc=None, **mo_), 4, False),
        "moe_combine": (moe._moe_combine_kernel, dict(idx_ptr=i32), dict(TOPK=9, J=8, KS=2, BLOCK_D=1024, ADD=False),
                        4, False),
        "fp8_gemm": (fg._gemv_kernel, dict(x_ptr=f8, w_ptr=f8, y_ptr=bf, cnt_ptr=i32),
                     dict(QUANT_X=False, SPLIT=True, BM=16, BN=64, PREFETCH=True), 4, False),
    }


# the kernels that ask L2 for their constant weights before the wait (the experts' kernels: the shared expert's)
PREFETCHING = ("router", "q_absorb", "absorb_out", "stage2_absorb", "fp8_gemm", "moe_gate_up", "moe_down")
_MEM = re.compile(r"\b(griddepcontrol\.launch_dependents|griddepcontrol\.wait|prefetch\.global\.L2|ld\.global|"
                  r"st\.global|atom\.global|red\.global)")


def _order(ptx: str) -> list[str]:
    """The kernel's griddepcontrol, prefetch and global memory instructions, in the PTX's order."""
    return [m.group(1) for line in ptx.splitlines() if (m := _MEM.search(line))]


def test_pdl_kernels_compile_for_hopper_in_order():
    """Every decode-step kernel compiled for sm_90 with PDL: launch_dependents is its first memory-ordering
    instruction, the wait comes before any store or atomic, and only the kernels that mean to (the GEMV's weight
    tile, the indexer weights' W) load before it; without PDL none of it is there. The wait sits in the entry
    block or at the top of each branch, so the PTX's text order is the order every program runs it in."""
    pytest.importorskip("triton")
    from .test_fused_kernels import _compile_for_hopper

    bad = []
    for name, (kernel, ptrs, consts, warps, early_loads) in _kernels().items():
        seq = _order(_compile_for_hopper(kernel, ptrs, dict(consts, PDL=1), num_warps=warps).asm["ptx"])
        wait = seq.index("griddepcontrol.wait") if "griddepcontrol.wait" in seq else len(seq)
        before = seq[:wait]
        if not seq or seq[0] != "griddepcontrol.launch_dependents":
            bad.append(f"{name}: launch_dependents is not first: {seq[:4]}")
        if wait == len(seq) or any(op.startswith(("st.", "atom.", "red.")) for op in before):
            bad.append(f"{name}: a store or atomic before the wait: {before}")
        if ("ld.global" in before) != early_loads:
            bad.append(f"{name}: loads before the wait {'expected' if early_loads else 'unexpected'}: {before}")
        if name in PREFETCHING and "prefetch.global.L2" not in before:
            bad.append(f"{name}: no L2 prefetch of its weight before the wait: {before}")
    for name in ("add_rounded", "absorb_out", "moe_combine"):  # without PDL: none of it
        kernel, ptrs, consts, warps, _ = _kernels()[name]
        seq = _order(_compile_for_hopper(kernel, ptrs, dict(consts, PDL=0), num_warps=warps).asm["ptx"])
        if any(op.startswith(("griddepcontrol", "prefetch")) for op in seq):
            bad.append(f"{name} without PDL: {sorted(set(seq))}")
    assert not bad, "\n".join(bad)


# the kernels compiled with PDL_AFTER_WAIT: the two that call griddepcontrol themselves through `pdl_launch` /
# `pdl_wait` since it came (the GEMV, the router), kernels with loads or prefetches before the wait, and plain ones
AFTER_WAIT = ("gemv", "router", "router_one", "router_one_split", "index_weights", "topk_split", "moe_down",
              "add_rounded")


def test_pdl_after_wait_compiles_the_trigger_after_the_wait():
    """PDL constexpr 2 (`_triton.PDL_AFTER_WAIT`, option pdl_early_tokens): compiled for sm_90, no launch_dependents
    before the wait, one right after it, and otherwise the PDL_EARLY build's griddepcontrol / memory instructions in
    the same order (the same loads and prefetches before the wait, the same stores after it)."""
    pytest.importorskip("triton")
    from .test_fused_kernels import _compile_for_hopper

    bad = []
    kernels = _kernels()
    for name in AFTER_WAIT:
        kernel, ptrs, consts, warps, _ = kernels[name]
        early, late = (_order(_compile_for_hopper(kernel, ptrs, dict(consts, PDL=mode), num_warps=warps).asm["ptx"])
                       for mode in (1, 2))
        wait = late.index("griddepcontrol.wait") if "griddepcontrol.wait" in late else -1
        if wait < 0 or "griddepcontrol.launch_dependents" in late[:wait]:
            bad.append(f"{name}: a trigger before the wait (or no wait): {late[:6]}")
        elif late[wait + 1:wait + 2] != ["griddepcontrol.launch_dependents"]:
            bad.append(f"{name}: no trigger right after the wait: {late[wait:wait + 3]}")
        drop = "griddepcontrol.launch_dependents"
        if [op for op in late if op != drop] != [op for op in early if op != drop]:
            bad.append(f"{name}: other instructions moved: {late[:8]} vs {early[:8]}")
    assert not bad, "\n".join(bad)


# the constexpr that compiles each prefetching kernel's L2 prefetches out (`FastPathOptions.prefetch_at` False):
# PREFETCH, or the absorb kernels' PF (how the tile is walked; 0: not asked of L2)
PREFETCH_OFF = {name: dict(PF=0) if name in ("q_absorb", "absorb_out", "stage2_absorb") else dict(PREFETCH=False)
                for name in PREFETCHING}


def test_pdl_prefetch_off_compiles_the_prefetches_out():
    """pdl_prefetch_tokens 0: each kernel that asks L2 for its weights before the wait, compiled for sm_90 with PDL,
    holds no `prefetch.global.L2`, and its griddepcontrol and global memory instructions are the prefetching build's,
    in the same order, less the prefetches: it still triggers its successor first, loads nothing before the wait and
    waits before its first store or atomic."""
    pytest.importorskip("triton")
    from .test_fused_kernels import _compile_for_hopper

    bad = []
    kernels = _kernels()
    for name in PREFETCHING:
        kernel, ptrs, consts, warps, _ = kernels[name]
        on, off = (_order(_compile_for_hopper(kernel, ptrs, dict(consts, PDL=1, **extra), num_warps=warps)
                          .asm["ptx"]) for extra in ({}, PREFETCH_OFF[name]))
        if "prefetch.global.L2" not in on or "prefetch.global.L2" in off:
            bad.append(f"{name}: prefetches with the switch on / off: {on.count('prefetch.global.L2')} / "
                       f"{off.count('prefetch.global.L2')}")
        if off != [op for op in on if op != "prefetch.global.L2"]:
            bad.append(f"{name}: without the prefetches the order changed: {off[:8]} vs {on[:8]}")
    assert not bad, "\n".join(bad)


# ----------------------------------------------------------------------------- under the interpreter
def test_pdl_interpreted():
    """Each kernel's PDL branch against its plain one, then a decode forward's wiring (one subprocess: ~25 s)."""
    run_interpreted(__file__, 600)


@contextmanager
def _launches(prefetch: list | None = None):
    """The Triton launches inside the block, as (kernel name, whether it took PDL: PDL 1 or 2 and launch_pdl); and in
    `prefetch` the names of those launched with their L2 prefetch compiled in (PREFETCH=True, or absorb's PF > 0)."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: list[tuple[str, bool]] = []
    run = InterpretedFunction.run

    def recorded(self, *args, **kwargs):
        seen.append((self.fn.__name__, kwargs.get("PDL") in (1, 2) and kwargs.get("launch_pdl") is True))
        if prefetch is not None and (kwargs.get("PREFETCH") is True or kwargs.get("PF", 0) > 0):
            prefetch.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    InterpretedFunction.run = recorded
    try:
        yield seen
    finally:
        InterpretedFunction.run = run


def _same(a, b) -> bool:
    """Equal bits: tensors (fp8 as bytes), and tuples / lists / None of them."""
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if a is None or b is None:
        return a is b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b)


def _covers(weights: list[torch.Tensor]) -> str | None:
    """Why this call's L2 prefetches (`tests.interp.PREFETCHED`) are not exactly the weights' bytes (None: each lies
    inside one of them, and the 128-byte lines from them cover every byte of each)."""
    import numpy as np

    from tests.interp import PREFETCHED

    if not PREFETCHED:
        return "no prefetch"
    addr = np.concatenate(PREFETCHED)
    spans = [(w.data_ptr(), w.numel() * w.element_size()) for w in weights]
    inside = np.zeros(addr.shape, dtype=bool)
    for a, n in spans:
        inside |= (addr >= a) & (addr < a + n)
    if not inside.all():
        return f"{int((~inside).sum())} prefetches outside the weights"
    starts = np.unique(addr)
    for a, n in spans:
        b = a + np.arange(n)
        i = np.searchsorted(starts, b, side="right") - 1
        missed = (i < 0) | (b - starts[np.maximum(i, 0)] >= 128)
        if missed.any():
            return f"{int(missed.sum())} of a weight's {n} bytes not prefetched"
    return None


def _pdl_equal(what: str, call, weight=None, launches: int | None = None):
    """call(pdl) with pdl False, then True: the same bits, every launch of the True call with PDL (and of the False
    call without), `launches` of them when given; and with `weight` (a tensor or a list), its prefetches cover
    exactly the weights (contiguous)."""
    from tests.interp import PREFETCHED

    PREFETCHED.clear()
    with _launches() as off_runs:
        off = call(False)
    assert not PREFETCHED and off_runs and not any(p for _, p in off_runs), (what, off_runs)
    with _launches() as on_runs:
        on = call(True)
    assert all(p for _, p in on_runs) and len(on_runs) == len(off_runs), (what, on_runs)
    assert launches is None or len(on_runs) == launches, (what, on_runs)
    assert _same(off, on), what
    if weight is not None:
        why = _covers(weight if isinstance(weight, list) else [weight])
        assert why is None, (what, why)
    elif PREFETCHED:
        raise AssertionError(f"{what}: prefetched, but no weight was named")
    return on


def _interpreted_randn(seed: int):
    """The interpreter patches the kernel checks need (loop bounds, CUDA's bf16 dot, PDL launch recording), and
    (randn(*shape, s=scale), its generator) seeded for their inputs."""
    from tests.interp import patch_interpreter_bf16_dot, patch_interpreter_loop_bounds, patch_interpreter_pdl

    patch_interpreter_loop_bounds()
    patch_interpreter_bf16_dot()
    patch_interpreter_pdl()
    g = torch.Generator().manual_seed(seed)

    def rn(*shape, s=1.0):
        return torch.randn(*shape, generator=g) * s

    return rn, g


def _kernel_checks() -> None:
    """Each PDL kernel through its Python entry, pdl off and on, odd small shapes."""
    from mtp.kernels.absorb import absorb_out, absorb_q
    from mtp.kernels.cache_write import cache_write
    from mtp.kernels.elementwise import rms_norm, silu_mul
    from mtp.kernels.fp8_gemm import fp8_gemm, fp8_linear
    from mtp.kernels.gemv_splitk import fp8_gemv
    from mtp.kernels.index_weights import index_weights
    from mtp.kernels.indexer import indexer_topk
    from mtp.kernels.mla_decode import mla_decode
    from mtp.kernels.mla_prologue import mla_kv_prologue, mla_q_prologue
    from mtp.kernels.mla_prologue_fused import mla_kv_prologue_norm, mla_q_prologue_absorb
    from mtp.kernels.moe import moe_experts
    from mtp.kernels.norm_quant import add_rms_norm_quant, add_rounded
    from mtp.kernels.router import moe_route_fused
    from mtp.kernels.topk import kept_workspace
    from mtp.model.attention import MLA
    from mtp.model.cache import KVCache
    from mtp.model.fp8 import act_quant, weight_quant
    from mtp.model.layers import Rotary
    from mtp.model.presets import tiny_config

    rn, g = _interpreted_randn(3)

    # the GEMVs: split-K CUDA-core and tensor-core (weights loaded before the wait), the few-row GEMM (prefetched)
    w8, sw = weight_quant(rn(130, 512, s=0.05))
    for M in (1, 3):
        x = rn(M, 512)
        _pdl_equal(f"fp8_gemv M={M}", lambda p: fp8_gemv(None, w8, sw, xq=act_quant(x), pdl=p), launches=1)
        _pdl_equal(f"fp8_gemv mma M={M}", lambda p: fp8_gemv(x, w8, sw, mma=True, pdl=p), launches=1)
    x = rn(3, 512)
    _pdl_equal("fp8_gemm", lambda p: fp8_gemm(*act_quant(x), w8, sw, pdl=p), w8, launches=1)
    for fuse in (True, False):  # x quantized in the GEMV, or by act_quant first (2 launches)
        _pdl_equal(f"fp8_linear fuse_quant={fuse}", lambda p: fp8_linear(x, w8, sw, fuse_quant=fuse, pdl=p), w8,
                   launches=1 if fuse else 2)
    # norms, adds, silu * up
    h, d, wn = rn(3, 384, s=3.0), rn(3, 384).bfloat16(), torch.rand(384, generator=g).bfloat16() + 0.5
    _pdl_equal("add_rms_norm_quant", lambda p: add_rms_norm_quant(h, d, wn, 1e-6, round_dtype=torch.float16, pdl=p))
    y = rn(3, 384, s=100.0)
    _pdl_equal("add_rounded", lambda p: add_rounded(h, y, torch.float16, pdl=p))
    gu = rn(2, 2, 300)
    _pdl_equal("silu_mul", lambda p: silu_mul(gu[..., :150], gu[..., 150:], torch.float32, pdl=p))
    _pdl_equal("rms_norm", lambda p: rms_norm(h, wn, 1e-6, torch.bfloat16, pdl=p))
    # the decode step's glue (switch glue_pdl): the slots' gather, the vocabulary-parallel lookup (ids inside and
    # outside the rank's rows), the MTP norm pair, the chain step's commit
    from mtp.kernels.elementwise import rms_norm_pair
    from mtp.kernels.lookup import embed_rows, rope_slots
    from tests.kernels.test_step_commit import _random_step

    cos_t, sin_t = rn(50, 32), rn(50, 32)
    lens = torch.tensor([3, 40])
    _pdl_equal("rope_slots", lambda p: rope_slots(lens, 3, cos_t, sin_t, pdl=p), launches=1)
    wv, ids = rn(7, 300).bfloat16(), torch.tensor([[2, 9, 12], [14, 5, 0]])
    _pdl_equal("embed_rows", lambda p: embed_rows(ids, wv, 5, pdl=p), launches=1)
    e, hh = rn(2, 1, 200).bfloat16(), rn(2, 1, 200).bfloat16()
    _pdl_equal("rms_norm_pair", lambda p: rms_norm_pair(e, wn[:200], 1e-6, hh, wn[100:300], 2e-6, torch.bfloat16,
                                                        pdl=p), launches=1)

    def commit(p):
        import copy

        from mtp.decode.accept import fused_commit

        st, drafts, verdict, stops = copy.deepcopy(step)
        fused_commit(st, drafts, verdict, stops, 4, pdl=p)
        return [t for t in vars(st).values() if isinstance(t, torch.Tensor)] + [st.cache.seq_lens]

    step = _random_step(g, 3, 3)
    _pdl_equal("chain_commit", commit, launches=1)
    # the router (its gate slice prefetched): the split-K implementations; impl one (its gate rows loaded before the
    # wait: nothing prefetched)
    xr, wg, bias = rn(2, 384), rn(64, 384, s=0.05), rn(64, s=0.05)
    for impl in ("serial", "grouped"):
        _pdl_equal(f"router {impl}", lambda p: moe_route_fused(xr, wg, bias, n_group=4, topk_group=2, topk=6,
                                                               impl=impl, pdl=p), wg, launches=1)
    _pdl_equal("router one", lambda p: moe_route_fused(xr, wg, bias, n_group=4, topk_group=2, topk=6, impl="one",
                                                       pdl=p), launches=1)
    # the experts: pair grid, persistent, with the shared expert as the last slot, with `add`
    E, D, inner, T = 5, 256, 256, 2
    ws = [weight_quant(rn(inner, D, s=0.05)) for _ in range(2 * E)] + [weight_quant(rn(D, inner, s=0.05))
                                                                       for _ in range(E)]
    stack = [torch.stack([w[k] for w in ws[a:a + E]]) for a in (0, E, 2 * E) for k in (0, 1)]
    xe = rn(T, D).bfloat16()
    ids = torch.tensor([[0, 3], [3, -1]], dtype=torch.int32)
    wts = torch.rand(T, 2, generator=g)
    for layout, shared, add in (("pairs", False, rn(T, D)), ("persistent", True, None), ("pairs", True, None)):
        _pdl_equal(f"moe_experts {layout} shared={shared}", lambda p: moe_experts(
            xe, ids, wts, *stack, out_dtype=torch.float32, layout=layout, shared=shared, add=add, pdl=p),
            [stack[0][-1], stack[2][-1], stack[4][-1]] if shared else None, launches=3)  # the shared expert's
    # the absorbed projections (W_kb rows over k, W_vb rows over o) and the MLA decode: dense, top-k, with W_vb
    H = 2
    w_kb, w_vb = rn(1, 128, 512, s=0.05), rn(H, 128, 512, s=0.05).bfloat16()
    qq = rn(2, 1, 192)
    _pdl_equal("absorb_q", lambda p: absorb_q(qq.view(2, 1, 1, 192)[..., :128], w_kb, pdl=p), w_kb, launches=1)
    o_lat = rn(2, 1, H, 512).bfloat16()
    _pdl_equal("absorb_out", lambda p: absorb_out(o_lat, w_vb, pdl=p), w_vb, launches=1)
    S = 24
    q, qpe, pe = rn(1, 2, H, 512), rn(1, 2, H, 64), rn(1, S, 64)
    kv8, kvs = act_quant(rn(1, S, 512))
    lens = torch.tensor([S - 2], dtype=torch.int32)
    topk = torch.randint(0, S - 1, (1, 2, 5), generator=g, dtype=torch.int32)
    for kw, n in ((dict(topk_idx=topk, splits=3), 2), (dict(w_vb=w_vb, splits=2), 2)):
        _pdl_equal(f"mla_decode {sorted(kw)}", lambda p: mla_decode(q, qpe, kv8, kvs, pe, lens, 0.07,
                                                                    out_dtype=torch.bfloat16, pdl=p, **kw),
                   w_vb if "w_vb" in kw else None, launches=n)
    # the indexer: head weights (one chunk of K, W before the wait; three chunks), scores + radix top-k (kept or
    # fresh workspace; the histogram pass in the scores kernel)
    xi, wi = rn(3, 384).bfloat16(), rn(4, 384, s=0.1).bfloat16()
    for plan in (None, (1, 1, 16, 4)):
        _pdl_equal(f"index_weights {plan}", lambda p: index_weights(xi, wi, 0.1, plan=plan, pdl=p), launches=1)
    Si, Hi = 48, 16
    iq8, iqs = act_quant(rn(1, 2, Hi, 128))
    ik8, iks = act_quant(rn(1, Si, 128))
    iw = rn(1, 2, Hi).abs()
    ilens = torch.tensor([Si - 2], dtype=torch.int32)
    kept_workspace(2, "cpu")
    for impl, rearm, n in (("radix", True, 4), ("radix_fused", False, 3)):
        _pdl_equal(f"indexer_topk {impl} rearm={rearm}", lambda p: indexer_topk(
            iq8, iqs.squeeze(-1), iw, ik8, iks.squeeze(-1), ilens, topk=8, impl=impl, rearm=rearm, pdl=p),
            launches=n)
    # the MLA prologue, fused (W_kb prefetched by its absorb programs) and not, and the unfused cache write
    cfg = tiny_config()
    mla = MLA(cfg, torch.float32)
    mla.w_kb = rn(mla.H, mla.P, mla.C, s=0.05)
    Q, C, R = cfg.q_lora_rank, mla.C, mla.R
    a = rn(2, 1, Q + 128 + C + R)
    pos = torch.tensor([[3], [5]])
    cos, sin = Rotary(cfg).angles(pos)
    qb = rn(2, 1, mla.H * (mla.P + R) + mla.indexer.n_heads * 128)

    def with_cache(fn):
        def run(p):
            cache = KVCache(cfg, 1, 2, 8, device="cpu", dtype=torch.float32, quantized=True).layer(0)
            out = fn(cache, p)
            return out, [getattr(cache, n) for n in ("kv", "kv_scale", "pe", "idx_k", "idx_k_scale")]
        return run

    _pdl_equal("mla_kv_prologue", with_cache(lambda c, p: mla_kv_prologue(mla, c, pos, a, cos, sin, pdl=p)),
               launches=1)
    _pdl_equal("mla_kv_prologue_norm", with_cache(
        lambda c, p: mla_kv_prologue_norm(mla, c, pos, a, cos, sin, torch.bfloat16, pdl=p)), launches=1)
    _pdl_equal("cache_write", with_cache(lambda c, p: cache_write(c, pos, a[..., :C], a[..., C:C + R],
                                                                  a[..., C + R:C + R + 128], pdl=p)), launches=1)
    _pdl_equal("mla_q_prologue", lambda p: mla_q_prologue(mla, qb, cos, sin, pdl=p), launches=1)
    _pdl_equal("mla_q_prologue_absorb", lambda p: mla_q_prologue_absorb(mla, qb, cos, sin, pdl=p), mla.w_kb,
               launches=1)


def _pf_equal(what: str, call, weights: list, launches: int) -> None:
    """call(prefetch) with PDL and its L2 prefetches, then with PDL and them compiled out (pdl_prefetch_tokens 0):
    the same bits; every launch (`launches` of them) took PDL; with prefetch they ask L2 for exactly `weights`
    (`_covers`), without, none is launched with its prefetch constexpr on and none runs."""
    from tests.interp import PREFETCHED

    out = {}
    for pf in (True, False):
        PREFETCHED.clear()
        flagged: list[str] = []
        with _launches(flagged) as runs:
            out[pf] = call(pf)
        assert len(runs) == launches and all(p for _, p in runs), (what, pf, runs)
        if pf:
            assert flagged, (what, "no launch asked for its prefetch")
            why = _covers(weights)
            assert why is None, (what, why)
        else:
            assert not flagged and not PREFETCHED, (what, flagged, len(PREFETCHED))
    assert _same(out[True], out[False]), what


def _prefetch_checks() -> None:
    """Each entry point whose kernels ask L2 for their weights before the wait, at 1..4 rows (tokens): the prefetches
    off (`prefetch=False`, `prefetch_at` beyond its tokens) give the bits of PDL with them (`_kernel_checks` holds
    those to no PDL's, `_step_checks` a whole forward without them). mla_decode hands prefetch to its fused stage 2
    (`stage2_absorb`, called directly at 2..4 rows: stage 1 takes no prefetch). ~7 s."""
    from mtp.kernels.absorb import absorb_out, absorb_q
    from mtp.kernels.fp8_gemm import fp8_gemm, fp8_linear
    from mtp.kernels.mla_decode import mla_decode
    from mtp.kernels.mla_out import stage2_absorb
    from mtp.kernels.mla_prologue_fused import mla_q_prologue_absorb
    from mtp.kernels.moe import moe_experts
    from mtp.kernels.router import moe_route_fused
    from mtp.model.attention import MLA
    from mtp.model.fp8 import act_quant, weight_quant
    from mtp.model.layers import Rotary
    from mtp.model.presets import tiny_config

    rn, g = _interpreted_randn(5)

    w8, sw = weight_quant(rn(130, 512, s=0.05))
    wg, bias = rn(64, 384, s=0.05), rn(64, s=0.05)
    E, D, inner, H = 5, 128, 128, 1  # the smallest shapes the kernels take: few programs under the interpreter
    ws = [weight_quant(rn(inner, D, s=0.05)) for _ in range(2 * E)] + [weight_quant(rn(D, inner, s=0.05))
                                                                       for _ in range(E)]
    stack = [torch.stack([w[k] for w in ws[a:a + E]]) for a in (0, E, 2 * E) for k in (0, 1)]
    shared_w = [stack[0][-1], stack[2][-1], stack[4][-1]]  # the shared expert's gate, up, down
    w_kb, w_vb = rn(1, 128, 128, s=0.05), rn(H, 64, 512, s=0.05).bfloat16()
    S = 24
    kv8, kvs = act_quant(rn(1, S, 512))
    pe, lens = rn(1, S, 64), torch.tensor([S - 2], dtype=torch.int32)
    cfg = tiny_config()
    mla = MLA(cfg, torch.float32)
    mla.w_kb = rn(mla.H, mla.P, mla.C, s=0.05)
    width = mla.H * (mla.P + mla.R) + mla.indexer.n_heads * 128
    for n in (1, 2, 3, 4):
        one = n == 1
        x = rn(n, 512)
        _pf_equal(f"fp8_gemm M={n}", lambda f: fp8_gemm(*act_quant(x), w8, sw, pdl=True, prefetch=f), [w8], 1)
        _pf_equal(f"fp8_linear M={n}", lambda f: fp8_linear(x, w8, sw, fuse_quant=n != 2, pdl=True, prefetch=f),
                  [w8], 1 if n != 2 else 2)  # x quantized in the GEMM, or by act_quant first (2 rows)
        xr = rn(n, 384)
        _pf_equal(f"router T={n}", lambda f: moe_route_fused(xr, wg, bias, n_group=4, topk_group=2, topk=6, pdl=True,
                                                             prefetch=f), [wg], 1)  # 'serial' at 2 tokens
        xe = rn(n, D).bfloat16()
        ids = torch.tensor([[0, 3], [3, -1], [1, 2], [-1, -1]], dtype=torch.int32)[:n]
        wts = torch.rand(n, 2, generator=g)
        layout = "pairs" if n == 3 else "persistent"
        _pf_equal(f"moe_experts {layout} T={n}", lambda f: moe_experts(
            xe, ids, wts, *stack, out_dtype=torch.float32, layout=layout, shared=True, programs=(8, 8), pdl=True,
            prefetch=f), shared_w, 3)
        qq = rn(n, 1, 192)
        _pf_equal(f"absorb_q n={n}", lambda f: absorb_q(qq.view(n, 1, 1, 192)[..., :128], w_kb, pdl=True,
                                                        prefetch=f), [w_kb], 1)
        o_lat = rn(n, 1, H, 512).bfloat16()
        _pf_equal(f"absorb_out n={n}", lambda f: absorb_out(o_lat, w_vb, pdl=True, prefetch=f), [w_vb], 1)
        if one:
            q, qpe = rn(1, n, H, 512), rn(1, n, H, 64)
            _pf_equal(f"mla_decode w_vb T={n}", lambda f: mla_decode(
                q, qpe, kv8, kvs, pe, lens, 0.07, out_dtype=torch.bfloat16, w_vb=w_vb, splits=2, pdl=True,
                prefetch=f), [w_vb], 2)
        else:
            o_part, lse = rn(n * H * 2, 512), rn(n * H * 2)
            _pf_equal(f"stage2_absorb n={n}", lambda f: stage2_absorb(o_part, lse, 2, w_vb, 1, n, pdl=True,
                                                                      prefetch=f), [w_vb], 1)
        pos = torch.arange(3, 3 + n).view(n, 1)
        cos, sin = Rotary(cfg).angles(pos)
        qb = rn(n, 1, width)
        _pf_equal(f"mla_q_prologue_absorb B={n}", lambda f: mla_q_prologue_absorb(
            mla, qb, cos, sin, index=one, pdl=True, prefetch=f), [mla.w_kb], 1)  # the indexer's queries: once


def _step_checks() -> None:
    """A tiny simulated TP=2 'split' rank (the smallest whose MLA takes the kernels), one decode forward of its
    trunk, head and MTP module at 1 token over 40 keys (the indexer and its top-k 16: every kernel of a dense step
    and more), the switch off, then on, then on with no prefetch and glue_pdl off: the same logits, hidden and cache
    bytes, every Triton launch with PDL but NOT_CHAINED's (and GLUE's with glue_pdl off); STEP_PREFETCHING's kernels
    launched with their L2 prefetches compiled in (and run) with prefetches on, none with them off (the option
    reaches every call site)."""
    from mtp.backends import fast_path as fp
    from mtp.checkpoint.synthetic import fill_cache_random
    from mtp.parallel.layout import ParallelPlan
    from mtp.parallel.simulate import simulated_rank
    from mtp.parallel.synthetic import random_parallel_model
    from tests.interp import PREFETCHED, patch_interpreter_loop_bounds, patch_interpreter_pdl
    from tests.plan.test_kernel_count import _tiny

    patch_interpreter_loop_bounds()
    patch_interpreter_pdl()
    cfg = _tiny(2)
    g = torch.Generator().manual_seed(0)
    with simulated_rank(2, 0) as comm, torch.no_grad():
        model = random_parallel_model(cfg, comm, ParallelPlan(2, expert_layout="split"), device="cpu",
                                      dtype=torch.bfloat16)
        fp.install_fast_modules(model)
        fp.set_elementwise(model, "triton")
        for L in (40,):
            ids = torch.randint(0, cfg.vocab_size, (1, 1), generator=g)
            out, names, pf_names = {}, {}, {}
            for pdl, pf, glue in ((False, True, True), (True, True, True), (True, False, False)):
                fp.set_kernels(model, pdl=pdl, pdl_prefetch_tokens=64 if pf else 0, glue_pdl=glue)
                cache = fill_cache_random(model.new_cache(1, L + 4), L)
                mcache = fill_cache_random(model.new_cache(1, L + 4, n_layers=1), L)
                PREFETCHED.clear()
                flagged: list[str] = []
                with _launches(flagged) as runs:
                    res = model(ids, cache, kv_len=L + 1)
                    mres = model.mtp_forward(0, ids, res.hidden, mcache, kv_len=L + 1)
                bufs = [getattr(c, n) for c in (cache, mcache) for n in CACHE]
                out[pdl, pf, glue] = [res.logits, res.hidden, mres.logits, *bufs]
                names[pdl, pf, glue] = {n for n, p in runs if p != pdl}  # kernels that did not follow the switch
                pf_names[pdl, pf, glue] = set(flagged)
                assert bool(PREFETCHED) == (pdl and pf), (L, pdl, pf, len(PREFETCHED))
            base = out[False, True, True]
            assert all(_same(base, o) for o in out.values()), L
            assert not names[False, True, True], (L, names[False, True, True])
            assert names[True, True, True] == NOT_CHAINED, (L, names)
            assert names[True, False, False] == NOT_CHAINED | GLUE, (L, names)
            assert pf_names[True, True, True] == STEP_PREFETCHING, (L, pf_names[True, True, True])
            assert not pf_names[False, True, True] and not pf_names[True, False, False], (L, pf_names)


if __name__ == "__main__":
    interpreted_main([_kernel_checks, _prefetch_checks, _step_checks])
