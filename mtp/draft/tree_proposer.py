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
from ..model.static import arange
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
        # g^{j+1} per position: module j's output hidden at its committed entries, module j+1's window input (the
        # last module's is read by none: an eagle drafter keeps none)
        self.g = [torch.zeros(batch, max_len, model.cfg.hidden_size, dtype=model.dtype, device=model.device)
                  for _ in range(n_mod - 1)]
        self.W = tree.max_depth + 1
        self.draft_forwards = 0
        # node blocks per depth: nodes [level[t], level[t + 1]) have depth t
        self.level = [tree.depth.index(t) for t in range(tree.max_depth + 1)] + [tree.n_nodes]
        self._constants(model, batch)

    def _constants(self, model: DeepseekV32, batch: int) -> None:
        """Index tensors and fills a step reads, made once per tree shape (a captured step launches nothing for them).
        A kept tensor is read-only. None where the index is the identity (a view is taken instead)."""
        tree, lv, dev, D = self.tree, self.level, model.device, self.tree.max_depth

        def index(ix: list[int], n: int):  # None: ix is 0..n-1 (take the whole block)
            return None if ix == list(range(n)) else torch.tensor(ix, dtype=torch.long, device=dev)

        # children of depth t: node i <- pick (parent - level[t]) * c + rank of the [M * c] drawn tokens
        self.picks, self.kid_picks = [], []
        for t in range(D):
            kids = range(lv[t + 1], lv[t + 2])
            c = max(tree.rank[i] for i in kids) + 1  # up to the highest rank placed (ranks may have gaps)
            ix = [(tree.parents[i] - lv[t]) * c + tree.rank[i] for i in kids]
            self.picks.append(c)
            self.kid_picks.append(index(ix, (lv[t + 1] - lv[t]) * c))
        # each tree forward t = 1..D-1: its nodes' parents within the hidden block it reads, its depths (0-based)
        self.fwd_parents, self.fwd_depth, self.fwd_logits_at = [None], [None], [None]
        for t in range(1, D):
            s = lv[t] if self.cfg.drafter.chained else 1
            e = lv[t + 1]
            if self.cfg.drafter.chained:  # depth t's parents: depth t-1's nodes, the previous forward's block
                self.fwd_parents.append(index([tree.parents[i] - lv[t - 1] for i in range(s, e)], lv[t] - lv[t - 1]))
            else:  # vanilla: nodes 1..e-1's parents among nodes 0..level[t]-1 (module t-1's outputs)
                self.fwd_parents.append(torch.tensor(tree.parents[s:e], dtype=torch.long, device=dev))
            self.fwd_depth.append(self.tt.depth_N[s:e] - 1)
            self.fwd_logits_at.append(None if self.cfg.drafter.chained else torch.arange(lv[t] - s, e - s, device=dev))
        # the leaves' logits rows (depth D: no forward gives them; zero), every node live (no adaptive threshold)
        self.leaf_logits = torch.zeros(1, tree.n_nodes - lv[D], model.cfg.vocab_size, dtype=model.acc, device=dev)
        self.all_live = torch.ones(batch, tree.n_nodes, dtype=torch.bool, device=dev)

    # ------------------------------------------------------------------ windows (committed entries)
    def _window(self, j: int, tokens_BS, hidden_BSD, n_B, W: int, max_n: int):
        """Module j (0-based) over W positions ending at its last committed one, e = n-2-j (from 0 while
        e < W - 1; the entries past e are scratch and dropped). Returns its output hidden over the window [B, W, D],
        the window's row at e (clamped to 0..W-1, as its start is) [B], the logits there [B, 1, V] and (module 0)
        the root token x_{n-1} [B, 1] (else None)."""
        m, cache = self.model, self.caches[j]
        tok, hid, at_B, root_B1 = self._window_inputs(j, tokens_BS, hidden_BSD, n_B, W)
        mod = self.cfg.module_for(j, m.n_mtp)
        out = m.mtp_forward(mod, tok, hid, cache, kv_len=max(max_n - 1 - j, W), head=self.heads.get(mod),
                            logits_at=at_B.unsqueeze(1))
        self.draft_forwards += 1
        g = pick_hidden(out, self.cfg.chain_hidden)
        if j < len(self.g):  # module j + 1's window input (vanilla)
            pos_BW = (n_B - (1 + j + W)).clamp_min(0).unsqueeze(1) + arange(W, n_B.device)
            self.g[j].scatter_(1, pos_BW.unsqueeze(-1).expand(-1, -1, g.shape[-1]), g)
        cache.truncate(n_B, 1 + j)  # e + 1
        return g, at_B, out.logits, root_B1

    def _window_inputs(self, j: int, tokens_BS, hidden_BSD, n_B, W: int):
        """(tok_BW, hid_BWD, at_B, root_B1 | None): module j's window start p0 = max(e - W + 1, 0) (its cache rolled
        back to it), its tokens (positions p0 + j + 1.., clamped to the buffer), its input hidden rows (the target's for
        module 0, else module j-1's), the window's row at e, n-2-j clamped to 0..W-1 (= e - p0 clamped) and, module
        0's, the root token. Module 0's in one launch on the fast path (switch tree_window, `kernels.draft_window.
        tree_window`: the same integers and rows), else these torch ops (12 launches)."""
        cache = self.caches[j]
        opts = getattr(self.model, "fast_options", None)  # read at call time: the switches may change between calls
        if j == 0 and opts is not None and opts.tree_window:
            from ..kernels.draft_window import tree_window, window_takes  # the fast path's: no Triton import here

            if window_takes(tokens_BS, hidden_BSD, n_B, cache.seq_lens):
                return tree_window(tokens_BS, hidden_BSD, n_B, cache.seq_lens, W,
                                   pdl=opts.glue_pdl_at(n_B.shape[0] * W))
        p0_B = (n_B - (1 + j + W)).clamp_min(0)
        cache.truncate(p0_B)
        pos_BW = p0_B.unsqueeze(1) + arange(W, n_B.device)
        tok = tokens_BS.gather(1, (pos_BW + (j + 1)).clamp_max(tokens_BS.shape[1] - 1))
        src = hidden_BSD if j == 0 else self.g[j - 1]
        hid = src.gather(1, pos_BW.unsqueeze(-1).expand(-1, -1, src.shape[-1]))
        root_B1 = tokens_BS.gather(1, (n_B - 1).unsqueeze(1)) if j == 0 else None
        return tok, hid, (n_B - (2 + j)).clamp(0, W - 1), root_B1

    def prefill(self, tokens_BS, hidden_BSD, n_B, W: int, max_n: int) -> None:
        """Fill every module's cache and hidden buffer over the prompt (windows of W = the longest prompt)."""
        for j in range(len(self.caches)):
            self._window(j, tokens_BS, hidden_BSD, n_B, W, max_n)

    # ------------------------------------------------------------------ the tree
    def propose(self, tokens_BS, hidden_BSD, n_B, draw_children, max_n: int, min_prob: float = 0.0) -> TreeDraft:
        """tokens_BS: committed tokens (n per row); hidden_BSD: the target hidden per position (valid <= n-2).
        `max_n`: host-known max of n_B (bounds the cache positions touched, no sync). `min_prob`: adaptive
        length threshold on each node's draft probability (softmax of the draft logits at its parent).
        Each depth's tokens, distributions and logits are kept apart and joined once at the end (a cat each, where
        writing every depth into [B, N] buffers was a zero fill and a copy a depth)."""
        tree, tt, lv, m = self.tree, self.tt, self.level, self.model
        B = n_B.shape[0]
        g_BWD, at_B, logits, root_B1 = self._window(0, tokens_BS, hidden_BSD, n_B, self.W, max_n)
        toks = [root_B1]  # per depth: the nodes' tokens [B, M_t] (root: x_{n-1})
        logits = [logits]  # per depth < D: the draft logits at its nodes [B, M_t, V]
        qs = []  # per depth >= 1: the distributions its nodes were drawn from [B, M_t, V] (sampled children)
        # the hidden block the next forward's nodes take their parents' rows from: the root's window entry, once per
        # depth-1 node (eagle; vanilla: module t-1's output hidden per node of depth < t, root first)
        chained, D = self.cfg.drafter.chained, tree.max_depth
        if chained and D > 1:
            prev_BMD = g_BWD.gather(1, at_B.view(B, 1, 1).expand(-1, lv[2] - lv[1], g_BWD.shape[-1]))
        elif D > 1:
            out_BND = torch.empty(B, lv[D], m.cfg.hidden_size, dtype=m.dtype, device=n_B.device)
            out_BND[:, :1] = g_BWD.gather(1, at_B.view(B, 1, 1).expand(-1, 1, g_BWD.shape[-1]))
        for t in range(1, D + 1):
            self._children(t - 1, logits[-1], toks, qs, draw_children)
            if t == D:
                break
            e = lv[t + 1]
            if chained:  # depth t's nodes, after the earlier depths in the cache
                s, cache, nodes, logits_at = lv[t], self.caches[0], toks[t], None
                par = self.fwd_parents[t]  # within the previous forward's block (t = 1: taken by the gather above)
                hid = prev_BMD if par is None or t == 1 else prev_BMD[:, par]
                mod = self.cfg.module_for(t, m.n_mtp)  # the drafter's chained module (eagle: the first)
                mask = tt.ancestor_NN[s:e, 1:e]
            else:  # vanilla module t (0-based) over the nodes of depth 1..t, fed module t-1's outputs
                root_g, root_at, _, _ = self._window(t, tokens_BS, hidden_BSD, n_B, self.W, max_n)
                s = 1
                hid = out_BND[:, self.fwd_parents[t]]
                nodes = torch.cat(toks[1:t + 1], 1) if t > 1 else toks[1]
                cache, mod = self.caches[t], self.cfg.module_for(t, m.n_mtp)
                mask, logits_at = tt.ancestor_NN[s:e, s:e], self.fwd_logits_at[t].expand(B, -1)
                if t + 1 < D:  # after `hid` was read: module t's own entry for the root
                    out_BND[:, :1] = root_g.gather(1, root_at.view(B, 1, 1).expand(-1, 1, root_g.shape[-1]))
            out = m.mtp_forward(mod, nodes, hid, cache, kv_len=max_n - 1 + e, tree_depth=self.fwd_depth[t],
                                tree_mask=mask, logits_at=logits_at, head=self.heads.get(mod))
            self.draft_forwards += 1
            prev_BMD = pick_hidden(out, self.cfg.chain_hidden)
            if not chained and t + 1 < D:  # read by the next module's forward
                out_BND[:, s:e] = prev_BMD
            logits.append(out.logits[:, -(e - lv[t]):])
        logits_BNV = torch.cat([*logits, self.leaf_logits.expand(B, -1, -1)], 1)
        nodes_BN = torch.cat(toks, 1)
        q_BNV = None if not qs else torch.cat([qs[0].new_zeros(B, 1, qs[0].shape[-1]), *qs], 1)
        return TreeDraft(nodes_BN, q_BNV, logits_BNV, self._live(logits_BNV, nodes_BN, min_prob))

    def _live(self, logits_BNV, nodes_BN, min_prob: float) -> torch.Tensor:
        """Bool [B, N]: nodes whose draft probability and every ancestor's are >= min_prob (the root always); without
        a threshold the kept all-True tensor (read-only)."""
        tt = self.tt
        if min_prob <= 0 and self.all_live.shape == nodes_BN.shape:
            return self.all_live
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

    def _children(self, t: int, logits_BMV, toks: list, qs: list, draw_children) -> None:
        """Draw the children of the depth-t nodes (logits_BMV: theirs; rank r child <- the r-th pick at its parent);
        appends depth t+1's tokens [B, M'] to `toks` and, where drawn from distributions, those to `qs`."""
        B, pick = logits_BMV.shape[0], self.kid_picks[t]
        toks_BMc, q_BMcV = draw_children(logits_BMV, self.picks[t])
        toks_BK = toks_BMc.reshape(B, -1)
        toks.append(toks_BK if pick is None else toks_BK[:, pick])
        if q_BMcV is not None:
            q_BKV = q_BMcV.reshape(B, -1, q_BMcV.shape[-1])
            qs.append(q_BKV if pick is None else q_BKV[:, pick])


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
