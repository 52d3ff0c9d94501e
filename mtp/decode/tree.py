"""Tree decoding: prefill -> [draft a tree -> verify every node in one forward -> accept a path -> commit it (cache
compaction) and roll back the rest] until done; eager, or the whole step as one CUDA graph per tree shape.

Shape legend: B batch, S buffer positions, N tree nodes, A = max depth + 1, D width, V vocabulary.

A separate loop from mtp/decode/engine.py on purpose: the engine is being split into stages; this is the CPU
reference the staged engine is to be held to. The step (`TreeStep`) is device work only on buffers allocated once
(`TreeState`, kept by `TreeStatePool` as the engine's `StatePool` keeps a chain's), with the metrics as device
counters, so `GraphRunner` (mtp/decode/graphs.py) captures and replays it as the engine's step. In graph / overlap
mode the `TreeEngine` (options, buffers, captured graphs) is kept across calls per model and settings
(mtp/decode/keep.py, shared with `mtp.generate`), so later calls replay the graph captured by the first.
Same state as the engine:
n committed tokens per row in `tokens`, the target hidden per position (valid up to n-2), a target cache of
n-1 positions. Each step the tree's N nodes (node 0 = x_{n-1}) are written at cache slots n-1..n-2+N; after
verification the kept path's slots are moved to n-1.. (`KVCache.compact`) and the cache ends at n_new - 1.
Host syncs: one per step (loop condition and cache bound), as the engine's eager mode; the graph modes read the
loop condition from pinned copies (`GraphRunner.run`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..draft.proposer import pick_hidden
from ..spec.tree_shape import TreeShape
from ..draft.tree_proposer import TreeProposer, sampled_children, topk_children
from ..model.deepseek import DeepseekV32
from ..verify import (SamplingParams, tree_relaxed_verify, tree_sampling_verify, tree_strict_verify,
                      tree_typical_verify, update_think_state)
from ..verify.sampling import filter_probs, sample
from .config import GenerationConfig
from .graphs import GraphRunner
from .health import NonFiniteError, logits_nonfinite, raise_nonfinite
from .keep import kept
from .metrics import SpecMetrics
from .state import StatePool, check_prompts
from .tree_metrics import TreeMetrics, TreeResult

__all__ = ["TreeEngine", "TreeMetrics", "TreeResult", "TreeState", "TreeStatePool", "TreeStep", "generate_tree",
           "run_tree"]


@dataclass
class TreeState:
    """Every tensor a tree step reads or writes, allocated once per (batch, buffer length) and updated in place, so
    one CUDA graph replays the step, in this call and in later calls that get these buffers again
    (`TreeStatePool`). The field names `GraphRunner` reads are the engine's (`DecodeState`)."""

    tokens: torch.Tensor  # [B, S] committed tokens
    hidden: torch.Tensor  # [B, S, D] target hidden per position (valid < n-1)
    cache: object  # KVCache of the target
    proposer: TreeProposer
    P_B: torch.Tensor  # prompt lengths
    Tp: int  # longest prompt of the current call
    max_len: int
    n_B: torch.Tensor  # committed length
    gen_B: torch.Tensor  # generated so far
    max_new_B: torch.Tensor  # this call's max_new_tokens (a tensor, so a captured step serves any value)
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


# verify name -> the tree verifier, called as rule(step, tree tensors, draft, target logits, think_B, live_BN).
TREE_VERIFIERS = {
    "strict": lambda s, tt, dr, lg, th, live: tree_strict_verify(tt, dr.tokens_BN, lg, live),
    "relaxed": lambda s, tt, dr, lg, th, live: tree_relaxed_verify(tt, dr.tokens_BN, lg, th, s.g.top_n, s.g.delta,
                                                                   *s.g.think_ids, live),
    "sample": lambda s, tt, dr, lg, th, live: tree_sampling_verify(tt, dr.tokens_BN, dr.q_BNV, lg, s.g.sampling,
                                                                   s.gen, live),
    "typical": lambda s, tt, dr, lg, th, live: tree_typical_verify(tt, dr.tokens_BN, lg, s.g.sampling.temperature,
                                                                   s.g.posterior_threshold, s.g.posterior_alpha, live),
}


class TreeStep:
    """One tree step on a `TreeState`, device ops only, every update in place: propose -> verify every node in
    one forward -> accept a path -> commit it (tokens, target hidden, `KVCache.compact`) -> device counters.
    `step(st, W, max_n)` is the signature `GraphRunner` captures; `max_n` bounds the positions touched."""

    def __init__(self, model: DeepseekV32, g: GenerationConfig, draw, stops: torch.Tensor, gen: torch.Generator):
        self.model, self.g, self.tree, self.draw, self.stops, self.gen = model, g, g.draft.tree, draw, stops, gen

    def __call__(self, st: TreeState, W: int, max_n: int) -> None:
        m, g, N, A = self.model, self.g, self.tree.n_nodes, self.tree.max_depth + 1
        tt = st.proposer.tt
        dev = st.n_B.device
        rows, arA = torch.arange(st.B, device=dev), torch.arange(A, device=dev)
        n_B, active_B = st.n_B, ~st.finished_B
        dr = st.proposer.propose(st.tokens, st.hidden, n_B, self.draw, max_n, g.draft.min_draft_prob)
        live = dr.live_BN if g.draft.min_draft_prob > 0 else None
        out = m(dr.tokens_BN, st.cache, kv_len=max_n - 1 + N, tree_depth=tt.depth_N, tree_mask=tt.ancestor_NN)
        logits_nonfinite(st.nonfinite, out.logits)
        try:
            rule = TREE_VERIFIERS[g.verify]
        except KeyError:
            raise ValueError(f"verify={g.verify!r} is not a tree verifier; expected one of "
                             f"{', '.join(TREE_VERIFIERS)}") from None
        v = rule(self, tt, dr, out.logits, st.think_B, live)
        # ---- accept: the path's drafts then the target token, cut at a stop token and at max_new_tokens
        a_B = torch.where(active_B, v.accept_len_B, 0)
        new_BA = dr.tokens_BN.gather(1, torch.cat((v.path_BA[:, 1:], v.path_BA[:, -1:]), 1))
        new_BA[rows, a_B] = v.next_token_B
        is_stop = torch.isin(new_BA, self.stops) & (arA <= a_B.unsqueeze(1))
        first_stop = torch.where(is_stop.any(1), is_stop.long().argmax(1), A)
        keep_B = torch.minimum(torch.minimum(a_B + 1, first_stop + 1), st.max_new_B - st.gen_B)
        keep_B = torch.where(active_B, keep_B, 0)
        kept_BA = arA < keep_B.unsqueeze(1)
        # ---- commit: tokens, the target hidden of the kept path (positions n-1..), the cache path
        S = st.tokens.shape[1]
        pos_BA = (n_B.unsqueeze(1) + arA).clamp_max(S - 1)
        st.tokens.scatter_(1, pos_BA, torch.where(kept_BA, new_BA, st.tokens.gather(1, pos_BA)))
        if g.think_ids is not None:
            st.think_B.copy_(update_think_state(st.think_B, new_BA, kept_BA, *g.think_ids))
        h_out = pick_hidden(out, g.draft.target_hidden)
        h_BAD = h_out.gather(1, v.path_BA.unsqueeze(-1).expand(-1, -1, st.hidden.shape[-1]))
        hpos_BAD = (pos_BA - 1).unsqueeze(-1).expand_as(h_BAD)
        st.hidden.scatter_(1, hpos_BAD, torch.where(kept_BA.unsqueeze(-1), h_BAD, st.hidden.gather(1, hpos_BAD)))
        st.cache.compact(n_B - 1, v.path_BA, keep_B)
        st.n_B.add_(keep_B)
        st.gen_B.add_(keep_B)
        st.finished_B.copy_(st.finished_B | (is_stop & kept_BA).any(1) | (st.gen_B >= st.max_new_B))
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


class TreeStatePool(StatePool):
    """A tree engine's buffers, kept and reused as the chain engine's (`StatePool`: per batch and rounded buffer
    length, least recently used dropped with its graph; `draft_room` of the tree past prompt + max_new_tokens)."""

    def _new(self, B: int, max_len: int) -> TreeState:
        m, dev, tree = self.model, self.dev, self.g.draft.tree

        def z(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=dev)

        A = tree.max_depth + 1
        return TreeState(tokens=z(B, max_len), hidden=z(B, max_len, m.cfg.hidden_size, dtype=m.dtype),
                         cache=m.new_cache(B, max_len), proposer=TreeProposer(m, self.g.draft, tree, B, max_len),
                         P_B=z(B), Tp=0, max_len=max_len, n_B=z(B), gen_B=z(B), max_new_B=z(B),
                         finished_B=z(B, dtype=torch.bool), think_B=z(B), nonfinite=z((), dtype=torch.bool),
                         new_BK1=z(B, A), keep_B=z(B), acc_B=z(B), hist_BA=z(B, A),
                         rank_DC=z(tree.max_depth, tree.max_rank + 1), row_steps=z(()), live_nodes=z(()),
                         relaxed_only=z(()))

    def _reset(self, st: TreeState, prompts: list[list[int]], max_new: int, seeds: list[int]) -> None:
        """Load a call's prompts; every counter back to its start (stale contents past a row's length are never
        read; the proposer's prefill rewrites its caches from position 0)."""
        st.Tp = max(len(p) for p in prompts)
        for b, p in enumerate(prompts):
            st.tokens[b, : len(p)] = torch.tensor(p, device=self.dev)
        st.P_B.copy_(torch.tensor([len(p) for p in prompts]))
        st.max_new_B.fill_(max_new)
        for t in (st.n_B, st.gen_B, st.finished_B, st.think_B, st.nonfinite, st.new_BK1, st.keep_B, st.acc_B,
                  st.hist_BA, st.rank_DC, st.row_steps, st.live_nodes, st.relaxed_only):
            t.zero_()
        st.cache.reset()
        for c in st.proposer.caches:
            c.reset()


class TreeEngine:
    """Tree decoding with one `GenerationConfig` (its draft carries the tree): the step, the buffers
    (`TreeStatePool`) and, in graph / overlap mode on CUDA, the captured step graphs (`GraphRunner`), all reused by
    later `run` calls. Off CUDA the graph modes run the static-bound step eagerly."""

    def __init__(self, model: DeepseekV32, g: GenerationConfig):
        g.validate(model)
        self.model, self.g, self.tree, self.dev = model, g, g.draft.tree, model.device
        self.gen = torch.Generator(device=self.dev)  # seeded per call (tree sampling; eager only)
        draw = (topk_children if g.draft.sampling == "greedy"
                else sampled_children(lambda lg: filter_probs(lg, g.sampling), self.gen))
        eos = model.cfg.eos_token_id if g.eos_id is None else g.eos_id
        self.stops = torch.tensor(sorted({eos, *g.stop_ids}), device=self.dev)
        self.step = TreeStep(model, g, draw, self.stops, self.gen)
        self.runner = GraphRunner(model, self.step) if g.mode != "eager" and self.dev.type == "cuda" else None
        self.pool = TreeStatePool(model, g, TreeProposer, on_drop=self.runner.drop if self.runner else lambda key: None)

    def _sync(self, st: TreeState, where: str) -> torch.Tensor:
        """[n_B, finished_B] on the host (loop condition + cache bound); stops a run whose logits went non-finite."""
        host = torch.cat((torch.stack((st.n_B, st.finished_B.long())), st.nonfinite.long().expand(1, st.B))).cpu()
        if host[2, 0]:
            raise_nonfinite(self.model, st.tokens, st.n_B, where)
        return host[:2]

    def bound(self, st: TreeState, host: torch.Tensor) -> int:
        """Positions a step may touch: the buffer's (static) on CUDA and in the graph modes, so that every mode
        runs the same kernels on the same shapes; else the host-known max of n."""
        if self.dev.type == "cuda" or self.g.mode != "eager":
            return st.max_len - self.tree.n_nodes
        return int(host[0].max())

    def _prefill(self, st: TreeState, first_draw) -> None:
        """Target prefill (right-padded) and the first token: n = P + 1, the target cache at P positions."""
        m, g, dev, B, Tp, P_B = self.model, self.g, self.dev, st.B, st.Tp, st.P_B
        out = m(st.tokens[:, :Tp], st.cache, kv_len=Tp, logits_at=(P_B - 1).unsqueeze(1))
        st.hidden[:, :Tp] = pick_hidden(out, g.draft.target_hidden)
        st.cache.truncate(P_B)
        logits_nonfinite(st.nonfinite, out.logits)
        first = first_draw(out.logits[:, 0])
        st.tokens[torch.arange(B, device=dev), P_B] = first
        st.n_B.copy_(P_B + 1)
        st.gen_B.fill_(1)
        st.finished_B.copy_(torch.isin(first, self.stops) | (st.gen_B >= st.max_new_B))
        if g.think_ids is not None:
            seen_BT = torch.arange(Tp + 1, device=dev) <= P_B.unsqueeze(1)  # the prompt and the first token
            st.think_B.copy_(update_think_state(st.think_B, st.tokens[:, : Tp + 1], seen_BT, *g.think_ids))
        st.new_BK1[:, 0] = first
        st.keep_B.fill_(1)

    def _decode(self, st: TreeState, emit) -> tuple[TreeMetrics, bool, float, float]:
        """Prefill, the first token, the draft prefill and every step: (metrics so far, whether anything was
        drafted, start and end-of-prefill clock readings)."""
        g, B = self.g, st.B
        t_start = time.perf_counter()
        self._prefill(st, lambda lg: sample(filter_probs(lg, g.sampling), self.gen) if g.verify == "sample"
                      else lg.argmax(-1))
        met = TreeMetrics(self.tree.n_nodes, self.tree.max_depth)
        host = self._sync(st, "the prefill")
        t_prefilled = time.perf_counter()  # after a host sync: the prefill's work is done, on any device
        emit(st.new_BK1.tolist(), st.keep_B.tolist(), [0] * B)
        drafting = not bool(host[1].all())  # nothing to draft for when every row ended at its first token
        if drafting:
            st.proposer.prefill(st.tokens, st.hidden, st.n_B, st.Tp, max_n=self.bound(st, host))
            if self.runner is None:
                while not bool(host[1].all()):
                    self.step(st, 0, self.bound(st, host))
                    met.target_forwards += 1
                    host = self._sync(st, f"step {met.target_forwards}")
                    emit(st.new_BK1.tolist(), st.keep_B.tolist(), st.acc_B.tolist())
            else:
                gm = SpecMetrics()
                self.runner.run(st, gm, emit, 0, self.bound(st, host), overlap=g.mode == "overlap")
                met.target_forwards, met.graph_replays, met.graph_captures = (gm.target_forwards, gm.graph_replays,
                                                                              gm.graph_captures)
                met.graph_capture_s, met.gpu_busy_ms, met.gpu_idle_ms = (gm.graph_capture_s, gm.gpu_busy_ms,
                                                                         gm.gpu_idle_ms)
        return met, drafting, t_start, t_prefilled

    @torch.no_grad()
    def run(self, prompts: list[list[int]], max_new_tokens: int, seed: int = 0,
            emit: Callable[[list, list, list], None] = lambda new, keep, acc: None) -> TreeResult:
        """Decode `prompts`; `emit(new, keep, acc)` gets each step's committed tokens (the prefill's token first)."""
        g, D = self.g, self.tree.max_depth
        if g.draft.mode == "vanilla" and min(map(len, prompts)) < D - 1:
            raise ValueError(f"vanilla trees of depth {D} need prompts of at least {D - 1} tokens (module m reads "
                             f"position n-1-m), got a prompt of {min(map(len, prompts))}")
        self.gen.manual_seed(seed)
        st = self.pool.get(prompts, max_new_tokens, [seed] * len(prompts))
        B, fw0 = st.B, st.proposer.draft_forwards  # a reused proposer's counter spans earlier calls
        try:
            met, drafting, t_start, t_prefilled = self._decode(st, emit)
        except NonFiniteError:
            # its caches now hold non-finite entries past the rows' lengths (a static bound weights those by zero,
            # and 0 * NaN is NaN): a later call must not reuse them
            self.pool.discard(st)
            raise
        met.time_prefill_s, met.time_decode_s = t_prefilled - t_start, time.perf_counter() - t_prefilled
        # ---- metrics (read once) and the tokens
        row_hist = st.hist_BA.tolist()
        met.accepted_hist = st.hist_BA.sum(0).tolist()
        met.accepted_rank = st.rank_DC.tolist()
        met.row_steps, met.live_nodes = int(st.row_steps), int(st.live_nodes)
        met.relaxed_only_accepts = int(st.relaxed_only)
        if self.runner is None:
            met.draft_forwards = st.proposer.draft_forwards - fw0
        else:  # graph replays do not run the proposer's Python: eagle 1 window + D-1 tree depths per step,
            # vanilla D windows + D-1 trees; plus the prefill's window per module
            per_step = D if g.draft.mode == "eagle" else 2 * D - 1
            met.draft_forwards = per_step * met.target_forwards + len(st.proposer.caches) * drafting
        toks, n_host, P_host = st.tokens.cpu(), st.n_B.tolist(), st.P_B.tolist()
        stop_set = set(self.stops.tolist())
        result = [toks[b, P_host[b]: n_host[b]].tolist() for b in range(B)]
        met.new_tokens = sum(map(len, result))
        return TreeResult(result, ["stop" if s and s[-1] in stop_set else "length" for s in result], met, row_hist)


def run_tree(model: DeepseekV32, prompts: Sequence[Sequence[int]], g: GenerationConfig, seed: int | None = None,
             emit: Callable[[list, list, list], None] = lambda new, keep, acc: None) -> TreeResult:
    """Tree decoding with a `GenerationConfig` whose draft carries the tree (`mtp.generate` dispatches here).
    graph / overlap: the engine (buffers + captured step graphs) is kept per model and settings, as the chain
    engine's, and dropped by `mtp.decode.engine.release(model)`; eager builds one per call."""
    prompts = check_prompts(prompts, model.cfg.vocab_size)
    engine = TreeEngine(model, g) if g.mode == "eager" else kept(model, g, lambda: TreeEngine(model, g))
    return engine.run(prompts, g.max_new_tokens, g.seed if seed is None else seed, emit)


def generate_tree(model: DeepseekV32, prompts: Sequence[Sequence[int]], tree: TreeShape | str,
                  max_new_tokens: int = 64, draft: str = "eagle", verify: str = "strict", *,
                  sampling: SamplingParams | None = None, draft_sampling: str = "greedy", top_n: int = 10,
                  delta: float = 0.6, think_ids: tuple[int, int] | None = None, min_draft_prob: float = 0.0,
                  seed: int = 0, eos_id: int | None = None, stop_ids: Sequence[int] = (), reuse_modules: bool = False,
                  target_hidden: str = "normed", chain_hidden: str = "normed", mode: str = "eager") -> TreeResult:
    """Tree speculative decoding (the keyword form; `mtp.generate(..., tree=...)` is the same through
    `GenerationConfig`, which checks every option). verify: 'strict' (greedy, lossless) | 'relaxed' (top_n /
    delta inside thinking spans delimited by think_ids, as the chain engine) | 'sample' (recursive rejection
    sampling with `sampling`; draft_sampling 'greedy' = top-k children, 'sample' = children drawn without
    replacement from the draft distribution). `min_draft_prob`: adaptive draft length (mtp.draft.tree_proposer);
    top-k children only. mode: 'eager' (one host sync per step), 'graph' (the whole step as one CUDA graph for
    this tree shape, replayed: `GraphRunner`, kept with its buffers for later calls of the same settings) or
    'overlap' (the graph replayed one step ahead of the host). On CUDA every mode runs the step with the same
    static bound (the buffer length), so all three give the same tokens; on a CPU 'graph' / 'overlap' run that
    static-bound step eagerly. Graph modes take strict or relaxed verification (tree sampling draws from a
    torch.Generator, which a replayed graph would not advance)."""
    sp = sampling or SamplingParams()
    g = GenerationConfig.from_options(
        max_new_tokens, draft, None, verify, tree=tree, min_draft_prob=min_draft_prob, draft_sampling=draft_sampling,
        top_n=top_n, delta=delta, think_ids=think_ids, seed=seed, eos_id=eos_id, stop_ids=stop_ids,
        reuse_modules=reuse_modules, target_hidden=target_hidden, chain_hidden=chain_hidden, mode=mode,
        temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p)
    return run_tree(model, prompts, g)
