"""Switch `FastPathOptions.moe_tma`: the persistent experts' weight tiles copied by TMA through host tensor descriptors
(`moe.moe_experts(tma=True)`, `moe.weight_desc`, `moe_items._w_tma`) instead of pointer tensors (cp.async), on the CPU.

- Compiled for sm_90 (triton's own ptxas, no GPU) at a TP=8 split rank's shapes (8 routed + the shared slot; x8 and
  item_regs, the default item loop), against the pointer tiles: each K loop issues its weight tiles as TMA copies
  (`ttng.async_tma_copy_global_to_local` in the TTGIR, `cp.async.bulk.tensor.2d` in the PTX), none as cp.async, and
  the pipeliner multi-buffers them as it did the cp.async ones (a [stages, 128, 128] buffer per weight, the copies for
  later K groups issued inside the loop, an mbarrier wait per group); the same shared memory but the barriers (so the
  same programs per SM), no more registers, no spills, a K loop of no more SASS instructions; PDL's order holds (the
  copies after the wait).
- Under the Triton interpreter (a subprocess; its e4m3 cast made CUDA's, its PDL branches as no-ops): torch.equal to
  the pointer tiles at 1, 2, 3 and 4 tokens with the shared slot and without, K slices 1 and more (a short last one),
  item_regs on and off, x8 on and off, -1 slots and experts repeated across tokens, grids of fewer programs than items;
  why N must be a multiple of 128 (an overhanging N-block of the [E * N, K] view copies the next expert's rows where
  the masked pointer load gives 0; past the view's last row TMA fills 0 as the mask does); bad stacks refused by name;
  the descriptor cache keyed by address and holding no tensor; `FastMoE` hands tma to persistent calls only, with the
  switch.
GPU twin at the real shapes (PDL, CUDA graphs): tests/kernels/test_moe_tma_gpu.py.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`
from mtp.kernels._triton import tl, triton  # noqa: E402
from tests.interp import interpreted_main, run_interpreted  # noqa: E402

DESC = "tensordesc<fp8e4nv[128, 128]>"  # the JIT's signature of a `moe.weight_desc`


def test_moe_tma_switch_and_variant():
    """On by default where the GPU has TMA (`moe.has_tma`: never on the CPU); `mtp-bench --kernel-variants
    moe_tma_off` turns it off, moe_tma on."""
    import torch

    from mtp.bench.rank import KERNEL_VARIANTS
    from mtp.kernels.dispatch import FastPathOptions
    from mtp.kernels.moe import has_tma

    o = FastPathOptions()
    assert o.moe_tma and not has_tma(torch.device("cpu"))
    flags, options = KERNEL_VARIANTS["moe_tma"]
    o.set(**flags)
    assert o.moe_tma and options == {}
    flags, options = KERNEL_VARIANTS["moe_tma_off"]
    o.set(**flags)
    assert not o.moe_tma and options == {}


def compile_experts(name: str, tma: bool, T: int = 1):
    """`moe._moe_gate_up_persistent` ('gate_up', x8) or `_moe_down_persistent` ('down') compiled for sm_90 as a TP=8
    split rank's T-token call launches them by default (item_regs, PDL after the wait past one token, 'waves'
    slices: 7 gate/up at one token, 2 from two), with the weight tiles by TMA or by pointers."""
    import mtp.kernels.moe as moe
    from tests.kernels.test_fused_kernels import _compile_for_hopper

    f8 = "*fp8e4nv"
    ppad = triton.next_power_of_2(9 * T)
    base = dict(TOPK=9, J=8, BM=16, KPAD=16, PPAD=ppad, PREFETCH=True, PDL=1 if T == 1 else 2, ITEM_REGS=True,
                NEXT_PF=False, TMA=tma)
    aligned = ("D", "I", "stride_xm", "stride_sxm", "stride_we", "stride_se")
    if name == "gate_up":
        ptrs = dict(x_ptr=f8, idx_ptr="*i32", w1_ptr=f8, w3_ptr=f8, h8_ptr=f8, cnt_ptr="*i32")
        descs = ("w1_desc", "w3_desc")
        kernel, stages, extra = moe._moe_gate_up_persistent, 4, dict(KSU=7 if T == 1 else 2,
                                                                     TP=triton.next_power_of_2(T), X8=True)
    else:
        ptrs = dict(h8_ptr=f8, idx_ptr="*i32", w2_ptr=f8)
        descs = ("w2_desc",)
        kernel, stages, extra = moe._moe_down_persistent, 5, {}
    if tma:
        ptrs.update({d: DESC for d in descs})
    else:
        extra.update({d: None for d in descs})
    return _compile_for_hopper(kernel, ptrs, dict(base, **extra), num_warps=4, num_stages=stages, aligned=aligned)


def _k_loop_ttgir(ttgir: str) -> str:
    """The TTGIR of the item loop's inner scf.for whose body holds a warp_group_dot (the K loop), to its yield."""
    for m in re.finditer(r"scf\.for [^\n]*iter_args[^\n]*\{\n", ttgir):
        body = ttgir[m.end():ttgir.index("scf.yield", m.end())]
        if "ttng.warp_group_dot" in body:
            return body
    raise AssertionError("no K loop (an scf.for with a warp_group_dot) in the TTGIR")


def test_tma_compile_for_hopper():
    pytest.importorskip("triton")
    from tests.kernels.test_moe_items import _item_loop, _k_loops, _sass
    from tests.kernels.test_moe_x8 import _sass_k_loop
    from tests.kernels.test_pdl import _order

    for name, tiles, stages in (("gate_up", 2, 4), ("down", 1, 5)):
        ptr, tma = compile_experts(name, False), compile_experts(name, True)
        item, loop = _item_loop(tma.asm["ttgir"]), _k_loop_ttgir(tma.asm["ttgir"])
        assert "tt.descriptor_load" not in tma.asm["ttgir"], f"{name}: a descriptor load left synchronous"
        # the tiles' buffers: stages deep, as the cp.async ones
        bufs = re.findall(rf"ttg\.local_alloc : \(\) -> !ttg\.memdesc<{stages}x128x128xf8E4M3FN", item)
        assert len(bufs) == tiles, (name, len(bufs))
        assert len(re.findall(rf"ttg\.local_alloc : \(\) -> !ttg\.memdesc<{stages}x128x128xf8E4M3FN",
                              _item_loop(ptr.asm["ttgir"]))) == tiles, name
        # in the K loop: a barrier wait per group, and the copies of a later group (the pipeline's), never a pointer
        # tile
        assert loop.count("ttng.async_tma_copy_global_to_local") == tiles, (name, loop.count("async_tma_copy"))
        assert "ttng.wait_barrier" in loop and "ttng.barrier_expect" in loop, name
        assert not re.search(r"async_copy_global_to_local [^\n]*tensor<128x128x!tt\.ptr", item), name
        # the copies before the loop: the pipeline's prologue (stages - 1 groups)
        pro = item[:item.index(loop)]
        assert pro.count("ttng.async_tma_copy_global_to_local") == tiles * (stages - 1), name
        for body in _k_loops(tma.asm["ptx"]):
            assert body.count("cp.async.bulk.tensor.2d") == tiles and "mbarrier.try_wait" in body, name
        # the same buffers: shared memory but the stages' mbarriers (8 bytes each), so the same programs per SM
        assert 0 < tma.metadata.shared - ptr.metadata.shared <= 8 * stages, (name, tma.metadata.shared,
                                                                               ptr.metadata.shared)
        (sass_t, use_t), (sass_p, use_p) = _sass(tma), _sass(ptr)
        assert use_t.get("STACK") == "0" and use_t.get("LOCAL") == "0", (name, use_t)
        assert int(use_t["REG"]) <= int(use_p["REG"]), (name, use_t, use_p)
        assert _sass_k_loop(sass_t) <= _sass_k_loop(sass_p), (name, _sass_k_loop(sass_t), _sass_k_loop(sass_p))
        # PDL: the launch first, before the wait only the shared expert's prefetch, every TMA copy after the wait
        ptx = tma.asm["ptx"]
        seq = _order(ptx)
        wait = seq.index("griddepcontrol.wait")
        assert seq[0] == "griddepcontrol.launch_dependents" and set(seq[1:wait]) == {"prefetch.global.L2"}, seq
        assert ptx.index("cp.async.bulk.tensor") > ptx.index("griddepcontrol.wait"), name
    four = compile_experts("gate_up", True, T=4)  # four tokens (PPAD 64, 2 slices, TP = 4): pipelined alike
    assert _k_loop_ttgir(four.asm["ttgir"]).count("ttng.async_tma_copy_global_to_local") == 2


def test_moe_tma_interpreted():
    run_interpreted(__file__, 600)


# ----------------------------------------------------------------------------- run under TRITON_INTERPRET=1
@triton.jit
def _tile_both_ways(w_ptr, w_desc, out_ptr, e, nb, N, K):
    """Expert e's N-block nb at K group 0 of a stack [E, N, K], loaded as `moe._down_ptrs` does (row mask, 0 past N)
    into out[0] and through the [E * N, K] descriptor (`moe_items._w_tma`) into out[1]."""
    r = tl.arange(0, 128)
    rows = nb * 128 + r
    w_ptrs = w_ptr + tl.full([], e, tl.int64) * N * K + rows.to(tl.int64)[:, None] * K + r[None, :]  # e may be a constexpr 1
    tl.store(out_ptr + r[:, None] * 128 + r[None, :], tl.load(w_ptrs, mask=(rows < N)[:, None], other=0.0))
    tl.store(out_ptr + 128 * 128 + r[:, None] * 128 + r[None, :], w_desc.load([e * N + nb * 128, 0]))


def overhang_tiles(w: torch.Tensor, e: int, nb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_tile_both_ways` on stack w (any N: the descriptor built here, not by `weight_desc`, which refuses it)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    E, N, K = w.shape
    out = torch.empty(2, 128, 128, dtype=w.dtype, device=w.device)
    _tile_both_ways[(1,)](w, TensorDescriptor.from_tensor(w.view(E * N, K), [128, 128]), out, e, nb, N, K)
    return out[0], out[1]


def overhang_checks(device: str = "cpu") -> None:
    """Why `weight_desc` wants N a multiple of 128: with N = 192 the second N-block overhangs by 64 rows. Of the
    last expert, TMA fills them with 0 as the pointer load's row mask does (past the [E * N, K] view); of any other,
    it copies the next expert's first 64 rows."""
    g = torch.Generator().manual_seed(8)
    E, N, K = 3, 192, 128
    w = (torch.rand(E, N, K, generator=g) + 0.5).to(torch.float8_e4m3fn).to(device)  # no zero element
    ptr, tma = overhang_tiles(w, E - 1, 1)
    assert torch.equal(ptr.float(), tma.float()) and not ptr[64:].float().any()
    ptr, tma = overhang_tiles(w, 0, 1)
    assert torch.equal(ptr[:64].float(), tma[:64].float()) and not ptr[64:].float().any()
    assert torch.equal(tma[64:].float(), w[1, :64].float()), "the next expert's rows"
    ptr, tma = overhang_tiles(w, 1, 0)  # a whole block: the same tile either way
    assert torch.equal(ptr.float(), tma.float())


def _kernel_checks() -> None:
    from mtp.kernels.moe import moe_experts
    from mtp.model.fp8 import act_quant
    from tests.kernels.test_moe_grouped import _experts

    E, D, I, J = 4, 384, 256, 2  # gate/up 3 K groups (a short last slice of 2), down 2; 2 N-blocks as a split rank
    ws = _experts(E + 1, D, I, seed=0)
    g = torch.Generator().manual_seed(7)

    def routing(T: int) -> torch.Tensor:
        idx = torch.stack([torch.randperm(E, generator=g)[:J] for _ in range(T)]).int()
        idx[0, 1] = -1  # a slot on another rank
        if T > 2:
            idx[2] = -1  # a token with no routed expert here (the shared one still, where shared)
        if T > 3:
            idx[3] = idx[1]  # token 3 routed as token 1
        return idx

    # (tokens, shared slot, slices (None: `default_splits`, at one token 3 and 2), grids, item_regs, x8, PDL)
    cases = [(1, True, None, None, True, True, 0), (2, False, (1, 1), None, True, False, 1),
             (3, True, "waves", None, False, True, 2), (4, True, (2, 2), (5, 7), True, True, 2),
             (3, False, (3, 2), (2, 3), True, True, 0)]
    for T, shared, splits, programs, regs, x8, pdl in cases:
        x = torch.randn(T, D, generator=g).bfloat16()
        idx, rw = routing(T), torch.rand(T, J, generator=g)
        kw = dict(out_dtype=torch.float32, layout="persistent", shared=shared, splits=splits, programs=programs,
                  item_regs=regs, xq=act_quant(x) if x8 else None, pdl=pdl)
        off = moe_experts(x, idx, rw, *ws, **kw)
        on = moe_experts(x, idx, rw, *ws, tma=True, **kw)
        assert torch.equal(on, off), (T, shared, splits, regs, x8, (on - off).abs().max().item())


def _desc_checks() -> None:
    """Bad stacks and calls refused by name; the cache: one descriptor per (address, shape, strides), no tensor
    held, the signature the JIT gives it."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    import mtp.kernels.moe as moe
    from tests.kernels.test_moe_grouped import _experts

    f8 = torch.float8_e4m3fn
    w = torch.zeros(2, 256, 384, dtype=f8)
    d = moe.weight_desc("w_gate", w)
    assert (list(d.shape), list(d.strides), list(d.block_shape)) == ([512, 384], [384, 1], [128, 128])
    raw = torch.zeros(2 * 256 * 384 + 16, dtype=torch.uint8)
    base = 1 if raw.data_ptr() % 16 == 0 else 16 - raw.data_ptr() % 16 + 1  # a misaligned address
    bad = [("w_up", raw[base:base + 2 * 256 * 384].view(f8).view(2, 256, 384), "a 16-byte aligned base address"),
           ("w_down", torch.zeros(2, 192, 384, dtype=f8), "N = 192 a multiple of 128"),
           ("w_gate", torch.zeros(2, 256, 120, dtype=f8), "16-byte aligned rows"),
           ("w_gate", torch.zeros(2, 384, 256, dtype=f8).transpose(1, 2), "a unit stride along K")]
    for name, t, match in bad:
        with pytest.raises(ValueError, match=rf"tma needs {name} \[.*{re.escape(match)}"):
            moe.weight_desc(name, t)
    ws = _experts(3, 256, 128, seed=5)
    x, idx, rw = torch.randn(1, 256).bfloat16(), torch.tensor([[0, 1]], dtype=torch.int32), torch.rand(1, 2)
    for kw in (dict(layout="pairs", tma=True), dict(layout="persistent", tma=1)):
        with pytest.raises(ValueError, match="tma must be a bool, and True only with the 'persistent' layout"):
            moe.moe_experts(x, idx, rw, *ws, **kw)
    # the CUDA path's cache, keyed by address: the same object again, its base a stand-in that holds no tensor
    a = moe._stack_desc(1 << 20, 512, 384, f8, torch.device("cuda", 0))
    assert a is moe._stack_desc(1 << 20, 512, 384, f8, torch.device("cuda", 0))
    assert a is not moe._stack_desc(1 << 21, 512, 384, f8, torch.device("cuda", 0))
    assert isinstance(a.base, moe._DescBase) and a.base.data_ptr() == 1 << 20
    assert native_specialize_impl(BaseBackend, a, False, True, True)[0] == DESC


def _module_checks() -> None:
    """`FastMoE` on a 'split' rank hands tma=True to its persistent calls (one token) with the switch where the device
    has TMA (`moe.has_tma`, made True here: the CPU has none), never to the pair grid past persistent_tokens, nor
    where the device has no TMA (the kernels' bits: `_kernel_checks`; here a recorder stands in)."""
    import mtp.backends.fast_path as fp
    from mtp.model.fp8 import act_quant
    from mtp.parallel import ParallelPlan
    from tests.parallel.test_moe_ep import fast_moe, layout_config, random_moe, rank_moes

    cfg = layout_config()
    ep = fast_moe(rank_moes(random_moe(cfg, seed=4), cfg, ParallelPlan(2, expert_layout="split"))[0])
    seen, kernel = [], fp.moe_experts

    def recorder(x, *a, **k):
        seen.append((k.get("layout"), k.get("tma")))
        return torch.zeros(x.shape, dtype=torch.float32)

    fp.moe_experts, device_tma = recorder, fp.has_tma
    try:
        for T in (1, ep.persistent_tokens + 1):
            x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(T))
            for on, dev in ((True, True), (False, True), (True, False)):
                ep.fast_options.moe_tma = on
                fp.has_tma = lambda device, dev=dev: dev
                seen.clear()
                ep(x, act_quant(x), rounded=False, reduce=False)
                persistent = T <= ep.persistent_tokens
                want = [("persistent" if persistent else ep.expert_layout, on and dev and persistent)]
                assert seen == want, (T, on, dev, seen)
    finally:
        fp.moe_experts, fp.has_tma = kernel, device_tma
        ep.fast_options.moe_tma = True


if __name__ == "__main__":
    interpreted_main([overhang_checks, _kernel_checks, _desc_checks, _module_checks], fp8_rounding=True, pdl=True)
