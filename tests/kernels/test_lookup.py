"""The decode forward's glue in one launch each (`mtp.kernels.lookup`, `elementwise.rms_norm_pair`) and the fast
modules that run them (`fast_path.FastRotary`, `FastVocabParallelEmbedding`, `FastMTPLayer`; switches rope_table,
tree_fwd_glue, vocab_embed, mtp_norms): the same bits as the torch ops they replace, on the CPU.

Shape legend: B rows, T tokens, D width, Vl a rank's vocabulary rows, P table positions, R/2 rotary pairs.

- In-process: the switches (on by default) and their bench variants; a CPU without the interpreter keeps the torch ops.
- Under the Triton interpreter (a subprocess, this file as a script):
  - embed_rows torch.equal to the vocabulary-parallel lookup (ids inside, below and past the rank's rows, [B, T]
    strided ids and [N] ids, bf16 and fp32 rows); rope_slots to `Rotary.slots` (the table made by `Rotary.angles`);
    tree_slots to `Rotary.tree_slots` (B 1 and 3, rows of different first slots, odd T / U / S, slots past the tree,
    depths [T] and [B, T], masks [T, U], [B, T, U] and strided slices of a tree's ancestor mask);
    rms_norm_pair to the cat of two Triton rms_norm calls (odd widths, strided rows, bf16 / fp32 in and out);
  - the fast modules on a tiny model: `FastRotary.slots` equal to the reference's at any bound from one table of every
    position (the memory planner's bytes), the reference's launches without a bound or past max_positions;
    `FastRotary.tree_slots` likewise (one launch; the torch ops with tree_fwd_glue or rope_table off);
    `FastMTPLayer.eh_input` equal to the reference's; a simulated rank's `FastVocabParallelEmbedding` equal to the
    reference's; each switch off taking the torch ops.
Whole steps with every switch on and off (the same decode buffers and caches): tests/bench/test_step_launches.py; GPU
twin: tests/backends/test_glue_gpu.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`
from tests.interp import interpreted_main, run_interpreted  # noqa: E402


def test_switches_are_on_by_default_with_bench_variants():
    from mtp.bench.rank import KERNEL_VARIANTS
    from mtp.kernels.dispatch import FastPathOptions

    o = FastPathOptions()
    names = ("step_commit", "rope_table", "vocab_embed", "mtp_norms")
    assert all(getattr(o, n) for n in names)
    for n in names:
        assert KERNEL_VARIANTS[f"{n}_off"][0] == {n: False}
    assert KERNEL_VARIANTS["glue_off"][0] == {n: False for n in names}
    assert o.glue_pdl and KERNEL_VARIANTS["glue_pdl_off"][0] == {"glue_pdl": False}  # the glue's PDL (session 22)
    assert o.tree_fwd_glue and KERNEL_VARIANTS["tree_fwd_glue_off"][0] == {"tree_fwd_glue": False}  # session 23


def test_cpu_tensors_keep_the_torch_ops():
    from mtp.kernels.lookup import embed_takes, rope_takes, tree_takes

    if os.environ.get("TRITON_INTERPRET") != "1":
        assert not embed_takes(torch.zeros(2, 3, dtype=torch.long), torch.zeros(8, 4))
        assert not rope_takes(torch.zeros(2, dtype=torch.long))
        assert not tree_takes(torch.zeros(2, dtype=torch.long), torch.zeros(3, dtype=torch.long),
                              torch.ones(3, 3, dtype=torch.bool))


def _hopper_ptx(kernel, types: dict, consts: dict, num_warps: int) -> str:
    """PTX of `kernel` for sm_90 (triton's own compiler, no GPU) as the elementwise kernels launch (no FMA contraction);
    arguments not in `types` are i32."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, enable_fp_fusion=False)).asm["ptx"]


def test_kernels_compile_for_hopper_and_the_norm_pair_is_rms_norms_code():
    """The four kernels compile for sm_90 at the real widths, no local-memory spill: the embedding lookup on bf16 rows,
    the slots + angles gather (a chain's and a tree's, with its visibility), the norm pair at D = 7168 (BLOCK_D 8192,
    8 warps as `rms_norm`'s). With PDL (switch glue_pdl; the gathers and the embedding trigger at their start,
    PDL_EARLY, the pair after its wait, PDL_AFTER_WAIT)
    each waits before its first global load or store (`test_pdl._order`: every row they read depends on an earlier
    kernel's output). The pair's float instructions (products, sums, shuffles of the row's reduction, rsqrt) are, per
    half, `_rms_norm_kernel`'s in the same order: the same sums, so the same bits (the GPU test compares them)."""
    import re

    import pytest

    pytest.importorskip("triton")
    from mtp.kernels.elementwise import _rms_norm_kernel, _rms_norm_pair_kernel
    from mtp.kernels.lookup import EMBED_BLOCK, VIS_BLOCK, _embed_kernel, _rope_slots_kernel, _tree_slots_kernel
    from tests.kernels.test_pdl import _order

    f32 = dict(inv_d="fp32", eps="fp32", eps_a="fp32", eps_b="fp32")
    ptx = {
        "embed": _hopper_ptx(_embed_kernel, dict(ids_ptr="*i64", w_ptr="*bf16", out_ptr="*bf16"),
                             dict(BLOCK=EMBED_BLOCK, PDL=1), 4),
        "rope": _hopper_ptx(_rope_slots_kernel, dict(lens_ptr="*i64", pos_ptr="*i64", cos_tab_ptr="*fp32",
                                                     sin_tab_ptr="*fp32", cos_ptr="*fp32", sin_ptr="*fp32"),
                            dict(BLOCK_R=32, PDL=1), 1),
        "tree": _hopper_ptx(_tree_slots_kernel, dict(lens_ptr="*i64", depth_ptr="*i64", mask_ptr="*u8", pos_ptr="*i64",
                                                     cos_tab_ptr="*fp32", sin_tab_ptr="*fp32", cos_ptr="*fp32",
                                                     sin_ptr="*fp32", vis_ptr="*u8"),
                            dict(BLOCK_R=32, BLOCK_S=VIS_BLOCK, PDL=1), 4),
        "pair": _hopper_ptx(_rms_norm_pair_kernel, dict(a_ptr="*bf16", wa_ptr="*bf16", b_ptr="*bf16", wb_ptr="*bf16",
                                                        y_ptr="*bf16", **f32), dict(BLOCK_D=8192, PDL=2), 8),
        "single": _hopper_ptx(_rms_norm_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", **f32),
                              dict(BLOCK_D=8192, PDL=2), 8)}
    assert not [k for k, p in ptx.items() if ".local" in p]
    gdc = ["griddepcontrol.launch_dependents", "griddepcontrol.wait"]
    orders = {k: _order(ptx[k]) for k in ("embed", "rope", "tree", "pair")}
    assert orders["embed"][:2] == orders["rope"][:2] == orders["tree"][:2] == gdc and orders["pair"][:2] == gdc[::-1], \
        {k: o[:4] for k, o in orders.items()}
    assert all(o.count("griddepcontrol.wait") == 1 for o in orders.values()), orders

    def float_ops(p: str) -> list[str]:
        return [ln.split()[0] for ln in p.splitlines() if re.match(r"\s+(add|mul|fma|sub)[\w.]*\.f32|\s+(rsqrt|shfl)", ln)]

    single, pair = float_ops(ptx["single"]), float_ops(ptx["pair"])
    assert len(single) > 100 and pair == single + single, (len(single), len(pair))


def test_lookup_kernels_interpreted():
    run_interpreted(__file__, 300, "kernels")


def test_fast_modules_interpreted():
    run_interpreted(__file__, 300, "modules")


# ----------------------------------------------------------------------------- run under TRITON_INTERPRET=1
def _kernel_checks() -> None:
    from mtp.kernels import elementwise as E
    from mtp.kernels.lookup import embed_rows, embed_rows_ref, rope_slots, rope_slots_ref, tree_slots, tree_slots_ref
    from mtp.model.layers import Rotary
    from mtp.model.presets import tiny_config
    from mtp.spec.tree_shape import TreeShape

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        w = torch.randn(37, 1100, generator=g).to(dtype)  # two column blocks, the second partial
        start = 40
        ids = torch.randint(0, 120, (3, 9), generator=g)  # below, inside and past [40, 77)
        ids[0, :3] = torch.tensor([start - 1, start, start + 36])
        for x in (ids, ids[:, ::2], ids.t(), ids[1]):
            got = embed_rows(x, w, start)
            want = embed_rows_ref(x, w, start)
            assert got.dtype == want.dtype and torch.equal(got, want), (dtype, x.shape)
            assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))  # +0.0 zeros
    rot = Rotary(tiny_config())
    cos_t, sin_t = rot.angles(torch.arange(300).unsqueeze(0))
    for lens, T in (([0, 5, 250], 4), ([17], 1), ([3, 290], 9)):
        sl = torch.tensor(lens)
        got, want = rope_slots(sl, T, cos_t[0], sin_t[0]), rope_slots_ref(sl, T, rot.inv_freq)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (lens, T)
        assert all(torch.equal(a, b) for a, b in zip(got, rot.slots(sl, T)))
    # a tree forward's: U - T earlier tree slots (a drafter's later depth) or none (a verify); S past the last slot
    anc = TreeShape.from_branching((2, 1, 1)).ancestor_mask()  # 7 nodes
    depth_N = anc.sum(1) - 1
    cases = ((anc, depth_N, [4], 12),  # B = 1, a verify (U = T = 7), 1 slot past the tree
             (anc[3:5, 1:5], depth_N[3:5] - 1, [9, 30, 250], 263),  # strided slices of the mask, as the proposer's
             (torch.rand(3, 3, 5, generator=g) < 0.5, torch.randint(0, 3, (3, 3), generator=g), [2, 120, 17], 299))
    for mask, depth, lens, S in cases:
        sl, T = torch.tensor(lens), mask.shape[-2]
        got = tree_slots(sl, T, depth, mask, S, cos_t[0], sin_t[0])
        want = tree_slots_ref(sl, T, depth, mask, S, rot.inv_freq)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (lens, T, S)
        assert all(torch.equal(a, b) for a, b in zip(got, rot.tree_slots(sl, T, depth, mask, S)))
    for D, lead, dt, out in ((64, (2, 3), torch.float32, torch.float32), (200, (5,), torch.bfloat16, torch.bfloat16),
                             (256, (1, 4), torch.bfloat16, torch.float32)):
        a = torch.randn(*lead, D, generator=g).to(dt)
        b = torch.randn(*lead, 2 * D, generator=g).to(dt)[..., ::2]  # strided rows: read in place (or copied) alike
        wa, wb = torch.rand(D, generator=g).to(dt) + 0.5, torch.rand(D, generator=g).to(dt) + 0.5
        got = E.rms_norm_pair(a, wa, 1e-6, b, wb, 2e-6, out)
        want = torch.cat((E.rms_norm(a, wa, 1e-6, out), E.rms_norm(b, wb, 2e-6, out)), -1)
        assert got.shape == want.shape and torch.equal(got, want), (D, lead, dt, out)
    assert not E.rms_norm_pair_takes(torch.zeros(2, 8), torch.ones(8), torch.zeros(3, 8), torch.ones(8), torch.float32)
    print("kernel checks ok")


def _module_checks() -> None:
    import dataclasses

    from mtp.backends import fast_path as fp
    from mtp.checkpoint.synthetic import random_model
    from mtp.kernels import lookup
    from mtp.kernels.dispatch import FastPathOptions
    from mtp.model.layers import Rotary
    from mtp.model.presets import tiny_config
    from mtp.parallel.layout import ParallelPlan
    from mtp.parallel.modules import VocabParallelEmbedding
    from mtp.parallel.simulate import simulated_rank
    from mtp.parallel.synthetic import random_parallel_model

    launches = []
    for name in ("_rope_slots_kernel", "_embed_kernel", "_tree_slots_kernel"):
        kernel = getattr(lookup, name)

        class Counted:
            def __getitem__(self, grid, kernel=kernel, name=name):
                launches.append(name)
                return kernel[grid]

        setattr(lookup, name, Counted())
    cfg = dataclasses.replace(tiny_config(), max_position_embeddings=9000)
    model = random_model(cfg, "cpu", torch.bfloat16, seed=0)
    ref = Rotary(cfg)
    fp.install_fast_modules(model, options=FastPathOptions())
    fp.set_elementwise(model, "triton")
    rot = model.rotary
    assert isinstance(rot, fp.FastRotary)
    lens = torch.tensor([3, 4000, 4090])
    for bound, T in ((4094, 4), (8000, 2), (4094, 4), (9000, 1)):
        launches.clear()
        got, want = rot.slots(lens, T, bound), ref.slots(lens, T)
        assert all(torch.equal(a, b) for a, b in zip(got, want)) and launches == ["_rope_slots_kernel"], bound
    # one table, of every position, whatever the bounds: never outgrown, and what the memory planner counts
    (cos, sin), = rot.rope_tables.values()
    assert cos.shape == sin.shape == (9000, cfg.qk_rope_head_dim // 2)
    assert cos.nbytes + sin.nbytes == Rotary.angle_table_bytes(cfg)
    for bound, opts in ((None, FastPathOptions()), (9001, FastPathOptions()), (10, FastPathOptions(rope_table=False))):
        rot.fast_options = opts
        launches.clear()
        got = rot.slots(lens, 2, bound)
        assert all(torch.equal(a, b) for a, b in zip(got, ref.slots(lens, 2))) and not launches, bound
    # a tree forward's slots, angles and visibility: one launch, the torch ops with either switch off or past the table
    anc = torch.ones(3, 5, dtype=torch.bool).tril(2)
    depth = torch.tensor([1, 2, 2])
    want = ref.tree_slots(lens, 3, depth, anc, 4100)
    for bound, opts, n in ((4100, FastPathOptions(), 1), (4100, FastPathOptions(tree_fwd_glue=False), 0),
                           (4100, FastPathOptions(rope_table=False), 0), (9001, FastPathOptions(), 0)):
        rot.fast_options = opts
        launches.clear()
        got = rot.tree_slots(lens, 3, depth, anc, bound)
        assert all(torch.equal(a[..., :4100], b) for a, b in zip(got, want)) and len(launches) == n, (bound, opts)
    rot.fast_options = model.fast_options
    # an MTP module's norms: one launch with the switch, the reference's three without
    layer = model.mtp[0]
    assert isinstance(layer, fp.FastMTPLayer) and fp.reference_class(type(layer)).__name__ == "MTPLayer"
    g = torch.Generator().manual_seed(1)
    e = torch.randn(2, 3, cfg.hidden_size, generator=g).bfloat16()
    h = torch.randn(2, 3, cfg.hidden_size, generator=g).bfloat16()
    want = torch.cat((layer.enorm(e, torch.bfloat16), layer.hnorm(h, torch.bfloat16)), -1)
    for opts in (FastPathOptions(), FastPathOptions(mtp_norms=False)):
        layer.fast_options = opts
        assert torch.equal(layer.eh_input(e, h, torch.bfloat16), want)
    # a vocabulary-parallel rank's embedding
    tcfg = dataclasses.replace(tiny_config(), num_attention_heads=8, intermediate_size=512)
    with simulated_rank(2, 1) as comm:
        rank = random_parallel_model(tcfg, comm, ParallelPlan(2), device="cpu", dtype=torch.bfloat16)
        fp.install_fast_modules(rank)
        emb = rank.model.embed_tokens
        assert isinstance(emb, fp.FastVocabParallelEmbedding) and emb.vocab_start > 0
        ids = torch.randint(0, tcfg.vocab_size, (2, 7), generator=g)
        want = VocabParallelEmbedding.forward(emb, ids)
        for opts, n in ((FastPathOptions(), 1), (FastPathOptions(vocab_embed=False), 0)):
            emb.fast_options = opts
            launches.clear()
            assert torch.equal(emb(ids), want) and launches.count("_embed_kernel") == n
        fp.disable_fast_path(rank)
        assert type(rank.model.embed_tokens) is VocabParallelEmbedding and type(rank.rotary) is Rotary
    print("module checks ok")


if __name__ == "__main__":
    interpreted_main({"kernels": _kernel_checks, "modules": _module_checks})
