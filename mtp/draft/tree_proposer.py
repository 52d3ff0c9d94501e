"""Draft trees from the MTP modules: top-k (or drawn) children per node, eagle and vanilla.

Shape legend: B batch, S buffer positions, W window, N tree nodes, M nodes in one forward, D width, V vocabulary.

Notation as in proposer.py: with 1-based m, module m at position i takes the hidden g^{m-1}_i (g^0 = the target's
h_i) and the token x_{i+m}, and predicts x_{i+m+1}. A row has n committed tokens; the tree's root is x_{n-1}
and a node at depth t is a candidate for x_{n-1+t}.

- eagle: module 1 over a window of committed positions ending at n-2 gives the root's children; then, one
  forward per depth t = 1..D-1, the module takes each depth-t node's token with the module output at its parent
  (position n-2+t) and gives that node's children. Each forward writes its nodes after the earlier depths'
  in the module's cache and attends through the tree mask (a node sees the committed entries and its ancestors).
- vanilla: module m (used at depth m) needs x_{i+m}, a drafted token once i > n-1-m. Its entries at positions
  <= n-1-m use committed tokens only: a window ending there. Its entries at positions n-m..n-2 depend on the
  path: one per tree node c of depth t in 1..m-1 (position n-2-m+1+t, token of c, hidden = module m-1's
  output for c's parent), all in one tree forward. The depth-(m-1) nodes' logits give their children.
Adaptive draft length (`min_prob`): a node whose probability under the draft at its parent is below the threshold,
and everything under it, is marked dead in `live_BN`; the shapes stay static (the nodes are still drafted and
verified) and the verifiers never accept a dead node.
Windows: each module keeps the hidden states of its committed entries in a buffer; a row advances by at most
D+1 per step, so a window of W = D+1 positions ending at the module's last committed position covers every
entry that became final since the last step, and the tree entries past it are rewritten every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.deepseek import DeepseekV32
from ..spec.draws import sample
from .proposer import DraftConfig, draft_heads, pick_hidden
from ..spec.tree_shape import TreeShape


@dataclass
class TreeDraft:
    tokens_BN: torch.Tensor  # long [B, N], node 0 = x_{n-1}
    q_BNV: torch.Tensor | None  # per node, the distribution its token was drawn from (None: top-k drafts)
    logits_BNV: torch.Tensor  # draft logits at each node (predicting its children; zero at leaves)
    live_BN: torch.Tensor  # bool [B, N]: nodes the row keeps (adaptive length; all True without a threshold)


class TreeProposer:
    """Owns one cache and one hidden buffer per module used. `draw_children(logits_BMV, c, gen)` -> (tokens [B,
    M, c], q [B, M, c, V] | None) picks c children per node; `topk_children` / `sampled_children` below."""

    def __init__(self, model: DeepseekV32, dcfg: DraftConfig, tree: TreeShape, batch: int, max_len: int):
        if tree.max_depth < 1:
            raise ValueError("a draft tree needs at least one drafted node")
        dcfg.validate(model.n_mtp)
        if not dcfg.drafter.drafts or dcfg.k != tree.max_depth:
            raise ValueError(f"a tree of depth {tree.max_depth} needs DraftConfig(mode='eagle' or 'vanilla', "
                             f"k={tree.max_depth}), got mode={dcfg.mode!r}, k={dcfg.k}")
        if dcfg.vocab is not None:
            raise ValueError("draft trees do not take a draft vocabulary yet")
        self.model, self.cfg, self.tree = model, dcfg, tree
        self.heads = draft_heads(model, dcfg)  # FP8 copies of the heads (`head_fp8`), else {}: the modules' own
        self.tt = tree.tensors(model.device)
        n_mod = dcfg.n_caches  # the drafter's: one module per depth (vanilla) or one chained (eagle)
        self.caches = [model.new_cache(batch, max_len, n_layers=1) for _ in range(n_mod)]
        # g^{j+1} per position: module j's output hidden at its committed entries (module j+1's window input)
        self.g = [torch.zeros(batch, max_len, model.cfg.hidden_size, dtype=model.dtype, device=model.device)
                  for _ in range(n_mod)]
        self.W = tree.max_depth + 1
        self.draft_forwards = 0
        # node blocks per depth: nodes [level[t], level[t + 1]) have depth t
        self.level = [tree.depth.index(t) for t in range(tree.max_depth + 1)] + [tree.n_nodes]

    # ------------------------------------------------------------------ windows (committed entries)
    def _window(self, j: int, tokens_BS, hidden_BSD, n_B, W: int, max_n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Module j (0-based) over W positions ending at its last committed one, e = n-2-j (from 0 while
        e < W - 1; the entries past e are scratch and dropped). Returns its output hidden [B, D] and logits
        [B, V] at e."""
        m, cache = self.model, self.caches[j]
        e_B = n_B - 2 - j
        p0_B = (e_B - W + 1).clamp_min(0)
        pos_BW = p0_B.unsqueeze(1) + torch.arange(W, device=n_B.device)
        tok = tokens_BS.gather(1, (pos_BW + j + 1).clamp_max(tokens_BS.shape[1] - 1))
        src = hidden_BSD if j == 0 else self.g[j - 1]
        hid = src.gather(1, pos_BW.unsqueeze(-1).expand(-1, -1, src.shape[-1]))
        cache.truncate(p0_B)
        mod = self.cfg.module_for(j, m.n_mtp)
        out = m.mtp_forward(mod, tok, hid, cache, kv_len=max(max_n - 1 - j, W), head=self.heads.get(mod),
                            logits_at=(e_B - p0_B).clamp(0, W - 1).unsqueeze(1))
        self.draft_forwards += 1
        g = pick_hidden(out, self.cfg.chain_hidden)
        self.g[j].scatter_(1, pos_BW.unsqueeze(-1).expand(-1, -1, g.shape[-1]), g)
        cache.truncate(e_B + 1)
        rows = torch.arange(n_B.shape[0], device=n_B.device)
        return g[rows, (e_B - p0_B).clamp(0, W - 1)], out.logits[:, 0]

    def prefill(self, tokens_BS, hidden_BSD, n_B, W: int, max_n: int) -> None:
        """Fill every module's cache and hidden buffer over the prompt (windows of W = the longest prompt)."""
        for j in range(len(self.caches)):
            self._window(j, tokens_BS, hidden_BSD, n_B, W, max_n)

    # ------------------------------------------------------------------ the tree
    def propose(self, tokens_BS, hidden_BSD, n_B, draw_children, max_n: int, min_prob: float = 0.0) -> TreeDraft:
        """tokens_BS: committed tokens (n per row); hidden_BSD: the target hidden per position (valid <= n-2).
        `max_n`: host-known max of n_B (bounds the cache positions touched, no sync). `min_prob`: adaptive
        length threshold on each node's draft probability (softmax of the draft logits at its parent)."""
        tree, tt, lv, m = self.tree, self.tt, self.level, self.model
        B, N, V = n_B.shape[0], tree.n_nodes, m.cfg.vocab_size
        rows = torch.arange(B, device=n_B.device)
        nodes_BN = torch.zeros(B, N, dtype=torch.long, device=n_B.device)
        nodes_BN[:, 0] = tokens_BS[rows, n_B - 1]
        logits_BNV = torch.zeros(B, N, V, dtype=m.acc, device=n_B.device)
        q_BNV = None
        # out_BND: the current module's output hidden per node (root: its window entry at e)
        out_BND = torch.zeros(B, N, m.cfg.hidden_size, dtype=m.dtype, device=n_B.device)
        out_BND[:, 0], logits_root = self._window(0, tokens_BS, hidden_BSD, n_B, self.W, max_n)
        logits_BNV[:, 0] = logits_root
        for t in range(1, tree.max_depth + 1):
            q_BNV = self._children(t - 1, logits_BNV, nodes_BN, q_BNV, draw_children)
            if t == tree.max_depth:
                break
            if self.cfg.drafter.chained:
                s, e = lv[t], lv[t + 1]  # this depth's nodes, after the earlier depths in the cache
                hid, cache, logits_at = out_BND[:, tt.parent_N[s:e]], self.caches[0], None
                mod = self.cfg.module_for(t, m.n_mtp)  # the drafter's chained module (eagle: the first)
                mask, depth = tt.ancestor_NN[s:e, 1:e], tt.depth_N[s:e] - 1
            else:  # vanilla module t (0-based) over the nodes of depth 1..t, fed module t-1's outputs
                root_h, _ = self._window(t, tokens_BS, hidden_BSD, n_B, self.W, max_n)
                s, e = 1, lv[t + 1]
                hid = out_BND[:, tt.parent_N[s:e]]
                cache, mod = self.caches[t], self.cfg.module_for(t, m.n_mtp)
                mask, depth = tt.ancestor_NN[s:e, s:e], tt.depth_N[s:e] - 1
                logits_at = torch.arange(lv[t] - s, e - s, device=n_B.device).expand(B, -1)
                out_BND[:, 0] = root_h  # after `hid` was read: module t's own entry for the root
            out = m.mtp_forward(mod, nodes_BN[:, s:e], hid, cache, kv_len=max_n - 1 + e, tree_depth=depth,
                                tree_mask=mask, logits_at=logits_at, head=self.heads.get(mod))
            self.draft_forwards += 1
            out_BND[:, s:e] = pick_hidden(out, self.cfg.chain_hidden)
            logits_BNV[:, lv[t]:e] = out.logits[:, -(e - lv[t]):]
        return TreeDraft(nodes_BN, q_BNV, logits_BNV, self._live(logits_BNV, nodes_BN, min_prob))

    def _live(self, logits_BNV, nodes_BN, min_prob: float) -> torch.Tensor:
        """Bool [B, N]: nodes whose draft probability and every ancestor's are >= min_prob (the root always)."""
        tt = self.tt
        live_BN = torch.ones_like(nodes_BN, dtype=torch.bool)
        if min_prob <= 0:
            return live_BN
        par = tt.parent_N[1:]
        p_BN = logits_BNV[:, par].softmax(-1).gather(2, nodes_BN[:, 1:].unsqueeze(-1)).squeeze(-1)
        live_BN[:, 1:] = p_BN >= min_prob
        for t in range(2, self.tree.max_depth + 1):  # a dead node's subtree is dead
            kids = slice(self.level[t], self.level[t + 1])
            live_BN[:, kids] &= live_BN[:, tt.parent_N[kids]]
        return live_BN

    def _children(self, t: int, logits_BNV, nodes_BN, q_BNV, draw_children):
        """Draw the children of the depth-t nodes (rank r child <- the r-th pick at its parent)."""
        tree, tt, lv = self.tree, self.tt, self.level
        s, e = lv[t], lv[t + 1]
        kids = slice(lv[t + 1], lv[t + 2])
        c = max(tree.rank[kids]) + 1  # picks per node: up to the highest rank placed (ranks may have gaps)
        toks_BMc, q_BMcV = draw_children(logits_BNV[:, s:e], c)
        par = tt.parent_N[kids] - s
        nodes_BN[:, kids] = toks_BMc[:, par, tt.rank_N[kids]]
        if q_BMcV is None:
            return q_BNV
        if q_BNV is None:
            q_BNV = torch.zeros_like(logits_BNV, dtype=q_BMcV.dtype)
        q_BNV[:, kids] = q_BMcV[:, par, tt.rank_N[kids]]
        return q_BNV


def topk_children(logits_BMV: torch.Tensor, c: int):
    """The c best tokens per node, best first (greedy drafts: point masses, q = None)."""
    return logits_BMV.topk(c, dim=-1).indices, None


def sampled_children(probs_fn, gen: torch.Generator | None):
    """c tokens per node drawn without replacement from probs_fn(logits); each child's q is the draft
    distribution with its earlier siblings removed and renormalized (what the tree sampler needs)."""
    def draw(logits_BMV: torch.Tensor, c: int):
        q = probs_fn(logits_BMV)
        toks, qs = [], []
        for _ in range(c):
            q = q / q.sum(-1, keepdim=True).clamp_min(1e-30)
            t = sample(q, gen)
            toks.append(t)
            qs.append(q)
            q = q.scatter(-1, t.unsqueeze(-1), 0.0)
        return torch.stack(toks, -1), torch.stack(qs, -2)

    return draw
