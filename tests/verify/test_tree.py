"""Tree verifiers on crafted tensors: strict against a brute-force walk, relaxed, recursive rejection sampling.

Shape legend: B batch (trials), N tree nodes, V vocabulary.

The sampling test checks what makes multi-draft sampling lossless: every emitted token follows the target
distribution at its position, whatever the drafts (chi-square at alpha = 0.001, ~20k seeded trials).
"""

from __future__ import annotations

import pytest
import torch

from mtp.spec.tree_shape import TreeShape
from mtp.verify import (SamplingParams, filter_probs, relaxed_verify, strict_verify, tree_relaxed_verify,
                        tree_sampling_verify, tree_strict_verify)
from mtp.verify.sampling import sample
from tests.verify.test_verify import CHI2_CRIT_001, assert_follows, chi2_stat

SHAPES = [TreeShape.from_branching((2, 2, 1)), TreeShape.from_branching((3, 1)), TreeShape.chain(3),
          TreeShape.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (2, 0), (0, 1, 0)])]
TH, ETH = 6, 7


def crafted(tree: TreeShape, B: int, V: int, seed: int):
    """Random logits; each node's token is its parent's argmax with probability 1/2, else random (so every
    acceptance depth occurs)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, tree.n_nodes, V, generator=g)
    target = logits.argmax(-1)
    parent = torch.tensor(tree.parents).clamp_min(0)
    hit = torch.rand(B, tree.n_nodes, generator=g) < 0.5
    tokens = torch.where(hit, target[:, parent], torch.randint(0, V, (B, tree.n_nodes), generator=g))
    return tokens, logits


def random_live(tree: TreeShape, B: int, seed: int) -> torch.Tensor:
    """A per-row pruning (each node kept with probability 3/4, and only under a kept parent)."""
    g = torch.Generator().manual_seed(seed)
    live = torch.rand(B, tree.n_nodes, generator=g) < 0.75
    live[:, 0] = True
    for i, q in enumerate(tree.parents[1:], 1):
        live[:, i] &= live[:, q]
    return live


def brute_force(tree: TreeShape, tokens, logits, live=None):
    """Per row: every (live) node whose path matches the argmax chain; the deepest, lowest index first."""
    target = logits.argmax(-1)
    out = []
    for b in range(tokens.shape[0]):
        good = [i for i in range(tree.n_nodes)
                if all(tokens[b, n] == target[b, tree.parents[n]] and (live is None or live[b, n])
                       for n in tree.path(i)[1:])]
        last = min(good, key=lambda i: (-tree.depth[i], i))
        out.append((tree.depth[last], int(target[b, last]), tree.path(last)))
    return out


@pytest.mark.parametrize("tree", SHAPES, ids=lambda t: f"N{t.n_nodes}")
def test_strict_takes_the_longest_argmax_path(tree):
    tokens, logits = crafted(tree, 256, 5, seed=tree.n_nodes)
    v = tree_strict_verify(tree.tensors(), tokens, logits)
    for b, (a, nxt, path) in enumerate(brute_force(tree, tokens, logits)):
        assert (int(v.accept_len_B[b]), int(v.next_token_B[b])) == (a, nxt), f"row {b}"
        assert v.path_BA[b].tolist() == list(path) + [path[-1]] * (tree.max_depth - a), f"row {b}"
    assert set(v.accept_len_B.tolist()) == set(range(tree.max_depth + 1))  # every depth exercised
    assert v.relaxed_only_B.eq(0).all()


@pytest.mark.parametrize("tree", SHAPES[:2], ids=lambda t: f"N{t.n_nodes}")
def test_strict_never_accepts_a_pruned_node(tree):
    tokens, logits = crafted(tree, 256, 5, seed=7)
    live = random_live(tree, 256, seed=8)
    v = tree_strict_verify(tree.tensors(), tokens, logits, live)
    for b, (a, nxt, path) in enumerate(brute_force(tree, tokens, logits, live)):
        assert (int(v.accept_len_B[b]), int(v.next_token_B[b])) == (a, nxt), f"row {b}"
        assert v.path_BA[b, : a + 1].tolist() == list(path), f"row {b}"
    assert not torch.equal(v.accept_len_B, tree_strict_verify(tree.tensors(), tokens, logits).accept_len_B)


def test_strict_on_a_chain_equals_the_chain_verifier():
    tree = TreeShape.chain(4)
    tokens, logits = crafted(tree, 256, 5, seed=1)
    v, c = tree_strict_verify(tree.tensors(), tokens, logits), strict_verify(tokens[:, 1:], logits)
    assert torch.equal(v.accept_len_B, c.accept_len_B) and torch.equal(v.next_token_B, c.next_token_B)


def test_bad_shapes_are_rejected():
    tt = SHAPES[0].tensors()
    with pytest.raises(ValueError, match="tokens \\[B, 11\\]"):
        tree_strict_verify(tt, torch.zeros(2, 10, dtype=torch.long), torch.zeros(2, 10, 5))


# ---------------------------------------------------------------------------------------------- relaxed
@pytest.mark.parametrize("tree", SHAPES[:2], ids=lambda t: f"N{t.n_nodes}")
def test_relaxed_with_zero_delta_or_outside_spans_is_strict(tree):
    tokens, logits = crafted(tree, 256, 8, seed=2)
    tt = tree.tensors()
    for think, delta in ((1, 0.0), (0, 0.5)):
        tokens_out = tokens.clamp_max(TH - 1)  # no span markers among the drafts: the span state stays put
        s = tree_strict_verify(tt, tokens_out, logits)
        r = tree_relaxed_verify(tt, tokens_out, logits, torch.full((256,), think), 3, delta, TH, ETH)
        assert torch.equal(r.accept_len_B, s.accept_len_B) and torch.equal(r.path_BA, s.path_BA)
        assert torch.equal(r.next_token_B, s.next_token_B) and r.relaxed_only_B.eq(0).all()


def test_relaxed_follows_each_nodes_own_span_state():
    """Tree (2, 1): branch 1 closes the span, branch 2 does not; both depth-2 drafts are near misses. Only the
    branch still inside the span accepts its near miss."""
    tree = TreeShape.from_branching((2, 1))  # nodes: 0 root, 1 and 2 at depth 1, 3 under 1, 4 under 2
    V = 8
    probs = torch.full((1, 5, V), 0.01)
    probs[0, 0, [ETH, 1]] = torch.tensor([0.45, 0.44])  # root: </think> and token 1 nearly tied
    probs[0, 1:, 2], probs[0, 1:, 3] = 0.5, 0.4  # every other node: 2 is the argmax, 3 close
    logits = probs.log()
    tokens = torch.tensor([[5, ETH, 1, 3, 3]])
    tt = tree.tensors()
    r = tree_relaxed_verify(tt, tokens, logits, torch.ones(1, dtype=torch.long), 2, 0.2, TH, ETH)
    assert r.path_BA.tolist() == [[0, 2, 4]] and int(r.accept_len_B) == 2 and int(r.relaxed_only_B) == 2
    assert int(r.next_token_B) == 2
    # Same span on a chain through node 2's branch: the chain verifier agrees.
    c = relaxed_verify(tokens[:, [2, 4]], logits[:, [0, 2, 4]], torch.ones(1, dtype=torch.long), 2, 0.2, TH, ETH)
    assert int(c.accept_len_B) == 2


# ---------------------------------------------------------------------------------------------- sampling
P_ROOT = [0.30, 0.25, 0.20, 0.10, 0.10, 0.05]
Q_ROOT = [0.05, 0.10, 0.15, 0.20, 0.20, 0.30]


def conditional(x: int, V: int) -> list[float]:
    """The target's distribution after token x (differs per x, so a wrong node's logits show)."""
    w = torch.arange(1, V + 1, dtype=torch.float64).roll(x)
    return (w / w.sum()).tolist()


def draw_siblings(q_BV: torch.Tensor, k: int, g) -> tuple[torch.Tensor, torch.Tensor]:
    """k tokens per row without replacement; returns tokens [B, k] and each one's conditional distribution
    [B, k, V] (q with the earlier siblings removed, renormalized)."""
    toks, qs, q = [], [], q_BV.clone()
    for _ in range(k):
        q = q / q.sum(-1, keepdim=True)
        t = sample(q, g)
        toks.append(t)
        qs.append(q)
        q = q.scatter(1, t.unsqueeze(1), 0.0)
    return torch.stack(toks, 1), torch.stack(qs, 1)


@pytest.mark.parametrize("draws", ["topk", "sampled", "topk-pruned"])
def test_tree_sampling_keeps_the_target_distribution(draws):
    """Tree (3, 2), V = 6, 20k trials. Token 1 follows p_root; given depth-1 node x accepted, token 2 follows
    p(. | x); given a depth-2 node accepted, the bonus follows p at that node. 'pruned': a per-row live mask
    (adaptive length) removes nodes."""
    B, V = 20000, 6
    tree = TreeShape.from_branching((3, 2))
    g = torch.Generator().manual_seed({"topk": 21, "sampled": 22, "topk-pruned": 24}[draws])
    tokens = torch.zeros(B, tree.n_nodes, dtype=torch.long)
    q = torch.zeros(B, tree.n_nodes, V)
    d1, q1 = draw_siblings(torch.tensor(Q_ROOT).expand(B, V), 3, g)
    tokens[:, 1:4], q[:, 1:4] = d1, q1
    for i in range(3):  # the children of depth-1 node 1 + i: nodes 4 + 2i, 5 + 2i, drawn from a per-token q
        q_par = torch.tensor([list(reversed(conditional(x, V))) for x in range(V)])[d1[:, i]]
        d2, q2 = draw_siblings(q_par, 2, g)
        tokens[:, 4 + 2 * i: 6 + 2 * i], q[:, 4 + 2 * i: 6 + 2 * i] = d2, q2
    p = torch.zeros(B, tree.n_nodes, V)
    p[:, 0] = torch.tensor(P_ROOT)
    table = torch.tensor([conditional(x, V) for x in range(V)])
    for n in range(1, tree.n_nodes):
        p[:, n] = table[tokens[:, n]]
    live = random_live(tree, B, seed=25) if draws == "topk-pruned" else None
    v = tree_sampling_verify(tree.tensors(), tokens, q if draws == "sampled" else None, p.log(), SamplingParams(), g,
                             live)
    a, path = v.accept_len_B, v.path_BA
    if live is not None:
        assert live.gather(1, path).all()  # only kept nodes are accepted
    emitted = [torch.where(a > j, tokens.gather(1, path[:, min(j + 1, 2)].unsqueeze(1)).squeeze(1), v.next_token_B)
               for j in range(3)]
    assert_follows(emitted[0], torch.tensor(P_ROOT), f"{draws}: token 1")
    tested = 0
    for x in range(V):
        rows = (a >= 1) & (emitted[0] == x)
        if rows.sum() >= 700:  # >= 33 expected in the rarest cell
            assert_follows(emitted[1][rows], table[x], f"{draws}: token 2 after {x}")
            tested += 1
    assert tested >= 3
    for x in range(V):  # the bonus after an accepted depth-2 node with token x
        rows = (a == 2) & (emitted[1] == x)
        if rows.sum() >= 300:
            assert_follows(emitted[2][rows], table[x], f"{draws}: bonus after {x}")
            tested += 1
    assert tested >= 4
    # Power: the drafts do not follow the target, so accepting them blindly would fail.
    stat, dof = chi2_stat(tokens[:, 1], torch.tensor(P_ROOT))
    assert stat > 10 * CHI2_CRIT_001[dof]
    # Accepting a sibling beyond rank 0 happens (the tree is doing something a chain cannot).
    assert (path[:, 1] > 1).float().mean() > 0.1


def test_tree_sampling_with_top_k_stays_in_the_filtered_support():
    B, V = 4096, 6
    tree = TreeShape.from_branching((3,))
    g = torch.Generator().manual_seed(23)
    sp = SamplingParams(temperature=0.7, top_k=3)
    logits = torch.tensor(P_ROOT).log().expand(B, tree.n_nodes, V)
    tokens = torch.cat((torch.zeros(B, 1, dtype=torch.long), torch.randint(0, V, (B, 3), generator=g)), 1)
    v = tree_sampling_verify(tree.tensors(), tokens, None, logits, sp, g)
    first = torch.where(v.accept_len_B > 0, tokens.gather(1, v.path_BA[:, 1:2]).squeeze(1), v.next_token_B)
    assert_follows(first, filter_probs(logits[0, 0], sp), "top-k 3, temperature 0.7")


def test_tree_sampling_skips_children_past_the_draft_support():
    """Four children drawn without replacement from a draft with support 2: children 3 and 4 have q = 0 and are
    never accepted; the emitted token still follows p."""
    B, V = 20000, 6
    tree = TreeShape.from_branching((4,))
    g = torch.Generator().manual_seed(26)
    q_draft = torch.tensor([0.0, 0.0, 0.6, 0.4, 0.0, 0.0])
    d, q = draw_siblings(q_draft.expand(B, V), 4, g)
    q = torch.nan_to_num(q)  # the 3rd and 4th draws renormalize zero mass
    tokens = torch.cat((torch.zeros(B, 1, dtype=torch.long), d), 1)
    qs = torch.cat((torch.zeros(B, 1, V), q), 1)
    logits = torch.tensor(P_ROOT).log().expand(B, tree.n_nodes, V)
    v = tree_sampling_verify(tree.tensors(), tokens, qs, logits, SamplingParams(), g)
    assert v.path_BA[:, 1].le(2).all()  # nodes 3 and 4 never accepted
    first = torch.where(v.accept_len_B > 0, tokens.gather(1, v.path_BA[:, 1:2]).squeeze(1), v.next_token_B)
    assert_follows(first, torch.tensor(P_ROOT), "support used up")


def test_tree_sampling_is_reproducible_from_the_generator():
    tree = SHAPES[0]
    tokens, logits = crafted(tree, 64, 6, seed=4)
    runs = [tree_sampling_verify(tree.tensors(), tokens, None, logits, SamplingParams(),
                                 torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(runs[0].path_BA, runs[1].path_BA) and torch.equal(runs[0].next_token_B, runs[1].next_token_B)
