"""Eager tree decoding (reference): prefill -> [draft a tree -> verify every node in one forward -> accept a path
-> commit it (cache compaction) and roll back the rest] until done.

Shape legend: B batch, S buffer positions, N tree nodes, A = max depth + 1, D width, V vocabulary.

A separate loop from mtp/decode/engine.py on purpose: the engine is being split into stages; this is the CPU
reference the staged engine and its CUDA graph (one per tree shape) are to be held to. Same state as the engine:
n committed tokens per row in `tokens`, the target hidden per position (valid up to n-2), a target cache of
n-1 positions. Each step the tree's N nodes (node 0 = x_{n-1}) are written at cache slots n-1..n-2+N; after
verification the kept path's slots are moved to n-1.. (`KVCache.compact`) and the cache ends at n_new - 1.
Host syncs: one per step (loop condition and cache bound), as the engine's eager mode.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from ..draft.proposer import DraftConfig, pick_hidden
from ..draft.tree import TreeShape
from ..draft.tree_proposer import TreeProposer, sampled_children, topk_children
from ..model.deepseek import DeepseekV32
from ..verify import (SamplingParams, tree_relaxed_verify, tree_sampling_verify, tree_strict_verify,
                      update_think_state)
from ..verify.sampling import filter_probs, sample
from .health import logits_nonfinite, raise_nonfinite


@dataclass
class TreeMetrics:
    """Acceptance of a tree run; counting unit: one (row, step) pair of a still-active row.
    accepted_hist[a]: steps that accepted a drafts (a path to depth a); accepted_rank[d][r]: accepted nodes at
    depth d+1 with sibling rank r."""

    n_nodes: int
    max_depth: int
    accepted_hist: list[int] = field(default_factory=list)
    accepted_rank: list[list[int]] = field(default_factory=list)
    row_steps: int = 0
    live_nodes: int = 0  # nodes the adaptive length kept, summed over (row, step) pairs (N each without it)
    relaxed_only_accepts: int = 0  # accepted drafts that were not the target argmax (relaxed, sampling)
    target_forwards: int = 0
    draft_forwards: int = 0
    new_tokens: int = 0
    time_prefill_s: float = 0.0  # the target's prefill and the first token
    time_decode_s: float = 0.0  # everything after: the drafter's prefill and every tree step

    @property
    def mean_accepted_len(self) -> float:
        """AL: tokens committed per verify of a row (accepted drafts + the target's token)."""
        n = max(self.row_steps, 1)
        return 1 + sum(a * c for a, c in enumerate(self.accepted_hist)) / n

    @property
    def accept_depth(self) -> list[float]:
        """P(a >= d) for d = 1..max_depth."""
        n = max(self.row_steps, 1)
        return [sum(self.accepted_hist[d:]) / n for d in range(1, self.max_depth + 1)]

    @property
    def tokens_per_node(self) -> float:
        """Committed tokens per verified node: what a verify slot buys (1 / N for a tree that never hits)."""
        return self.mean_accepted_len / self.n_nodes

    @property
    def tokens_per_live_node(self) -> float:
        """Committed tokens per node the adaptive length kept (what a kernel skipping dead nodes would pay for)."""
        return self.mean_accepted_len * self.row_steps / max(self.live_nodes, 1)

    def merge(self, other: TreeMetrics) -> TreeMetrics:
        """Sum of two runs of the same tree shape (batches of one eval run)."""
        if (other.n_nodes, other.max_depth) != (self.n_nodes, self.max_depth):
            raise ValueError(f"cannot merge tree metrics of {self.n_nodes} nodes / depth {self.max_depth} with "
                             f"{other.n_nodes} nodes / depth {other.max_depth}")
        out = TreeMetrics(self.n_nodes, self.max_depth,
                          [a + b for a, b in zip(self.accepted_hist, other.accepted_hist)],
                          [[a + b for a, b in zip(r, q)] for r, q in zip(self.accepted_rank, other.accepted_rank)])
        for name in ("row_steps", "live_nodes", "relaxed_only_accepts", "target_forwards", "draft_forwards",
                     "new_tokens", "time_prefill_s", "time_decode_s"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        return out

    def raw(self) -> dict:
        return asdict(self)

    def to_dict(self) -> dict:
        d = {"accept/mean_len": self.mean_accepted_len, "tree/tokens_per_node": self.tokens_per_node,
             "tree/nodes": self.n_nodes, "count/row_steps": self.row_steps,
             "count/relaxed_only_accepts": self.relaxed_only_accepts,
             "tree/tokens_per_live_node": self.tokens_per_live_node,
             "tree/live_nodes_per_step": self.live_nodes / max(self.row_steps, 1),
             "count/target_forwards": self.target_forwards, "count/draft_forwards": self.draft_forwards}
        n = max(self.row_steps, 1)
        for t, p in enumerate(self.accept_depth, 1):
            d[f"accept/depth_{t}"] = p
            for r, c in enumerate(self.accepted_rank[t - 1]):
                d[f"accept/depth_{t}_rank_{r}"] = c / n
        return d


@dataclass
class TreeResult:
    tokens: list[list[int]]
    finish_reasons: list[str]
    metrics: TreeMetrics
    row_accepted_hist: list[list[int]] = field(default_factory=list)  # accepted_hist of each row alone


def check_tree_options(draft: str, verify: str, draft_sampling: str = "greedy", min_draft_prob: float = 0.0) -> None:
    """The options of `generate_tree` that need neither model nor prompts: front ends check a config with this
    before loading anything. ValueError naming the option and its value."""
    if draft not in ("eagle", "vanilla"):
        raise ValueError(f"tree drafting needs draft='eagle' or 'vanilla', got {draft!r}")
    if verify not in ("strict", "relaxed", "sample"):
        raise ValueError(f"tree verify must be 'strict', 'relaxed' or 'sample', got {verify!r}")
    if draft_sampling not in ("greedy", "sample") or (draft_sampling == "sample" and verify != "sample"):
        raise ValueError(f"draft_sampling must be 'greedy', or 'sample' with verify='sample'; got {draft_sampling!r}"
                         f" with verify={verify!r}")
    if not 0 <= min_draft_prob < 1:
        raise ValueError(f"min_draft_prob must be in [0, 1), got {min_draft_prob}")
    if min_draft_prob > 0 and draft_sampling == "sample":
        # Pruning a drawn child by its own probability changes the law it was drawn from (q_i restricted to
        # likely tokens), and the sampler's min(1, p / q_i) would no longer be exact.
        raise ValueError("min_draft_prob needs top-k children (draft_sampling='greedy'): pruning drawn children "
                         "by their own probability would make tree sampling lossy")


@torch.no_grad()
def generate_tree(model: DeepseekV32, prompts: Sequence[Sequence[int]], tree: TreeShape, max_new_tokens: int = 64,
                  draft: str = "eagle", verify: str = "strict", *, sampling: SamplingParams | None = None,
                  draft_sampling: str = "greedy", top_n: int = 10, delta: float = 0.6,
                  think_ids: tuple[int, int] | None = None, min_draft_prob: float = 0.0, seed: int = 0,
                  eos_id: int | None = None,
                  stop_ids: Sequence[int] = (), reuse_modules: bool = False, target_hidden: str = "normed",
                  chain_hidden: str = "normed") -> TreeResult:
    """Tree speculative decoding, eager. verify: 'strict' (greedy, lossless) | 'relaxed' (top_n / delta inside
    thinking spans delimited by think_ids, as the chain engine) | 'sample' (recursive rejection sampling with
    `sampling`; draft_sampling 'greedy' = top-k children, 'sample' = children drawn without replacement from the
    draft distribution). `min_draft_prob`: adaptive draft length (mtp.draft.tree_proposer); top-k children only."""
    check_tree_options(draft, verify, draft_sampling, min_draft_prob)
    if verify == "relaxed" and (think_ids is None or top_n < 1 or not 0 <= delta <= 1):
        raise ValueError(f"verify='relaxed' needs think_ids=(<think>, </think>), top_n >= 1 and delta in [0, 1]; "
                         f"got think_ids={think_ids}, top_n={top_n}, delta={delta}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    prompts = [[int(t) for t in p] for p in prompts]
    if not prompts or any(not p for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    D, N, A = tree.max_depth, tree.n_nodes, tree.max_depth + 1
    if draft == "vanilla" and min(map(len, prompts)) < D - 1:
        raise ValueError(f"vanilla trees of depth {D} need prompts of at least {D - 1} tokens (module m reads "
                         f"position n-1-m), got a prompt of {min(map(len, prompts))}")
    sp = sampling or SamplingParams()
    m, dev = model, model.device
    dcfg = DraftConfig(draft, D, reuse_modules=reuse_modules, target_hidden=target_hidden, chain_hidden=chain_hidden,
                       sampling=draft_sampling)
    B, Tp = len(prompts), max(map(len, prompts))
    S = Tp + max_new_tokens + N + 2
    gen = torch.Generator(device=dev).manual_seed(seed)
    proposer = TreeProposer(m, dcfg, tree, B, S)
    tt = proposer.tt
    draw = topk_children if draft_sampling == "greedy" else sampled_children(lambda lg: filter_probs(lg, sp), gen)
    stops = torch.tensor(sorted({m.cfg.eos_token_id if eos_id is None else eos_id, *stop_ids}), device=dev)

    tokens = torch.zeros(B, S, dtype=torch.long, device=dev)
    hidden = torch.zeros(B, S, m.cfg.hidden_size, dtype=m.dtype, device=dev)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(p, device=dev)
    P_B = torch.tensor([len(p) for p in prompts], device=dev)
    rows = torch.arange(B, device=dev)
    cache = m.new_cache(B, S)

    nonfinite = torch.zeros((), dtype=torch.bool, device=dev)  # any target logits NaN / inf (mtp.decode.health)

    def sync(where: str) -> torch.Tensor:
        """[n_B, finished_B] on the host (loop condition + cache bound); stops a run whose logits went non-finite."""
        host = torch.cat((torch.stack((n_B, finished_B.long())), nonfinite.long().expand(1, B))).cpu()
        if host[2, 0]:
            raise_nonfinite(m, tokens, n_B, where)
        return host[:2]

    def pick(logits_BV):
        return sample(filter_probs(logits_BV, sp), gen) if verify == "sample" else logits_BV.argmax(-1)

    # ---- prefill and the first token
    t_start = time.perf_counter()
    out = m(tokens[:, :Tp], cache, kv_len=Tp, logits_at=(P_B - 1).unsqueeze(1))
    hidden[:, :Tp] = pick_hidden(out, target_hidden)
    cache.truncate(P_B)
    logits_nonfinite(nonfinite, out.logits)
    first = pick(out.logits[:, 0])
    tokens[rows, P_B] = first
    n_B, gen_B = P_B + 1, torch.ones_like(P_B)
    finished_B = torch.isin(first, stops) | (gen_B >= max_new_tokens)
    think_B = torch.zeros(B, dtype=torch.long, device=dev)
    if think_ids is not None:
        seen_BT = torch.arange(Tp + 1, device=dev) <= P_B.unsqueeze(1)  # the prompt and the first token
        think_B = update_think_state(think_B, tokens[:, : Tp + 1], seen_BT, *think_ids)
    met = TreeMetrics(N, D, [0] * A, [[0] * max(tree.max_children, 1) for _ in range(D)])
    host = sync("the prefill")
    t_prefilled = time.perf_counter()  # after a host sync: the prefill's work is done, on any device
    row_hist = [[0] * A for _ in range(B)]
    if not bool(host[1].all()):
        proposer.prefill(tokens, hidden, n_B, Tp, max_n=int(host[0].max()))
    depth_N, mask_NN = tt.depth_N, tt.ancestor_NN
    arA = torch.arange(A, device=dev)
    while not bool(host[1].all()):
        max_n = int(host[0].max())
        active_B = ~finished_B
        dr = proposer.propose(tokens, hidden, n_B, draw, max_n, min_draft_prob)
        live = dr.live_BN if min_draft_prob > 0 else None
        out = m(dr.tokens_BN, cache, kv_len=max_n - 1 + N, tree_depth=depth_N, tree_mask=mask_NN)
        logits_nonfinite(nonfinite, out.logits)
        if verify == "strict":
            v = tree_strict_verify(tt, dr.tokens_BN, out.logits, live)
        elif verify == "relaxed":
            v = tree_relaxed_verify(tt, dr.tokens_BN, out.logits, think_B, top_n, delta, *think_ids, live)
        else:
            v = tree_sampling_verify(tt, dr.tokens_BN, dr.q_BNV, out.logits, sp, gen, live)
        # ---- accept: the path's drafts then the target token, cut at a stop token and at max_new_tokens
        a_B = torch.where(active_B, v.accept_len_B, 0)
        new_BA = dr.tokens_BN.gather(1, torch.cat((v.path_BA[:, 1:], v.path_BA[:, -1:]), 1))
        new_BA[rows, a_B] = v.next_token_B
        is_stop = torch.isin(new_BA, stops) & (arA <= a_B.unsqueeze(1))
        first_stop = torch.where(is_stop.any(1), is_stop.long().argmax(1), A)
        keep_B = torch.minimum(torch.minimum(a_B + 1, first_stop + 1), max_new_tokens - gen_B)
        keep_B = torch.where(active_B, keep_B, 0)
        kept_BA = arA < keep_B.unsqueeze(1)
        # ---- commit: tokens, the target hidden of the kept path (positions n-1..), the cache path
        pos_BA = (n_B.unsqueeze(1) + arA).clamp_max(S - 1)
        tokens.scatter_(1, pos_BA, torch.where(kept_BA, new_BA, tokens.gather(1, pos_BA)))
        if think_ids is not None:
            think_B = update_think_state(think_B, new_BA, kept_BA, *think_ids)
        h_BAD = pick_hidden(out, target_hidden).gather(1, v.path_BA.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        hpos_BA = pos_BA - 1
        old = hidden.gather(1, hpos_BA.unsqueeze(-1).expand_as(h_BAD))
        hidden.scatter_(1, hpos_BA.unsqueeze(-1).expand_as(h_BAD), torch.where(kept_BA.unsqueeze(-1), h_BAD, old))
        cache.compact(n_B - 1, v.path_BA, keep_B)
        n_B, gen_B = n_B + keep_B, gen_B + keep_B
        finished_B = finished_B | (is_stop & kept_BA).any(1) | (gen_B >= max_new_tokens)
        # ---- metrics (host copies once per step: this loop is the reference, not the fast path)
        met.target_forwards += 1
        met.relaxed_only_accepts += int((v.relaxed_only_B * active_B).sum())
        met.live_nodes += int((dr.live_BN & active_B.unsqueeze(1)).sum())
        for b in active_B.nonzero().flatten().tolist():
            a = int(a_B[b])
            met.accepted_hist[a] += 1
            row_hist[b][a] += 1
            met.row_steps += 1
            for d in range(1, a + 1):
                met.accepted_rank[d - 1][tree.rank[int(v.path_BA[b, d])]] += 1
        host = sync(f"step {met.target_forwards}")
    met.draft_forwards = proposer.draft_forwards
    met.time_prefill_s, met.time_decode_s = t_prefilled - t_start, time.perf_counter() - t_prefilled
    toks, n_host = tokens.cpu(), n_B.tolist()
    stop_set = set(stops.tolist())
    result = [toks[b, len(p): n_host[b]].tolist() for b, p in enumerate(prompts)]
    met.new_tokens = sum(map(len, result))
    return TreeResult(result, ["stop" if s and s[-1] in stop_set else "length" for s in result], met, row_hist)
