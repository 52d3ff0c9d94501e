"""The parallel layout (who holds which slice) and exact FP8 re-blocking; no process group needed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mtp.model.deepseek import fp8
from mtp.model.config import ConfigError, ModelConfig
from mtp.model.layers import Linear
from mtp.parallel import ParallelPlan, RankLayout, ReblockError, Shard, reblock_scale, shard_fp8
from mtp.parallel.layout import split_range
from mtp.parallel.reblock import row_block
from mtp.parallel.load import check_fp8_inputs
from mtp.checkpoint.inventory import checkpoint_spec
from mtp.model.presets import real_config, tiny_config, tiny_parallel_config


# ----------------------------------------------------------------------------------------- re-blocking
def blocky_fp8(N: int, K: int, seed: int = 0):
    """An FP8 weight whose 128x128 blocks all have different scales (a wrong block map cannot go unseen)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g)
    bi = torch.arange(N).div(128, rounding_mode="floor").unsqueeze(1)
    bj = torch.arange(K).div(128, rounding_mode="floor").unsqueeze(0)
    w = w * torch.exp2((bi * 3 + bj).float() - 4)
    w8, s = fp8.weight_quant(w)
    assert s.unique().numel() == s.numel()
    return w8, s


@pytest.mark.parametrize("shard", [Shard(0, 0, 64), Shard(0, 64, 128), Shard(0, 96, 128), Shard(0, 128, 320),
                                   Shard(0, 256, 320), Shard(0, 0, 320), Shard(1, 64, 128), Shard(1, 128, 300),
                                   Shard(1, 256, 300), Shard(1, 32, 64)])
def test_reblocked_slice_dequantizes_to_the_same_weight(shard):
    w8, s = blocky_fp8(320, 300)  # ragged last blocks in both dims
    full = fp8.weight_dequant(w8, s)
    lw8, ls = shard_fp8(w8, s, shard)
    n, k = lw8.shape
    assert tuple(ls.shape) == (-(-n // 128), -(-k // 128))  # the slice's own 128-blocking, as Linear expects
    want = full.narrow(shard.dim, shard.start, shard.stop - shard.start)
    assert torch.equal(fp8.weight_dequant(lw8, ls), want)


def test_tp32_64_row_halves_of_a_block():
    """The brief's case: TP 32 cuts 2048 rows into 64-row slices; odd ranks start mid-block."""
    scale = torch.arange(16 * 56, dtype=torch.float32).view(16, 56) + 1
    for rank in range(32):
        got = reblock_scale(scale, (2048, 7168), Shard(0, 64 * rank, 64 * rank + 64))
        assert torch.equal(got, scale[rank // 2: rank // 2 + 1])


@pytest.mark.parametrize("numerics", ["fp8", "dequant"])
def test_linear_on_a_reblocked_row_slice_equals_the_full_linear(numerics):
    """Split a 128-row block into 2 x 64 (and a 3-block weight into 64 | 64 | 256): each rank's Linear
    returns exactly its columns of the full output, under both numerics."""
    N, K = 384, 256
    w8, s = blocky_fp8(N, K, seed=1)
    full = Linear(K, N, True)
    full.weight.data, full.weight_scale_inv.data = w8, s
    full.numerics = numerics
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(2))
    y = full(x)
    for a, b in ((0, 64), (64, 128), (128, 384)):
        lw8, ls = shard_fp8(w8, s, Shard(0, a, b))
        part = Linear(K, b - a, True)
        part.weight.data, part.weight_scale_inv.data = lw8, ls
        part.numerics = numerics
        assert torch.equal(part(x), y[:, a:b]), (a, b)


def test_reblocked_column_halves_sum_to_the_full_product():
    """Row-parallel use of a cut block (dequant numerics): the two 64-column partials add up to the output."""
    w8, s = blocky_fp8(256, 128, seed=3)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(4))
    parts = []
    for a, b in ((0, 64), (64, 128)):
        lw8, ls = shard_fp8(w8, s, Shard(1, a, b))
        parts.append(x[:, a:b] @ fp8.weight_dequant(lw8, ls).T)
    torch.testing.assert_close(parts[0] + parts[1], x @ fp8.weight_dequant(w8, s).T, rtol=1e-6, atol=1e-5)


def test_straddling_column_slice_is_refused():
    w8, s = blocky_fp8(384, 256)
    with pytest.raises(ReblockError, match="straddles parent blocks"):
        shard_fp8(w8, s, Shard(1, 32, 160), what="layer.o_proj.weight")


@pytest.mark.parametrize("numerics", ["fp8", "dequant"])
@pytest.mark.parametrize("a,b,rows", [(64, 192, 64), (192, 384, 64), (96, 288, 32), (0, 200, 128)])
def test_straddling_row_slices_take_finer_scale_blocks(a, b, rows, numerics):
    """A row slice whose own 128-blocks would straddle parent blocks (the bundled model's q_b_proj at TP=2: 2 heads
    x 96 rows from row 192) gets `row_block` rows per scale block and still equals the full weight's rows."""
    N, K = 384, 256
    w8, s = blocky_fp8(N, K, seed=5)
    assert row_block(a, b) == rows
    lw8, ls = shard_fp8(w8, s, Shard(0, a, b))
    assert tuple(ls.shape) == (-(-(b - a) // rows), 2)
    assert torch.equal(fp8.weight_dequant(lw8, ls, rows=rows), fp8.weight_dequant(w8, s)[a:b])
    full = Linear(K, N, True)
    full.weight.data, full.weight_scale_inv.data, full.numerics = w8, s, numerics
    part = Linear(K, b - a, True, scale_rows=rows)
    part.weight.data, part.weight_scale_inv.data, part.numerics = lw8, ls, numerics
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(6))
    assert torch.equal(part(x), full(x)[:, a:b])


def test_scale_of_the_wrong_shape_is_refused():
    with pytest.raises(ReblockError, match=r"expected \[2, 2\]"):
        reblock_scale(torch.ones(3, 2), (256, 256), Shard(0, 0, 128))


# ----------------------------------------------------------------------------------------- layout
def small_real_config() -> ModelConfig:
    """Real widths (heads, experts, vocab, MLP widths), 3 dense + 1 MoE layer + 1 MTP: fast to enumerate."""
    return real_config(layers=4, dense_layers=3)


@pytest.mark.parametrize("cfg_name,world,split", [("tiny", 2, "blocks"), ("real", 8, "blocks"),
                                                  ("real", 32, "blocks"), ("real", 32, "even")])
def test_ranks_partition_every_tensor_exactly(cfg_name, world, split):
    cfg = small_real_config() if cfg_name == "real" else dataclasses.replace(tiny_config(), num_attention_heads=8)
    spec = checkpoint_spec(cfg)
    layouts = [RankLayout(cfg, ParallelPlan(world, split), r) for r in range(world)]
    for name, ts in spec.items():
        if ts.kind == "scale":
            continue  # a scale follows its weight's shard through reblock_scale (tested above)
        shards = [lay.shard(name) for lay in layouts]
        held = [s for s in shards if s is not None]
        if ".mlp.experts." in name:
            assert len(held) == 1 and held[0].dim is None, name
        elif all(s.dim is None for s in held):
            assert len(held) == world, name  # replicated
        else:
            dims = {s.dim for s in held}
            assert len(dims) == 1 and len(held) == world, name
            d = dims.pop()
            spans = sorted((s.start, s.stop) for s in held)
            assert spans[0][0] == 0 and spans[-1][1] == ts.shape[d], (name, spans)
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (name, spans)


def test_real_config_ranges():
    cfg = ModelConfig()
    lay = RankLayout(cfg, ParallelPlan(8), 3)
    assert lay.heads == (48, 64) and lay.experts == (96, 128) and lay.vocab == (48480, 64640)
    assert lay.dense == (3 * 2304, 4 * 2304) and lay.shared == (768, 1024)
    assert lay.shard("model.layers.5.self_attn.q_b_proj.weight_scale_inv") == Shard(0, 48 * 192, 64 * 192)
    assert lay.shard("model.layers.5.self_attn.o_proj.weight") == Shard(1, 48 * 128, 64 * 128)
    assert lay.shard("model.layers.5.mlp.experts.95.up_proj.weight") is None
    assert lay.shard("model.layers.61.mlp.experts.100.down_proj.weight") == Shard()
    assert lay.shard("model.layers.61.shared_head.head.weight") == Shard(0, 48480, 64640)
    assert lay.shard("model.layers.61.eh_proj.weight") == Shard(0, 3 * 896, 4 * 896)  # column parallel: D / 8 rows
    assert lay.eh_rows == (3 * 896, 4 * 896)
    assert lay.shard("model.layers.0.self_attn.indexer.wq_b.weight") == Shard()


def test_block_split_at_world_32():
    """The real shared expert has 16 blocks: at W = 32 even ranks hold one, odd ranks none; the dense MLP's
    144 blocks go 4 or 5 per rank. Nothing cuts a 128-block."""
    widths = [split_range(2048, 32, r, "blocks", "x") for r in range(32)]
    assert [b - a for a, b in widths] == [0, 128] * 16
    dense = [b - a for a, b in (split_range(18432, 32, r, "blocks", "x") for r in range(32))]
    assert sum(dense) == 18432 and set(dense) == {512, 640}
    assert split_range(2048, 32, 1, "even", "x") == (64, 128)


def test_indivisible_counts_name_the_field():
    with pytest.raises(ConfigError, match="num_attention_heads = 128 is not divisible .* 3"):
        RankLayout(ModelConfig(), ParallelPlan(3), 0)
    with pytest.raises(ConfigError, match="intermediate_size = 384 does not split evenly"):
        split_range(384, 5, 0, "even", "intermediate_size")
    with pytest.raises(ConfigError, match="mlp_split"):
        ParallelPlan(2, "rows")


def test_eh_proj_rows_need_a_hidden_size_the_world_divides():
    """eh_proj is split by output rows, D / W each: a D the world does not divide is refused, naming the field; a
    config without MTP modules has no eh_proj and is not refused for it."""
    cfg = dataclasses.replace(tiny_parallel_config(16), hidden_size=264)  # heads, experts, vocab divide by 16
    with pytest.raises(ConfigError, match=r"hidden_size \(the MTP eh_proj's output rows\) = 264 is not divisible "
                                          r"by the parallel world size 16"):
        RankLayout(cfg, ParallelPlan(16), 3)
    assert RankLayout(dataclasses.replace(cfg, num_nextn_predict_layers=0), ParallelPlan(16), 3).eh_rows == (0, 264)


def test_eh_proj_slices_give_the_whole_product_bit_for_bit():
    """Every rank's eh_proj (W = 2, 4, 8; built as `random_parallel_model` cuts it, through the loader's
    `rank_part`) holds its rows of the single-rank weight, and the ranks' outputs laid side by side in rank
    order (what `Comm.all_gather_last` returns) equal the single-rank product bit for bit: each output channel
    is still one whole dot over the 2D inputs, on one rank. fp32, one thread on both sides."""
    from mtp.checkpoint.synthetic import random_model
    from mtp.parallel.modules import ColumnParallelLinear
    from mtp.parallel.synthetic import random_parallel_model
    from tests.parallel.test_moe_ep import SumLaterComm

    cfg = tiny_parallel_config(8, layers=2)
    full = random_model(cfg, device="cpu", dtype=torch.float32, seed=3).mtp[0].eh_proj
    D = cfg.hidden_size
    x = torch.randn(2, 5, 2 * D, generator=torch.Generator().manual_seed(4))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CPU GEMM blocks its sums by the thread count: the same count on both sides
    try:
        want = full(x)
        for world in (2, 4, 8):
            parts = []
            for rank in range(world):
                m = random_parallel_model(cfg, SumLaterComm(rank, world), ParallelPlan(world), device="cpu",
                                          dtype=torch.float32, seed=3)
                eh = m.mtp[0].eh_proj
                assert isinstance(eh, ColumnParallelLinear) and eh.out_features == D // world
                assert torch.equal(eh.weight, full.weight[rank * D // world:(rank + 1) * D // world])
                parts.append(eh.matmul(x))
            assert torch.equal(torch.cat(parts, -1), want), world
    finally:
        torch.set_num_threads(threads)


def test_fp8_numerics_refuse_cut_activation_groups():
    tiny4 = tiny_config()  # 4 heads x 32: o_proj gets 64 channels per rank at W = 2, half a group: the two
    check_fp8_inputs(RankLayout(tiny4, ParallelPlan(2), 0))  # ranks share its amax (RowParallelLinear)
    odd = dataclasses.replace(tiny_config(), v_head_dim=96)  # 2 heads x 96 = 192 channels: 1.5 groups per rank
    with pytest.raises(ConfigError, match="o_proj .* gets 192 input channels"):
        check_fp8_inputs(RankLayout(odd, ParallelPlan(2), 0))
    tiny8 = tiny_parallel_config(2)
    check_fp8_inputs(RankLayout(tiny8, ParallelPlan(2), 1))  # whole groups everywhere
    with pytest.raises(ConfigError, match="shared expert down_proj gets 64"):
        check_fp8_inputs(RankLayout(tiny8, ParallelPlan(2, "even"), 1))


# ----------------------------------------------------------------------------------------- expert layouts
@pytest.mark.parametrize("layout", ["contiguous", "interleaved", "permuted"])
def test_expert_layouts_partition_the_experts(layout):
    """Real config at EP 8: each rank holds 32 whole experts, every expert on exactly one rank."""
    cfg = small_real_config()
    lays = [RankLayout(cfg, ParallelPlan(8, expert_layout=layout), r) for r in range(8)]
    assert sorted(e for lay in lays for e in lay.expert_ids) == list(range(256))
    assert all(len(lay.expert_ids) == 32 for lay in lays)
    groups = [{e // 32 for e in lay.expert_ids} for lay in lays]  # routing groups of 32 a rank's experts are in
    if layout == "contiguous":
        assert groups == [{r} for r in range(8)] and lays[3].experts == (96, 128)
    if layout == "interleaved":  # every group spread over all ranks, 4 experts each
        assert lays[3].expert_ids[:3] == (3, 11, 19) and all(g == set(range(8)) for g in groups)
    name = "model.layers.3.mlp.experts.{}.down_proj.weight"
    for lay in lays:
        assert lay.shard(name.format(lay.expert_ids[0])) == Shard()  # whole experts
        assert (lay.experts is None) == (layout != "contiguous")  # a range only where the experts are one
        assert sum(lay.shard(name.format(e)) is not None for e in range(256)) == 32


def test_permuted_layout_is_seeded_and_split_layout_cuts_every_expert():
    cfg = small_real_config()
    perm = [RankLayout(cfg, ParallelPlan(8, expert_layout="permuted", expert_seed=s), 0).expert_ids for s in (0, 0, 1)]
    assert perm[0] == perm[1] != perm[2]
    lays = [RankLayout(cfg, ParallelPlan(8, expert_layout="split"), r) for r in range(8)]
    assert all(lay.expert_ids == tuple(range(256)) for lay in lays)
    assert [lay.expert_inter for lay in lays] == [(256 * r, 256 * r + 256) for r in range(8)]  # 2 blocks each
    assert lays[5].shard("model.layers.3.mlp.experts.7.gate_proj.weight") == Shard(0, 1280, 1536)
    assert lays[5].shard("model.layers.3.mlp.experts.7.down_proj.weight_scale_inv") == Shard(1, 1280, 1536)
    check_fp8_inputs(lays[5])
    # 128 channels per routed expert: under 'even', 64 per rank cut an fp8 group (2 shared experts: 128 each, fine)
    tiny = dataclasses.replace(tiny_parallel_config(2), n_shared_experts=2)
    with pytest.raises(ConfigError, match="routed expert down_proj .* gets 64"):
        check_fp8_inputs(RankLayout(tiny, ParallelPlan(2, "even", expert_layout="split"), 1))
    with pytest.raises(ConfigError, match="expert_layout must be one of .* got 'striped'"):
        ParallelPlan(8, expert_layout="striped")
    with pytest.raises(ConfigError, match="n_routed_experts = 256 is not divisible .* 3"):
        RankLayout(dataclasses.replace(cfg, num_attention_heads=3), ParallelPlan(3, expert_layout="interleaved"), 0)


@pytest.mark.parametrize("inter,world,want", [(2048, 8, "split"), (2048, 16, "split"), (2048, 2, "split"),
                                              (2048, 32, "contiguous"), (128, 2, "contiguous"), (384, 2, "contiguous"),
                                              (2048, 1, "contiguous")])
def test_auto_layout_splits_where_every_rank_gets_whole_blocks(inter, world, want):
    """'auto' (the runtime's default): 'split' where each rank gets the same whole 128-blocks of every expert
    (DeepSeek-V3.2's 2048 at 2..16 ranks), else 'contiguous' (the bundled model's 128 at 2 ranks: one block)."""
    from mtp.placement import choose_layout

    assert choose_layout("auto", inter, world) == want
    assert choose_layout("interleaved", inter, world) == "interleaved"  # a named layout is taken as it is
    with pytest.raises(ValueError, match="expert_layout must be one of"):
        choose_layout("balanced", inter, world)


def test_rank_layout_resolves_auto():
    """RankLayout (and so the loader and every module built from it) sees the concrete layout, never 'auto'."""
    real = real_config(layers=2, dense_layers=1)
    lay = RankLayout(real, ParallelPlan(8, expert_layout="auto"), 3)
    assert lay.plan.expert_layout == "split" and len(lay.expert_ids) == real.n_routed_experts
    assert lay.expert_inter == (3 * 256, 4 * 256)
    tiny = tiny_parallel_config(2)
    lay = RankLayout(tiny, ParallelPlan(2, expert_layout="auto"), 1)
    want = "split" if tiny.moe_intermediate_size % 256 == 0 else "contiguous"
    assert lay.plan.expert_layout == want
