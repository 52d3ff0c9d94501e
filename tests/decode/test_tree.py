"""Tree drafting from the MTP modules and eager tree decoding, on a float64 tiny checkpoint whose MTP heads agree
with the trunk often enough to accept paths at every depth and at sibling ranks > 0.

Shape legend: B batch, S buffer positions, N tree nodes, V vocabulary.

Drafter oracle: the draft logits at a tree node c must equal those the chain proposer (mtp.draft.proposer, tested
against a from-scratch recompute in tests/draft/test_proposer.py) computes when its drafts are forced to c's path: the
tree's masks, positions and per-module windows must reproduce exactly the chain each path stands for.
Decoder oracle: strict tree decoding equals plain greedy decoding token for token.
"""

from __future__ import annotations

import pytest
import torch

from mtp import generate
from mtp.decode.tree import generate_tree
from mtp.decode.tree_metrics import TreeMetrics
from mtp.draft import DraftConfig, Proposer
from mtp.draft.proposer import pick_hidden
from mtp.spec.tree_shape import TreeShape
from mtp.draft.tree_proposer import TreeProposer, topk_children
from mtp.verify import SamplingParams

N_NEW = 14
PROMPT_LENS = (5, 23)  # index_topk = 16: one row starts dense, one sparse
SHAPES = {"b221": TreeShape.from_branching((2, 2, 1)), "b31": TreeShape.from_branching((3, 1)),
          "chain3": TreeShape.chain(3), "b4": TreeShape.from_branching((4,)),
          "paths": TreeShape.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]),
          # rank gaps, as in TensorRT-LLM's eagle_choices: (0, 1, 1) without (0, 1, 0), (2,) without (1,)
          "gaps": TreeShape.from_paths([(0,), (2,), (0, 1), (0, 1, 1), (2, 0)])}
TOL = 1e-9
TH, ETH = 510, 511  # <think>, </think> stand-ins in the 512-token tiny vocabulary


@pytest.fixture(scope="module")
def model(agreeing_model):  # tests/decode/conftest.py: one float64 tiny model whose MTP modules agree often
    return agreeing_model


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, 500, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def greedy(model, prompts):
    out = generate(model, prompts, N_NEW)
    assert out.finish_reasons == ["length"] * len(prompts), "pick prompts whose greedy output has no EOS"
    return out.tokens


# ---------------------------------------------------------------------------------------------- drafter
def forced_chain_logits(chain: Proposer, tokens_BS, hidden_BSD, n_B, p0_B, W, max_n, path_tokens_BT):
    """The chain proposer's draft logits at depth T+1 (0-based index T) when its first T drafts are forced."""
    seen = []

    def draw(logits_BV):
        seen.append(logits_BV.clone())
        j = len(seen) - 1
        return (path_tokens_BT[:, j] if j < path_tokens_BT.shape[1] else logits_BV.argmax(-1)), None

    chain.propose(tokens_BS.clone(), hidden_BSD, n_B, p0_B, W, draw, max_n)
    return seen[path_tokens_BT.shape[1]]


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
@pytest.mark.parametrize("shape", ["b221", "paths", "gaps"])
def test_tree_drafts_equal_forced_chain_drafts(model, prompts, greedy, mode, shape):
    """Over several steps (rows advancing by different amounts, up to D+1, so every window width is used)."""
    tree = SHAPES[shape]
    D, B = tree.max_depth, len(prompts)
    dcfg = DraftConfig(mode, D, reuse_modules=True)
    S = 64
    full = torch.zeros(B, S, dtype=torch.long)
    for b, (p, t) in enumerate(zip(prompts, greedy)):
        full[b, : len(p) + len(t)] = torch.tensor(p + t)
    with torch.no_grad():
        hidden = pick_hidden(model(full), "normed")  # causal: position i only sees tokens <= i
        tp, cp = TreeProposer(model, dcfg, tree, B, S), Proposer(model, dcfg, B, S)
        n = torch.tensor([len(p) + 1 for p in prompts])
        Tp = max(PROMPT_LENS)
        tp.prefill(full, hidden, n, Tp, max_n=int(n.max()))
        cp.prefill(full, hidden, n, Tp, max_n=int(n.max()))
        junk = torch.randint(0, 512, (B, S), generator=torch.Generator().manual_seed(2))
        for step in range(4):
            live = torch.where(torch.arange(S) < n.unsqueeze(1), full, junk)  # nothing past n may be read
            dr = tp.propose(live, hidden, n, topk_children, int(n.max()))
            assert torch.equal(dr.tokens_BN[:, 0], full[torch.arange(B), n - 1])
            p0 = (n - 1 - dcfg.window()).clamp_min(0)
            scale = dr.logits_BNV.abs().max()
            for c in range(tree.n_nodes):
                if not tree.children[c]:
                    continue
                path = list(tree.path(c))[1:]
                ref = forced_chain_logits(cp, live, hidden, n, p0, dcfg.window(), int(n.max()), dr.tokens_BN[:, path])
                err = float((dr.logits_BNV[:, c] - ref).abs().max() / scale)
                assert err < TOL, f"step {step}, node {c} (path {path}): max rel diff {err:.2e}"
                kids = list(tree.children[c])  # child of rank r = the r-th best token (ranks may skip)
                best = ref.topk(max(tree.rank[k] for k in kids) + 1, -1).indices
                assert torch.equal(dr.tokens_BN[:, kids], best[:, [tree.rank[k] for k in kids]]), f"children of {c}"
            n = n + (torch.arange(B) + step) % (D + 1) + 1


# ---------------------------------------------------------------------------------------------- decoding
CASES = [(mode, shape, 2) for mode in ("eagle", "vanilla") for shape in SHAPES] + [("eagle", "b221", 1),
                                                                                     ("vanilla", "b31", 1)]


@pytest.mark.parametrize("mode,shape,batch", CASES)
def test_strict_tree_decoding_equals_greedy(model, prompts, greedy, mode, shape, batch):
    tree = SHAPES[shape]
    rows = list(range(batch)) if batch == 2 else [1]
    out = generate_tree(model, [prompts[b] for b in rows], tree, N_NEW, draft=mode, reuse_modules=True)
    for i, b in enumerate(rows):
        assert out.tokens[i] == greedy[b], f"row {b} (prompt {PROMPT_LENS[b]} tokens) diverges from greedy"
    assert out.finish_reasons == ["length"] * batch
    met = out.metrics
    h = met.accepted_hist
    assert sum(h) == met.row_steps and met.new_tokens == N_NEW * batch
    for d in range(1, tree.max_depth + 1):  # every accepted path crosses depths 1..a once, at one rank
        assert sum(met.accepted_rank[d - 1]) == sum(h[d:])
        assert met.accept_depth[d - 1] == pytest.approx(sum(h[d:]) / met.row_steps)
    assert met.mean_accepted_len == pytest.approx(1 + sum(a * c for a, c in enumerate(h)) / met.row_steps)
    assert met.tokens_per_node == pytest.approx(met.mean_accepted_len / tree.n_nodes)
    assert sum(h[1:]) >= 2, h  # the point of this checkpoint: paths do get accepted
    d = met.to_dict()
    assert d["accept/mean_len"] == met.mean_accepted_len and "accept/depth_1_rank_0" in d


@pytest.mark.parametrize("mode,shape", [("eagle", "b221"), ("vanilla", "chain3")])
def test_adaptive_length_stays_greedy_and_prunes(model, prompts, greedy, mode, shape):
    """min_draft_prob prunes low-probability nodes (per row, static shapes): still exactly greedy, fewer live nodes.
    This checkpoint's drafts are flat over 512 tokens: 0.02 keeps about a third of the nodes of (2, 2, 1)."""
    tree = SHAPES[shape]
    out = generate_tree(model, prompts, tree, N_NEW, draft=mode, reuse_modules=True, min_draft_prob=0.02)
    assert out.tokens == greedy
    met = out.metrics
    assert met.row_steps < met.live_nodes < tree.n_nodes * met.row_steps and sum(met.accepted_hist[1:]) >= 1
    assert met.live_nodes >= met.mean_accepted_len * met.row_steps  # the root and every accepted node are live
    assert met.tokens_per_live_node > met.tokens_per_node
    full = generate_tree(model, prompts, tree, N_NEW, draft=mode, reuse_modules=True)
    assert full.metrics.live_nodes == tree.n_nodes * full.metrics.row_steps


def test_trees_accept_beyond_the_top_rank(model, prompts):
    """What a tree buys over a chain: some accepted nodes are not the drafter's top-1."""
    out = generate_tree(model, prompts, SHAPES["b31"], N_NEW, draft="eagle")
    assert sum(out.metrics.accepted_rank[0][1:]) >= 1, out.metrics.accepted_rank


def test_relaxed_accepts_near_misses_only_inside_the_thinking_span(model, prompts, greedy):
    """Row 0 never enters a span: it stays greedy. Row 1's prompt opens one: near misses get accepted there.
    With delta = 0 the relaxed rule is strict everywhere."""
    assert not {TH, ETH} & set(greedy[0])
    kw = dict(draft="eagle", verify="relaxed", think_ids=(TH, ETH), top_n=10)
    zero = generate_tree(model, prompts, SHAPES["b221"], N_NEW, delta=0.0, **kw)
    assert zero.tokens == greedy and zero.metrics.relaxed_only_accepts == 0
    spans = [prompts[0], prompts[1] + [TH]]
    out = generate_tree(model, spans, SHAPES["b221"], N_NEW, delta=0.6, **kw)
    assert out.tokens[0] == greedy[0]
    assert out.metrics.relaxed_only_accepts > 0
    assert generate(model, [spans[1]], N_NEW).tokens[0] != out.tokens[1]  # near misses changed row 1


@pytest.mark.parametrize("draft_sampling", ["greedy", "sample"])
def test_tree_sampling_runs_and_reproduces(model, prompts, draft_sampling):
    kw = dict(draft="eagle", verify="sample", sampling=SamplingParams(temperature=0.8), draft_sampling=draft_sampling,
              seed=3)
    a = generate_tree(model, prompts, SHAPES["b221"], 8, **kw)
    b = generate_tree(model, prompts, SHAPES["b221"], 8, **kw)
    assert a.tokens == b.tokens and all(len(t) == 8 for t in a.tokens)
    assert sum(a.metrics.accepted_hist) == a.metrics.row_steps


@pytest.mark.parametrize("kw,match", [
    (dict(verify="lenient"), "verify must be one of"),
    (dict(verify="relaxed"), "think_ids must be a"),
    (dict(draft_sampling="sample"), "draft_sampling"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(min_draft_prob=1.0), r"min_draft_prob must be a number in \[0, 1\)"),
    (dict(min_draft_prob=0.2, verify="sample", draft_sampling="sample"), "lossy"),
    (dict(draft="vanilla", prompts=[[3]]), "prompts of at least 2 tokens"),
    (dict(draft="none"), "draft must be 'eagle' or 'vanilla' with tree"),
])
def test_bad_arguments_are_rejected(model, prompts, kw, match):
    kw = dict(kw)
    ps = kw.pop("prompts", prompts)
    with pytest.raises(ValueError, match=match):
        generate_tree(model, ps, SHAPES["b221"], kw.pop("max_new_tokens", 4), reuse_modules=True, **kw)


def test_merged_metrics_keep_the_graph_counters():
    """mtp-eval merges the tree metrics of its batches; in graph / overlap mode the replays, captures and GPU
    time must add up too (they were dropped by the merge)."""
    a = TreeMetrics(7, 2, [1, 2, 3], [[1, 0], [2, 0]], graph_replays=4, graph_captures=1, graph_capture_s=0.5,
                    gpu_busy_ms=8.0, gpu_idle_ms=1.0)
    b = TreeMetrics(7, 2, [0, 1, 1], [[1, 1], [0, 1]], graph_replays=6, graph_captures=0, graph_capture_s=0.5,
                    gpu_busy_ms=12.0, gpu_idle_ms=0.5)
    m = a.merge(b)
    assert (m.graph_replays, m.graph_captures, m.graph_capture_s, m.gpu_busy_ms, m.gpu_idle_ms) == (
        10, 1, 1.0, 20.0, 1.5)
    assert m.to_dict()["graph/gpu_step_ms"] == pytest.approx(2.0)


def test_metrics_split_by_row_and_merge_across_calls(model, prompts):
    """mtp-eval reads each row's histogram from a batched call and merges its batches' metrics: the rows of one
    call must add up to the call, and two one-row calls merged must count what the batched call counts."""
    shape = SHAPES["b221"]
    both = generate_tree(model, prompts, shape, N_NEW, draft="eagle", min_draft_prob=0.05)
    rows = [generate_tree(model, [p], shape, N_NEW, draft="eagle", min_draft_prob=0.05) for p in prompts]
    assert both.tokens == [r.tokens[0] for r in rows]
    assert [sum(c) for c in zip(*both.row_accepted_hist)] == both.metrics.accepted_hist
    assert both.row_accepted_hist == [r.metrics.accepted_hist for r in rows]
    m = rows[0].metrics.merge(rows[1].metrics)
    for name in ("accepted_hist", "accepted_rank", "row_steps", "live_nodes", "new_tokens"):
        assert getattr(m, name) == getattr(both.metrics, name), name
    assert m.mean_accepted_len == pytest.approx(both.metrics.mean_accepted_len)
    assert both.metrics.time_prefill_s > 0 and both.metrics.time_decode_s > 0
    other = generate_tree(model, prompts[:1], SHAPES["b31"], 2, draft="eagle").metrics
    with pytest.raises(ValueError, match="cannot merge tree metrics of 11 nodes / depth 3 with 7 nodes / depth 2"):
        m.merge(other)


@pytest.mark.parametrize("draft_sampling,shape", [("greedy", "b31"), ("sample", "b31"), ("sample", "gaps")])
def test_tree_sampling_matches_the_target_distribution(model, draft_sampling, shape):
    """500 copies of one prompt, top_k = 3, three new tokens: the joint law of (t1, t2, t3) over its 27 cells
    matches the exact law of plain sampling (tests/decode/test_engine.py), through tree steps whose tokens are accepted
    nodes of any rank, residual samples or bonus tokens."""
    from tests.decode.test_engine import _assert_law, _joint_law

    B, prompt, sp = 500, [7, 8, 9, 10], SamplingParams(top_k=3)
    exact, _ = _joint_law(model, prompt, sp)
    assert len(exact) == 27
    r = generate_tree(model, [prompt] * B, SHAPES[shape], 3, draft="eagle", verify="sample", sampling=sp,
                      draft_sampling=draft_sampling, seed=31)
    assert sum(r.metrics.accepted_hist[1:]) > 100 and sum(r.metrics.accepted_rank[0][1:]) >= 10, r.metrics
    _assert_law(f"tree {shape}, {draft_sampling} drafts", r, exact, B)
