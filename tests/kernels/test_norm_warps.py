"""The add + RMSNorm + quant kernel's warps (`norm_quant.row_tiles`, option `FastPathOptions.norm_warps`), on the CPU.

The warps set the order of a row's sum of squares, so every launch whose bits must equal another's takes the same
count. Here, with the kernels' launches replaced by recorders (the wrappers take CPU tensors; nothing is computed):
- `add_rms_norm_quant` launches 32 warps by default from 32 groups of 128 (its tile's groups, a power of two: D >
  2048, so every D >= 4096; the TP=8 rank's 7168), 4 below, the count it is given otherwise, and refuses a count
  outside `ROW_WARPS`;
- `FastBlock` hands norm_warps to every norm of a model-width row: the input norm, the post-attention one, and both
  through a `Pending`'s fallback (the hand-off; the fold of the sum's rounding and the cast launch), so the hand-off
  and the unfused block give the same bits at every setting;
- the q_a norm's two launches, `add_rms_norm_quant` alone and inside `mla_prologue_fused`'s kv launch, get the same
  tile and warps wherever that launch takes the row (q_lora <= NORM_MAX_Q): the same bits (the fast path gives the
  unfused q_a norm row_tiles' warps, never norm_warps).
Compiled for sm_90 (triton's own ptxas, no GPU), the kernel at 32 warps holds at most the 64 registers a thread of a
1024-thread program may have, with no spill, at the launches the decode step makes of a row of 7168 and 4096.
The kernel under the interpreter at each count (its sums do not follow the warps there): tests/kernels/
test_fused_kernels.py; on the GPU against the reference and itself: tests/kernels/test_fused_kernels_gpu.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

import mtp.kernels.mla_prologue as mla_prologue
import mtp.kernels.norm_quant as nq
from mtp.kernels.dispatch import FastPathOptions
from mtp.kernels.norm_quant import ROW_WARPS, add_rms_norm_quant, row_tiles


class Launches:
    """Stands in for a Triton kernel: `kernel[grid](*args, **kw)` records (BG, num_warps) and computes nothing."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.seen.append((kw["BG"], kw["num_warps"]))


@pytest.fixture
def launches(monkeypatch) -> Launches:
    """The norm kernel's launches recorded; the wrappers take CPU tensors (their `require` a no-op: TRITON_INTERPRET
    set here would make every kernel module imported from now on an interpreted one, for later tests too)."""
    rec = Launches()
    monkeypatch.setattr(nq, "_add_norm_quant_kernel", rec)
    for module in (nq, mla_prologue):
        monkeypatch.setattr(module, "require", lambda t, name: None)
    return rec


def test_row_tiles_default_is_32_warps_from_32_groups(launches):
    assert [row_tiles(D) for D in (7168, 4096, 2176, 2048, 1536, 256)] == [
        (64, 32), (32, 32), (32, 32), (16, 4), (16, 4), (2, 4)]
    w = torch.ones(7168).bfloat16()
    for D in (7168, 5120, 4096, 2048, 1536):
        add_rms_norm_quant(torch.randn(2, D), torch.randn(2, D).bfloat16(), w[:D], 1e-6)
    add_rms_norm_quant(torch.randn(1, 7168), None, w, 1e-6, num_warps=8)
    assert launches.seen == [(64, 32), (64, 32), (32, 32), (16, 4), (16, 4), (64, 8)]
    for bad in (0, 2, 3, 64, True, 8.0, "8"):
        with pytest.raises(ValueError, match="num_warps must be one of"):
            add_rms_norm_quant(torch.randn(1, 256), None, w[:256], 1e-6, num_warps=bad)


def _block(norm_warps: int, D: int, o_proj_comm=None):
    """A `FastBlock` of width D with stand-ins for the attention (its output: a fixed fraction of its input; with
    o_proj_comm, a row-parallel o_proj over that group) and the FFN (the identity)."""
    from mtp.backends.fast_path import FastBlock
    from mtp.model.layers import RMSNorm
    from mtp.parallel.modules import RowParallelLinear

    class Attn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            if o_proj_comm is not None:
                self.o_proj = RowParallelLinear(128, D, False, torch.bfloat16, o_proj_comm)

        def forward(self, x, *args):
            return x.float() * 0.5  # a partial sum in the accumulation dtype, or the output

    block = FastBlock.__new__(FastBlock)
    torch.nn.Module.__init__(block)
    block.input_layernorm = RMSNorm(D, 1e-6, torch.bfloat16)
    block.post_attention_layernorm = RMSNorm(D, 1e-6, torch.bfloat16)
    block.self_attn, block.mlp = Attn(), torch.nn.Identity()
    block.fast_options = FastPathOptions(norm_warps=norm_warps)
    return block


def test_fast_block_hands_norm_warps_to_every_model_width_norm(launches):
    """norm_warps 0 (row_tiles': 32 at 7168), 8 and 16: both norms of the block, directly and through a `Pending`'s
    fallback (the previous block's FFN sum; o_proj's partial under 'nccl'), with the sum's rounding folded into
    the kernel and as a cast before it, launch the kernel at that count."""
    from mtp.backends.pending import Pending
    from tests.parallel.test_moe_ep import SumLaterComm

    D, B, T = 7168, 1, 2
    comm = SumLaterComm(0, 2)  # all_reduce the identity; no one-shot kernel: each Pending's fallback
    for nw in (0, 8, 16):
        want = nw or row_tiles(D)[1]
        for fold in (True, False):
            for pending, o_proj in ((False, False), (True, True), (True, False), (False, True)):
                launches.seen.clear()
                block = _block(nw, D, comm if o_proj else None)
                block.fast_options.set(fuse_out_cast=fold)
                h = torch.randn(B, T, D)
                if pending:
                    h = Pending(h, torch.randn(B, T, D), torch.bfloat16, comm, fold)
                with torch.no_grad():
                    block(h, None, None, None, None, 4, None, torch.bfloat16)
                assert launches.seen == [(64, want)] * 2, (nw, fold, pending, o_proj, launches.seen)
    assert FastPathOptions().norm_warps == 0 and row_tiles(D)[1] == 32


def test_q_a_norm_launches_agree(monkeypatch, launches):
    """The q_a norm alone (`add_rms_norm_quant`, the fast path's unfused launch, row_tiles' warps) and inside the
    fused kv launch (`mla_kv_prologue_norm`) get the same tile and warps at every q_lora that launch takes, and it
    takes none where row_tiles would give other warps than its own."""
    import dataclasses

    import mtp.kernels.mla_prologue_fused as mpf
    from mtp.model.attention import MLA
    from mtp.model.cache import KVCache
    from mtp.model.layers import Rotary
    from mtp.model.presets import tiny_config

    fused = Launches()
    monkeypatch.setattr(mpf, "_kv_norm_kernel", fused)
    for Q in (128, 512, 1536, mpf.NORM_MAX_Q):
        cfg = dataclasses.replace(tiny_config(), q_lora_rank=Q)
        mla = MLA(cfg, torch.bfloat16)
        a = torch.randn(1, 2, Q + mla.indexer.head_dim + mla.C + mla.R).bfloat16()
        pos = torch.arange(2)[None]
        cos, sin = Rotary(cfg).angles(pos)
        cache = KVCache(cfg, 1, 1, 8, device="cpu", dtype=torch.bfloat16, quantized=True).layer(0)
        n = mla.q_a_layernorm
        add_rms_norm_quant(a[..., :Q], None, n.weight, n.eps, torch.bfloat16, store_y=False)
        mpf.mla_kv_prologue_norm(mla, cache, pos, a, cos, sin, torch.bfloat16)
    assert fused.seen == launches.seen and len(fused.seen) == 4, (fused.seen, launches.seen)
    kv_warps = fused.seen[0][1]
    assert all(row_tiles(Q)[1] == kv_warps for Q in range(128, 8193, 128) if mpf.kv_norm_fits(Q))


def test_norm_compiles_for_hopper_at_32_warps_without_spills():
    """`_add_norm_quant_kernel` for sm_90 at 32 warps (1024 threads: at most 64 registers each), as the decode step
    launches it on a row of 7168 (the input norm: no add; the post-attention norm: a bf16 delta; a `Pending`'s fold:
    an fp32 sum rounded to bf16 in the kernel; PDL) and of 4096: no spill (no stack, no local memory), registers
    within the 64. Measured when written: 46 / 62 / 62 registers at 7168, 32 at 4096, 1 KB of static shared memory
    and 16-32 KB of Triton's scratch for the cross-warp sums (`metadata.shared`)."""
    pytest.importorskip("triton")
    import triton

    from .test_fused_kernels import _compile_for_hopper

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists() and not shutil.which("cuobjdump"):
        pytest.skip("no cuobjdump")
    tool = str(tool) if tool.exists() else "cuobjdump"
    ptrs = dict(h_ptr="*fp32", w_ptr="*bf16", hout_ptr="*fp32", y_ptr="*bf16", x8_ptr="*fp8e4nv", sx_ptr="*fp32")
    # (D, delta's type or None, ROUND): the launches of `FastBlock` and `Pending.add_norm`
    for D, delta, rnd in ((7168, None, 2), (7168, "*bf16", 2), (7168, "*fp32", 0), (4096, "*fp32", 0)):
        bg, warps = row_tiles(D)
        assert warps == 32
        consts = dict(ADD=delta is not None, STORE_H=delta is not None, STORE_Y=True, QUANT=True, BG=bg, PDL=1,
                      ROUND=rnd)
        k = _compile_for_hopper(nq._add_norm_quant_kernel, dict(ptrs, d_ptr=delta or "*fp32"), consts,
                                num_warps=warps, aligned=("stride_h",))
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
        use = {name: int(n) for name, n in re.findall(r"(REG|STACK|LOCAL|SHARED):(\d+)", res)}
        assert use.get("STACK") == 0 and use.get("LOCAL") == 0, (D, delta, res)
        assert 0 < use["REG"] <= 64, (D, delta, res)
        print(f"D={D} delta={delta}: {use}, Triton's shared {k.metadata.shared} B")


def test_row_warps_are_the_options():
    """The counts the kernel takes are the option's (besides 0, row_tiles' choice)."""
    assert ROW_WARPS == (4, 8, 16, 32) and all(FastPathOptions(norm_warps=n).norm_warps == n for n in (0, *ROW_WARPS))
