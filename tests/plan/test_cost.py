"""Each term of the speed model against a hand count on the tiny config, and its bytes against mtp-plan's
memory model (one source of truth)."""

import pytest
import torch

from mtp.model.presets import tiny_config, tiny_parallel_config
from mtp.parallel import memory
from mtp.parallel.layout import ParallelPlan
from mtp.plan.cost import Layout, Shape, draft_terms, experts_touched, forward_terms, kv_split, rank_bytes


def by_name(terms):
    return {t.name: t for t in terms}


def test_mla_absorbed_decode_hand_count():
    cfg = tiny_config()  # D 256, H 4, q_lora 128, C 128, nope 32, rope 64, v 32, index_topk 16
    t = by_name(forward_terms(cfg, Layout(), Shape(1, 1, 10)))["mla"]
    q_a, q_b, kv_a, o = 256 * 128, 128 * 4 * 96, 256 * 192, 4 * 32 * 256
    absorb_q, absorb_o = 4 * 32 * 128, 4 * 128 * 32
    scores, values = 10 * 4 * 192, 10 * 4 * 128  # 10 keys, no indexer at 10 <= 16
    assert t.flops_fp8 == 2 * (q_a + q_b + kv_a + o)
    assert t.flops_bf16 == 2 * (absorb_q + absorb_o + scores + values)
    mla_kv, idx_kv = kv_split(cfg)
    assert t.kv_bytes == 10 * mla_kv
    assert "indexer" not in by_name(forward_terms(cfg, Layout(), Shape(1, 1, 10)))


def test_indexer_and_dsa_cap_hand_count():
    cfg = tiny_config()
    terms = by_name(forward_terms(cfg, Layout(), Shape(2, 1, 40)))
    ix = terms["indexer"]
    assert ix.flops_fp8 == 2 * 2 * (128 * 8 * 128 + 256 * 128 + 40 * 8 * 128)
    # prefill of 40 new tokens: query i scores its i + 1 visible keys (820 pairs per row, not 40 x 40)
    pre = by_name(forward_terms(cfg, Layout(), Shape(1, 40, 40, "prefill", "naive")))["indexer"]
    assert pre.macs["scores"][0] == 820 * 8 * 128
    assert ix.flops_bf16 == 2 * 2 * 256 * 8
    assert ix.kv_bytes == 2 * 40 * (128 + 4)
    assert terms["mla"].kv_bytes == 2 * 16 * kv_split(cfg)[0]  # attention reads only the 16 selected keys
    assert sum(kv_split(cfg)) == memory.kv_bytes_per_token_layer(cfg)


def test_mlp_experts_head_hand_count():
    cfg = tiny_config()
    t = by_name(forward_terms(cfg, Layout(), Shape(1, 3, 8)))
    N = 3
    assert t["dense_mlp"].flops_fp8 == 2 * N * 3 * 256 * 384
    assert t["routed_experts"].flops_fp8 == 2 * N * 4 * 3 * 256 * 128
    assert t["shared_expert"].flops_fp8 == 2 * N * 3 * 256 * 128
    assert t["router"].flops_bf16 == 2 * N * 256 * 16
    assert t["head"].flops_bf16 == 2 * N * 256 * 512
    per_expert = rank_bytes(cfg, Layout())["routed experts"] / 2 / 16  # 2 MoE layers, 16 experts
    assert t["routed_experts"].weight_bytes == pytest.approx(experts_touched(16, 16, 4, N) * per_expert)
    assert experts_touched(16, 16, 4, 1) == pytest.approx(4.0)


def test_prefill_naive_is_causal():
    cfg = tiny_config()
    t = by_name(forward_terms(cfg, Layout(), Shape(1, 4, 4, "prefill", "naive", dsa=False)))["mla"]
    pairs = 1 + 2 + 3 + 4
    assert t.macs["scores"][0] == pairs * 4 * 96 and t.macs["k_up"][0] == 4 * 128 * 4 * 32


@pytest.mark.parametrize("world", [1, 2, 4])
def test_rank_bytes_are_the_memory_models(world):
    cfg = tiny_parallel_config(world) if world > 1 else tiny_config()
    lay = Layout(world, world)
    plan = ParallelPlan(world=world)
    assert rank_bytes(cfg, lay, n_mtp=0) == memory.rank_weight_bytes(cfg, plan, 0, torch.bfloat16, 0)
    assert rank_bytes(cfg, lay, n_mtp=1) == memory.weight_bytes_by_rank(cfg, plan, torch.bfloat16, 1)[0]
    # every weight byte of the trunk is read once by a forward that touches every expert (embedding aside)
    terms = forward_terms(cfg, lay, Shape(1, 4096, 4096))
    read = sum(t.weight_bytes * t.layers for t in terms)
    total = sum(memory.rank_weight_bytes(cfg, plan, 0, torch.bfloat16, 0).values())
    embed = rank_bytes(cfg, lay)["embedding + lm_head"] / 2
    assert read == pytest.approx(total - embed, rel=1e-9)


def test_tp_collectives_are_the_memory_models():
    cfg = tiny_parallel_config(2)
    N = 3
    terms = forward_terms(cfg, Layout(2, 2), Shape(1, N, 8))
    comm = sum(c.nbytes * c.count * t.layers for t in terms for c in t.comm)
    assert comm == memory.comm_bytes_per_forward(cfg, N, cfg.num_hidden_layers)["total"]
    assert sum(c.count * t.layers for t in terms for c in t.comm if c.op == "all_reduce") == \
        2 * cfg.num_hidden_layers + 1
    assert not any(t.comm for t in forward_terms(cfg, Layout(1, 1), Shape(1, N, 8)))


def test_dp_attention_dispatch_combine():
    cfg = tiny_config()
    t = by_name(forward_terms(cfg, Layout(1, 4, dp_attention=True), Shape(2, 1, 8)))["routed_experts"]
    remote = 2 * 4 * (1 - 4 / 16)  # tokens x topk leaving for the 12 experts on other ranks
    assert {c.op: c.nbytes for c in t.comm} == {"dispatch": remote * 256, "combine": remote * 256 * 2}
    assert t.flops_fp8 == 2 * 2 * 4 * 3 * 256 * 128  # the same tokens x topk come in from the other ranks
    # TP 2 inside each of 2 attention groups, EP 4: 2 x N tokens x topk pairs over 4 ranks; each rank sends half
    # of its group's tokens
    cfg2 = tiny_parallel_config(2)
    t2 = by_name(forward_terms(cfg2, Layout(2, 4, dp_attention=True), Shape(2, 1, 8)))["routed_experts"]
    assert t2.flops_fp8 == 2 * (2 * 2 * 4 / 4) * 3 * 256 * 128
    assert {c.op: c.nbytes for c in t2.comm}["dispatch"] == 2 / 2 * 4 * (1 - 4 / 16) * 256


def test_draft_is_one_moe_block_and_its_extras():
    cfg = tiny_config()
    d = by_name(draft_terms(cfg, Layout(), Shape(1, 1, 8)))
    assert "dense_mlp" not in d and all(t.layers == 1 for t in d.values())
    assert d["mtp_eh_proj"].flops_fp8 == 2 * 2 * 256 * 256
    with_mtp = sum(memory.rank_weight_bytes(cfg, ParallelPlan(), 0, torch.bfloat16, 1).values())
    trunk = sum(memory.rank_weight_bytes(cfg, ParallelPlan(), 0, torch.bfloat16, 0).values())
    layer = sum(t.weight_bytes for t in draft_terms(cfg, Layout(), Shape(1, 4096, 4096))
                if t.name not in ("head",))
    embed = rank_bytes(cfg, Layout())["embedding + lm_head"] / 2
    # the module's own embed / head copies aside; its block's norms are the trunk's per-layer share (which
    # carries a third of the final norm's 1 KiB on this 3-layer model: 0.007% here)
    assert layer == pytest.approx(with_mtp - trunk - 2 * embed, rel=1e-4)


def test_draft_eh_proj_is_column_parallel():
    """At tp = 2 a rank computes D / 2 of eh_proj's output channels over all 2D inputs, reads its rows, and
    all-gathers the [N, D] bf16 output (none at tp = 1)."""
    cfg = tiny_parallel_config(2)
    one = by_name(draft_terms(cfg, Layout(), Shape(1, 3, 8)))["mtp_eh_proj"]
    two = by_name(draft_terms(cfg, Layout(2, 2), Shape(1, 3, 8)))["mtp_eh_proj"]
    D = cfg.hidden_size
    assert one.flops_fp8 == 2 * 3 * 2 * D * D and two.flops_fp8 == one.flops_fp8 / 2
    assert one.comm == () and [(c.op, c.nbytes) for c in two.comm] == [("all_gather", 3 * D * 2)]
    assert one.weight_bytes - two.weight_bytes == 2 * D * D * 2 / 2  # half of eh_proj's bf16 rows


@pytest.mark.parametrize("kw, bad", [(dict(tp=0), "--tp"), (dict(tp=2, ep=4), "--ep"),
                                     (dict(tp=4, ep=6, dp_attention=True), "--ep"), (dict(nodes=0), "--nodes")])
def test_layout_errors_name_the_option(kw, bad):
    with pytest.raises(ValueError, match=bad):
        Layout(**kw)


def test_split_rank_reads_a_slice_per_touched_expert():
    """A 'split' rank (every expert's 1/8 slice, `mtp.placement`) reads a slice per expert it touches, out of all E:
    8 touched slices are one whole expert's bytes, what a 'contiguous' rank touching 1 of its 32 reads; under uniform
    routing both layouts read the same expected bytes. (Session 15: a split rank's measured count read as whole
    experts put the calibration's w = 4 roofline at 16.3 ms for an 8.6 ms step.)"""
    from mtp.model.config import ModelConfig

    cfg = ModelConfig()
    lay = Layout(8, 8)
    per_layer = rank_bytes(cfg, lay)["routed experts"] / (cfg.num_hidden_layers - cfg.first_k_dense_replace)

    def routed(**kw):
        return by_name(forward_terms(cfg, lay, Shape(1, 1, 1025, **kw)))["routed_experts"].weight_bytes

    assert routed(touched=8.0, expert_layout="split") == pytest.approx(8 * per_layer / 256)
    assert routed(touched=8.0, expert_layout="split") == pytest.approx(routed(touched=1.0, expert_layout="contiguous"))
    assert routed(expert_layout="split") == pytest.approx(routed(expert_layout="contiguous"))
    assert routed(expert_layout="auto") == pytest.approx(routed(expert_layout="split"))  # 'auto' picks split here
