"""Draft-tree verifies on the Triton fast path, under the Triton interpreter on the CPU (a subprocess started with
TRITON_INTERPRET=1, this file as a script: the interpreter is chosen when the kernels are decorated).

Shape legend: B batch, T queries (tree nodes), S keys, N nodes, J top-k.

- kernels: the indexer scores kernel with a visibility mask, its top-k (radix, radix_fused, torch) equal to the
  reference selection (`topk_select_ref` over `indexer_scores_ref`: `Indexer.select`'s rule) and never a key the
  node may not see; `mla_decode` with the visibility (dense) and with a top-k (sparse) against `mla_decode_ref`.
- model: a small model the MLA kernels accept (latent 512, rope 64, 16 indexer heads), fp32, FP8 numerics, on
  the fast path: the tree verify gives, at the nodes of every root-to-leaf path, the logits of a causal forward
  over context + that path alone (and a causal verify of all nodes does not); a chain written as a tree equals
  the causal forward bit for bit. Two regimes: every node sees <= index_topk keys (the visibility is the
  selection: dense `mla_decode`) and more (per-node top-k: indexer kernel + sparse `mla_decode`).
tests/decode/test_tree_gpu.py holds the fast tree verify to the reference one at real widths on a GPU, and strict
tree decoding on the fast path to plain greedy.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`
from tests.interp import interpreted_main, run_interpreted  # noqa: E402


def test_tree_kernels_interpreted():
    run_interpreted(__file__, 300, "kernels")


@pytest.mark.slow
def test_tree_verify_on_the_fast_path_interpreted():
    run_interpreted(__file__, 600, "model")


# ----------------------------------------------------------------------------- run under TRITON_INTERPRET=1
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _tree_vis(lens: list[int], tree, S: int) -> torch.Tensor:
    """[B, N, S] visibility of a tree whose nodes sit at slots lens[b]..lens[b] + N - 1."""
    from mtp.model.layers import tree_visibility

    return tree_visibility(torch.tensor(lens), tree.ancestor_mask(), S)


def _kernel_checks() -> None:
    from mtp.spec.tree_shape import TreeShape
    from mtp.kernels.indexer import TOPK_IMPLS, indexer_scores, indexer_scores_ref, indexer_topk
    from mtp.kernels.mla_decode import mla_decode, mla_decode_ref
    from mtp.kernels.topk import topk_select_ref
    from mtp.model.fp8 import act_quant

    g = torch.Generator().manual_seed(3)
    tree = TreeShape.from_branching((2, 2))
    N, S = tree.n_nodes, 150
    lens = [120, 40]  # row 1's nodes see 41..43 keys: fewer than J = 64, more than J = 32
    B = len(lens)
    vis = _tree_vis(lens, tree, S)
    L = torch.tensor(lens, dtype=torch.int32)
    q8, qs = act_quant(torch.randn(B, N, 16, 128, generator=g))
    k8, ks = act_quant(torch.randn(B, S, 128, generator=g))
    w = torch.randn(B, N, 16, generator=g)
    ref = indexer_scores_ref(q8, qs[..., 0], w, k8, ks[..., 0], L, visible=vis)
    got = indexer_scores(q8, qs[..., 0], w, k8, ks[..., 0], L, visible=vis)
    seen = ref != float("-inf")
    assert torch.equal(seen, vis & (torch.arange(S) < (L.view(B, 1, 1) + torch.arange(N).view(1, N, 1) + 1)))
    assert torch.equal(got == float("-inf"), ~seen) and _rel(got[seen], ref[seen]) < 1e-6
    for J in (32, 64, 200):
        want = topk_select_ref(got, L, J)
        for impl in TOPK_IMPLS:
            idx, _ = indexer_topk(q8, qs[..., 0], w, k8, ks[..., 0], L, J, impl=impl, visible=vis)
            picked = idx.long()
            ok = picked >= 0
            assert bool(vis.gather(2, picked.clamp_min(0))[ok].all()), f"{impl}: picked a key the node may not see"
            if impl == "torch":  # torch.topk's order and tie rule: compare the sets
                assert torch.equal(idx.sort(-1).values, want.sort(-1).values), (impl, J)
            else:
                assert torch.equal(idx, want), (impl, J)
    # attention: the visibility alone (every seen key attended) and a per-node top-k
    H = 3
    q = torch.randn(B, N, H, 512, generator=g)
    qpe = torch.randn(B, N, H, 64, generator=g)
    kv8, kvs = act_quant(torch.randn(B, S, 512, generator=g))
    pe = torch.randn(B, S, 64, generator=g)
    o = mla_decode(q, qpe, kv8, kvs, pe, L, 0.07, visible=vis)
    r = mla_decode_ref(q, qpe, kv8, kvs, pe, L, 0.07, visible=vis)
    causal = mla_decode_ref(q, qpe, kv8, kvs, pe, L, 0.07)
    assert _rel(o, r) < 1e-5 and _rel(causal, r) > 1e-3, (_rel(o, r), _rel(causal, r))
    idx = topk_select_ref(ref, L, 64)
    for variant in ("fused", "split4"):
        o = mla_decode(q, qpe, kv8, kvs, pe, L, 0.07, topk_idx=idx, variant=variant)
        assert _rel(o, mla_decode_ref(q, qpe, kv8, kvs, pe, L, 0.07, topk_idx=idx, visible=vis)) < 1e-5, variant


def _model_checks() -> None:
    """The tree verify on the fast path against the fast path's own causal forwards, path by path (the oracle of
    tests/draft/test_tree.py): the interpreter's in-kernel FP8 casts are not CUDA's, so its fast path sits ~0.2 (rel L2)
    from the reference on this random model, tree or not; the GPU test holds fast to reference."""
    from mtp.backends.fast_path import FastMLA, FastPathOptions, install_fast_modules
    from mtp.checkpoint.files import load_model, save_checkpoint
    from mtp.checkpoint.tiny import random_tensors, tiny_config
    from mtp.kernels import topk
    from mtp.spec.tree_shape import TreeShape

    # the MLA kernels need latent 512, rope 64 and >= 16 indexer heads; 2 dense layers keep it quick
    cfg = dataclasses.replace(tiny_config(), kv_lora_rank=512, index_n_heads=16, num_attention_heads=4,
                              num_hidden_layers=2, first_k_dense_replace=2, num_nextn_predict_layers=0)
    path = save_checkpoint(random_tensors(cfg, seed=0), cfg, Path(tempfile.mkdtemp()) / "m")
    model = load_model(path, dtype=torch.float32, numerics="fp8")
    install_fast_modules(model, options=FastPathOptions(absorb=False))
    assert all(isinstance(layer.self_attn, FastMLA) for layer in model.model.layers)
    g = torch.Generator().manual_seed(0)
    tree = TreeShape.from_paths([(0,), (1,), (0, 0), (0, 1)])  # siblings at depths 1 and 2; leaves 2, 3, 4
    N = tree.n_nodes
    # absorb off (above): its kernel's bf16 weights meet the interpreter's wrong bf16 tl.dot (the einsum path)
    for lens in ([5, 3], [22, 19]):  # S <= index_topk = 16 (dense), then a per-node top-k (sparse)
        B, P = len(lens), max(lens)
        L = torch.tensor(lens)
        prompt = torch.randint(0, cfg.vocab_size, (B, P), generator=g)
        nodes = torch.randint(0, cfg.vocab_size, (B, N), generator=g)
        cache = model.new_cache(B, P + N + 2)
        with torch.no_grad():
            model(prompt, cache)

            def verify(toks, shape=None):
                cache.truncate(L)  # each verify writes past the rows' lengths only
                kw = dict(tree_depth=shape.depth_tensor(), tree_mask=shape.ancestor_mask()) if shape else {}
                return model(toks, cache, kv_len=P + toks.shape[1], **kw).logits

            got = verify(nodes, tree)
            causal = verify(nodes)  # every node sees the nodes before it: not the tree
            # the leaves whose paths skip an earlier sibling: [0, 2] (not node 1) and [0, 1, 4] (not nodes 2, 3);
            # leaf 3's path [0, 1, 3] asks less of the mask than leaf 4's (not node 2 alone)
            for leaf in (2, 4):
                assert leaf in tree.leaves
                p = list(tree.path(leaf))
                want = verify(nodes[:, p])
                err, off = _rel(got[:, p], want), _rel(causal[:, p], want)
                print(f"lens {lens} path {p}: tree vs causal path forward {err:.1e} (causal verify {off:.1e})")
                assert err < 1e-4 and (p == list(range(len(p))) or off > 1e-2), (lens, p, err, off)
            chain = TreeShape.chain(N - 1)  # a chain written as a tree: the causal kernels' rows, bit for bit
            assert torch.equal(verify(nodes, chain), causal), lens
            if P + N > cfg.index_topk:  # the top-k ran on its kept workspaces, left zeroed
                assert topk._KEPT and not any(ws.any() for ws in topk._KEPT.values())
                model.fast_options.set(topk_rearm=False)  # a zeroed workspace per call: the same logits
                assert torch.equal(verify(nodes, tree), got), lens
                model.fast_options.set(topk_rearm=True)


if __name__ == "__main__":
    interpreted_main({"kernels": _kernel_checks, "model": _model_checks})
