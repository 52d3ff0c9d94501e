"""GPU tests of draft trees: the tree-visibility kernels at real sizes, the tree verify on the Triton fast path
against the reference tree verify, strict tree decoding (reference float64 and fast path) against plain greedy,
and the captured tree step (graph / overlap) against eager, token for token.

Shape legend: B batch, N tree nodes, S keys, J top-k, V vocabulary.
"""

import tempfile

import pytest
import torch

from mtp.backends.fast_path import disable_fast_path, enable_fast_path
from mtp.checkpoint.files import load_model, save_checkpoint
from mtp.checkpoint.tiny import agreeing_mtp, random_tensors, tiny_config
from mtp.decode.engine import generate
from mtp.decode.tree import generate_tree
from mtp.spec.tree_shape import TreeShape
from mtp.model.layers import tree_visibility
from mtp.model.presets import gpu_test_config

pytestmark = [pytest.mark.gpu]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from mtp.kernels.indexer import indexer_scores_ref, indexer_topk  # noqa: E402
from mtp.kernels.mla_decode import mla_decode, mla_decode_ref  # noqa: E402
from mtp.kernels.topk import topk_select_ref  # noqa: E402
from mtp.model.fp8 import act_quant  # noqa: E402

from .test_engine_gpu import _as_float32  # noqa: E402  (the same model with its bf16 tensors widened to fp32)

DEV = "cuda"
PROMPTS = [list(range(3, 40)), list(range(50, 61)), list(range(100, 190))]  # 90 > index_topk 64: sparse rows
TREES = {"2x2": TreeShape.from_branching((2, 2)), "4x1x1": TreeShape.from_branching((4, 1, 1)),
         "paths": TreeShape.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])}


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _vis(lens, tree, S):
    return tree_visibility(torch.tensor(lens, device=DEV), tree.ancestor_mask(DEV), S)


# ----------------------------------------------------------------------------- kernels, real sizes
@pytest.mark.parametrize("impl", ["radix", "radix_fused", "torch"])
def test_indexer_topk_over_each_nodes_keys(impl):
    """S = 5000 > J = 2048 for row 0; row 1's nodes see ~1500 keys (< J: all kept)."""
    tree = TREES["paths"]
    N, S, J, H = tree.n_nodes, 5000, 2048, 64
    lens = [4990, 1500]
    B = len(lens)
    vis = _vis(lens, tree, S)
    L = torch.tensor(lens, device=DEV, dtype=torch.int32)
    q8, qs = act_quant(torch.randn(B, N, H, 128, device=DEV))
    k8, ks = act_quant(torch.randn(B, S, 128, device=DEV))
    w = torch.randn(B, N, H, device=DEV) * H ** -0.5 * 128 ** -0.5
    idx, sc = indexer_topk(q8, qs[..., 0], w, k8, ks[..., 0], L, J, impl=impl, visible=vis)
    rsc = indexer_scores_ref(q8, qs[..., 0], w, k8, ks[..., 0], L, visible=vis)
    assert torch.equal(torch.isinf(sc), torch.isinf(rsc)), "the kernel's mask differs from the reference's"
    picked = idx.long()
    assert bool(vis.gather(2, picked.clamp_min(0))[picked >= 0].all()), "a node's top-k holds a key it may not see"
    if impl != "torch":  # exactly the reference's rule on the kernel's own scores
        assert torch.equal(idx, topk_select_ref(sc, L, J))
    else:
        assert torch.equal(idx.sort(-1).values, topk_select_ref(sc, L, J).sort(-1).values)
    assert ((idx >= 0).sum(-1)[1] == vis[1, :, :].sum(-1)).all(), "row 1 sees fewer keys than J: all are kept"


@pytest.mark.parametrize("variant", ["fused", "split4"])
def test_mla_decode_with_the_tree_visibility(variant):
    tree = TREES["4x1x1"]
    N, S, H = tree.n_nodes, 1000, 128
    lens = [900, 300]
    B = len(lens)
    vis = _vis(lens, tree, S)
    L = torch.tensor(lens, device=DEV, dtype=torch.int32)
    kv8, kvs = act_quant(torch.randn(B, S, 512, device=DEV))
    pe = torch.randn(B, S, 64, device=DEV).bfloat16()
    q = torch.randn(B, N, H, 512, device=DEV) * 0.05
    qpe = torch.randn(B, N, H, 64, device=DEV) * 0.05
    o = mla_decode(q, qpe, kv8, kvs, pe, L, 0.0723, visible=vis, variant=variant)
    ref = mla_decode_ref(q, qpe, kv8, kvs, pe, L, 0.0723, visible=vis)
    assert rel(o, ref) < 1e-2, rel(o, ref)
    assert rel(mla_decode_ref(q, qpe, kv8, kvs, pe, L, 0.0723), ref) > 5 * rel(o, ref)  # the mask matters here


# ----------------------------------------------------------------------------- model: fast vs reference
def _agreeing_model(cfg, dtype):
    """A checkpoint whose MTP module agrees with the trunk often (drafts get accepted), loaded on the GPU."""
    with tempfile.TemporaryDirectory() as td:
        path = save_checkpoint(agreeing_mtp(random_tensors(cfg, seed=1), cfg), cfg, f"{td}/m")
        return load_model(path, device=DEV, dtype=dtype, numerics="fp8")


@pytest.fixture(scope="module")
def model():
    return _agreeing_model(gpu_test_config(layers=3, mtp_modules=1), torch.bfloat16)


def _tree_logits(model, prompt, nodes, tree):
    kv = model.new_cache(1, 256)
    with torch.no_grad():
        model(prompt, kv)
        return model(nodes, kv, kv_len=prompt.shape[1] + tree.n_nodes, tree_depth=tree.depth_tensor(DEV),
                     tree_mask=tree.ancestor_mask(DEV)).logits.double()


@pytest.mark.parametrize("name", list(TREES))
def test_fast_tree_verify_as_close_to_fp32_as_the_bf16_reference(model, name):
    """As tests/decode/test_engine_gpu.py holds the chain verify: the fast path's tree logits are held to what the
    bf16 reference tree verify achieves, both against an fp32 reference tree verify of the same weights; after a
    37-token prompt (every node sees <= index_topk = 64 keys) and a 90-token one (per-node top-k)."""
    tree = TREES[name]
    m32 = _as_float32(model)
    g = torch.Generator(device=DEV).manual_seed(0)
    for p in (PROMPTS[0], PROMPTS[2]):
        prompt = torch.tensor([p], device=DEV)
        nodes = torch.randint(0, model.cfg.vocab_size, (1, tree.n_nodes), device=DEV, generator=g)
        ref32 = _tree_logits(m32, prompt, nodes, tree)
        ref16 = _tree_logits(model, prompt, nodes, tree)
        enable_fast_path(model)
        try:
            fast = _tree_logits(model, prompt, nodes, tree)
        finally:
            disable_fast_path(model)
        err = lambda x: rel(x, ref32)  # noqa: E731
        print(f"{name} prompt {len(p)}: rel L2 vs fp32 reference: bf16 reference {err(ref16):.3f}, fast {err(fast):.3f}")
        assert err(fast) <= 1.5 * err(ref16) + 0.02


def test_fast_tree_verify_at_real_width():
    """The same at DeepSeek-V3.2's real widths (128 heads, 7168 wide, 256 experts; 1 dense + 1 MoE layer) with
    index_topk lowered to 64, so that a 90-token prompt takes the per-node top-k."""
    from mtp.model.presets import real_config
    from mtp.checkpoint.synthetic import random_model

    cfg = real_config(layers=2, dense_layers=1, mtp_modules=0, index_topk=64)
    m16 = random_model(cfg, device=DEV, dtype=torch.bfloat16, seed=3)
    m32 = _as_float32(m16)
    tree = TREES["paths"]
    g = torch.Generator(device=DEV).manual_seed(1)
    for n in (37, 90):
        prompt = torch.randint(0, cfg.vocab_size, (1, n), device=DEV, generator=g)
        nodes = torch.randint(0, cfg.vocab_size, (1, tree.n_nodes), device=DEV, generator=g)
        ref32, ref16 = _tree_logits(m32, prompt, nodes, tree), _tree_logits(m16, prompt, nodes, tree)
        enable_fast_path(m16)
        try:
            fast = _tree_logits(m16, prompt, nodes, tree)
        finally:
            disable_fast_path(m16)
        print(f"real width, prompt {n}: rel L2 vs fp32: bf16 reference {rel(ref16, ref32):.3f}, fast {rel(fast, ref32):.3f}")
        assert rel(fast, ref32) <= 1.5 * rel(ref16, ref32) + 0.02
    del m16, m32
    torch.cuda.empty_cache()


def _near_tie_divergence(model, prompt, want, got) -> str | None:
    """None if `got` equals `want` (plain greedy) or first departs from it where the plain path's top two logits
    nearly tie (a summation-order flip: the verify runs N tokens per forward, plain decoding one); else why not."""
    j = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
    if j is None:
        return None if len(want) == len(got) else f"lengths {len(want)} vs {len(got)}"
    with torch.no_grad():
        lg = model(torch.tensor([prompt + want[:j]], device=DEV)).logits[0, -1].double()
    top = lg.topk(2).values
    gap = (top[0] - top[1]).item()
    if gap <= 0.05 * lg.std().item():
        print(f"token {j}: {got[j]} vs greedy {want[j]} at a near tie (gap {gap:.3g}, logit std {lg.std():.3g})")
        return None
    return f"token {j}: {got[j]} vs greedy {want[j]}, top-2 gap {gap:.3g} (logit std {lg.std():.3g})"


@pytest.mark.parametrize("draft,name", [("eagle", "2x2"), ("eagle", "paths"), ("vanilla", "4x1x1")])
def test_strict_tree_decoding_on_the_fast_path_is_plain_greedy(model, draft, name):
    enable_fast_path(model)
    try:
        plain = generate(model, PROMPTS, 24).tokens
        out = generate_tree(model, PROMPTS, TREES[name], 24, draft=draft, reuse_modules=True)
        why = [_near_tie_divergence(model, p, w, g) for p, w, g in zip(PROMPTS, plain, out.tokens)]
    finally:
        disable_fast_path(model)
    print(f"{draft} {name}: AL {out.metrics.mean_accepted_len:.2f}, rows equal to greedy "
          f"{sum(w == g for w, g in zip(plain, out.tokens))}/{len(PROMPTS)}")
    assert out.metrics.mean_accepted_len > 1.2, "the agreeing model should accept drafts"
    assert not any(why), why


@pytest.mark.parametrize("draft,name", [("eagle", "2x2"), ("vanilla", "paths")])
def test_strict_tree_decoding_is_plain_greedy_on_gpu_float64(draft, name):
    m = _agreeing_model(tiny_config(mtp_modules=2), torch.float64)
    base = generate(m, PROMPTS, 20)
    out = generate_tree(m, PROMPTS, TREES[name], 20, draft=draft, reuse_modules=True)
    assert out.tokens == base.tokens
    assert out.metrics.mean_accepted_len > 1.2


# ----------------------------------------------------------------------------- the captured tree step
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("draft,name,kw", [("eagle", "2x2", {}), ("vanilla", "4x1x1", dict(min_draft_prob=0.05)),
                                           ("eagle", "paths", dict(verify="relaxed", think_ids=(5, 6)))])
def test_tree_graph_and_overlap_replay_eager(model, fast, draft, name, kw):
    """One CUDA graph per tree shape (the whole step: propose -> verify -> accept -> compact, metrics as device
    counters) replays what eager computes, token for token, on the reference and on the fast path."""
    if fast:
        enable_fast_path(model)
    try:
        outs = {mode: generate_tree(model, PROMPTS, TREES[name], 24, draft=draft, mode=mode, reuse_modules=True, **kw)
                for mode in ("eager", "graph", "overlap")}
    finally:
        if fast:
            disable_fast_path(model)
    e = outs["eager"]
    for mode in ("graph", "overlap"):
        o = outs[mode]
        assert o.tokens == e.tokens, mode
        assert o.metrics.accepted_hist == e.metrics.accepted_hist and o.metrics.accepted_rank == e.metrics.accepted_rank
        assert (o.metrics.row_steps, o.metrics.live_nodes, o.metrics.draft_forwards) == (
            e.metrics.row_steps, e.metrics.live_nodes, e.metrics.draft_forwards), mode
        assert o.metrics.graph_replays >= o.metrics.target_forwards > 0 and o.metrics.graph_capture_s > 0
    d = outs["graph"].metrics.to_dict()
    print(f"{draft} {name} fast={fast}: AL {e.metrics.mean_accepted_len:.2f}, GPU step {d['graph/gpu_step_ms']:.2f} ms")
