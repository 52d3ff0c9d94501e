"""The speculative decoding loop: prefill -> [propose -> verify -> accept -> commit] until every row is done.

Shape legend: B batch, S buffer positions, K drafts, D width, V vocabulary.

The stages and their homes: propose `mtp/draft/` (the MTP proposer, `DraftSampler` for sampled drafts);
verify `mtp/verify/` (pure functions of tensors); accept / commit (with the cache rollback) `accept.py`; the
decode state and its buffers `state.py`; options and their validation `config.py`; one step as a CUDA graph
and the overlap scheduler `graphs.py`. This file holds `Engine.step` (one step, device work only) and the
eager loop around it, and `generate`.

Per row the engine keeps n committed tokens in `tokens_BS` and the target's hidden state of every position
in `hidden_BSD` (valid up to n-2). The target cache holds n-1 positions: the last committed token is fed at
the next verify together with the K drafts, so one target forward scores K+1 positions. Rows advance
independently; finished rows stay frozen so every tensor keeps its shape. `draft='none'` (K = 0) is plain
autoregressive decoding through the same code (the baseline).

Host syncs (eager mode): one per step to read (n, finished) for the loop condition and cache bounds, plus the
step's committed tokens for `on_step`. graph / overlap modes replay the step as one CUDA graph and read the
same values from pinned buffers, overlap one step late. Design notes: mtp/DESIGN.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..draft.policy import DraftSampler
from ..draft.proposer import Proposer, pick_hidden
from ..model.deepseek import DeepseekV32
from ..verify import (Verdict, prompt_think_state, relaxed_verify, sampling_verify, strict_verify, typical_verify,
                      update_think_state)
from ..spec.draws import RowDraws
from .accept import accept, commit
from .config import GenerationConfig, row_seeds
from .health import NonFiniteError, logits_nonfinite, raise_nonfinite
from .keep import _ENGINES, kept, release  # noqa: F401  (callers know them as mtp.decode.engine.*)
from .metrics import RowClock, SpecMetrics
from .state import DecodeState, StatePool, check_prompts
from .tree_metrics import TreeMetrics


@dataclass
class GenerateResult:
    tokens: list[list[int]]  # new tokens per prompt (stop token included when it ended the row)
    finish_reasons: list[str]  # 'stop' | 'length'
    metrics: SpecMetrics
    tree: TreeMetrics | None = None  # a tree run's own metrics (acceptance per depth and sibling rank, nodes)
    row_accepted_hist: list[list[int]] | None = None  # a tree run's accepted-count histogram per row


@dataclass
class StepEvent:
    """What one step committed, for streaming front ends (rows that were already finished get [])."""

    new_tokens: list[list[int]]
    accepted: list[int]  # drafts accepted per row (the rest of new_tokens is the target's own token)


def stops(on_step: Callable[[StepEvent], None]) -> Callable[[StepEvent], None]:
    """Mark a step callback that may raise to end the generation early (the chat's Ctrl-C). On a model split over
    ranks (mtp.parallel.driver) every step then ends with rank 0's verdict sent to every rank, so all stop at the
    same step; that costs one small message per step. An unmarked callback runs on rank 0 only, and an exception
    from it ends the whole run there."""
    on_step.may_stop = True
    return on_step


def generate(model: DeepseekV32, prompts: Sequence[Sequence[int]],
             max_new_tokens: int | GenerationConfig = 64, draft: str = "none", k: int | None = None,
             verify: str = "strict", *, config: GenerationConfig | None = None,
             on_step: Callable[[StepEvent], None] | None = None, **options) -> GenerateResult:
    """Speculative generation with `config` (a `GenerationConfig`, also accepted in place of max_new_tokens),
    or with keywords that build one (`GenerationConfig.from_options`: max_new_tokens, draft, k, verify and the
    options listed there; `seed` may be one int per prompt). graph / overlap modes keep the engine (buffers +
    captured step graphs) per model and settings, so later calls replay its graphs; seeds are per call (they
    live in a buffer the captured step reads). With a draft tree (`tree=`, `DraftConfig.tree`) it decodes
    with mtp.decode.tree (one int seed), metrics mapped to SpecMetrics (k = the tree's depth) and the tree's
    own in `tree`."""
    if isinstance(max_new_tokens, GenerationConfig):
        config, max_new_tokens = max_new_tokens, 64
    if config is not None:
        if (max_new_tokens, draft, k, verify) != (64, "none", None, "strict") or options:
            raise TypeError("generate: pass either a GenerationConfig or keyword options, not both")
        gcfg, seed = config, config.seed
    else:
        seed = options.pop("seed", 0)
        row_seeds(seed, len(prompts))  # a bad seed list fails here, before any rank starts
        gcfg = GenerationConfig.from_options(max_new_tokens, draft, k, verify, seed=seed if isinstance(seed, int) else 0,
                                             **options)
    peers = getattr(model, "peers", None)
    if peers is not None:  # rank 0 of a sharded model: every rank runs this call (mtp.parallel.driver)
        return peers.generate(model, prompts, gcfg, seed, on_step)
    return run_generation(model, prompts, gcfg, seed, on_step)


def run_generation(model: DeepseekV32, prompts: Sequence[Sequence[int]], gcfg: GenerationConfig, seed,
                   on_step: Callable[[StepEvent], None] | None = None) -> GenerateResult:
    """`generate` on this process's model once the options are resolved (`seed`: an int, or one per prompt)."""
    seeds = row_seeds(seed, len(prompts))
    if gcfg.draft.tree is not None:  # tree decoding (mtp/decode/tree.py): the tree's metrics ride along
        from .tree import run_tree

        if not isinstance(seed, int) and len(set(seeds)) > 1:
            raise ValueError(f"generate: a draft tree takes one int seed, got per-prompt seeds {seeds!r:.80} (tree "
                             "sampling draws a whole batch from one torch.Generator)")
        clock = RowClock(len(prompts))
        r = run_tree(model, prompts, gcfg, emit=Emitter(on_step, len(prompts), clock),
                     seed=seeds[0] if seeds else None)
        spec = r.metrics.spec(gcfg.draft.mode, gcfg.verify, prompt_tokens=sum(map(len, prompts)), n_rows=len(prompts))
        clock.fill(spec, [len(t) for t in r.tokens])
        return GenerateResult(r.tokens, r.finish_reasons, spec, tree=r.metrics, row_accepted_hist=r.row_accepted_hist)
    if gcfg.mode == "eager":
        return Engine(model, gcfg).run(prompts, on_step=on_step, seeds=seeds)
    engine = kept(model, gcfg, lambda: Engine(model, gcfg))
    return engine.run(prompts, on_step=on_step, max_new_tokens=gcfg.max_new_tokens, seeds=seeds)


# verify name -> the chain verifier, called as rule(engine, drafts_BK, q_BKV, logits_BKV, think_B, draws). Draft ids
# are checked on the CPU only (sample): on CUDA the check would add a host sync to every step.
CHAIN_VERIFIERS = {
    "strict": lambda e, d, q, lg, th, dr: strict_verify(d, lg),
    "relaxed": lambda e, d, q, lg, th, dr: relaxed_verify(d, lg, th, e.g.top_n, e.g.delta, *e.g.think_ids,
                                                          e.g.span_rule),
    "sample": lambda e, d, q, lg, th, dr: sampling_verify(d, q, lg, e.g.sampling, dr, check_ids=e.dev.type == "cpu"),
    "typical": lambda e, d, q, lg, th, dr: typical_verify(d, lg, e.g.sampling.temperature, e.g.posterior_threshold,
                                                          e.g.posterior_alpha),
}


class Engine:
    """`proposer_factory(model, draft_cfg, batch, max_len)` replaces the MTP proposer (tests use oracle and
    adversarial drafters through it); anything with `propose(...)` (which writes its drafts into the token
    buffer at n.., as `Proposer.propose` does, and returns them) and `draft_forwards` works, and an optional
    `prefill(tokens, hidden, n, W, max_n)` fills its caches over the prompt."""

    def __init__(self, model: DeepseekV32, gcfg: GenerationConfig, proposer_factory: Callable | None = None):
        gcfg.validate(model)
        self.model, self.g = model, gcfg
        self.dev = model.device
        self.draw = DraftSampler(gcfg.draft.sampling, gcfg.sampling)
        self.runner = None
        if gcfg.mode != "eager":
            from .graphs import GraphRunner

            self.runner = GraphRunner(model, self.step)
        self.pool = StatePool(model, gcfg, proposer_factory or Proposer,
                              on_drop=self.runner.drop if self.runner else lambda key: None)
        eos = model.cfg.eos_token_id if gcfg.eos_id is None else gcfg.eos_id
        self.stop_ids = torch.tensor(sorted({eos, *gcfg.stop_ids}), device=self.dev)

    # ------------------------------------------------------------------ pieces
    def _clock(self) -> float:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)  # timing split only; the graph path measures with events
        return time.perf_counter()

    def verify(self, drafts_BK, q_BKV, logits_BKV, think_B, draws: RowDraws) -> Verdict:
        try:
            rule = CHAIN_VERIFIERS[self.g.verify]
        except KeyError:
            raise ValueError(f"verify={self.g.verify!r} is not a chain verifier; expected one of "
                             f"{', '.join(CHAIN_VERIFIERS)}") from None
        return rule(self, drafts_BK, q_BKV, logits_BKV, think_B, draws)

    def bound(self, st: DecodeState, host: torch.Tensor) -> int:
        """Bound on the positions a step touches. On CUDA always the buffer length, so eager, graph and overlap
        run the very same kernels on the same shapes (bitwise-equal outputs); on CPU the host-known max of n."""
        return st.max_len - self.g.draft.k if self.dev.type == "cuda" else int(host[0].max())

    def _sync(self, st: DecodeState, where: str) -> torch.Tensor:
        """The step's one host sync: [n_B, finished_B] for the loop condition and cache bounds; stops the run when
        the logits went non-finite (`where` names the prefill or the step in the error)."""
        host = torch.cat((torch.stack((st.n_B, st.finished_B.long())), st.nonfinite.long().expand(1, st.B))).cpu()
        if host[2, 0]:
            raise_nonfinite(self.model, st.tokens, st.n_B, where)
        return host[:2]

    def _prefill(self, st: DecodeState) -> None:
        """Target prefill (right-padded: padding sits after each row's prompt, so it never affects it) and the
        first token. Leaves n = P + 1 and the target cache at P positions."""
        m, g, dcfg, dev = self.model, self.g, self.g.draft, self.dev
        B, Tp, P_B = st.B, st.Tp, st.P_B
        C = g.prefill_chunk or Tp
        last = None  # logits at each row's last prompt position, taken from the chunk that holds it
        for s in range(0, Tp, C):  # chunks run through the cache-using forward, as decoding does
            e = min(Tp, s + C)
            at = (P_B - 1).clamp(s, e - 1) - s
            out = m(st.tokens[:, s:e], st.cache, kv_len=e, logits_at=at.unsqueeze(1))
            st.hidden[:, s:e] = pick_hidden(out, dcfg.target_hidden)
            here = ((P_B - 1 >= s) & (P_B - 1 < e)).view(B, 1, 1)
            last = out.logits if last is None else torch.where(here, out.logits, last)
        st.cache.truncate(P_B)
        logits_nonfinite(st.nonfinite, last)
        if g.think_ids is not None:
            st.think_B.copy_(prompt_think_state(st.tokens[:, :Tp], torch.arange(Tp, device=dev) < P_B.unsqueeze(1),
                                                *g.think_ids, g.span_rule))
        draws = RowDraws(st.seed_B, st.P_B)  # the first token's draws sit at position P
        first = self.verify(st.tokens[:, :0], None, last, st.think_B, draws).next_token_B
        st.tokens[torch.arange(B, device=dev), P_B] = first
        st.n_B.copy_(P_B + 1)
        st.finished_B.copy_(torch.isin(first, self.stop_ids) | (st.gen_B >= st.max_new_B))
        if g.think_ids is not None:
            st.think_B.copy_(update_think_state(st.think_B, first.unsqueeze(1),
                                                torch.ones(B, 1, dtype=torch.bool, device=dev), *g.think_ids))
        st.new_BK1[:, 0] = first
        st.keep_B.fill_(1)

    def _draft_prefill(self, st: DecodeState, host: torch.Tensor) -> None:
        """Run the draft modules over the whole prompt (window p0 = 0, W = longest prompt) so their caches hold
        every committed position; from then on each step, the first included, recomputes only the steady
        window, so one captured graph serves them all. The drafts made here are scratch (argmax, no random
        draws); the first step drafts again from its own window."""
        prefill = getattr(st.proposer, "prefill", None)  # custom proposers without caches need none
        if prefill is None:
            return
        prefill(st.tokens, st.hidden, st.n_B, st.Tp, max_n=self.bound(st, host), chunk=self.g.prefill_chunk)
        st.p0_B.copy_((st.n_B - 1 - self.g.draft.window()).clamp_min(0))

    def step(self, st: DecodeState, W: int, max_n: int, marks: list | None = None) -> None:
        """One speculative step, device ops only, every update in place (so a CUDA graph can replay it).
        `max_n` bounds the positions touched (host-known max of n, or the buffer length for graphs).
        `marks`: eager timing only; gets a clock reading between drafting and verification."""
        m, g, dcfg = self.model, self.g, self.g.draft
        K = dcfg.k
        ar = torch.arange(K + 1, device=self.dev)
        n_B = st.n_B
        active_B = ~st.finished_B
        draws = RowDraws(st.seed_B, n_B)  # read before the commit below moves n_B: this step's position
        if K:  # propose: the proposer writes the drafts at n.. of `tokens` (where verify reads them)
            drafts, q = st.proposer.propose(st.tokens, st.hidden, n_B, st.p0_B, W, self.draw.bind(draws),
                                            max_n=max_n)
        else:
            drafts, q = st.tokens[:, :0], None
        if marks is not None:
            marks.append(self._clock())
        # verify: one target forward over [x_{n-1}, d_1..d_K]
        vin = st.tokens.gather(1, (n_B - 1).unsqueeze(1) + ar)
        out = m(vin, st.cache, kv_len=min(max_n + K, st.max_len))
        st.hidden.scatter_(1, ((n_B - 1).unsqueeze(1) + ar).unsqueeze(-1).expand(-1, -1, st.hidden.shape[-1]),
                           pick_hidden(out, dcfg.target_hidden))
        logits_nonfinite(st.nonfinite, out.logits)
        v = self.verify(drafts, q, out.logits, st.think_B, draws)
        # accept + commit (rolling back is lowering lengths: no copy)
        acc = accept(drafts, v, active_B, self.stop_ids, st.max_new_B - st.gen_B)
        commit(st, acc, g.think_ids, dcfg.window())
        # metrics, on the device (no sync)
        st.hist_K1.scatter_add_(0, acc.accepted_B, active_B.long())
        st.relaxed_only.add_((v.relaxed_only_B * active_B).sum())
        st.row_steps.add_(active_B.long().sum())
        st.new_BK1.copy_(acc.new_BK1)
        st.keep_B.copy_(acc.keep_B)
        st.acc_B.copy_(torch.minimum(acc.accepted_B, acc.keep_B))

    # ------------------------------------------------------------------ loop
    @torch.no_grad()
    def run(self, prompts, on_step: Callable[[StepEvent], None] | None = None,
            max_new_tokens: int | None = None, seeds: Sequence[int] | None = None) -> GenerateResult:
        """Generate for `prompts`; `max_new_tokens` overrides the config's for this call, `seeds` (one per prompt)
        the sampling seeds (default: the config's seed + row index). An Engine kept across calls reuses its
        buffers and, in graph / overlap mode, the captured step graph."""
        g, dcfg = self.g, self.g.draft
        prompts = check_prompts(prompts, self.model.cfg.vocab_size)
        seeds = row_seeds(g.seed if seeds is None else seeds, len(prompts))
        max_new = g.max_new_tokens if max_new_tokens is None else max_new_tokens
        if not isinstance(max_new, int) or max_new < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new!r}")
        K, B = dcfg.k, len(prompts)
        met = SpecMetrics(k=K, draft=dcfg.mode, verify=g.verify, n_rows=B, prompt_tokens=int(sum(map(len, prompts))),
                          hidden_options={"target_hidden": dcfg.target_hidden, "chain_hidden": dcfg.chain_hidden})
        st = self.pool.get(prompts, max_new, seeds)
        try:
            fw0 = getattr(st.proposer, "draft_forwards", 0)
            t0 = self._clock()
            clock = RowClock(B)
            self._prefill(st)
            t1 = self._clock()
            met.time_prefill_s = t1 - t0
            emit = Emitter(on_step, B, clock)
            host = self._sync(st, "the prefill")
            emit(st.new_BK1.tolist(), st.keep_B.tolist(), [0] * B)
            drafting = K > 0 and not bool(host[1].all())
            if drafting:  # nothing to draft for when every row ended at its first token
                self._draft_prefill(st, host)
            W = dcfg.window()
            if self.g.mode == "eager":
                while not bool(host[1].all()):
                    marks = [self._clock()]
                    self.step(st, W, self.bound(st, host), marks)
                    ta, tm, tb = marks[0], marks[1], self._clock()
                    host = self._sync(st, f"step {met.target_forwards + 1}")
                    met.target_forwards += 1
                    emit(st.new_BK1.tolist(), st.keep_B.tolist(), st.acc_B.tolist())
                    met.time_draft_s += tm - ta
                    met.time_verify_s += tb - tm
                    met.time_host_s += time.perf_counter() - tb
            elif not bool(host[1].all()):
                self.runner.run(st, met, emit, W, self.bound(st, host), overlap=self.g.mode == "overlap")
        except NonFiniteError:
            # Its caches now hold non-finite entries past the rows' lengths; attention over a static bound
            # weights those masked slots by zero, and 0 * NaN is NaN, so a later call must not reuse them.
            self.pool.discard(st)
            raise
        met.time_decode_s = time.perf_counter() - t1
        met.accepted_hist = st.hist_K1.tolist()
        met.row_steps = int(st.row_steps)
        met.relaxed_only_accepts = int(st.relaxed_only)
        if isinstance(st.proposer, Proposer):
            # K module forwards per step (vanilla: one per depth; eagle: window + K-1 chained) plus the draft
            # prefill (each vanilla module once, the eagle module once). Counted, not read from the proposer:
            # graph replays do not run its Python, and a reused proposer's counter spans earlier calls.
            chunks = -(-st.Tp // (g.prefill_chunk or st.Tp))
            met.draft_forwards = K * met.target_forwards + (K if dcfg.mode == "vanilla" else 1) * chunks * drafting
        elif st.proposer is not None:
            met.draft_forwards = st.proposer.draft_forwards - fw0
        n_host, P_host = st.n_B.tolist(), st.P_B.tolist()
        toks = st.tokens.cpu()
        result, reasons = [], []
        stop_set = set(self.stop_ids.tolist())
        for b in range(B):
            seq = toks[b, P_host[b]: n_host[b]].tolist()
            result.append(seq)
            reasons.append("stop" if seq and seq[-1] in stop_set else "length")
        met.new_tokens = sum(len(s) for s in result)
        clock.fill(met, [len(s) for s in result])
        return GenerateResult(result, reasons, met)


class Emitter:
    """Turns a step's committed tokens into a StepEvent for `on_step` (rows with nothing committed get []),
    after timing them on the call's RowClock."""

    def __init__(self, on_step, B: int, clock: RowClock):
        self.on_step, self.B, self.clock = on_step, B, clock

    def __call__(self, new_rows: list[list[int]], keep: list[int], acc: list[int]) -> None:
        self.clock(new_rows, keep, acc)
        if self.on_step is not None:
            self.on_step(StepEvent([new_rows[b][: keep[b]] for b in range(self.B)], acc))
