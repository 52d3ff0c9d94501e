"""The speed model's kernel count (`mtp.plan.kernels`) against the code: a hand derivation per layer kind at a few
(tokens, context) points of the real TP=8 rank, and the launches `mtp.plan.launches` counts when the fast path
runs a tiny simulated rank under the Triton interpreter (a subprocess: the interpreter is chosen when the kernels
are decorated), with the fast path's token thresholds shrunk so that every branch is taken at 1..14 tokens.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`

from mtp.model.presets import real_config  # noqa: E402
from mtp.plan.kernels import Limits, StepShape, per_layer, step_launches  # noqa: E402
from tests.interp import interpreted  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# shrunk thresholds for the interpreted run, in the real ones' order (gemv 1 < FUSE_M = grouped 16 < SMALL_M =
# router = absorb 64 < kernel route 256), scaled down; the chunk of the grouped GEMM small enough to be cut
SHRUNK = dict(fuse_m=2, small_m=6, absorb_max=5, router_max=3, kernel_route=12, grouped_above=2, moe_chunk=4)
# (rows, width, context before the forward): dense attention (S <= top-k 16) and the indexer (S > 16), at
# every branch: 1 row (split-K GEMV); 3 tokens: act_quant, one grouped chunk; 6: 2 router launches + 2 cats, the
# einsum absorb, 2 grouped chunks + cat; 9 > SMALL_M: the unquantized block (the reference MoE forward); 14 >
# kernel_route: the reference router; the indexer at 1 row and at 2 (the keys' contiguous copies)
POINTS = [(1, 1, 8), (1, 3, 8), (2, 3, 8), (3, 3, 8), (2, 7, 2), (1, 1, 40), (2, 1, 40), (2, 2, 40)]
# the points where the MoE's launches could depend on the expert layout: the router kernel at 1 and 6 tokens (the
# id mapping inside it), 14 tokens (the reference router, then `local_ids` in torch: a range, a table or none)
LAYOUT_POINTS = [(1, 1, 8), (2, 3, 8), (2, 7, 2)]
# one process (world 1): the token thresholds' branches are world 2's (the same code); what differs is per layer at
# every point (no all-reduce, the shared expert in the experts' stack, every expert local: no id mapping), so two
# points suffice: the GEMV + router kernel, and the reference router + unquantized block (all eight took ~220 s of
# the CI's 20 minutes under the interpreter; the grouped chunk and the indexer, whose launches do not depend on the
# world, are counted at world 2 only since session 23)
WORLD1_POINTS = [(1, 1, 8), (2, 7, 2)]
CACHE_EXTRA = 4  # the cache holds context + max(4, width) keys (as mtp-bench's k = 3 verify)


def _real_limits() -> Limits:
    return Limits.current()


def test_hand_derivation_real_rank_one_token_1k():
    """TP=8 rank, 1 token, S = 1025 <= top-k 2048 (no indexer). Read from fast_path.FastBlock / mla_forward_fast:
    attention = input norm-quant 1 + q_a|wk|kv_a GEMV 1 + kv prologue with the q_a norm-quant 1 + q_b|wq_b GEMV 1
    + q prologue with absorb q 1 + mla_decode 2 (absorb out inside stage 2) + o_proj GEMV 1 + post norm-quant 1
    (o_proj's cast after the all-reduce inside it) = 9. dense MLP = gate|up GEMV 1 + silu*up 1 + down GEMV 1 +
    add_rounded 1 (the cast after the all-reduce and the residual add) = 4. MoE on the 'split' rank `mtp-bench --tp 8`
    builds (the runtime's layout, 'auto') = router 1 + experts (gate-up, down, combine; the shared expert their last
    slot) 3 + add_rounded 1 = 5; with the shared expert's own launches (switch shared_in_experts off, or a
    'contiguous' rank, whose shared slice is narrower than its experts) + shared gate|up 1 + silu*up 1 + shared
    down 1 = 8. So dense 13, MoE 14; 61 layers: 3 x 13 + 58 x 14 = 851, head 3 (its norm, GEMM, the logits' cast),
    glue 5 (the bench's truncate, the slots and angles 1, the embedding 1, its cast, seq_lens += T; switches rope_table
    and vocab_embed off: the slots and angles 5, the vocabulary-parallel embedding 8, glue 16) (shared_in_experts off or
    'contiguous': MoE 17, 1025).
    Switch fuse_prologue off: attention + 2 (the kv prologue and q_a norm, q prologue and absorb q apart): dense 15,
    MoE 16, 973. fuse_absorb_out and fuse_out_cast off: attention + 2 (absorb out, o_proj's cast), dense MLP + 1
    (its cast): dense 16, MoE 16, 976. All four off: attention 13, dense MLP 5, so dense 18, MoE 21 (the
    session-4 profile: 305 GEMVs = 5 x 61, 183 norm-quants = 3 x 61, 58 routers, 58 x 3 expert kernels, 64 bf16
    casts = 61 + 3): 1272.
    The counts above are with switch mlp_reduce_norm off. On (the default), every trunk block hands its FFN's sum to
    the next block's add + norm + quant (`plan.kernels.ffn_hand_off`: tp > 1, fuse_out_cast, the quantized path):
    no add_rounded per block (dense and MoE 1 fewer), the last block's resolved in the glue (+ 1)."""
    cfg = real_config(layers=61, dense_layers=3)
    sh = StepShape(1, 1, 1025, tp=8)
    lim = _real_limits()

    def count(lim_, sh=sh):
        p = per_layer(cfg, sh, lim_)
        return p["dense"], p["moe"], sum(step_launches(cfg, sh, lim_).values()) - p["head"] - p["glue"]

    # the default keeps absorb out as its own launch (fuse_absorb_out off: measured slower fused, session 11): + 1
    # per layer against the derivation below, which has every fusion on; and hands the FFN's sum on: - 1
    # and moe_down_nb (the default since session 20): the 'split' rank's one-token call is persistent, whose down
    # kernel stores y: no combine, MoE 1 fewer (the bench's 881 -> 823 kernels a step, H200); the rest below without it
    assert not lim.fuse_absorb_out and lim.mlp_reduce_norm and lim.moe_down_nb and count(lim) == (13, 13, 851 - 58)
    lim = dataclasses.replace(lim, moe_down_nb=False)
    assert count(lim) == (13, 14, 851)
    assert per_layer(cfg, sh, lim)["glue"] == 5 + 1
    assert per_layer(cfg, sh, dataclasses.replace(lim, rope_table=False, vocab_embed=False))["glue"] == 16 + 1
    assert per_layer(cfg, StepShape(1, 1, 1025, tp=1), lim)["glue"] == 5  # one process: one lookup either way
    assert per_layer(cfg, StepShape(1, 1, 1025, tp=1), dataclasses.replace(lim, rope_table=False))["glue"] == 9
    # an MTP module's extras: its glue without the truncate and the embedding's cast, its norms 1 (3 with switch
    # mtp_norms off), eh_proj and its cast, the head 3 (norm, GEMM, the logits' cast), and its block's own FFN add (a
    # trunk block hands its on)
    mtp_extra = per_layer(cfg, sh, lim)["mtp"] - per_layer(cfg, sh, lim)["moe"]
    assert mtp_extra == 3 + 1 + 2 + 3 + 1
    off = dataclasses.replace(lim, rope_table=False, vocab_embed=False, mtp_norms=False)
    assert per_layer(cfg, sh, off)["mtp"] - per_layer(cfg, sh, off)["moe"] == 14 + 3 + 2 + 3 + 1
    assert count(dataclasses.replace(lim, mlp_reduce_norm=False)) == (14, 15, 851 + 61)
    assert count(dataclasses.replace(lim, fuse_absorb_out=True)) == (12, 13, 851 - 61)
    lim = dataclasses.replace(lim, fuse_absorb_out=True, mlp_reduce_norm=False)

    p = per_layer(cfg, sh, lim)
    assert (p["head"], p["glue"]) == (3, 5)
    assert count(lim) == count(lim, StepShape(1, 1, 1025, tp=8, expert_layout="split")) == (13, 14, 851)
    assert count(dataclasses.replace(lim, shared_in_experts=False)) == (13, 17, 1025)
    assert count(lim, StepShape(1, 1, 1025, tp=8, expert_layout="contiguous")) == (13, 17, 1025)
    assert count(dataclasses.replace(lim, fuse_prologue=False)) == (15, 16, 973)
    assert count(dataclasses.replace(lim, fuse_absorb_out=False, fuse_out_cast=False)) == (16, 16, 976)
    none = dataclasses.replace(lim, fuse_prologue=False, fuse_absorb_out=False, fuse_out_cast=False,
                               shared_in_experts=False)
    assert count(none) == (18, 21, 1272)
    # one process (n_shared = 1): the shared expert's 3 launches and its output's fp32 cast, 4 fewer
    assert per_layer(cfg, StepShape(1, 1, 1025, tp=1), lim)["moe"] == \
        per_layer(cfg, StepShape(1, 1, 1025, tp=1), dataclasses.replace(lim, shared_in_experts=False))["moe"] - 4
    one = per_layer(cfg, StepShape(1, 1, 1025, tp=1), lim)  # no all-reduce: of the output side only absorb out
    assert one["dense"] == per_layer(cfg, StepShape(1, 1, 1025, tp=1),
                                     dataclasses.replace(lim, fuse_absorb_out=False, fuse_out_cast=False))["dense"] - 1


def test_hand_derivation_real_rank_few_tokens_and_grouped():
    """2..16 tokens: no split-K GEMV; the GEMVs fed a quantized x (q_a|wk|kv_a, q_b|wq_b, gate|up) stay one launch,
    o_proj and the down projections (7168 rows > SMALL_N 4096) get an act_quant each: dense 13 + 2 = 15, MoE
    14 + 1 = 15 on the 'split' rank (shared expert in the experts' kernels; 17 + 2 = 19 with its own launches, on a
    'contiguous' rank), head 3 (the logits' cast is the gathered slices' copy). 17..64 tokens: the grouped expert
    GEMM (count, align, act_quant, gate-up, down, combine: 6 instead of 3), which keeps the shared expert's own
    launches on every rank: MoE 22. 96 tokens (> SMALL_M = ABSORB_MAX_TOKENS 64): the
    block's norm does not quantize: q_a|wk|kv_a gets an act_quant (+1), the einsum absorb (q's bmm + copy, out's
    bmm + copy instead of absorb q inside the q prologue and absorb out inside stage 2: +4), the dense gate|up an
    act_quant (+1): dense 15 + 1 + 4 + 1 = 21; MoE: attention 10 + 1 + 4 = 15, shared gate|up 2 + silu 1 + down 2,
    router 2 launches of 64 + 2 cats = 4, grouped 6, routed + shared 1, cast 1, residual add 1: 15 + 18 = 33. 192
    tokens: 3 router launches (+1): 34. With fuse_prologue off: 2 more up to 64 tokens, 1 more above (the kv
    prologue and q_a norm apart). Switch mlp_reduce_norm off here (the FFN's add in its own block); on (the
    default) the add moves to the next block's norm up to SMALL_M tokens: dense and MoE 1 fewer."""
    cfg = real_config(layers=61, dense_layers=3)
    # every fusion on (the default keeps absorb out apart up to 64 tokens: + 1, checked at the end)
    lim = dataclasses.replace(_real_limits(), fuse_absorb_out=True, mlp_reduce_norm=False, moe_down_nb=False)
    Ns = (2, 16, 17, 64, 96, 192)
    got = {N: per_layer(cfg, StepShape(1, N, 1024 + N, tp=8), lim) for N in Ns}
    assert [(got[N]["dense"], got[N]["moe"]) for N in Ns] == \
        [(15, 15), (15, 15), (15, 22), (15, 22), (21, 33), (21, 34)]
    assert got[2]["head"] == 3
    contiguous = {N: per_layer(cfg, StepShape(1, N, 1024 + N, tp=8, expert_layout="contiguous"), lim) for N in Ns}
    assert [contiguous[N]["moe"] for N in Ns] == [19, 19, 22, 22, 33, 34]
    unfused = dataclasses.replace(lim, fuse_prologue=False, shared_in_experts=False)
    old = {N: per_layer(cfg, StepShape(1, N, 1024 + N, tp=8), unfused) for N in Ns}
    assert [(old[N]["dense"], old[N]["moe"]) for N in Ns] == \
        [(17, 21), (17, 21), (17, 24), (17, 24), (22, 34), (22, 35)]
    default = {N: per_layer(cfg, StepShape(1, N, 1024 + N, tp=8), _real_limits()) for N in Ns}
    # moe_down_nb (default): persistent calls have no combine: the 'split' rank up to 4 tokens
    # (SPLIT_PERSISTENT_TOKENS), a 'contiguous' rank (scattered experts, by size) up to 64 / 8 = 8
    assert [(default[N]["dense"], default[N]["moe"]) for N in Ns] == \
        [(15, 14), (15, 15), (15, 22), (15, 22), (21, 33), (21, 34)]
    assert [default[N]["glue"] for N in Ns] == [6, 6, 6, 6, 5, 5]
    assert [per_layer(cfg, StepShape(1, N, 1024 + N, tp=8, expert_layout="contiguous"), _real_limits())["moe"]
            for N in (2, 8, 9, 16)] == [18, 18, 19, 19]


def test_hand_derivation_indexer():
    """S = 8193 > top-k 2048, 1 row: the indexer adds the head weights 1 (`kernels.index_weights`), scores 1, radix
    histogram + split + write 3 = 5 per layer, on a GPU as on the CPU counter; the top-k's workspace is the kept one,
    which its write kernel re-arms (`topk_rearm`; off: a zeroed workspace per call, + 1 memset = 6); with
    `topk_one_launch` the three top-k launches are one (2 fewer) where its grid fits the SMs, with
    `indexer_one_launch` the scores and the top-k are one launch (3 fewer). The session-4
    32k profile had 8: the head weights were cuBLAS's split-K GEMM, its reduce kernel and a float mul, with
    _indexer_kernel, the 3 top-k kernels and FillFunctor. Rows > 1 with the cache longer than S: + 2 contiguous
    copies of the keys and their scales. Up to `fused_hist_rows` tokens (default 1) the histogram runs in the scores
    kernel (radix_fused): one launch fewer; the counts below that name 5 and 6 are with it off (0)."""
    cfg = real_config(layers=61, dense_layers=3)
    fused = _real_limits()
    lim = dataclasses.replace(fused, fused_hist_rows=0)
    base = per_layer(cfg, StepShape(1, 1, 1025, tp=8), lim)
    long = per_layer(cfg, StepShape(1, 1, 8193, tp=8), lim)
    assert long["moe"] - base["moe"] == 5 and long["dense"] - base["dense"] == 5
    memset = per_layer(cfg, StepShape(1, 1, 8193, tp=8), dataclasses.replace(lim, topk_rearm=False))
    assert memset["moe"] - base["moe"] == 6
    # the default: the histogram in the scores kernel at one token, its own launch from two on
    assert per_layer(cfg, StepShape(1, 1, 8193, tp=8), fused)["moe"] - base["moe"] == 4
    for rows, width in ((1, 2), (2, 1), (1, 4)):
        sh = StepShape(rows, width, 8193, tp=8)
        assert per_layer(cfg, sh, fused) == per_layer(cfg, sh, lim)
    # topk_one_launch: the radix top-k's three phases in one launch where its grid fits 132 SMs (every decode shape)
    one = dataclasses.replace(lim, topk_one_launch=True)
    for rows, width, S in ((1, 1, 8193), (1, 4, 32772), (2, 4, 65540)):
        sh = StepShape(rows, width, S, tp=8)
        assert per_layer(cfg, sh, one)["moe"] == per_layer(cfg, sh, lim)["moe"] - 2
    assert per_layer(cfg, StepShape(1, 1, 8193, tp=8), dataclasses.replace(one, topk_rearm=False))["moe"] == 4 + \
        base["moe"]
    past = StepShape(8, 1, 16 * 8192 + 10, tp=8)  # a chunk past MAX_TILE: the three launches
    assert per_layer(cfg, past, one)["moe"] == per_layer(cfg, past, lim)["moe"]
    # indexer_one_launch: scores and top-k in one launch (head weights + 1); where its grid does not fit, the scores
    # kernel with the histograms + the one-launch top-k (2), or + split and write when that does not fit either (3)
    both = dataclasses.replace(lim, indexer_one_launch=True)
    for rows, width, S in ((1, 1, 8193), (1, 4, 32772), (2, 4, 65540), (8, 1, 65536)):
        sh = StepShape(rows, width, S, tp=8)
        assert per_layer(cfg, sh, both)["moe"] == per_layer(cfg, sh, lim)["moe"] - 3, (rows, width, S)
    assert per_layer(cfg, StepShape(1, 9, 8201, tp=8), both)["moe"] == \
        per_layer(cfg, StepShape(1, 9, 8201, tp=8), lim)["moe"] - 2  # 9 queries: past MAX_T
    assert per_layer(cfg, past, both)["moe"] == per_layer(cfg, past, lim)["moe"] - 1
    mid = StepShape(8, 1, 65544, tp=8)  # 8 rows past 64k: 8192-key chunks, too long for the scores, not the top-k
    assert per_layer(cfg, mid, both)["moe"] == per_layer(cfg, mid, lim)["moe"] - 2
    two = per_layer(cfg, StepShape(2, 1, 8193, tp=8, cache_len=8196), lim)
    assert two["moe"] - per_layer(cfg, StepShape(2, 1, 8193, tp=8), lim)["moe"] == 2


@pytest.mark.parametrize("world", [2, pytest.param(1, marks=pytest.mark.slow)])
def test_model_equals_counted_launches_tiny_rank(world):
    """The count of every layer kind equals the launches of the code on a tiny rank, at every point of POINTS
    (one process: WORLD1_POINTS)."""
    _check_counts(world, "contiguous")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["interleaved", "split"])
def test_model_equals_counted_launches_every_expert_layout(layout):
    """A rank of scattered experts (a global -> local table) and a 'split' rank launch what the model says, at the
    points where routing runs: the router kernel maps ids itself (a table is one more load in it, not a launch),
    and after the reference router every expert-parallel rank gathers from its table (`kernels.dispatch.expert_map`,
    'contiguous' too), which also makes the ids int32, so it takes the place of the int32 cast of a process holding
    every expert ('split'). 'permuted' maps by a table as 'interleaved' does. The layout shows in one place: a
    'split' rank runs its shared expert inside the experts' kernels (`FastMoE.shared_in_stack`) up to
    grouped_above tokens, 3 launches fewer."""
    _check_counts(2, layout)


def _check_counts(world: int, layout: str) -> None:
    r = interpreted([__file__, str(world), layout], 600)
    assert r.returncode == 0, f"counting failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    counted = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(counted) == len(_points(world, layout))
    cfg = _tiny(world)
    lim = dataclasses.replace(_real_limits(), **SHRUNK)
    bad = []
    for key, got in counted.items():
        B, w, L = (int(v) for v in key.split(","))
        sh = StepShape(B, w, L + w, tp=world, cache_len=L + max(w, CACHE_EXTRA), expert_layout=layout)
        want = per_layer(cfg, sh, lim)
        for kind, n in got.items():
            if want[kind] != n:
                bad.append(f"{layout}: rows {B} width {w} context {L} {kind}: model {want[kind]}, counted {n}")
    assert not bad, "\n".join(bad)


def _points(world: int, layout: str) -> list[tuple[int, int, int]]:
    """(rows, width, context) points counted: POINTS for a 'contiguous' rank of 2, WORLD1_POINTS for one process,
    LAYOUT_POINTS for another expert layout."""
    if layout != "contiguous":
        return LAYOUT_POINTS
    return POINTS if world > 1 else WORLD1_POINTS


def _tiny(world: int):
    """The smallest rank whose MLA takes the kernels (latent 512, rope 64, 16 indexer heads) and whose shared expert
    has a block on every rank; one dense and one MoE layer, one MTP module."""
    from mtp.model.presets import tiny_parallel_config

    return dataclasses.replace(tiny_parallel_config(max(world, 2), layers=2, dense_layers=1, index_topk=16),
                               kv_lora_rank=512, index_n_heads=16, moe_intermediate_size=128 * max(world, 2))


def _count(world: int, layout: str = "contiguous") -> dict:
    """{'B,w,L': {kind: launches per layer}} of one trunk forward (and one MTP module forward) per point of
    `_points(world, layout)`."""
    from contextlib import nullcontext

    import torch

    from mtp.checkpoint.synthetic import random_model
    from mtp.backends import fast_path as fp
    from mtp.checkpoint.synthetic import fill_cache_random
    from mtp.kernels import fp8_gemm
    from mtp.kernels.topk import kept_workspace
    from mtp.parallel.layout import ParallelPlan
    from mtp.parallel.simulate import simulated_rank
    from mtp.parallel.synthetic import random_parallel_model
    from mtp.plan.launches import counting
    from tests.interp import patch_interpreter_loop_bounds

    patch_interpreter_loop_bounds()
    fp8_gemm.FUSE_M, fp.SMALL_M, fp8_gemm.SMALL_M = SHRUNK["fuse_m"], SHRUNK["small_m"], SHRUNK["small_m"]
    fp.ABSORB_MAX_TOKENS, fp.ROUTER_MAX_TOKENS = SHRUNK["absorb_max"], SHRUNK["router_max"]
    fp.FastMoE.kernel_route_tokens, fp.FastMoE.grouped_above = SHRUNK["kernel_route"], SHRUNK["grouped_above"]
    fp.FastMoE.max_tokens = SHRUNK["moe_chunk"]
    cfg = _tiny(world)
    out = {}
    with (simulated_rank(world, 0) if world > 1 else nullcontext()) as comm:
        model = random_parallel_model(cfg, comm, ParallelPlan(world, expert_layout=layout), device="cpu",
                                      dtype=torch.bfloat16) \
            if world > 1 else random_model(cfg, "cpu", torch.bfloat16, seed=0)
        fp.install_fast_modules(model)
        fp.set_elementwise(model, "triton")
        g = torch.Generator().manual_seed(0)
        for B, w, L in _points(world, layout):
            cache = fill_cache_random(model.new_cache(B, L + max(w, CACHE_EXTRA)), L)
            base = cache.seq_lens.clone()
            ids = torch.randint(0, cfg.vocab_size, (B, w), generator=g)

            def fwd():
                cache.truncate(base)
                return model(ids, cache, kv_len=L + w)

            mcache = fill_cache_random(model.new_cache(B, L + max(w, CACHE_EXTRA), n_layers=1), L)
            kept_workspace(B * w, "cpu")  # the indexer top-k's kept workspace: allocated once per process and rows
            with torch.no_grad():
                if not out:  # the first forwards allocate the kernels' split-K counters, once per process
                    model.mtp_forward(0, ids, fwd().hidden, mcache, kv_len=L + w)
                    mcache.truncate(base)
                with counting(model) as c:
                    res = fwd()
                with counting(model) as m:
                    model.mtp_forward(0, ids, res.hidden, mcache, kv_len=L + w)
            kinds = c.per_kind()
            out[f"{B},{w},{L}"] = {"dense": kinds["dense"], "moe": kinds["moe"], "head": kinds["head"],
                                   "glue": kinds["glue"], "mtp": m.total()}
    return out


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    print(json.dumps(_count(int(sys.argv[1]), sys.argv[2])))
