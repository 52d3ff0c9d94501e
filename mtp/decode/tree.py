"""Tree decoding: prefill -> [draft a tree -> verify every node in one forward -> accept a path -> commit it (cache
compaction) and roll back the rest] until done; eager, or the whole step as one CUDA graph per tree shape.

Shape legend: B batch, S buffer positions, N tree nodes, A = max depth + 1, D width, V vocabulary.

A separate loop from mtp/decode/engine.py on purpose: the engine is being split into stages; this is the CPU
reference the staged engine is to be held to. The step (`TreeStep`) is device work only on buffers allocated once
(`TreeState`), with the metrics as device counters, so `GraphRunner` (mtp/decode/graphs.py) captures and replays
it as the engine's step. Same state as the engine:
n committed tokens per row in `tokens`, the target hidden per position (valid up to n-2), a target cache of
n-1 positions. Each step the tree's N nodes (node 0 = x_{n-1}) are written at cache slots n-1..n-2+N; after
verification the kept path's slots are moved to n-1.. (`KVCache.compact`) and the cache ends at n_new - 1.
Host syncs: one per step (loop condition and cache bound), as the engine's eager mode; the graph modes read the
loop condition from pinned copies (`GraphRunner.run`).
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
    time_decode_s: float = 0.0  # everything after: the drafter's prefill, graph capture and every tree step
    # graph / overlap modes (CUDA): capture cost and GPU time of the replays
    graph_replays: int = 0
    graph_capture_s: float = 0.0
    gpu_busy_ms: float = 0.0
    gpu_idle_ms: float = 0.0

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
        if self.graph_replays:
            busy = self.gpu_busy_ms + self.gpu_idle_ms
            d.update({"graph/capture_s": self.graph_capture_s, "graph/gpu_step_ms": self.gpu_busy_ms / self.graph_replays,
                      "graph/gpu_idle_frac": self.gpu_idle_ms / busy if busy else 0.0})
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


MODES = ("eager", "graph", "overlap")


@dataclass
class TreeState:
    """Every tensor a tree step reads or writes, allocated once per call and updated in place (so one CUDA graph
    replays the step). The field names `GraphRunner` reads are the engine's (`DecodeState`)."""

    tokens: torch.Tensor  # [B, S] committed tokens
    hidden: torch.Tensor  # [B, S, D] target hidden per position (valid < n-1)
    cache: object  # KVCache of the target
    proposer: TreeProposer
    max_len: int
    n_B: torch.Tensor  # committed length
    gen_B: torch.Tensor  # generated so far
    finished_B: torch.Tensor
    think_B: torch.Tensor  # inside a thinking span after the last committed token
    nonfinite: torch.Tensor  # [] bool: some target logits were NaN / inf (mtp.decode.health)
    new_BK1: torch.Tensor  # [B, A] last step's path tokens then the target's; the first keep_B were committed
    keep_B: torch.Tensor
    acc_B: torch.Tensor  # last step: committed drafts per row
    # metrics, device counters (read once, after the run)
    hist_BA: torch.Tensor  # [B, A] steps of row b that accepted a drafts
    rank_DC: torch.Tensor  # [D, C] accepted nodes per depth and sibling rank
    row_steps: torch.Tensor
    live_nodes: torch.Tensor
    relaxed_only: torch.Tensor

    @property
    def B(self) -> int:
        return self.tokens.shape[0]


class TreeStep:
    """One tree step on a `TreeState`, device ops only, every update in place: propose -> verify every node in
    one forward -> accept a path -> commit it (tokens, target hidden, `KVCache.compact`) -> device counters.
    `step(st, W, max_n)` is the signature `GraphRunner` captures; `max_n` bounds the positions touched."""

    def __init__(self, model: DeepseekV32, tree: TreeShape, verify: str, draw, stops: torch.Tensor,
                 max_new_tokens: int, sampling: SamplingParams, gen, min_draft_prob: float, top_n: int,
                 delta: float, think_ids, target_hidden: str):
        self.model, self.tree, self.verify, self.draw, self.stops = model, tree, verify, draw, stops
        self.max_new, self.sp, self.gen, self.min_prob = max_new_tokens, sampling, gen, min_draft_prob
        self.top_n, self.delta, self.think_ids, self.target_hidden = top_n, delta, think_ids, target_hidden

    def __call__(self, st: TreeState, W: int, max_n: int) -> None:
        m, N, A = self.model, self.tree.n_nodes, self.tree.max_depth + 1
        tt = st.proposer.tt
        dev = st.n_B.device
        rows, arA = torch.arange(st.B, device=dev), torch.arange(A, device=dev)
        n_B, active_B = st.n_B, ~st.finished_B
        dr = st.proposer.propose(st.tokens, st.hidden, n_B, self.draw, max_n, self.min_prob)
        live = dr.live_BN if self.min_prob > 0 else None
        out = m(dr.tokens_BN, st.cache, kv_len=max_n - 1 + N, tree_depth=tt.depth_N, tree_mask=tt.ancestor_NN)
        logits_nonfinite(st.nonfinite, out.logits)
        if self.verify == "strict":
            v = tree_strict_verify(tt, dr.tokens_BN, out.logits, live)
        elif self.verify == "relaxed":
            v = tree_relaxed_verify(tt, dr.tokens_BN, out.logits, st.think_B, self.top_n, self.delta,
                                    *self.think_ids, live)
        else:
            v = tree_sampling_verify(tt, dr.tokens_BN, dr.q_BNV, out.logits, self.sp, self.gen, live)
        # ---- accept: the path's drafts then the target token, cut at a stop token and at max_new_tokens
        a_B = torch.where(active_B, v.accept_len_B, 0)
        new_BA = dr.tokens_BN.gather(1, torch.cat((v.path_BA[:, 1:], v.path_BA[:, -1:]), 1))
        new_BA[rows, a_B] = v.next_token_B
        is_stop = torch.isin(new_BA, self.stops) & (arA <= a_B.unsqueeze(1))
        first_stop = torch.where(is_stop.any(1), is_stop.long().argmax(1), A)
        keep_B = torch.minimum(torch.minimum(a_B + 1, first_stop + 1), self.max_new - st.gen_B)
        keep_B = torch.where(active_B, keep_B, 0)
        kept_BA = arA < keep_B.unsqueeze(1)
        # ---- commit: tokens, the target hidden of the kept path (positions n-1..), the cache path
        S = st.tokens.shape[1]
        pos_BA = (n_B.unsqueeze(1) + arA).clamp_max(S - 1)
        st.tokens.scatter_(1, pos_BA, torch.where(kept_BA, new_BA, st.tokens.gather(1, pos_BA)))
        if self.think_ids is not None:
            st.think_B.copy_(update_think_state(st.think_B, new_BA, kept_BA, *self.think_ids))
        h_BAD = pick_hidden(out, self.target_hidden).gather(1, v.path_BA.unsqueeze(-1).expand(-1, -1, st.hidden.shape[-1]))
        hpos_BAD = (pos_BA - 1).unsqueeze(-1).expand_as(h_BAD)
        st.hidden.scatter_(1, hpos_BAD, torch.where(kept_BA.unsqueeze(-1), h_BAD, st.hidden.gather(1, hpos_BAD)))
        st.cache.compact(n_B - 1, v.path_BA, keep_B)
        st.n_B.add_(keep_B)
        st.gen_B.add_(keep_B)
        st.finished_B.copy_(st.finished_B | (is_stop & kept_BA).any(1) | (st.gen_B >= self.max_new))
        # ---- metrics, on the device (no sync): only rows that were active count
        on = active_B.long()
        st.hist_BA.scatter_add_(1, a_B.unsqueeze(1), on.unsqueeze(1))
        D, C = st.rank_DC.shape
        depth_D = torch.arange(1, D + 1, device=dev)
        hit_BD = ((depth_D <= a_B.unsqueeze(1)) & active_B.unsqueeze(1)).long()
        st.rank_DC.view(-1).scatter_add_(0, ((depth_D - 1) * C + tt.rank_N[v.path_BA[:, 1:]]).flatten(),
                                         hit_BD.flatten())
        st.row_steps.add_(on.sum())
        st.live_nodes.add_((dr.live_BN & active_B.unsqueeze(1)).sum())
        st.relaxed_only.add_((v.relaxed_only_B * on).sum())
        st.new_BK1.copy_(new_BA)
        st.keep_B.copy_(keep_B)
        st.acc_B.copy_(torch.minimum(a_B, keep_B))


@torch.no_grad()
def generate_tree(model: DeepseekV32, prompts: Sequence[Sequence[int]], tree: TreeShape, max_new_tokens: int = 64,
                  draft: str = "eagle", verify: str = "strict", *, sampling: SamplingParams | None = None,
                  draft_sampling: str = "greedy", top_n: int = 10, delta: float = 0.6,
                  think_ids: tuple[int, int] | None = None, min_draft_prob: float = 0.0, seed: int = 0,
                  eos_id: int | None = None,
                  stop_ids: Sequence[int] = (), reuse_modules: bool = False, target_hidden: str = "normed",
                  chain_hidden: str = "normed", mode: str = "eager") -> TreeResult:
    """Tree speculative decoding. verify: 'strict' (greedy, lossless) | 'relaxed' (top_n / delta inside
    thinking spans delimited by think_ids, as the chain engine) | 'sample' (recursive rejection sampling with
    `sampling`; draft_sampling 'greedy' = top-k children, 'sample' = children drawn without replacement from the
    draft distribution). `min_draft_prob`: adaptive draft length (mtp.draft.tree_proposer); top-k children only.
    mode: 'eager' (one host sync per step), 'graph' (the whole step as one CUDA graph for this tree shape,
    replayed: `GraphRunner`) or 'overlap' (the graph replayed one step ahead of the host). On CUDA every mode
    runs the step with the same static bound (the buffer length), so all three give the same tokens; on a CPU
    'graph' / 'overlap' run that static-bound step eagerly. Graph modes take strict or relaxed verification
    (tree sampling draws from a torch.Generator, which a replayed graph would not advance)."""
    check_tree_options(draft, verify, draft_sampling, min_draft_prob)
    if mode not in MODES:
        raise ValueError(f"generate_tree: mode must be one of {MODES}, got {mode!r}")
    if mode != "eager" and verify == "sample":
        raise ValueError(f"generate_tree: mode={mode!r} takes verify='strict' or 'relaxed': tree sampling draws from a "
                         "torch.Generator, which a replayed CUDA graph would not advance (use mode='eager')")
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
    draw = topk_children if draft_sampling == "greedy" else sampled_children(lambda lg: filter_probs(lg, sp), gen)
    stops = torch.tensor(sorted({m.cfg.eos_token_id if eos_id is None else eos_id, *stop_ids}), device=dev)

    def z(*shape, dtype=torch.long):
        return torch.zeros(*shape, dtype=dtype, device=dev)

    st = TreeState(tokens=z(B, S), hidden=z(B, S, m.cfg.hidden_size, dtype=m.dtype), cache=m.new_cache(B, S),
                   proposer=TreeProposer(m, dcfg, tree, B, S), max_len=S, n_B=z(B), gen_B=z(B),
                   finished_B=z(B, dtype=torch.bool), think_B=z(B), nonfinite=z((), dtype=torch.bool),
                   new_BK1=z(B, A), keep_B=z(B), acc_B=z(B), hist_BA=z(B, A), rank_DC=z(D, max(tree.max_children, 1)),
                   row_steps=z(()), live_nodes=z(()), relaxed_only=z(()))
    for b, p in enumerate(prompts):
        st.tokens[b, : len(p)] = torch.tensor(p, device=dev)
    P_B = torch.tensor([len(p) for p in prompts], device=dev)
    step = TreeStep(m, tree, verify, draw, stops, max_new_tokens, sp, gen, min_draft_prob, top_n, delta, think_ids,
                    target_hidden)

    def sync(where: str) -> torch.Tensor:
        """[n_B, finished_B] on the host (loop condition + cache bound); stops a run whose logits went non-finite."""
        host = torch.cat((torch.stack((st.n_B, st.finished_B.long())), st.nonfinite.long().expand(1, B))).cpu()
        if host[2, 0]:
            raise_nonfinite(m, st.tokens, st.n_B, where)
        return host[:2]

    def bound(host: torch.Tensor) -> int:
        """Positions a step may touch: the buffer's (static) on CUDA and in the graph modes, so that every mode
        runs the same kernels on the same shapes; else the host-known max of n."""
        return S - N if dev.type == "cuda" or mode != "eager" else int(host[0].max())

    # ---- prefill and the first token
    t_start = time.perf_counter()
    out = m(st.tokens[:, :Tp], st.cache, kv_len=Tp, logits_at=(P_B - 1).unsqueeze(1))
    st.hidden[:, :Tp] = pick_hidden(out, target_hidden)
    st.cache.truncate(P_B)
    logits_nonfinite(st.nonfinite, out.logits)
    logits = out.logits[:, 0]
    first = sample(filter_probs(logits, sp), gen) if verify == "sample" else logits.argmax(-1)
    st.tokens[torch.arange(B, device=dev), P_B] = first
    st.n_B.copy_(P_B + 1)
    st.gen_B.fill_(1)
    st.finished_B.copy_(torch.isin(first, stops) | (st.gen_B >= max_new_tokens))
    if think_ids is not None:
        seen_BT = torch.arange(Tp + 1, device=dev) <= P_B.unsqueeze(1)  # the prompt and the first token
        st.think_B.copy_(update_think_state(st.think_B, st.tokens[:, : Tp + 1], seen_BT, *think_ids))
    met = TreeMetrics(N, D)
    host = sync("the prefill")
    t_prefilled = time.perf_counter()  # after a host sync: the prefill's work is done, on any device
    drafting = not bool(host[1].all())  # nothing to draft for when every row ended at its first token
    if drafting:
        st.proposer.prefill(st.tokens, st.hidden, st.n_B, Tp, max_n=bound(host))
        if mode == "eager" or dev.type != "cuda":
            while not bool(host[1].all()):
                step(st, 0, bound(host))
                met.target_forwards += 1
                host = sync(f"step {met.target_forwards}")
        else:
            from .graphs import GraphRunner
            from .metrics import SpecMetrics

            runner, gm = GraphRunner(m, step), SpecMetrics()
            runner.run(st, gm, lambda new, keep, acc: None, 0, bound(host), overlap=mode == "overlap")
            met.target_forwards, met.graph_replays = gm.target_forwards, gm.graph_replays
            met.graph_capture_s, met.gpu_busy_ms, met.gpu_idle_ms = gm.graph_capture_s, gm.gpu_busy_ms, gm.gpu_idle_ms
    met.time_prefill_s, met.time_decode_s = t_prefilled - t_start, time.perf_counter() - t_prefilled
    # ---- metrics (read once) and the tokens
    row_hist = st.hist_BA.tolist()
    met.accepted_hist = st.hist_BA.sum(0).tolist()
    met.accepted_rank = st.rank_DC.tolist()
    met.row_steps, met.live_nodes = int(st.row_steps), int(st.live_nodes)
    met.relaxed_only_accepts = int(st.relaxed_only)
    if mode == "eager" or dev.type != "cuda":
        met.draft_forwards = st.proposer.draft_forwards
    else:  # graph replays do not run the proposer's Python: eagle 1 window + D-1 tree depths per step, vanilla D
        # windows + D-1 trees; plus the prefill's window per module
        per_step = D if draft == "eagle" else 2 * D - 1
        met.draft_forwards = per_step * met.target_forwards + len(st.proposer.caches) * drafting
    toks, n_host = st.tokens.cpu(), st.n_B.tolist()
    stop_set = set(stops.tolist())
    result = [toks[b, len(p): n_host[b]].tolist() for b, p in enumerate(prompts)]
    met.new_tokens = sum(map(len, result))
    return TreeResult(result, ["stop" if s and s[-1] in stop_set else "length" for s in result], met, row_hist)
