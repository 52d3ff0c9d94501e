"""The indexer's head-weights kernel (`mtp.kernels.index_weights`) against its torch reference on the CPU: the plan,
the reference's contract, and the kernel under the Triton interpreter (a subprocess started with TRITON_INTERPRET=1,
this file as a script: the interpreter is chosen when the kernels are decorated), with the fast path's wiring.

Tolerance (`bound`): both sides sum the same fp32 products (exact for bf16 x bf16) in different orders, and an
order's rounding error is at most depth * 2^-24 * sum_k |x_k w_k| to first order. For these random-sign terms it
stays near a few units (measured here: <= 2.5 * 2^-24 * sum |x w| at K = 7168, N = 1..64, bf16 and fp32); 2^-18
(64 units) leaves 25x, while rounding an fp32 x to bf16 (2^-9 per product) costs ~700 units at the median
and ~4000 at the worst element, so a kernel that lost x's or W's low bits fails. Integer-valued inputs have exact
sums in any order: there the kernel must equal the reference bit for bit (any indexing or masking slip shows).
tests/kernels/test_index_weights_gpu.py holds the kernel to the reference on a GPU (and in a CUDA graph).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`
from tests.interp import interpreted_main, run_interpreted  # noqa: E402

H, DK, K = 64, 128, 7168  # DeepSeek-V3.2's indexer heads, head dim, hidden size
SCALE = H ** -0.5 * DK ** -0.5


def bound(x: torch.Tensor, w_HK: torch.Tensor, scale: float) -> torch.Tensor:
    """The elementwise tolerance of the module docstring: 2^-18 * sum_k |x_k w_k| * |scale|."""
    return 2.0 ** -18 * (x.double().abs().reshape(-1, x.shape[-1]) @ w_HK.double().abs().T).reshape(
        *x.shape[:-1], w_HK.shape[0]) * abs(scale)


def assert_within(name: str, got: torch.Tensor, want: torch.Tensor, tol: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == torch.float32, (name, got.shape, want.shape, got.dtype)
    d = (got.double() - want.double()).abs()
    bad = d > tol
    assert not bad.any(), (f"{name}: {int(bad.sum())} of {d.numel()} outside the bound; worst at "
                           f"{torch.nonzero(d / tol == (d / tol).max())[:3].tolist()}: |diff| / bound "
                           f"{(d / tol).max().item():.2f}")


def test_plan_keeps_64_to_128_programs_and_one_chunk():
    """Every row count gets a tile whose accumulators fit a lane (BM x BH <= 32), one chunk of K for a bf16 K of
    7168 (all of a program's loads at once), and 64..128 programs up to 64 rows (the weight spread over many SMs)."""
    pytest.importorskip("triton")
    from mtp.kernels.index_weights import index_weights_plan

    for N in range(1, 257):
        bm, bh, kv, nw = index_weights_plan(N, H, K, 8)
        progs = -(-H // bh) * -(-N // bm)
        assert bm * bh <= 32 and kv * 8 >= K and kv <= 1024 and nw == 16, (N, bm, bh, kv, nw)
        assert N > 64 or 64 <= progs <= 128, (N, bm, bh, progs)
        assert N > 4 or (bh == 1 and bm >= N), (N, bm, bh)
    assert index_weights_plan(1, 16, 1024, 8)[:2] == (1, 1)  # the test models' 16 heads
    assert index_weights_plan(8, H, K, 4)[2:] == (512, 8)  # fp32: 4 chunks of 512 vectors of 4, 8 warps


def test_reference_is_the_indexers_contract():
    """`Indexer.select` takes F.linear(x, W) * H^-0.5 in fp32 and applies Dk^-0.5 in its score einsum; the
    reference folds both factors (as the fast path does): one rounding apart."""
    from mtp.kernels.index_weights import index_weights_ref

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 256, generator=g).bfloat16()
    w = (torch.randn(16, 256, generator=g) * 0.02).bfloat16()
    sel = torch.nn.functional.linear(x.float(), w.float()) * 16 ** -0.5 * DK ** -0.5
    got = index_weights_ref(x, w, 16 ** -0.5 * DK ** -0.5)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 16)
    assert ((got - sel).abs() <= 2 * 2.0 ** -24 * sel.abs()).all()


def test_kernel_compiles_for_hopper_without_spills():
    """Compiled for sm_90 on the CPU (triton's ptxas) at the plans of 1, 8 and 64 rows (bf16) and 64 (fp32): no
    spill to local memory, and shared memory only for the final cross-warp sum (at most 4 barriers): the x and W
    tiles load in the layout they multiply in (K across the lanes), not shuffled through shared memory."""
    pytest.importorskip("triton")
    import re
    import shutil
    import subprocess
    import tempfile

    import triton

    from mtp.kernels.index_weights import _index_weights_kernel, index_weights_plan

    from .test_fused_kernels import _compile_for_hopper

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists() and not shutil.which("cuobjdump"):
        pytest.skip("no cuobjdump")
    tool = str(tool) if tool.exists() else "cuobjdump"
    # PDL (switch `pdl`): W's chunk loaded before the wait up to 32 rows, after it from 33 (it spilled first)
    for N, dt, pdl in ((1, "bf16", False), (8, "bf16", False), (64, "bf16", False), (64, "fp32", False),
                       (8, "bf16", True), (64, "bf16", True)):
        vec = 8 if dt == "bf16" else 4
        bm, bh, kv, nw = index_weights_plan(N, H, K, vec)
        k = _compile_for_hopper(_index_weights_kernel, dict(x_ptr=f"*{dt}", w_ptr=f"*{dt}", scale="fp32"),
                                dict(H=H, K=K, BM=bm, BH=bh, KV=kv, VEC=vec, PDL=pdl), num_warps=nw,
                                aligned=("stride_x", "stride_w"))
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
            sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
        use = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", res))
        assert use.get("STACK") == "0" and use.get("LOCAL") == "0", (N, dt, pdl, res)
        assert 0 < sass.count("BAR.SYNC") <= 4, (N, dt, pdl, sass.count("BAR.SYNC"))


def test_index_weights_interpreted():
    run_interpreted(__file__, 600)


# ----------------------------------------------------------------------------- run under TRITON_INTERPRET=1
def _kernel_checks() -> None:
    from mtp.kernels.index_weights import index_weights, index_weights_ref

    g = torch.Generator().manual_seed(0)

    def ints(*shape, dtype=torch.bfloat16):  # exact products and sums (|sum| <= 16 K < 2^24) in any order
        return torch.randint(-4, 5, shape, generator=g).to(dtype)

    # (x's shape, H): the model's at each branch of the plan (4 x 1; 4 x 2; 4 x 4; 8 x 4), odd K (a
    # vector's tail masked) with heads not a power of two, a [B, T, K] block of the test models' 16 heads
    for xs, h in [((3, K), H), ((8, K), H), ((24, K), H), ((64, K), H), ((13, 1003), 24), ((2, 3, 1024), 16)]:
        x, w = ints(*xs), ints(h, xs[-1])
        got = index_weights(x, w, SCALE)
        assert torch.equal(got, index_weights_ref(x, w, SCALE)), f"integer inputs {xs} H={h}"
    assert torch.equal(index_weights(x, w, SCALE), got), "two calls differ"
    for dt, rows in ((torch.bfloat16, (1, 2, 8, 32)), (torch.float32, (1, 64))):  # the bf16 model, the fp32 one
        w = (torch.randn(H, K, generator=g) * 0.02).to(dt)
        for N in rows:
            x = (torch.randn(N, K, generator=g) * torch.logspace(-3, 1, K)).to(dt)
            assert_within(f"{dt} N={N}", index_weights(x, w, SCALE), index_weights_ref(x, w, SCALE),
                          bound(x, w, SCALE))
    # an fp32 x keeps its low bits: 1 + 2^-8 is no bf16 (it rounds to 1), and K of them sum exactly in fp32
    x = torch.full((2, K), 1 + 2.0 ** -8)
    got = index_weights(x, torch.ones(H, K).bfloat16(), 1.0)
    assert torch.equal(got, torch.full((2, H), K * (1 + 2.0 ** -8))), got[0, :4]
    # float64 x is rounded to fp32 on load, as x.float() (summed 2 a vector, not 4: another order); a row
    # stride > K is read in place
    x = torch.randn(5, K + 16, generator=g, dtype=torch.float64)[:, :K]
    w = (torch.randn(H, K, generator=g) * 0.02).float()
    assert_within("float64 x", index_weights(x, w, SCALE), index_weights_ref(x, w, SCALE), bound(x, w, SCALE))
    # (the same fp32 values in the same order: x64 with w32 and x32 with w64, both loaded 2 a vector)
    assert torch.equal(index_weights(x, w, SCALE), index_weights(x.float(), w.double(), SCALE)), "fp64 x rounding"
    xb = torch.randn(5, K + 64, generator=g).bfloat16()[:, 8:K + 8]
    assert torch.equal(index_weights(xb, w.bfloat16(), SCALE), index_weights(xb.contiguous(), w.bfloat16(), SCALE))
    assert index_weights(torch.zeros(0, K).bfloat16(), w, SCALE).shape == (0, H)
    for bad, err, match in [
        (lambda: index_weights(xb, w[0], SCALE), ValueError, r"weight_HK \[7168\]"),
        (lambda: index_weights(xb[:, :100], w, SCALE), ValueError, r"got x \[5, 100\]"),
        (lambda: index_weights(xb.int(), w, SCALE), TypeError, "must be one of"),
    ]:
        with pytest.raises(err, match=match):
            bad()


def _wiring_checks() -> None:
    """The fast path's head weights (`fast_path.indexer_head_weights`) on a model the MLA kernels accept: the
    kernel on `weights_proj.weight` with H^-0.5 * Dk^-0.5 (switch on), the old fp32 linear (off), both within the
    bound of the reference formula; no per-layer copy of the weight is made."""
    from mtp.backends.fast_path import FastMLA, indexer_head_weights, install_fast_modules, set_kernels
    from mtp.checkpoint.synthetic import random_model
    from mtp.kernels.index_weights import index_weights_ref
    from mtp.model.presets import gpu_test_config

    model = random_model(gpu_test_config(layers=1, mtp_modules=0), "cpu", torch.bfloat16, seed=0)
    install_fast_modules(model)
    mla = model.model.layers[0].self_attn
    assert isinstance(mla, FastMLA) and not mla.mm_fp32  # (cuBLAS's bf16 -> fp32 mm: a CUDA build only)
    W, ix = mla.indexer.weights_proj.weight, mla.indexer
    x = torch.randn(2, 3, W.shape[1], generator=torch.Generator().manual_seed(1)).bfloat16()
    scale = ix.n_heads ** -0.5 * ix.head_dim ** -0.5
    ref = index_weights_ref(x, W, scale)
    for on in (True, False):
        set_kernels(model, index_weights=on)
        assert_within(f"fast path, index_weights={on}", indexer_head_weights(mla, x), ref, bound(x, W, scale))
    big = [n for n, t in vars(mla).items() if isinstance(t, torch.Tensor) and t.numel() >= W.numel()]
    assert set(big) <= {"w_kb", "w_vb"}, big  # the absorbed kv_b copies only


if __name__ == "__main__":
    interpreted_main([_kernel_checks, _wiring_checks], seed=None)
