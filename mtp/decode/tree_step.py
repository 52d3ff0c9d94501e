"""The tree step: draft a tree -> verify every node in one forward -> accept a path -> commit it (cache compaction)
and roll back the rest. Device work only, every update in place, so `GraphRunner` captures it as one CUDA graph
per tree shape.

Shape legend: B batch, S buffer positions, N tree nodes, A = max depth + 1, D width, C sibling ranks.

The engine (engine.py) runs this or the chain step (chain.py) through the same loop, with accept.py's accept /
commit / count: the tree passes the drafts along its verdict's path to `accept` and the path to `commit`, which
compacts the cache instead of lowering its lengths. On the fast path the three run in one launch (`fused_commit`,
switch step_commit, as a chain's), and the path's compaction, its target hidden rows and the tree's counters in one
more (`kernels.tree_commit`, switch tree_glue; off: `KVCache.compact` and `keep_path`, the torch reference). Each
step the N nodes (node 0 = x_{n-1}) are written at cache slots n-1..n-2+N; after verification the kept path's slots
move to n-1.. and the cache ends at n_new - 1.
Tree sampling draws from one torch.Generator per engine, seeded per call (hence eager only: a replayed graph
would not advance it; `GenerationConfig` refuses the graph modes for it).

Launches (`python -m mtp.bench.step_launches --tree 2x1x1`, a tiny TP=2 rank, 2 rows): glue 54 a step (session 25;
98 before the proposer's constants and its first window's kernel, switch tree_window; 122 with tree_verdict off, session 23's count, against which that session counted 173 with tree_glue off, 173 with
tree_fwd_glue off and 289 with every glue switch off). After the verify: the drafts' path gather, the commit kernel
and the tree glue kernel (3; with tree_glue off 39: the commit's base, the compaction's 16 launches, the hidden rows'
and counters' 20). Each tree forward (the verify and the drafter's, 3 a step) takes its slots, the angles of its
nodes' positions (from the table, at the tree's first slot + depth) and its visibility in one launch
(`Rotary.tree_slots` on the fast path, switch tree_fwd_glue; off: the slots' 4 launches, the angles' 4 and
`tree_visibility`'s 10, 54 a step). The strict verdict is one launch (`verify.tree.strict_argmax`: switch
tree_verdict, `kernels.tree_verdict`; off: `tree_strict_verdict`'s 25 torch launches). The proposer (before the
verify): its first window in one launch (switch tree_window; off: 12 torch launches), the root's hidden row, a top-k
per depth and one cat each for the nodes' tokens and logits.
"""

from __future__ import annotations

import torch

from ..draft.proposer import pick_hidden
from ..draft.tree_proposer import TreeProposer, sampled_children, topk_children
from ..model.deepseek import DeepseekV32
from ..spec.draws import filter_probs
from ..model.static import arange
from .accept import accept, commit, count, fused_commit, fused_commit_takes
from .config import GenerationConfig
from .health import logits_nonfinite, scan
from .state import StatePool, TreeState
from .tree_metrics import TreeMetrics


class TreeStep:
    """One tree step on a `TreeState`; the same hooks as `ChainStep` for the engine's loop."""

    def __init__(self, model: DeepseekV32, g: GenerationConfig, stops: torch.Tensor, clock):
        self.model, self.g, self.tree, self.stops, self.clock = model, g, g.draft.tree, stops, clock
        # a registered name whose rule does not load fails here; a greedy verifier's rule of the argmax gets it from
        # the health check's scan (one launch on the fast path: `ChainRule`)
        self.rule, self.of_argmax = g.verifier.tree_rule(), g.verifier.tree_argmax_rule()
        self.gen = torch.Generator(device=model.device)  # seeded per call (tree sampling; eager only)
        self.draw = (topk_children if g.draft.sampling == "greedy"
                     else sampled_children(lambda lg: filter_probs(lg, g.sampling), self.gen))
        self.reach = self.tree.n_nodes  # a step writes N positions past the bound it is given
        self.W = 0  # the tree proposer keeps its own windows

    def pool(self, on_drop) -> StatePool:
        tree, dev = self.tree, self.model.device

        def extras(B: int) -> dict:
            return dict(rank_DC=torch.zeros(tree.max_depth, tree.max_rank + 1, dtype=torch.long, device=dev),
                        live_nodes=torch.zeros((), dtype=torch.long, device=dev))

        return StatePool(self.model, self.g, lambda m, d, B, L: TreeProposer(m, d, d.tree, B, L), on_drop,
                         state_cls=TreeState, extras=extras)

    def seed(self, seeds: list[int]) -> None:
        self.gen.manual_seed(seeds[0])  # one generator for the batch (generate refuses differing seeds)

    def first_rng(self, st: TreeState) -> torch.Generator:
        return self.gen

    def check(self, prompts: list[list[int]]) -> None:
        d, D = self.g.draft.drafter, self.tree.max_depth
        short = min(map(len, prompts))
        if short < d.tree_min_prompt(D):
            raise ValueError(f"{d.name} trees of depth {D} need prompts of at least {d.tree_min_prompt(D)} tokens "
                             f"(module m reads position n-1-m), got a prompt of {short}")

    def draft_prefill(self, st: TreeState, max_n: int) -> None:
        """Every module's cache and hidden buffer over the prompt (one pass: trees take no prefill_chunk)."""
        st.proposer.prefill(st.tokens, st.hidden, st.n_B, st.Tp, max_n=max_n)

    def draft_forwards(self, st: TreeState, target_forwards: int, drafting: bool, fw0: int) -> int:
        """The drafter's forwards per tree step, plus the prefill's window per cache (counted, as a chain's)."""
        d = self.g.draft.drafter
        return d.tree_forwards(self.tree.max_depth) * target_forwards + len(st.proposer.caches) * drafting

    def extra_metrics(self, st: TreeState, met) -> TreeMetrics:
        """The tree's own metrics (acceptance per depth and sibling rank, live nodes), from the chain's `met`."""
        t = TreeMetrics(self.tree.n_nodes, self.tree.max_depth, list(met.accepted_hist), st.rank_DC.tolist(),
                        row_steps=met.row_steps, live_nodes=int(st.live_nodes),
                        relaxed_only_accepts=met.relaxed_only_accepts)
        for name in ("target_forwards", "draft_forwards", "new_tokens", "time_prefill_s", "time_decode_s",
                     "time_draft_prefill_s", "graph_replays", "graph_captures", "graph_capture_s", "gpu_busy_ms", "gpu_idle_ms"):
            setattr(t, name, getattr(met, name))
        return t

    def __call__(self, st: TreeState, W: int, max_n: int, marks: list | None = None) -> None:
        """One tree step, device ops only, every update in place; `max_n` bounds the positions touched."""
        m, g, N = self.model, self.g, self.tree.n_nodes
        tt = st.proposer.tt
        dev = st.n_B.device
        active_B = ~st.finished_B
        dr = st.proposer.propose(st.tokens, st.hidden, st.n_B, self.draw, max_n, g.draft.min_draft_prob)
        if marks is not None:
            marks.append(self.clock())
        live = dr.live_BN if g.draft.min_draft_prob > 0 else None
        out = m(dr.tokens_BN, st.cache, kv_len=max_n - 1 + N, tree_depth=tt.depth_N, tree_mask=tt.ancestor_NN)
        opts = getattr(m, "fast_options", None)
        if self.of_argmax is not None:
            v = self.of_argmax(g, tt, dr, scan(out.logits, opts, st.nonfinite), live, opts)
        else:
            logits_nonfinite(st.nonfinite, out.logits, opts)
            v = self.rule(g, tt, dr, out.logits, st.think_B, self.gen, live)
        drafts_BK = dr.tokens_BN.gather(1, v.path_BA[:, 1:])
        h_out = pick_hidden(out, g.draft.target_hidden)
        fused = fused_commit_takes(opts, g.think_ids, st, drafts_BK, v, self.stops)
        if fused and opts.tree_glue and tree_glue_takes(st, h_out, v.path_BA, dr.live_BN):
            from ..kernels.tree_commit import tree_commit

            # accept + commit + count in one launch (switch step_commit), then the path's compaction, hidden rows and
            # the tree's counters in one more (switch tree_glue; it reads n and keep as the commit left them)
            fused_commit(st, drafts_BK, v, self.stops, None, opts.glue_pdl_at(st.B))
            tree_commit(st.cache, st.n_B, st.keep_B, v.path_BA, st.hidden, h_out, active_B, v.accept_len_B, tt.rank_N,
                        st.rank_DC, dr.live_BN, st.live_nodes, opts.glue_pdl_at(st.B))
            return
        # the kept path's positions n.. (read before commit moves n; its hidden rows go to n-1..)
        A = v.path_BA.shape[1]
        ar_A = arange(A, dev)  # the kept 0..A-1: the path's positions here, its kept entries after the commit
        pos_BA = (st.n_B.unsqueeze(1) + ar_A).clamp_max(st.max_len - 1)
        if fused:
            # accept + commit + count in one launch (switch step_commit), then the path's compaction by torch
            fused_commit(st, drafts_BK, v, self.stops, None, opts.glue_pdl_at(st.B), path_BA=v.path_BA)
            kept_BA = ar_A.unsqueeze(0) < st.keep_B.unsqueeze(1)
            accepted_B = v.accept_len_B  # `accept`'s accepted_B wherever a row is active (the only rows counted)
        else:
            acc = accept(drafts_BK, v, active_B, self.stops, st.max_new_B - st.gen_B)
            kept_BA, accepted_B = acc.kept_BK1, acc.accepted_B
            commit(st, acc, g.think_ids, path_BA=v.path_BA)
            count(st, acc, v.relaxed_only_B, active_B)
        keep_path(st, h_out, v.path_BA, pos_BA, kept_BA, accepted_B, active_B, tt.rank_N, dr.live_BN)


def tree_glue_takes(st: TreeState, h_BND: torch.Tensor, path_BA: torch.Tensor, live_BN: torch.Tensor) -> bool:
    """Whether `kernels.tree_commit` takes this step's compaction, hidden rows and counters (its shapes' limits:
    `tree_commit.tree_commit_takes`); the caller checks the switches (step_commit, tree_glue)."""
    from ..kernels.tree_commit import tree_commit_takes

    return tree_commit_takes(st.cache, st.hidden, h_BND, path_BA, st.rank_DC, live_BN)


def keep_path(st: TreeState, h_BND: torch.Tensor, path_BA: torch.Tensor, pos_BA: torch.Tensor, kept_BA: torch.Tensor,
              accepted_B: torch.Tensor, active_B: torch.Tensor, rank_N: torch.Tensor, live_BN: torch.Tensor) -> None:
    """After the commit, by torch ops: the target hidden rows h_BND [B, N, H] of the kept path's nodes (path_BA [B,
    A], root first) written at hidden positions pos_BA - 1 (pos_BA: n.., clamped to the buffer, from n before the
    commit) where kept_BA; the tree's counters: rank_DC[d - 1, rank_N[path[b, d]]] += 1 for the depths d <=
    accepted_B[b] of active rows (active_B: not finished when the step began), live_nodes += their live nodes
    (live_BN). The reference of `kernels.tree_commit` (with `KVCache.compact`), switch tree_glue off."""
    h_BAD = h_BND.gather(1, path_BA.unsqueeze(-1).expand(-1, -1, st.hidden.shape[-1]))
    hpos_BAD = (pos_BA - 1).unsqueeze(-1).expand_as(h_BAD)
    st.hidden.scatter_(1, hpos_BAD, torch.where(kept_BA.unsqueeze(-1), h_BAD, st.hidden.gather(1, hpos_BAD)))
    # the tree's own counters: accepted nodes per depth and sibling rank, live nodes
    D, C = st.rank_DC.shape
    depth_D = torch.arange(1, D + 1, device=path_BA.device)
    hit_BD = ((depth_D <= accepted_B.unsqueeze(1)) & active_B.unsqueeze(1)).long()
    st.rank_DC.view(-1).scatter_add_(0, ((depth_D - 1) * C + rank_N[path_BA[:, 1:]]).flatten(), hit_BD.flatten())
    st.live_nodes.add_((live_BN & active_B.unsqueeze(1)).sum())
