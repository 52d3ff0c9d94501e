"""CPU checks of the kernels' plain-PyTorch references (run everywhere, no GPU needed)."""

from __future__ import annotations

import torch

import mtp.kernels
from mtp.model.fp8 import act_quant, weight_dequant, weight_quant
from mtp.kernels.fp8_gemm import fp8_linear_ref
from mtp.kernels.indexer import indexer_topk_ref, topk_from_scores
from mtp.kernels.mla_decode import mla_decode_ref
from mtp.kernels.moe import moe_experts_ref, route_from_logits_ref


def test_import_without_gpu():
    assert isinstance(mtp.kernels.available(), bool)


def test_route_ref_ties_and_groups():
    # 4 experts in 2 groups; group 1 has the best pair, ties go to the lower index
    logits = torch.zeros(1, 4)
    bias = torch.tensor([0.0, 0.0, 0.5, 0.5])
    w, idx = route_from_logits_ref(logits, bias, n_group=2, topk_group=1, topk=1, route_scale=1.0)
    assert idx.tolist() == [[2]] and torch.allclose(w, torch.ones(1, 1))
    w, idx = route_from_logits_ref(logits, torch.zeros(4), n_group=2, topk_group=2, topk=3, route_scale=2.5)
    assert idx.tolist() == [[0, 1, 2]] and torch.allclose(w, torch.full((1, 3), 2.5 / 3))


def test_fp8_linear_ref_close_to_dequant_matmul():
    torch.manual_seed(0)
    w8, sw = weight_quant(torch.randn(200, 256) * 0.05)
    x = torch.randn(3, 256)
    y = fp8_linear_ref(x, w8, sw)
    x8, sx = act_quant(x)
    xd = (x8.float().view(3, 2, 128) * sx.unsqueeze(-1)).view(3, 256)
    assert torch.allclose(y, xd @ weight_dequant(w8, sw).t(), rtol=1e-5, atol=1e-5)


def test_moe_experts_ref_single_expert_matches_linear():
    torch.manual_seed(0)
    D, I = 256, 128
    (g8, gs), (u8, us), (d8, ds) = weight_quant(torch.randn(I, D) * 0.05), weight_quant(torch.randn(I, D) * 0.05), weight_quant(torch.randn(D, I) * 0.05)
    x = torch.randn(1, D)
    y = moe_experts_ref(x, torch.tensor([[0]]), torch.tensor([[2.0]]), g8[None], gs[None], u8[None], us[None], d8[None], ds[None])
    h = torch.nn.functional.silu(fp8_linear_ref(x, g8, gs)) * fp8_linear_ref(x, u8, us)
    assert torch.allclose(y, 2 * fp8_linear_ref(h, d8, ds), rtol=1e-5, atol=1e-6)


def test_moe_experts_ref_skips_minus_one_slots():
    """Expert id -1 (expert on another rank) adds nothing: the same as the slot dropped, or its weight 0."""
    torch.manual_seed(0)
    E, D, I = 4, 256, 128
    g, u, d = ([weight_quant(torch.randn(N, K) * 0.05) for _ in range(E)] for N, K in ((I, D), (I, D), (D, I)))
    ws = [torch.stack(t) for pair in (g, u, d) for t in zip(*pair)]  # w_gate, s_gate, w_up, s_up, w_down, s_down
    x = torch.randn(3, D)
    idx = torch.tensor([[2, -1, 0, -1], [-1, -1, -1, -1], [1, 3, -1, 2]])
    rw = torch.rand(3, 4)
    y = moe_experts_ref(x, idx, rw, *ws)
    assert torch.equal(y[1], torch.zeros(D)), "a token whose slots are all -1 must get exactly 0"
    keep = idx >= 0
    y0 = moe_experts_ref(x, idx.clamp(min=0), rw * keep, *ws)  # -1 -> expert 0 with weight 0
    assert torch.equal(y, y0)
    y2 = moe_experts_ref(x[2:], idx[2:, [0, 1, 3]], rw[2:, [0, 1, 3]], *ws)  # the -1 slot dropped
    assert torch.equal(y[2:], y2)

def test_mla_ref_sparse_all_selected_equals_dense():
    torch.manual_seed(0)
    B, T, H, S = 2, 2, 4, 50
    kv8, kvs = act_quant(torch.randn(B, S, 512))
    pe = torch.randn(B, S, 64).bfloat16()
    q, qpe = torch.randn(B, T, H, 512) * 0.1, torch.randn(B, T, H, 64) * 0.1
    lens = torch.tensor([10, 47])
    idx = torch.arange(S, dtype=torch.int32).expand(B, T, S).contiguous()
    dense = mla_decode_ref(q, qpe, kv8, kvs, pe, lens, 0.1)
    sparse = mla_decode_ref(q, qpe, kv8, kvs, pe, lens, 0.1, topk_idx=idx)
    assert torch.allclose(dense, sparse)


def test_indexer_topk_padding():
    scores = torch.tensor([[[1.0, 3.0, float("-inf"), 2.0]]])
    assert topk_from_scores(scores, 6, sorted=True).tolist() == [[[1, 3, 0, -1, -1, -1]]]
    assert sorted(topk_from_scores(scores, 6)[0, 0].tolist()) == [-1, -1, -1, 0, 1, 3]
    q8, qs = act_quant(torch.randn(1, 1, 16, 128))
    k8, ks = act_quant(torch.randn(1, 5, 128))
    idx, sc = indexer_topk_ref(q8, qs[..., 0], torch.rand(1, 1, 16), k8, ks[..., 0], torch.tensor([2]), topk=4)
    assert set(idx[0, 0, :3].tolist()) == {0, 1, 2} and idx[0, 0, 3] == -1
