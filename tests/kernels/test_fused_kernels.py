"""The fused decode kernels (split-K GEMV, add + RMSNorm + quant, one-launch router) and their fast-path wiring,
under the Triton interpreter on the CPU.

The interpreter is chosen when a kernel is decorated (at import), so the checks run in a subprocess started
with TRITON_INTERPRET=1 (this file as a script). Its fp32 -> fp8 casts are not CUDA's and its bf16 tl.dot is
wrong, so: pre-quantized inputs are held to the fp8 references; a kernel's in-register quantization is held
to the interpreter's own act_quant kernel; the router runs on fp32 inputs. tests/kernels/test_fused_kernels_gpu.py
holds every kernel to the plain-PyTorch references on a GPU (bit-exact quantization, bf16 gate).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from mtp.kernels.dispatch import FastPathOptions

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script: the repo root, for `tests`
from tests.interp import interpreted  # noqa: E402


def _run_interpreted(which: str) -> None:
    r = interpreted([__file__, which], 600)
    assert r.returncode == 0, f"interpreted checks failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    assert f"{which} ok" in r.stdout


def test_fused_kernels_interpreted():
    _run_interpreted("kernels")


@pytest.mark.slow
def test_fast_block_wiring_interpreted():
    _run_interpreted("model")


def _compile_for_hopper(kernel, pointers: dict, consts: dict, num_warps: int, num_stages: int = 3,
                        aligned: tuple[str, ...] = ()):
    """Compile a kernel for sm_90 without a GPU (triton's own ptxas): PTX and cubin, or the compiler's error.
    aligned: arguments the JIT would specialize as multiples of 16 on the device (every pointer then is too):
    without that alignment the pipeliner cannot use cp.async and `num_stages` buys no shared-memory buffers."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {}
    names = list(inspect.signature(kernel.fn).parameters)
    for name in names:
        sig[name] = "constexpr" if name in consts else pointers.get(name, "*fp32" if name.endswith("_ptr") else "i32")
    sig.update({k: "fp32" for k in ("route_scale",) if k in sig})
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if aligned and n not in consts and (n.endswith("_ptr") or n in aligned)}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                              num_stages=num_stages))


def _params_read(kernel, ptx: str, consts: dict) -> set[str]:
    """The names of `kernel`'s runtime arguments its PTX loads (`ld.param`): an argument a constexpr branch leaves
    unused is declared but never read."""
    import inspect
    import re

    args = [n for n in inspect.signature(kernel.fn).parameters if n not in consts]
    read = {int(i) for i in re.findall(rf"ld\.param\.\w+\s+%\w+, \[{kernel.fn.__name__}_param_(\d+)\]", ptx)}
    return {args[i] for i in read}


def test_new_kernels_compile_for_hopper():
    """The tensor-core GEMV and the grouped router compile for an H100 / H200 (the interpreter runs neither
    through the compiler): the GEMV's product is an MMA, at every row count and both input kinds. Both router
    kernels with a rank's expert table (TABLE) read the table and not the range, and without it (a range: the
    code as before tables existed, the same PTX instructions as measured) the range and never the table."""
    pytest.importorskip("triton")
    import inspect

    from mtp.kernels.gemv_splitk import MMA_ROWS, _gemv_mma_kernel
    from mtp.kernels.router import _route_fused_kernel, _route_grouped_kernel

    for M, prequant in ((1, True), (8, True), (3, False)):
        x = "*fp8e4nv" if prequant else "*bf16"
        k = _compile_for_hopper(_gemv_mma_kernel, dict(x_ptr=x, w_ptr="*fp8e4nv", y_ptr="*bf16", cnt_ptr="*i32"),
                                dict(M=M, PREQUANT=prequant, SPLIT=True, BN=32, GPS=8, SPAD=8, PDL=0, MP=MMA_ROWS),
                                num_warps=4)
        assert "mma.sync" in k.asm["ptx"] or "wgmma" in k.asm["ptx"], f"no MMA in the M={M} GEMV"
    ptrs = dict(x_ptr="*bf16", w_ptr="*bf16", ci_ptr="*i32", cnt_ptr="*i32", idx_out_ptr="*i32", table_ptr="*i32")
    for kernel, btr, table in ((_route_grouped_kernel, 1, False), (_route_grouped_kernel, 8, False),
                               (_route_grouped_kernel, 8, True), (_route_fused_kernel, 2, False),
                               (_route_fused_kernel, 2, True)):
        grouped = {"CPAD": 8} if kernel is _route_grouped_kernel else {}
        consts = dict(E=256, NG=8, TOPK_GROUP=4, TOPK=8, KPAD=8, BE=32, BT=16, BTR=btr, GPS=4, SPLITS=14, BF16=True,
                      STORE_LOGITS=False, PDL=1, TABLE=table, LINE=64, PREFETCH=True, **grouped)
        names = set(inspect.signature(kernel.fn).parameters)
        k = _compile_for_hopper(kernel, {n: t for n, t in ptrs.items() if n in names}, consts, num_warps=8)
        read = _params_read(kernel, k.asm["ptx"], consts)
        assert ("table_ptr" in read) == table and ({"e0", "e1"} <= read) != table, (kernel.fn.__name__, table, read)


def test_fast_path_options_set():
    opts = FastPathOptions()
    old = opts.set(gemv=False)
    assert opts.gemv is False and old.gemv is True
    with pytest.raises(ValueError, match="unknown switch"):
        opts.set(gmev=True, router=False)
    assert opts.router is True  # nothing set when one name is wrong
    opts.set(**vars(old))
    assert opts == FastPathOptions()


@pytest.mark.parametrize("rows,M,want", [(8, 1, "gemv"), (8, 4, "gemv"), (8, 8, "gemv"), (8, 9, "gemm"),
                                          (1, 1, "gemv"), (1, 2, "gemm"), (2, 2, "gemv"), (2, 3, "gemm"),
                                          (0, 1, "gemm")])
def test_linear_dispatch_by_rows(monkeypatch, rows, M, want):
    """`linear` runs the split-K GEMV for 1..gemv_rows rows and the tensor-core GEMM above (or when off);
    the kernels are replaced by recorders, so this runs without Triton."""
    import mtp.kernels.fp8_gemm as gemm
    import mtp.kernels.gemv_splitk as gemv
    from mtp.kernels.dispatch import linear

    took = []
    monkeypatch.setattr(gemv, "fp8_gemv", lambda x, w8, sw, **kw: took.append("gemv"))
    monkeypatch.setattr(gemm, "fp8_linear", lambda x, w8, sw, **kw: took.append("gemm"))
    linear(torch.zeros(M, 256), torch.zeros(128, 256), torch.ones(1, 2), FastPathOptions(gemv_rows=rows))
    assert took == [want]


@pytest.mark.parametrize("bad", [9, -1, True, 2.0, "4"])
def test_gemv_rows_checked(bad):
    with pytest.raises(ValueError, match="gemv_rows must be an integer in 0..8"):
        FastPathOptions(gemv_rows=bad)
    opts = FastPathOptions()
    with pytest.raises(ValueError, match="gemv_rows must be an integer in 0..8"):
        opts.set(gemv_rows=bad)
    assert opts.gemv_rows == 1  # the measured default, unchanged


def test_set_kernels_invalidates_kept_graphs():
    """Flipping a switch through the fast path bumps model.version (graphs kept by the engine are captured
    again) and restores with the switches it returns."""
    from mtp.backends.fast_path import install_fast_modules, set_kernels
    from mtp.model.presets import tiny_config
    from mtp.model.deepseek import DeepseekV32

    model = DeepseekV32(tiny_config(), n_mtp=0)
    install_fast_modules(model)
    v = model.version
    old = set_kernels(model, router=False)
    assert model.version == v + 1 and model.fast_options.router is False and old.router is True
    set_kernels(model, **vars(old))
    assert model.version == v + 2 and model.fast_options.router is True


# ----------------------------------------------------------------------------- run under TRITON_INTERPRET=1
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _expect_errors(name: str, cases, err: type = ValueError) -> None:
    """Each (call, match): the call raises err with `match` in its message."""
    for bad, match in cases:
        try:
            bad()
        except err as e:
            assert match in str(e), str(e)
        else:
            raise AssertionError(f"{name} accepted bad input ({match})")


def _gemv_checks() -> None:
    from mtp.model.fp8 import act_quant as act_quant_ref
    from mtp.model.fp8 import weight_quant
    from mtp.kernels.act_quant import act_quant
    from mtp.kernels.gemv_splitk import MAX_M, fp8_gemv, fp8_gemv_ref

    # odd N (ragged last scale block), K of 3 groups (GPS 1: 3 slices) and 4 groups (one slice or two)
    for N, K, Ms, tune in ((200, 384, range(1, 6), {}), (130, 512, (2, 5), {}), (130, 512, (1, 4), dict(gps=2, bn=16))):
        w8, sw = weight_quant(torch.randn(N, K) * 0.05)
        for M in Ms:  # verify widths 1..K+1 for K = 4 drafts on one shape (the interpreter is slow), two on the others
            x = torch.randn(M, K) * torch.logspace(-2, 1, K)
            xq = act_quant_ref(x)
            y = fp8_gemv(None, w8, sw, xq=xq, **tune)
            r = fp8_gemv_ref(None, w8, sw, xq=xq)
            assert y.dtype == torch.float32 and _rel(y, r) < 1e-5, (N, K, M, tune, _rel(y, r))
            again = fp8_gemv(None, w8, sw, xq=xq, **tune)  # the split-K counters re-armed themselves
            assert torch.equal(again, y)
            own = fp8_gemv(None, w8, sw, xq=act_quant(x), **tune)  # the interpreter's own quantization
            assert torch.equal(fp8_gemv(x, w8, sw, out_dtype=torch.float32, **tune), own), (N, K, M, tune)
    # the tensor-core variant (an option, off by default): odd N, the model's K (1536, 2048, 7168), one row, odd
    # row counts and MAX_M, x pre-quantized and quantized in the kernel, the planned tile and a forced one
    for N, K, Ms, tune in ((130, 1536, (1, 3, MAX_M), {}), (72, 2048, (4,), {}),
                           (40, 7168, (7,), {}), (200, 1536, (3,), dict(bn=32, gps=2))):
        w8, sw = weight_quant(torch.randn(N, K) * 0.05)
        for M in Ms:
            x = torch.randn(M, K) * torch.logspace(-2, 1, K)
            xq = act_quant_ref(x)
            y = fp8_gemv(None, w8, sw, xq=xq, mma=True, **tune)
            r = fp8_gemv_ref(None, w8, sw, xq=xq)
            assert y.dtype == torch.float32 and _rel(y, r) < 1e-5, ("mma", N, K, M, tune, _rel(y, r))
            if M == MAX_M:  # the counters re-armed themselves
                assert torch.equal(fp8_gemv(None, w8, sw, xq=xq, mma=True, **tune), y)
            own = fp8_gemv(None, w8, sw, xq=act_quant(x), mma=True, **tune)
            assert torch.equal(fp8_gemv(x, w8, sw, out_dtype=torch.float32, mma=True, **tune), own), ("mma", N, K, M)
    # one slice (`gemv_plan`'s one_slice: K = 2048, 16 groups, no fix-up) against the reference and the split plan
    from mtp.kernels.gemv_splitk import gemv_plan

    assert gemv_plan(24, 16, torch.device("cpu"), one_slice=16) == dict(bn=8, gps=16, num_warps=4)
    assert gemv_plan(24, 16, torch.device("cpu"))["gps"] == 8  # 0: the split plan
    assert gemv_plan(24, 12, torch.device("cpu"), one_slice=16)["gps"] == 4  # not a power of two: split
    # 8 warps on a 16 KB tile, 4 where the grid holds more than WAVES_4_WARPS programs per SM (the CPU counts one SM)
    assert gemv_plan(16, 56, torch.device("cpu")) == dict(bn=16, gps=8, num_warps=8)
    assert gemv_plan(16160, 56, torch.device("cpu")) == dict(bn=16, gps=8, num_warps=4)
    w8, sw = weight_quant(torch.randn(24, 2048) * 0.05)
    for M in (1, 3):
        x = torch.randn(M, 2048) * torch.logspace(-2, 1, 2048)
        xq = act_quant_ref(x)
        y = fp8_gemv(None, w8, sw, xq=xq, one_slice=16)
        assert _rel(y, fp8_gemv_ref(None, w8, sw, xq=xq)) < 1e-5, ("one slice", M)
        assert _rel(y, fp8_gemv(None, w8, sw, xq=xq)) < 1e-6, ("one slice vs split", M)
        own = fp8_gemv(None, w8, sw, xq=act_quant(x), one_slice=16)  # x quantized in the kernel: the same bits
        assert torch.equal(fp8_gemv(x, w8, sw, out_dtype=torch.float32, one_slice=16), own), ("one slice", M)
    xb = torch.randn(2, 3, 256).bfloat16()  # leading dims and a bf16 output
    w8, sw = weight_quant(torch.randn(96, 256) * 0.05)
    y = fp8_gemv(None, w8, sw, xq=act_quant_ref(xb), out_dtype=torch.bfloat16)
    assert y.shape == (2, 3, 96) and y.dtype == torch.bfloat16
    assert _rel(y.float(), fp8_gemv_ref(xb, w8, sw).float()) < 1e-2
    _expect_errors("fp8_gemv", ((lambda: fp8_gemv(torch.randn(MAX_M + 1, 256), w8, sw), "rows"),
                                (lambda: fp8_gemv(torch.randn(1, 128), w8, sw), "input channels"),
                                (lambda: fp8_gemv(None, w8, sw, xq=(act_quant_ref(xb)[0], None)), "xq must be"),
                                (lambda: fp8_gemv(torch.randn(2, 256), w8, sw, mma=True, bn=8), "mma needs bn")))


def _norm_checks() -> None:
    from mtp.kernels.act_quant import act_quant
    from mtp.kernels.norm_quant import add_rms_norm_quant, add_rms_norm_quant_ref

    for M, D in ((1, 640), (5, 384), (3, 256)):
        h = torch.randn(M, D) * 3
        d = torch.randn(M, D).bfloat16()
        w = torch.rand(D).bfloat16() + 0.5
        h[0, :128] = 0  # with d, a group of small values
        hn, y, x8, sx = add_rms_norm_quant(h, d, w, 1e-6)
        rh, ry, _, _ = add_rms_norm_quant_ref(h, d, w, 1e-6)
        assert torch.equal(hn, rh), "the residual add must be the reference's add, bit for bit"
        ulp = ry.float().abs() * 2 ** -7 + 1e-30  # a bf16 ulp: the sum of squares is a tree sum
        assert bool(((y.float() - ry.float()).abs() <= ulp).all()), (M, D, (y.float() - ry.float()).abs().max())
        k8, ks = act_quant(y)  # quantizes what it stored
        assert torch.equal(sx, ks) and torch.equal(x8.view(torch.uint8), k8.view(torch.uint8))
        h0, y0, q8, qs = add_rms_norm_quant(h, None, w, 1e-6, store_y=False)  # the q_a norm: quantized y only
        _, ry0, _, _ = add_rms_norm_quant_ref(h, None, w, 1e-6)
        assert h0 is h and y0 is None and _rel(q8.float() * qs.repeat_interleave(128, -1), ry0.float()) < 0.1
        _, y1, n8, _ = add_rms_norm_quant(h, d, w, 1e-6, quant=False)
        assert n8 is None and torch.equal(y1, y)
        hb = (h[:, :256] * 0.1).bfloat16()  # a bf16 input without a delta (the q_a norm's)
        _, yb, b8, bs = add_rms_norm_quant(hb, None, w[:256], 1e-6)
        _, ryb, _, _ = add_rms_norm_quant_ref(hb, None, w[:256], 1e-6)
        assert bool(((yb.float() - ryb.float()).abs() <= ryb.float().abs() * 2 ** -7 + 1e-30).all())
        k8, ks = act_quant(yb)
        assert torch.equal(bs, ks) and torch.equal(b8.view(torch.uint8), k8.view(torch.uint8))
    # each warp count the fast path may give a row (`FastPathOptions.norm_warps`; None: row_tiles', 32 here) launches
    # and gives the default's outputs (the interpreter's sums do not follow the warps: the GPU test holds each count
    # to the reference and to itself, tests/kernels/test_fused_kernels_gpu.py)
    from mtp.kernels.norm_quant import ROW_WARPS

    h, d, w = torch.randn(2, 4096) * 3, torch.randn(2, 4096), torch.rand(4096).bfloat16() + 0.5
    want = add_rms_norm_quant(h, d, w, 1e-6, round_dtype=torch.bfloat16)
    for nw in ROW_WARPS:
        got = add_rms_norm_quant(h, d, w, 1e-6, round_dtype=torch.bfloat16, num_warps=nw)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b)
                   for a, b in zip(got, want)), nw
    _expect_errors("add_rms_norm_quant", [(lambda: add_rms_norm_quant(torch.randn(2, 200), None, torch.ones(200), 1e-6),
                                           "multiple of 128"),
                                          (lambda: add_rms_norm_quant(h, d, w, 1e-6, num_warps=6), "num_warps must")])
    _expect_errors("add_rms_norm_quant", [(lambda: add_rms_norm_quant(torch.randn(2, 256).bfloat16(),
                                                                      torch.randn(2, 256), torch.ones(256), 1e-6),
                                           "with a delta")], err=TypeError)
    # the block's last residual add: h + y rounded to the model dtype, bit for bit (fp16 / fp32 here: the
    # interpreter's bf16 rounding is numpy's, held on the GPU)
    from mtp.kernels.norm_quant import add_rounded, add_rounded_ref

    h, y = torch.randn(3, 2500) * 3, torch.randn(3, 2500) * 1e3
    for dt in (torch.float16, torch.float32):
        assert torch.equal(add_rounded(h, y, dt), add_rounded_ref(h, y, dt)), dt
    assert not torch.equal(add_rounded_ref(h, y, torch.float16), h + y)  # the rounding is there to see


def _router_checks() -> None:
    from mtp.kernels.dispatch import expert_map, local_ids
    from mtp.kernels.router import SPLITK_IMPLS as IMPLS  # impl 'one': tests/kernels/test_router_one.py
    from mtp.kernels.router import moe_route_fused, moe_route_ref, route_from_logits_ref

    torch.manual_seed(1)
    # DeepSeek's E = 256 / 8 groups at one token, two ('auto' picks the serial tail there) and 8 (padded rows
    # at 5 and 7 below), and the tiny models' odd configs
    cases = [(T, 256, 256, 8, 4, 8) for T in (1, 2, 8)]
    cases += [(5, 64, 384, 4, 2, 6), (3, 32, 256, 1, 1, 3), (2, 16, 256, 4, 2, 4), (7, 8, 128, 2, 1, 2),
              (4, 8, 128, 4, 2, 3)]
    for T, E, D, ng, tg, k in cases:
        x = torch.randn(T, D)
        wg = torch.randn(E, D) * 0.05
        bias = torch.randn(E) * 0.05
        kw = dict(n_group=ng, topk_group=tg, topk=k)
        got = {impl: moe_route_fused(x, wg, bias, return_logits=True, impl=impl, **kw) for impl in (*IMPLS, "auto")}
        w, idx, lg = got["serial"]
        for impl in [i for i in got if i != "serial"]:  # the same logits, ids and weights bit for bit
            assert all(torch.equal(a, b) for a, b in zip(got[impl], got["serial"])), (impl, T, E, ng)
        assert _rel(lg, x @ wg.t()) < 1e-5
        wr, ir = route_from_logits_ref(lg, bias, **kw)
        assert torch.equal(idx, ir), (T, E, idx.tolist(), ir.tolist())
        assert _rel(w, wr) < 1e-6
        e0, e1 = E // 4, E // 2  # an expert-parallel rank's view
        # a rank of scattered experts ('interleaved' / 'permuted'): every third expert and a few more, its table
        table = expert_map(sorted(set(range(1, E, 3)) | {0, E - 1}), E, "cpu").router
        for impl in IMPLS:
            assert torch.equal(moe_route_fused(x, wg, bias, impl=impl, **kw)[1], idx)
            wl, il = moe_route_fused(x, wg, bias, local=(e0, e1), impl=impl, **kw)
            assert torch.equal(wl, w) and torch.equal(il, torch.where((idx >= e0) & (idx < e1), idx - e0, -1))
            wt, it = moe_route_fused(x, wg, bias, local=table, impl=impl, **kw)
            assert torch.equal(wt, w) and torch.equal(it, table[idx.long()]), (impl, T, E, it.tolist())
            assert torch.equal(it, local_ids(idx, table)) and (it >= 0).any() and (it < 0).any()
    # exact ties everywhere (x = 0: every sigmoid is 0.5; bias in steps of 0.25): equal experts in a group,
    # equal group scores across groups; lower index first at every step
    x = torch.zeros(4, 256)
    for E, ng, tg, k in ((64, 4, 2, 6), (256, 8, 4, 8), (16, 4, 2, 4)):
        wg = torch.randn(E, 256)
        bias = torch.randint(0, 3, (E,)).float() * 0.25
        wr, ir = moe_route_ref(x, wg, bias, n_group=ng, topk_group=tg, topk=k)
        for impl in IMPLS:
            w, idx = moe_route_fused(x, wg, bias, n_group=ng, topk_group=tg, topk=k, impl=impl)
            assert torch.equal(idx, ir), (impl, E, idx.tolist(), ir.tolist())
            assert _rel(w, wr) < 1e-6
    wg, bias = torch.randn(16, 256), torch.zeros(16)
    _expect_errors("moe_route_fused", (
        (lambda: moe_route_fused(torch.randn(2, 256), wg, bias, n_group=4, topk_group=2, topk=4,
                                 local=torch.zeros(16, dtype=torch.int64)), "table must be a contiguous int32 [16]"),
        (lambda: moe_route_fused(torch.randn(2, 256), wg, bias, n_group=4, topk_group=2, topk=4,
                                 local=torch.zeros(8, dtype=torch.int32)), "got torch.int32 [8]"),
        (lambda: moe_route_fused(torch.randn(17, 256), wg, bias, n_group=4, topk_group=2, topk=4, impl="grouped"),
         "1..16 tokens"),
        (lambda: moe_route_fused(torch.randn(2, 256), wg, bias, n_group=4, topk_group=1, topk=5, impl="grouped"),
         "topk 5 <= topk_group 1"),
        (lambda: moe_route_fused(torch.randn(2, 256), wg, bias, n_group=4, topk_group=2, topk=4, impl="sorted"),
         "impl must be")))


def _prologue_checks() -> None:
    """The MLA prologue kernels on a tiny fp32 MLA: every FP8 code and scale they write equals the interpreter's
    act_quant of the reference chain's values (the rotary keys and q_pe exactly)."""
    from mtp.model.attention import MLA
    from mtp.model.cache import KVCache
    from mtp.kernels.act_quant import act_quant
    from mtp.kernels.mla_prologue import mla_kv_prologue, mla_q_prologue, mla_q_prologue_ref
    from mtp.model.layers import Rotary, rope_interleaved
    from mtp.model.presets import tiny_config

    cfg = tiny_config()
    mla = MLA(cfg, torch.float32)
    ix = mla.indexer
    mla.kv_a_layernorm.weight.data = torch.rand(cfg.kv_lora_rank) + 0.5
    ix.k_norm.weight.data, ix.k_norm.bias.data = torch.rand(128) + 0.5, torch.randn(128) * 0.1
    B, T, Q, C, R = 2, 3, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    a = torch.randn(B, T, Q + 128 + C + R)
    pos = torch.tensor([[3, 4, 5], [7, 8, 9]])
    cos, sin = Rotary(cfg).angles(pos)
    cache = KVCache(cfg, 1, B, 16, device="cpu", dtype=torch.float32, quantized=True).layer(0)
    mla_kv_prologue(mla, cache, pos, a, cos, sin)
    b = torch.arange(B)[:, None].expand(B, T)
    c8, cs = act_quant(mla.kv_a_layernorm(a[..., Q + 128:Q + 128 + C], torch.float32))
    k8, ks = act_quant(ix.rotate(ix.k_norm(a[..., Q:Q + 128]), cos, sin))
    pe = rope_interleaved(a[..., Q + 128 + C:], cos, sin)
    assert torch.equal(cache.kv[b, pos].view(torch.uint8), c8.view(torch.uint8)) and torch.equal(cache.kv_scale[b, pos], cs)
    assert torch.equal(cache.idx_k[b, pos].view(torch.uint8), k8.view(torch.uint8))
    assert torch.equal(cache.idx_k_scale[b, pos], ks[..., 0]) and torch.equal(cache.pe[b, pos], pe)
    qq = torch.randn(B, T, mla.H * (mla.P + R) + ix.n_heads * 128)
    q_pe, iq8, iqs = mla_q_prologue(mla, qq, cos, sin)
    rp, _, _ = mla_q_prologue_ref(mla, qq, cos, sin)
    r8, rs = act_quant(ix.rotate(qq[..., mla.H * (mla.P + R):].view(B, T, ix.n_heads, 128), cos, sin))
    assert torch.equal(q_pe, rp) and q_pe.is_contiguous()
    assert torch.equal(iq8.view(torch.uint8), r8.view(torch.uint8)) and torch.equal(iqs, rs)
    # without the indexer's queries (S <= top-k): q_pe alone, from the q_b output or the whole q_b | wq_b row
    for width in (mla.H * (mla.P + R), qq.shape[-1]):
        q_pe2, none8, none_s = mla_q_prologue(mla, qq[..., :width], cos, sin, index=False)
        assert torch.equal(q_pe2, rp) and none8 is None and none_s is None
    try:
        mla_q_prologue(mla, qq[..., :-1], cos, sin, index=False)
        raise AssertionError("a q_b output of the wrong width was taken")
    except ValueError as e:
        assert "mla_q_prologue: qq must be" in str(e)


def _prologue_fused_checks() -> None:
    """The fused prologue launches (`mla_prologue_fused`) against the two launches each replaces, bit for bit
    (torch.equal on every byte written): the kv prologue + q_a norm-quant, and the q prologue + absorb q, with and
    without the indexer's queries (the q_b output alone), at 1..5 tokens on 1-3 rows, fp32 (tensor-core dots as IEEE
    fp32) and bf16, over the tiny layout (4 heads < 8 indexer heads) and a wider one (12 heads > 8 indexer heads,
    as TP=1's 128 > 64; q_lora 256)."""
    import dataclasses

    from mtp.kernels.absorb import absorb_q
    from mtp.kernels.mla_prologue import mla_kv_prologue, mla_q_prologue
    from mtp.kernels.mla_prologue_fused import mla_kv_prologue_norm, mla_q_prologue_absorb
    from mtp.kernels.norm_quant import add_rms_norm_quant
    from mtp.model.attention import MLA
    from mtp.model.cache import KVCache
    from mtp.model.layers import Rotary
    from mtp.model.presets import tiny_config

    def same(x, y) -> bool:  # fp8 compared as bytes (NaN codes included)
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        return torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.element_size() == 1 else torch.equal(x, y)

    g = torch.Generator().manual_seed(5)
    # (config, dtype, rows, tokens per row, the q side without the indexer's queries too); few programs: each
    # interpreted one costs ~25 ms, and the absorb tiles narrow to >= 128 programs (32 here, 96 at 12 heads)
    wide = dataclasses.replace(tiny_config(), num_attention_heads=12, q_lora_rank=256)
    cases = [(tiny_config(), torch.float32, 1, 5, False), (tiny_config(), torch.float32, 3, 1, True),
             (tiny_config(), torch.bfloat16, 2, 2, True), (wide, torch.bfloat16, 1, 1, False)]
    for cfg, dt, B, T, unindexed in cases:
        mla = MLA(cfg, dt)
        ix = mla.indexer
        mla.kv_a_layernorm.weight.data = (torch.rand(cfg.kv_lora_rank, generator=g) + 0.5).to(dt)
        mla.q_a_layernorm.weight.data = (torch.rand(cfg.q_lora_rank, generator=g) + 0.5).to(dt)
        ix.k_norm.weight.data = torch.rand(128, generator=g) + 0.5
        ix.k_norm.bias.data = torch.randn(128, generator=g) * 0.1
        H, P, R, C, Q = mla.H, mla.P, mla.R, mla.C, cfg.q_lora_rank
        mla.w_kb = (torch.randn(H, P, C, generator=g) * 0.05).to(dt)
        a = (torch.randn(B, T, Q + 128 + C + R, generator=g) * 2).to(dt)
        pos = torch.randint(0, 8, (B, 1), generator=g) + torch.arange(T)
        cos, sin = Rotary(cfg).angles(pos)
        caches = [KVCache(cfg, 1, B, 16, device="cpu", dtype=dt, quantized=True).layer(0) for _ in range(2)]
        mla_kv_prologue(mla, caches[0], pos, a, cos, sin)
        n = mla.q_a_layernorm
        _, _, r8, rs = add_rms_norm_quant(a[..., :Q], None, n.weight, n.eps, dt, store_y=False)
        for kv_split in (False, True):  # a token's latent and indexer key in one program, or in two
            caches[1] = KVCache(cfg, 1, B, 16, device="cpu", dtype=dt, quantized=True).layer(0)
            q8, qs = mla_kv_prologue_norm(mla, caches[1], pos, a, cos, sin, dt, kv_split=kv_split)
            for name in ("kv", "kv_scale", "pe", "idx_k", "idx_k_scale"):
                assert same(getattr(caches[0], name), getattr(caches[1], name)), (name, dt, B, T, kv_split)
            assert same(q8, r8) and same(qs, rs), (dt, B, T, kv_split)
        qq = torch.randn(B, T, H * (P + R) + ix.n_heads * 128, generator=g).to(dt)
        q_lat = absorb_q(qq[..., :H * (P + R)].view(B, T, H, P + R)[..., :P], mla.w_kb)
        for index in (True, False) if unindexed else (True,):  # S > top-k; S <= top-k (the q_b output alone)
            x = qq if index else qq[..., :H * (P + R)]
            want = (*mla_q_prologue(mla, x, cos, sin, index=index), q_lat)
            got = mla_q_prologue_absorb(mla, x, cos, sin, index=index)
            for w, o, name in zip(want, got, ("q_pe", "iq8", "iqs", "q_lat")):
                assert (w is None and o is None) if not index and name in ("iq8", "iqs") else same(w, o), \
                    (name, dt, B, T, index)
    _expect_errors("mla_prologue_fused", (
        (lambda: mla_q_prologue_absorb(mla, torch.zeros(1, 65, H * (P + R)), *Rotary(cfg).angles(
            torch.arange(65)[None]), index=False), "tokens 1..64"),))


def _absorb_checks() -> None:
    """The absorbed kv_b projections (fp32: the interpreter's bf16 tl.dot is wrong) on a strided q_nope."""
    from mtp.kernels.absorb import absorb_out, absorb_out_ref, absorb_q, absorb_q_ref

    for B, T, H in ((1, 1, 4), (2, 3, 3), (3, 1, 2), (1, 3, 2)):  # (3, 1): rows of one token, walked by rows' stride
        qq = torch.randn(B, T, H * 192 + 50)
        q_nope = qq[..., :H * 192].view(B, T, H, 192)[..., :128]  # the q_b output's nope channels
        wkb, wvb = torch.randn(H, 128, 512) * 0.05, torch.randn(H, 128, 512) * 0.05
        q_lat = absorb_q(q_nope, wkb)
        assert q_lat.is_contiguous() and _rel(q_lat, absorb_q_ref(q_nope, wkb)) < 1e-6
        o_lat = torch.randn(B, T, H, 512)
        assert _rel(absorb_out(o_lat, wvb), absorb_out_ref(o_lat, wvb)) < 1e-6


def mla_decode_inputs(B: int, T: int, H: int, S: int, kind: str, picks: int, g: torch.Generator):
    """A small `mla_decode` case on the CPU: (q_lat, q_pe, kv8, kv_scale, pe, seq_lens, kwargs) with a cache of S keys,
    random committed lengths (token 0 of row 0 sees one key, so some key splits see none), and per `kind` the
    kwargs: "dense" none, "topk" `picks` top-k positions among the keys each token sees (~20% -1, padding), "vis" a
    random tree visibility mask."""
    from mtp.model.fp8 import act_quant

    q = torch.randn(B, T, H, 512, generator=g)
    qpe = torch.randn(B, T, H, 64, generator=g)
    kv8, kvs = act_quant(torch.randn(B, S, 512, generator=g))
    pe = torch.randn(B, S, 64, generator=g)
    L = torch.randint(0, S - T, (B,), generator=g, dtype=torch.int32)
    L[0] = 0
    kw = {}
    if kind == "topk":
        seen = L.view(B, 1, 1) + torch.arange(T).view(1, T, 1) + 1
        idx = (torch.randint(0, 1 << 20, (B, T, picks), generator=g) % seen).int()
        kw["topk_idx"] = torch.where(torch.rand(B, T, picks, generator=g) < 0.2, -1, idx)
    elif kind == "vis":
        kw["visible"] = torch.rand(B, T, S, generator=g) < 0.6
    return q, qpe, kv8, kvs, pe, L, kw


def _stage2_absorb_checks() -> None:
    """mla_decode's stage 2 with the absorbed output projection (`mla_out.stage2_absorb`) equals stage 2 +
    absorb_out bit for bit (the same wrong bf16 tl.dot of the interpreter on both sides, the same merge): 1..5
    tokens, 1-3 rows, odd head counts, dense / top-k / tree visibility, forced split counts and the default, bf16 and
    fp32 weights, absorb_out's output block and a wider one; and both near the fp32 einsum."""
    from tests.interp import patch_interpreter_bf16_dot, patch_interpreter_loop_bounds

    from mtp.kernels.absorb import absorb_out, absorb_out_ref
    from mtp.kernels.mla_decode import mla_decode

    patch_interpreter_loop_bounds()  # the merge loops over a runtime split count
    patch_interpreter_bf16_dot()  # else the bf16 products are garbage, on both sides alike
    g = torch.Generator().manual_seed(5)
    S = 40
    cases = [(1, 1, 3, None, "dense", torch.bfloat16, None), (3, 1, 2, 3, "topk", torch.bfloat16, None),
             (2, 2, 3, 2, "vis", torch.bfloat16, None), (1, 5, 1, 4, "topk", torch.float32, None),
             (1, 3, 2, 1, "dense", torch.bfloat16, 64), (2, 5, 3, 5, "topk", torch.bfloat16, None)]
    for B, T, H, splits, kind, dt, block_v in cases:
        q, qpe, kv8, kvs, pe, L, kw = mla_decode_inputs(B, T, H, S, kind, 7, g)
        w_vb = (torch.randn(H, 128, 512, generator=g) * 0.05).to(dt)
        lat = mla_decode(q, qpe, kv8, kvs, pe, L, 0.07, out_dtype=dt, splits=splits, **kw)
        want = absorb_out(lat, w_vb)
        got = mla_decode(q, qpe, kv8, kvs, pe, L, 0.07, out_dtype=dt, splits=splits, w_vb=w_vb, block_v=block_v,
                         **kw)
        assert got.dtype == want.dtype and got.shape == (B, T, H, 128), (got.dtype, got.shape)
        assert torch.equal(got, want), (B, T, H, kind, dt, (got.float() - want.float()).abs().max())
        assert _rel(got.float(), absorb_out_ref(lat.float(), w_vb.float())) < 1e-2  # bf16 output's rounding
    for bad in (dict(w_vb=torch.zeros(2, 128, 512)), dict(w_vb=torch.zeros(3, 128, 256, dtype=torch.bfloat16))):
        try:
            mla_decode(q, qpe, kv8, kvs, pe, L, 0.07, out_dtype=torch.bfloat16, **bad)
            raise AssertionError(f"a w_vb of {bad['w_vb'].dtype} {list(bad['w_vb'].shape)} was taken")
        except ValueError as e:
            assert "mla_decode: w_vb must be" in str(e)


def _model_checks() -> None:
    """A tiny fp32 model with every fast-path module installed: the new kernels (switches on; the shared expert
    inside the experts' kernels, which the test sees run) give the old kernels' logits (switches off) within fp32
    summation order, both under the interpreter."""
    import tempfile

    from tests.interp import patch_interpreter_loop_bounds

    from mtp.checkpoint.files import load_model, save_checkpoint
    from mtp.backends.fast_path import FAST_CLASSES, FastBlock, disable_fast_path, install_fast_modules, set_kernels
    from mtp.checkpoint.random_weights import random_tensors
    from mtp.model.presets import tiny_config

    patch_interpreter_loop_bounds()
    cfg = tiny_config()
    path = save_checkpoint(random_tensors(cfg, seed=0), cfg, Path(tempfile.mkdtemp()) / "tiny")
    model = load_model(path, dtype=torch.float32, numerics="fp8")
    ids = torch.randint(0, cfg.vocab_size, (2, 3), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        install_fast_modules(model)
        assert all(isinstance(b, FastBlock) for b in [*model.model.layers, *model.mtp])
        out = {}
        from mtp.model.moe import MoE

        calls = []  # module hooks (mtp-bench counts experts with one) must see the fused block's MoE call too
        hooks = [m.register_forward_pre_hook(lambda mod, inp: calls.append(mod)) for m in model.model.layers.modules()
                 if isinstance(m, MoE)]
        # switch shared_in_experts: the shared expert (stacked with the routed ones: one process, n_shared = 1) runs
        # inside the experts' kernels, so its own module is never called; off, once per MoE forward
        moes = [m for m in model.model.layers.modules() if isinstance(m, MoE)]
        assert all(m.shared_index is not None for m in moes)
        shared_calls = []
        hooks += [m.shared_experts.register_forward_pre_hook(lambda mod, inp: shared_calls.append(mod)) for m in moes]
        for on in (False, True):
            set_kernels(model, gemv=on, norm_quant=on, router=on, prologue=on, absorb=on, shared_in_experts=on)
            cache = model.new_cache(2, 16)
            calls.clear()
            shared_calls.clear()
            out[on] = model(ids, cache).logits
            assert len(calls) == len(moes) > 0, (on, len(calls), len(moes))
            out[on, "decode"] = model(ids[:, :1], cache).logits  # one token: the absorbed, fused block path
            assert len(calls) == 2 * len(moes)
            assert len(shared_calls) == (0 if on else 2 * len(moes)), (on, len(shared_calls))
        for hk in hooks:
            hk.remove()
        assert _rel(out[True, "decode"], out[False, "decode"]) < 1e-5, _rel(out[True, "decode"], out[False, "decode"])
        for on in (False, True):
            set_kernels(model, gemv=on, norm_quant=on, router=on, prologue=on, absorb=on, shared_in_experts=on)
            out[on, "mtp"] = model.mtp_forward(0, ids, torch.randn(2, 3, cfg.hidden_size,
                                                                    generator=torch.Generator().manual_seed(1)),
                                               model.new_cache(2, 16, n_layers=1)).logits
        assert _rel(out[True], out[False]) < 1e-5, _rel(out[True], out[False])
        assert _rel(out[True, "mtp"], out[False, "mtp"]) < 1e-5
        disable_fast_path(model)
        assert not any(isinstance(m, FAST_CLASSES) for m in model.modules()), "disable must restore the classes"
    _fused_prologue_wiring()
    # one rank of a TP=2 model (collectives the identity): the per-rank MLP / expert-parallel MoE paths
    from tests.parallel.test_moe_ep import SumLaterComm

    from mtp.parallel import ParallelPlan
    from mtp.parallel.synthetic import random_parallel_model
    from mtp.model.presets import tiny_parallel_config

    cfg = tiny_parallel_config(world=2)
    comm = SumLaterComm(1, 2)
    comm.all_gather_last = lambda t, out_dtype=None: t.to(out_dtype or t.dtype)  # the local vocabulary's logits
    rank = random_parallel_model(cfg, comm, ParallelPlan(world=2), device="cpu", dtype=torch.float32)
    with torch.no_grad():
        install_fast_modules(rank)
        from mtp.backends.fast_path import FastParallelMLP

        assert any(type(m) is FastParallelMLP and m.fused_gate_up is not None for m in rank.modules())
        out = {}
        for on in (False, True):
            set_kernels(rank, gemv=on, norm_quant=on, router=on, prologue=on, absorb=on, fuse_absorb_out=on,
                        fuse_out_cast=on)
            out[on] = rank(ids, rank.new_cache(2, 16)).logits
        assert _rel(out[True], out[False]) < 1e-5, _rel(out[True], out[False])
        # the fused block under the stand-in's 'nccl': o_proj's partial through a `Pending`, the dense MLP's reduced
        # sum through add_rounded (fp32 here: the wiring; the bf16 rounding is tests/parallel/test_mlp_handoff.py)
        set_kernels(rank, fuse_out_cast=False)
        off = rank(ids, rank.new_cache(2, 16)).logits
        assert torch.equal(off, out[True])


def _fused_prologue_wiring() -> None:
    """A model whose MLA takes the kernels (latent 512, rope 64, 16 indexer heads; fp32, FP8 numerics): its decode
    and verify blocks run the fused prologue launches (counted), and switch fuse_prologue off gives the same logits
    bit for bit, with the indexer's queries (S > top-k 16) and without (S <= 16); absorb off, or more tokens than
    ABSORB_MAX_TOKENS, keeps the q prologue's own launch and absorbs in `mla_attend_fast`."""
    import dataclasses
    import tempfile

    import mtp.backends.fast_path as fp
    from mtp.backends.fast_path import FastMLA, install_fast_modules, set_kernels
    from mtp.checkpoint.files import load_model, save_checkpoint
    from mtp.checkpoint.random_weights import random_tensors
    from mtp.model.presets import tiny_config

    cfg = dataclasses.replace(tiny_config(), kv_lora_rank=512, index_n_heads=16, num_hidden_layers=2,
                              first_k_dense_replace=2, num_nextn_predict_layers=0)
    path = save_checkpoint(random_tensors(cfg, seed=1), cfg, Path(tempfile.mkdtemp()) / "m")
    model = load_model(path, dtype=torch.float32, numerics="fp8")
    install_fast_modules(model)
    assert all(isinstance(layer.self_attn, FastMLA) for layer in model.model.layers)
    calls = {"kv": 0, "q": 0}

    seen_split = set()

    def counted(key, fn):
        def run(*args, **kw):
            calls[key] += 1
            if key == "kv":
                seen_split.add(kw.get("kv_split"))
            return fn(*args, **kw)
        return run

    kv_fn, q_fn = fp.mla_kv_prologue_norm, fp.mla_q_prologue_absorb
    fp.mla_kv_prologue_norm, fp.mla_q_prologue_absorb = counted("kv", kv_fn), counted("q", q_fn)
    g = torch.Generator().manual_seed(2)
    try:
        with torch.no_grad():
            for P, w in ((5, 2), (20, 1)):  # S <= 16: no indexer queries; S > 16: the indexer scores
                prompt = torch.randint(0, cfg.vocab_size, (2, P + w), generator=g)
                cache = model.new_cache(2, P + w + 2)
                model(prompt[:, :P], cache)
                base = cache.seq_lens.clone()
                out = {}
                # kv_split off with absorb off: the kv launch's switch handed over (its bits: _prologue_fused_checks)
                for flags in (dict(fuse_prologue=True), dict(fuse_prologue=False), dict(absorb=False, kv_split=False)):
                    set_kernels(model, **{"fuse_prologue": True, "absorb": True, "kv_split": True, **flags})
                    cache.truncate(base)  # each block writes past the prompt only
                    before = dict(calls)
                    out[tuple(flags.items())] = model(prompt[:, P:], cache, kv_len=P + w).logits
                    fused_kv = 2 if "fuse_prologue" not in flags or flags["fuse_prologue"] else 0  # per layer
                    fused_q = 2 if flags == dict(fuse_prologue=True) else 0
                    assert (calls["kv"] - before["kv"], calls["q"] - before["q"]) == (fused_kv, fused_q), \
                        (P, w, flags, calls, before)
                fused, unfused, no_absorb = out.values()
                assert torch.equal(fused, unfused), (P, w, _rel(fused, unfused))
                assert seen_split == {True, False}, seen_split
                # absorb off: the einsum (not comparable here: the interpreter's bf16 tl.dot is wrong)
                assert torch.isfinite(no_absorb).all()
            fp_max = fp.ABSORB_MAX_TOKENS
            fp.ABSORB_MAX_TOKENS = 1  # a 2-token verify past the absorb kernels: the q prologue's own launch
            try:
                set_kernels(model, fuse_prologue=True, absorb=True)
                cache.truncate(base)  # the last prompt's cache (P = 20, room for 2 more)
                before = dict(calls)
                assert torch.isfinite(model(prompt[:, P - 1:P + 1], cache, kv_len=P + 2).logits).all()
                assert calls["q"] == before["q"] and calls["kv"] == before["kv"] + 2
            finally:
                fp.ABSORB_MAX_TOKENS = fp_max
    finally:
        fp.mla_kv_prologue_norm, fp.mla_q_prologue_absorb = kv_fn, q_fn


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from tests.interp import patch_interpreter_loop_bounds

    patch_interpreter_loop_bounds()  # first: the interpreter's overheads off for every check (results unchanged)
    torch.manual_seed(0)
    if sys.argv[1] == "kernels":
        _gemv_checks()
        _norm_checks()
        _router_checks()
        _prologue_checks()
        _prologue_fused_checks()
        _absorb_checks()
        _stage2_absorb_checks()
    else:
        _model_checks()
    print(f"{sys.argv[1]} ok")
