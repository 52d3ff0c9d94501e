"""Draft trees: the tree verify forward against plain causal forwards, path by path.

Shape legend: B batch, N tree nodes, V vocabulary, L context tokens.

Oracle: a tree verify over N nodes must give, at the nodes of every root-to-leaf path, the logits a plain
forward gives over context + that path alone (each node sees the committed cache and its own ancestors, at
rotary position seq_len + depth, and the indexer's top-k is taken per node). A float64 model, so that the two
computations (different key order and batching) agree to rounding (measured ~1e-14 of the largest logit).
Regimes: 'dense' (every node sees <= index_topk = 16 keys) and 'sparse' (contexts of 20 and 27 tokens: the
indexer drops keys, so a top-k over the wrong key set shows).
"""

from __future__ import annotations

import pytest
import torch

from mtp.checkpoint.files import load_model
from mtp.model.config import RuntimeOptions
from mtp.spec.tree_shape import TreeShape

SHAPES = {"b221": TreeShape.from_branching((2, 2, 1)), "b31": TreeShape.from_branching((3, 1)),
          "paths": TreeShape.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 1, 0, 0)]),
          "gaps": TreeShape.from_paths([(0,), (2,), (0, 1), (0, 1, 1), (2, 0)])}
TOL = 1e-9


@pytest.fixture(scope="module")
def model64(tiny_ckpt):
    return load_model(tiny_ckpt, dtype=torch.float64, numerics="fp8")


# ---------------------------------------------------------------------------------------------- verify forward
def tree_forward(model, ctx_BL, lens, tokens_BN, tree: TreeShape):
    """Prefill the contexts (row b keeps lens[b] tokens), then score every node in one tree verify."""
    B, N = tokens_BN.shape
    kv = model.new_cache(B, ctx_BL.shape[1] + 2 * N)  # room for a second verify
    model(ctx_BL, cache=kv)
    kv.truncate(torch.tensor(lens))
    out = model(tokens_BN, cache=kv, tree_depth=tree.depth_tensor(), tree_mask=tree.ancestor_mask())
    assert kv.seq_lens.tolist() == [n + N for n in lens]
    return out.logits, kv


def path_logits(model, ctx_L, path_tokens):
    """Plain causal forward (no cache) over context + path: the logits at the path's tokens."""
    ids = torch.cat((ctx_L, path_tokens)).unsqueeze(0)
    return model(ids).logits[0, ctx_L.numel():]


@pytest.mark.parametrize("attn_impl", ["naive", "absorb"])
@pytest.mark.parametrize("lens", [(5, 3), (27, 20)], ids=["dense", "sparse"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_tree_verify_equals_causal_forward_per_path(model64, attn_impl, lens, shape):
    tree = SHAPES[shape]
    g = torch.Generator().manual_seed(sum(lens) + tree.n_nodes)
    V = model64.cfg.vocab_size
    ctx = torch.randint(0, V, (2, max(lens)), generator=g)
    tokens = torch.randint(0, V, (2, tree.n_nodes), generator=g)
    saved = model64.runtime
    model64.set_runtime(RuntimeOptions(numerics="fp8", attn_impl=attn_impl))
    try:
        with torch.no_grad():
            got, _ = tree_forward(model64, ctx, lens, tokens, tree)
            scale = got.abs().max()
            for b, n in enumerate(lens):
                for leaf in tree.leaves:
                    path = list(tree.path(leaf))
                    ref = path_logits(model64, ctx[b, :n], tokens[b, path])
                    err = float((got[b, path] - ref).abs().max() / scale)
                    assert err < TOL, f"row {b}, path {path}: max rel diff {err:.2e}"
            # The oracle has power: a causal verify over the same nodes (every node sees all earlier ones) differs.
            kv = model64.new_cache(2, ctx.shape[1] + tree.n_nodes)
            model64(ctx, cache=kv)
            kv.truncate(torch.tensor(lens))
            causal = model64(tokens, cache=kv).logits
            assert (causal - got).abs().max() / scale > 1e-3
    finally:
        model64.set_runtime(saved)


def test_chain_tree_equals_the_plain_verify(model64):
    """The chain shape through the tree arguments is today's causal verify."""
    g = torch.Generator().manual_seed(3)
    ctx = torch.randint(0, 512, (2, 20), generator=g)
    tokens = torch.randint(0, 512, (2, 4), generator=g)
    with torch.no_grad():
        got, _ = tree_forward(model64, ctx, (20, 17), tokens, TreeShape.chain(3))
        kv = model64.new_cache(2, 24)
        model64(ctx, cache=kv)
        kv.truncate(torch.tensor((20, 17)))
        ref = model64(tokens, cache=kv).logits
    assert torch.allclose(got, ref, rtol=0, atol=1e-12)


def test_tree_written_depth_by_depth_equals_one_pass(model64):
    """A tree forward over part of a tree whose earlier levels are already cached (U > T, as a drafter writes
    it one depth per forward) equals the one-pass tree verify."""
    tree = SHAPES["b221"]
    g = torch.Generator().manual_seed(5)
    ctx = torch.randint(0, 512, (2, 27), generator=g)
    tokens = torch.randint(0, 512, (2, tree.n_nodes), generator=g)
    mask, depth = tree.ancestor_mask(), tree.depth_tensor()
    with torch.no_grad():
        ref, _ = tree_forward(model64, ctx, (27, 20), tokens, tree)
        kv = model64.new_cache(2, 27 + tree.n_nodes)
        model64(ctx, cache=kv)
        kv.truncate(torch.tensor((27, 20)))
        parts, s = [], 0
        for d in range(tree.max_depth + 1):
            e = s + tree.depth.count(d)
            parts.append(model64(tokens[:, s:e], cache=kv, tree_depth=depth[s:e], tree_mask=mask[s:e, :e]).logits)
            s = e
    assert torch.allclose(torch.cat(parts, 1), ref, rtol=0, atol=1e-9 * float(ref.abs().max()))


def test_tree_arguments_are_checked(model64):
    kv = model64.new_cache(1, 8)
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="both tree_depth"):
        model64(ids, cache=kv, tree_depth=torch.arange(3))
    with pytest.raises(ValueError, match="T = 3 <= U"):
        model64(ids, cache=kv, tree_depth=torch.arange(4), tree_mask=torch.ones(4, 4, dtype=torch.bool))


# ---------------------------------------------------------------------------------------------- commit / rollback
@pytest.mark.parametrize("lens", [(5, 3), (27, 20)], ids=["dense", "sparse"])
def test_compacted_path_reads_like_a_plain_decode(model64, lens):
    """Verify a tree, keep a different path prefix per row (root only, and root + 2 drafts), compact; the next
    tree verify then scores exactly as a causal forward over context + kept tokens + its own path."""
    tree = SHAPES["b221"]
    g = torch.Generator().manual_seed(11 + sum(lens))
    ctx = torch.randint(0, 512, (2, max(lens)), generator=g)
    tokens = torch.randint(0, 512, (2, tree.n_nodes), generator=g)
    nxt = torch.randint(0, 512, (2, tree.n_nodes), generator=g)
    keep = torch.tensor([1, 3])
    nodes = torch.stack([tree.path_table()[8], tree.path_table()[10]])  # paths 0-1-4-8 and 0-2-6-10
    with torch.no_grad():
        _, kv = tree_forward(model64, ctx, lens, tokens, tree)
        kv.compact(torch.tensor(lens), nodes, keep)
        assert kv.seq_lens.tolist() == [lens[0] + 1, lens[1] + 3]
        got = model64(nxt, cache=kv, tree_depth=tree.depth_tensor(), tree_mask=tree.ancestor_mask()).logits
        scale = got.abs().max()
        for b, n in enumerate(lens):
            committed = torch.cat((ctx[b, :n], tokens[b, nodes[b, : keep[b]]]))
            for leaf in tree.leaves:
                path = list(tree.path(leaf))
                ref = path_logits(model64, committed, nxt[b, path])
                err = float((got[b, path] - ref).abs().max() / scale)
                assert err < TOL, f"row {b}, path {path} after compaction: max rel diff {err:.2e}"


def test_compact_checks_shapes(model64):
    kv = model64.new_cache(2, 8)
    with pytest.raises(ValueError, match="compact needs"):
        kv.compact(torch.zeros(1, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long),
                   torch.ones(2, dtype=torch.long))
