"""Switch `FastPathOptions.moe_down_nb` on the GPU (pytest -m gpu): the experts' down projection by output block,
every expert of the call in one pipelined loop, y stored directly (`moe.moe_experts(down_nb=True)`,
`mtp.kernels.moe_down_nb`).
Not the switch off's bits (another fp32 sum order): held to it and to `moe_experts_ref` at the tolerance of fp32
reordering (`test_moe_grouped.TOL`: 1e-5 relative, the norm over the output), and to the float64 reference within the
expert kernels' fp8-flip bound (`test_kernels_gpu.moe_flip_bound`, as `test_moe_experts_shared_slot` holds them);
torch.equal where the bits must not move:
- at a TP=8 'split' rank's shapes (256 routed slices + the shared one, 256 wide, D = 7168; 8 routed + the shared slot
  per token) at 1..4 tokens: random routings, -1 slots, experts repeated across tokens; the step's call (item_regs,
  x8, 'waves' slices, TMA where the GPU has it) without PDL and with it (the trigger at the start and after the
  wait); every tile (BN 32 / 64 / 128, one or two K groups an iteration: one or two the same bits), TMA the same bits
  as pointer tiles; without the shared slot, with add;
- batch invariance: a token's row alone (T = 1) bit-identical to its row among others (T = 4, each position, other
  tokens different), for the kernel alone (`moe_down_nb.down_nb` on gate/up's h) at every tile and with TMA, and end
  to end with the gate/up K slices fixed;
- in a CUDA graph of two chained calls (as two MoE layers), PDL on and off, replayed 8 times with new inputs and
  routings copied in, against eager calls;
- D not a multiple of BN (the kernel alone, D = 7136), and a contiguous rank's full-width experts (32 of 256, I = 2048:
  16 K groups an expert);
- option moe_down_pf_experts (`moe_experts(down_pf_experts=)`: the plan from the router's ids and the first experts'
  rows asked of L2 before the down kernel's PDL wait) with and without gate/up's trigger after its wait
  (gate_up_after_wait): in a CUDA graph of two chained layers, each the router kernel then the experts, as the step
  launches them with PDL (the trigger at the start and after the wait), replayed with new inputs: the same bits as
  the option off, with and without the shared slot.
CPU twin (the interpreter, the sm_90 code's structure): tests/kernels/test_moe_down_nb.py.
MTP_TEST_DEVICE=cpu with TRITON_INTERPRET=1 dry-runs these on the CPU (slow).
"""

from __future__ import annotations

import os

import pytest
import torch

from mtp.kernels import available

pytestmark = pytest.mark.gpu
DEV = os.environ.get("MTP_TEST_DEVICE", "cuda")
if not (available() or (DEV == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")):
    pytest.skip("needs triton and a CUDA device", allow_module_level=True)

from mtp.kernels.act_quant import act_quant  # noqa: E402
from mtp.kernels.moe import has_tma, moe_experts, weight_desc  # noqa: E402
from mtp.kernels.moe_down_nb import DOWN_NB_ROWS, down_nb  # noqa: E402

from .test_fused_kernels_gpu import split_rank_weights  # noqa: E402
from .test_kernels_gpu import local_ids, moe_flip_bound, poison, stacked  # noqa: E402
from .test_moe_down_nb import TOL, _rel, down_ref, down_stack  # noqa: E402
from .test_moe_items_gpu import _routings  # noqa: E402

TILES = [(rows, groups) for rows in DOWN_NB_ROWS for groups in (1, 2)]
# A 32-row tile is below wgmma's 64-row M: its FP8 dot compiles to mma.sync, which accumulates in full fp32 where
# wgmma's FP8 accumulation keeps fewer mantissa bits (DeepSeek-V3's report: ~14): on an H200 (session 20) the 32-row
# tiles differ from the 64 / 128-row ones by 2.0-2.2e-4 relative, and a 64-row tile from the float64 sum by 1.3e-4.
# Tiles of different instructions, and a kernel against the float64 sum, are held to this; the same instruction in
# another fp32 order to TOL.
ACC_TOL = 1e-3
TMA = DEV == "cuda" and has_tma(torch.device(DEV))


@pytest.fixture(scope="module")
def split_stack():
    return split_rank_weights()  # 1.4 GB of FP8, once for the file


def _with_shared(ids: torch.Tensor, w: torch.Tensor, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing with the shared expert S as an explicit last slot of weight 1 (the references' form)."""
    T = ids.shape[0]
    return (torch.cat([ids, torch.full((T, 1), S, dtype=torch.int32, device=ids.device)], 1),
            torch.cat([w, torch.ones(T, 1, device=w.device)], 1))


@pytest.mark.parametrize("pdl", [0, 1, 2])
@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_down_nb_split_rank(split_stack, T, pdl):
    st = split_stack
    S = st[0].shape[0] - 1
    g = torch.Generator(device=DEV).manual_seed(60 * T + pdl)
    x = torch.randn(T, st[0].shape[2], device=DEV, generator=g).bfloat16()
    w = torch.rand(T, 8, device=DEV, generator=g)
    kw = dict(out_dtype=torch.float32, layout="persistent", shared=True, pdl=pdl, item_regs=True, splits="waves",
              xq=act_quant(x), tma=TMA)
    for name, ids in _routings(T, S, 8, g).items():
        poison()
        off = moe_experts(x, ids, w, *st, **kw)
        on = moe_experts(x, ids, w, *st, down_nb=True, **kw)
        assert _rel(on, off) < TOL, (name, _rel(on, off))
        y64, bound = moe_flip_bound(x, *_with_shared(ids, w, S), *st)
        slack = bound + 2e-3 * y64.abs().max()
        for label, y in (("down_nb", on), ("off", off)):
            err = (y.double() - y64).abs()
            assert bool((err <= slack).all()), f"{name} {label}: {int((err > slack).sum())} beyond the fp8-flip bound"
        if pdl == 0:  # every tile within reordering of the default; one or two groups an iteration the same bits
            by_tile = {}
            for tile in TILES:
                poison()
                by_tile[tile] = moe_experts(x, ids, w, *st, down_nb=True, down_tile=tile, **kw)
                tol = TOL if tile[0] >= 64 else ACC_TOL
                assert _rel(by_tile[tile], on) < tol, (name, tile, _rel(by_tile[tile], on))
            for rows in DOWN_NB_ROWS:
                assert torch.equal(by_tile[(rows, 1)], by_tile[(rows, 2)]), (name, rows)
            if TMA:
                for tile in ((64, 2), (128, 1), (32, 2)):
                    ptr = moe_experts(x, ids, w, *st, down_nb=True, down_tile=tile, **dict(kw, tma=False))
                    assert torch.equal(by_tile[tile], ptr), (name, tile, "tma")


@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_down_nb_without_shared_slot(split_stack, T):
    """The shared expert apart (its output as add, after the routed sum); -1 slots, a token with none routed here."""
    st = split_stack
    S = st[0].shape[0] - 1
    g = torch.Generator(device=DEV).manual_seed(70 + T)
    x = torch.randn(T, st[0].shape[2], device=DEV, generator=g).bfloat16()
    w = torch.rand(T, 8, device=DEV, generator=g)
    ids = _routings(T, S, 8, g)["skip"]
    add = torch.randn(T, st[0].shape[2], device=DEV, generator=g)
    kw = dict(out_dtype=torch.float32, layout="persistent", item_regs=True, xq=act_quant(x), tma=TMA)
    poison()
    on = moe_experts(x, ids, w, *st, down_nb=True, **kw)
    assert _rel(on, moe_experts(x, ids, w, *st, **kw)) < TOL
    if T > 2:
        assert not on[2].any(), "a token with no expert here: exactly 0"
    assert torch.equal(moe_experts(x, ids, w, *st, down_nb=True, add=add, **kw), on + add)


def _gate_up_h(st, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor):
    """Gate/up's h8 / hs of a split rank's call (the persistent gate/up kernel's own output), for `down_nb` alone:
    read back through a recorder of `moe.down_nb_kernel`."""
    import mtp.kernels.moe as moe

    seen, kernel = {}, moe.down_nb_kernel

    def recorder(h8, hs, *a, **k):
        seen["h"] = (h8.clone(), hs.clone())
        return kernel(h8, hs, *a, **k)

    moe.down_nb_kernel = recorder
    try:
        moe_experts(x, ids, w, *st, out_dtype=torch.float32, layout="persistent", shared=True, down_nb=True,
                    splits=(2, 1))
    finally:
        moe.down_nb_kernel = kernel
    return seen["h"]


def test_down_nb_batch_invariant(split_stack):
    """Each of 4 tokens alone (T = 1) has the bits of its row in the 4-token call: the kernel alone on gate/up's h at
    every tile and by TMA, and end to end with the gate/up K slices fixed (2; `default_splits` depends on T)."""
    st = split_stack
    S = st[0].shape[0] - 1
    g = torch.Generator(device=DEV).manual_seed(80)
    x = torch.randn(4, st[0].shape[2], device=DEV, generator=g).bfloat16()
    w = torch.rand(4, 8, device=DEV, generator=g)
    ids = _routings(4, S, 8, g)["skip"]
    # experts repeated across tokens: token 3's first four are token 1's, its other four none of them (a token's
    # experts are distinct: `moe_experts` requires it)
    others = [e for e in torch.randperm(S, device=DEV, generator=g).tolist() if e not in ids[1, :4].tolist()]
    ids[3, :4] = ids[1, :4]
    ids[3, 4:] = torch.tensor(others[:4], dtype=ids.dtype, device=DEV)
    h8, hs = _gate_up_h(st, x, ids, w)
    topk = 9
    for tile in TILES:
        for tma in (False, TMA) if tile[1] == 2 else (False,):
            desc = weight_desc("w_down", st[4], tile[0]) if tma else None
            four = down_nb(h8, hs, ids, w, st[4], st[5], 4, True, torch.float32, tile=tile, desc=desc)
            for p in range(4):
                q = slice(p * topk, (p + 1) * topk)
                one = down_nb(h8[q], hs[q], ids[p:p + 1], w[p:p + 1], st[4], st[5], 1, True, torch.float32, tile=tile,
                              desc=desc)
                assert torch.equal(one[0], four[p]), (tile, tma, p, (one[0] - four[p]).abs().max().item())
    kw = dict(out_dtype=torch.float32, layout="persistent", shared=True, item_regs=True, splits=(2, 1), tma=TMA,
              down_nb=True)
    four = moe_experts(x, ids, w, *st, xq=act_quant(x), **kw)
    for p in range(4):
        one = moe_experts(x[p:p + 1], ids[p:p + 1], w[p:p + 1], *st, xq=act_quant(x[p:p + 1]), **kw)
        assert torch.equal(one[0], four[p]), (p, (one[0] - four[p]).abs().max().item())


@pytest.mark.parametrize("pdl", [0, 1, 2])
@pytest.mark.parametrize("T", [1, 4])
def test_down_nb_graph_replay(split_stack, T, pdl):
    """Two chained calls (the second's x the first's output, as consecutive MoE layers) captured with the switch on,
    replayed 8 times with new inputs and routings copied in: each replay equals the eager calls."""
    if DEV != "cuda":
        pytest.skip("CUDA graphs")
    st = split_stack
    S = st[0].shape[0] - 1
    g = torch.Generator(device=DEV).manual_seed(90 + T + pdl)
    x = torch.randn(T, st[0].shape[2], device=DEV, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(S, device=DEV, generator=g)[:8] for _ in range(T)]).int()
    w = torch.rand(T, 8, device=DEV, generator=g)
    kw = dict(out_dtype=torch.float32, layout="persistent", shared=True, splits="waves", item_regs=True, pdl=pdl,
              tma=TMA, down_nb=True)

    def two() -> torch.Tensor:
        y = moe_experts(x, ids, w, *st, xq=act_quant(x), **kw).bfloat16()
        return moe_experts(y, ids, w, *st, xq=act_quant(y), **kw)

    two()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = two()
    for i in range(8):
        x.copy_(torch.randn(x.shape, device=DEV, generator=g))
        ids.copy_(_routings(T, S, 8, g)[("random", "skip", "same")[i % 3]])
        w.copy_(torch.rand(w.shape, device=DEV, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, two()), i


def test_down_nb_odd_width():
    """D = 7136, a multiple of no BN but 32 (BN = 64 / 128: the last block's rows past D masked), 9 experts (the last
    the shared one), the kernel alone against its float64 sum."""
    from .test_moe_down_nb import down_inputs, poison_pairs

    E, D, I, J = 9, 7136, 256, 8
    wd, sd = down_stack(E, D, I, seed=5, device=DEV)
    g = torch.Generator().manual_seed(6)
    for T in (1, 4):
        idx, h8, hs = down_inputs(T, J, E, I, True, g, DEV)
        idx[0, 2] = -1
        poison_pairs(h8, hs, idx, True)
        rw = torch.rand(T, J, generator=g).to(DEV)
        ref = down_ref(h8, hs, idx, rw, wd, sd, True)
        for tile in ((32, 2), (64, 2), (128, 1)):
            poison()
            y = down_nb(h8, hs, idx, rw, wd, sd, T, True, torch.float32, tile=tile)
            assert _rel(y, ref) < ACC_TOL, (T, tile, _rel(y, ref))


@pytest.mark.parametrize("T", [1, 4])
def test_down_nb_full_width_rank(T):
    """A contiguous rank's 32 experts of 256 at full width (I = 2048: 16 K groups an expert, 8 iterations of two)."""
    E_loc, D, I, J = 32, 7168, 2048, 8
    torch.manual_seed(200 + T)
    ws = [*stacked(E_loc, I, D), *stacked(E_loc, I, D), *stacked(E_loc, D, I)]
    x = torch.randn(T, D, device=DEV).bfloat16()
    ids = local_ids(torch.stack([torch.randperm(256, device=DEV)[:J] for _ in range(T)]).int(), 0, E_loc)
    if not (ids[0] >= 0).any():
        ids[0, 0] = 3
    w = torch.rand(T, J, device=DEV)
    kw = dict(out_dtype=torch.float32, layout="persistent", item_regs=True, xq=act_quant(x), tma=TMA)
    off = moe_experts(x, ids, w, *ws, **kw)
    for tile in ((64, 2), (128, 1)):
        on = moe_experts(x, ids, w, *ws, down_nb=True, down_tile=tile, **kw)
        assert _rel(on, off) < TOL, (tile, _rel(on, off))


@pytest.mark.parametrize("pdl", [1, 2])
@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_down_pf_graph_same_bits(split_stack, T, pdl):
    """Two layers, each `router.moe_route_fused` then `moe_experts` (the router's ids read by the down kernel before its
    wait where gate/up triggers it after its own wait: this is the race the option must not lose), captured in one
    CUDA graph per variant (off; pf 8 and 64 with gate/up's trigger after its wait; pf 8 without it, compiled out at
    pdl 1), with and without the shared slot, replayed 4 times with new inputs: every variant's output has the bits of
    the option off's, in the graph and eager."""
    if DEV != "cuda":
        pytest.skip("CUDA graphs")
    from mtp.kernels.router import moe_route_fused

    st = split_stack
    S = st[0].shape[0] - 1
    D = st[0].shape[2]
    g = torch.Generator(device=DEV).manual_seed(300 + 10 * T + pdl)
    x = torch.randn(T, D, device=DEV, generator=g).bfloat16()
    wg = (torch.randn(S, D, device=DEV, generator=g) * 0.05).bfloat16()
    bias = torch.randn(S, device=DEV, generator=g) * 0.01
    add = torch.randn(T, D, device=DEV, generator=g)
    variants = {"off": {}, "pf8": dict(gate_up_after_wait=True, down_pf_experts=8),
                "pf64": dict(gate_up_after_wait=True, down_pf_experts=64), "pf8_noaw": dict(down_pf_experts=8)}
    for shared in (True, False):
        kw = dict(out_dtype=torch.float32, layout="persistent", shared=shared, add=None if shared else add,
                  splits="waves", item_regs=True, pdl=pdl, tma=TMA, down_nb=True)

        def two(v: dict) -> torch.Tensor:
            h = x
            for _ in range(2):  # the second layer's routing depends on the first's output
                w, ids = moe_route_fused(h, wg, bias, pdl=pdl, impl="one")
                y = moe_experts(h, ids, w, *st, xq=act_quant(h), **kw, **v)
                h = y.bfloat16()
            return y

        for v in variants.values():
            two(v)  # compile outside the capture
        torch.cuda.synchronize()
        graphs, outs = {}, {}
        for name, v in variants.items():
            graphs[name] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[name]):
                outs[name] = two(v)
        for i in range(4):
            x.copy_(torch.randn(x.shape, device=DEV, generator=g))
            for graph in graphs.values():
                graph.replay()
            torch.cuda.synchronize()
            eager = two({})
            for name in variants:
                assert torch.equal(outs[name], eager), (shared, i, name)
                assert torch.equal(two(variants[name]), eager), (shared, i, name, "eager")
