"""The speculative decoding loop: prefill -> [propose -> verify -> accept -> commit] until every row is done; one
engine for chains and draft trees.

Shape legend: B batch, S buffer positions, K drafts, D width, V vocabulary.

The stages and their homes: propose `mtp/draft/` (the drafters `modes.py`, the MTP proposers, `DraftSampler` for
sampled drafts); verify `mtp/verify/` (pure functions of tensors, found by name in `registry.py`); accept / commit
(with the cache rollback) `accept.py`; the step itself, device work only, `chain.py` (`ChainStep`) or
`tree_step.py` (`TreeStep`); the decode state and its buffers `state.py`; options and their validation
`config.py`; one step as a CUDA graph and the overlap scheduler `graphs.py`. This file holds the `Engine` (the
prefill, the eager loop, the one host sync per step, the result) and `generate`.

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

from ..draft.proposer import pick_hidden
from ..model.deepseek import DeepseekV32
from ..verify.relaxed import prompt_think_state, update_think_state
from .chain import ChainRule, ChainStep
from .config import GenerationConfig, check_max_new_tokens, row_seeds
from .health import NonFiniteError, raise_nonfinite
from .keep import _ENGINES, kept, release  # noqa: F401  (callers know them as mtp.decode.engine.*)
from .metrics import RowClock, SpecMetrics
from .state import DecodeState, check_prompts
from .tree_metrics import TreeMetrics
from .tree_step import TreeStep


@dataclass
class GenerateResult:
    tokens: list[list[int]]  # new tokens per prompt (stop token included when it ended the row)
    finish_reasons: list[str]  # 'stop' | 'length'
    metrics: SpecMetrics
    tree: TreeMetrics | None = None  # a tree run's own metrics (acceptance per depth and sibling rank, nodes)
    row_accepted_hist: list[list[int]] | None = None  # accepted-count histogram of each row ([B][k + 1])


@dataclass
class StepEvent:
    """What one step committed, for streaming front ends (rows that were already finished get [])."""

    new_tokens: list[list[int]]
    accepted: list[int]  # drafts accepted per row (the rest of new_tokens is the target's own token)


def stops(on_step: Callable[[StepEvent], None]) -> Callable[[StepEvent], None]:
    """Mark a step callback that may raise to end the generation early (the chat's Ctrl-C). On a model split over
    ranks (mtp.distributed.driver) every step then ends with rank 0's verdict sent to every rank, so all stop at the
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
    live in a buffer the captured step reads). `draft` and `verify` take a registered drafter or verifier by
    name or as the object (mtp.draft.modes, mtp.verify.registry). With a draft tree (`tree=`,
    `DraftConfig.tree`) the engine runs the tree step (one int seed), metrics as SpecMetrics (k = the tree's
    depth) with the tree's own in `tree`."""
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
    if peers is not None:  # rank 0 of a sharded model: every rank runs this call (mtp.distributed.driver)
        return peers.generate(model, prompts, gcfg, seed, on_step)
    return run_generation(model, prompts, gcfg, seed, on_step)


def run_generation(model: DeepseekV32, prompts: Sequence[Sequence[int]], gcfg: GenerationConfig, seed,
                   on_step: Callable[[StepEvent], None] | None = None) -> GenerateResult:
    """`generate` on this process's model once the options are resolved (`seed`: an int, or one per prompt)."""
    seeds = row_seeds(seed, len(prompts))
    if gcfg.draft.tree is not None and not isinstance(seed, int) and len(set(seeds)) > 1:
        raise ValueError(f"generate: a draft tree takes one int seed, got per-prompt seeds {seeds!r:.80} (tree "
                         "sampling draws a whole batch from one torch.Generator)")
    if gcfg.mode == "eager":
        return Engine(model, gcfg).run(prompts, on_step=on_step, seeds=seeds)
    engine = kept(model, gcfg, lambda: Engine(model, gcfg))
    return engine.run(prompts, on_step=on_step, max_new_tokens=gcfg.max_new_tokens, seeds=seeds)


class Engine:
    """Decoding with one `GenerationConfig`: the step (`ChainStep`, or `TreeStep` when the draft carries a tree),
    its buffers (`StatePool`) and, in graph / overlap mode, its captured step graphs (`GraphRunner`), all reused by
    later `run` calls. `proposer_factory` (chains): see `ChainStep`. `static_bound`: run every step with the
    buffer length as its position bound, as a captured step does (default: on CUDA, where every mode does so;
    tests set it on a CPU to hold the graph modes' step to eager's). Graph modes need CUDA (`GenerationConfig.validate`
    refuses them elsewhere, for chains and trees alike)."""

    def __init__(self, model: DeepseekV32, gcfg: GenerationConfig, proposer_factory: Callable | None = None,
                 static_bound: bool | None = None):
        gcfg.validate(model)
        self.model, self.g = model, gcfg
        self.dev = model.device
        self.static_bound = self.dev.type == "cuda" if static_bound is None else static_bound
        eos = model.cfg.eos_token_id if gcfg.eos_id is None else gcfg.eos_id
        self.stop_ids = torch.tensor(sorted({eos, *gcfg.stop_ids}), device=self.dev)
        self.first_rule = ChainRule(gcfg)  # the prefill's token: the chain rule over no drafts
        if gcfg.draft.tree is None:
            self.step = ChainStep(model, gcfg, self.stop_ids, self._clock, proposer_factory)
        elif proposer_factory is not None:
            raise ValueError("Engine: proposer_factory replaces a chain's proposer; a draft tree has its own")
        else:
            self.step = TreeStep(model, gcfg, self.stop_ids, self._clock)
        self.runner = None
        if gcfg.mode != "eager":
            from .graphs import GraphRunner

            self.runner = GraphRunner(model, self.step)
        self.pool = self.step.pool(on_drop=self.runner.drop if self.runner else lambda key: None)

    # ------------------------------------------------------------------ pieces
    def _clock(self) -> float:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)  # timing split only; the graph path measures with events
        return time.perf_counter()

    def bound(self, st: DecodeState, host: torch.Tensor) -> int:
        """Bound on the positions a step touches. With `static_bound` (on CUDA) always the buffer's, so eager, graph
        and overlap run the very same kernels on the same shapes (bitwise-equal outputs); else the host-known max
        of n."""
        return st.max_len - self.step.reach if self.static_bound else int(host[0].max())

    def _sync(self, st: DecodeState, where: str) -> torch.Tensor:
        """The step's one host sync: [n_B, finished_B] for the loop condition and cache bounds; stops the run when
        the logits went non-finite (`where` names the prefill or the step in the error)."""
        host = torch.cat((torch.stack((st.n_B, st.finished_B.long())), st.nonfinite.long().expand(1, st.B))).cpu()
        if host[2, 0]:
            raise_nonfinite(self.model, st.tokens, st.n_B, where)
        return host[:2]

    def _prefill(self, st: DecodeState) -> None:
        """Target prefill (right-padded: padding sits after each row's prompt, so it never affects it) and the
        first token (the verifier's chain rule over no drafts). Leaves n = P + 1 and the target cache at P
        positions."""
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
        if g.think_ids is not None:
            st.think_B.copy_(prompt_think_state(st.tokens[:, :Tp], torch.arange(Tp, device=dev) < P_B.unsqueeze(1),
                                                *g.think_ids, g.span_rule))
        first = self.first_rule(m, g, st.tokens[:, :0], None, last, st.think_B, self.step.first_rng(st),
                                st.nonfinite).next_token_B
        st.tokens[torch.arange(B, device=dev), P_B] = first
        st.n_B.copy_(P_B + 1)
        st.finished_B.copy_(torch.isin(first, self.stop_ids) | (st.gen_B >= st.max_new_B))
        if g.think_ids is not None:
            st.think_B.copy_(update_think_state(st.think_B, first.unsqueeze(1),
                                                torch.ones(B, 1, dtype=torch.bool, device=dev), *g.think_ids))
        st.new_BK1[:, 0] = first
        st.keep_B.fill_(1)

    # ------------------------------------------------------------------ loop
    @torch.no_grad()
    def run(self, prompts, on_step: Callable[[StepEvent], None] | None = None,
            max_new_tokens: int | None = None, seeds: Sequence[int] | None = None) -> GenerateResult:
        """Generate for `prompts`; `max_new_tokens` overrides the config's for this call, `seeds` (one per prompt)
        the sampling seeds (default: the config's seed + row index; a tree seeds its generator with the first).
        An Engine kept across calls reuses its buffers and, in graph / overlap mode, the captured step graph."""
        g, dcfg = self.g, self.g.draft
        prompts = check_prompts(prompts, self.model.cfg.vocab_size)
        self.step.check(prompts)
        seeds = row_seeds(g.seed if seeds is None else seeds, len(prompts))
        max_new = g.max_new_tokens if max_new_tokens is None else max_new_tokens
        check_max_new_tokens(max_new)
        K, B = dcfg.k, len(prompts)
        met = SpecMetrics(k=K, draft=dcfg.mode, verify=g.verify, n_rows=B, prompt_tokens=int(sum(map(len, prompts))),
                          hidden_options={"target_hidden": dcfg.target_hidden, "chain_hidden": dcfg.chain_hidden})
        self.step.seed(seeds)
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
                td = self._clock()
                self.step.draft_prefill(st, self.bound(st, host))
                # the drafter's pass over the prompt: part of the decode time (no draft before it), reported
                # apart so that per-step figures (time_decode_s / target_forwards) can leave it out
                met.time_draft_prefill_s = self._clock() - td
            if self.g.mode == "eager":
                while not bool(host[1].all()):
                    marks = [self._clock()]
                    self.step(st, self.step.W, self.bound(st, host), marks)
                    ta, tm, tb = marks[0], marks[1], self._clock()
                    host = self._sync(st, f"step {met.target_forwards + 1}")
                    met.target_forwards += 1
                    emit(st.new_BK1.tolist(), st.keep_B.tolist(), st.acc_B.tolist())
                    met.time_draft_s += tm - ta
                    met.time_verify_s += tb - tm
                    met.time_host_s += time.perf_counter() - tb
            elif not bool(host[1].all()):
                self.runner.run(st, met, emit, self.step.W, self.bound(st, host), overlap=self.g.mode == "overlap")
        except NonFiniteError:
            # Its caches now hold non-finite entries past the rows' lengths; attention over a static bound
            # weights those masked slots by zero, and 0 * NaN is NaN, so a later call must not reuse them.
            self.pool.discard(st)
            raise
        met.time_decode_s = time.perf_counter() - t1
        return self._result(st, met, clock, drafting, fw0)

    def _result(self, st: DecodeState, met: SpecMetrics, clock: RowClock, drafting: bool, fw0: int) -> GenerateResult:
        """Read the device counters and the tokens once, after the run."""
        row_hist = st.hist_BK1.tolist()
        met.accepted_hist = [sum(col) for col in zip(*row_hist)]
        met.row_steps = int(st.row_steps)
        met.relaxed_only_accepts = int(st.relaxed_only)
        met.draft_forwards = self.step.draft_forwards(st, met.target_forwards, drafting, fw0)
        n_host, P_host = st.n_B.tolist(), st.P_B.tolist()
        toks = st.tokens.cpu()
        stop_set = set(self.stop_ids.tolist())
        result = [toks[b, P_host[b]: n_host[b]].tolist() for b in range(st.B)]
        reasons = ["stop" if seq and seq[-1] in stop_set else "length" for seq in result]
        met.new_tokens = sum(len(s) for s in result)
        clock.fill(met, [len(s) for s in result])
        return GenerateResult(result, reasons, met, tree=self.step.extra_metrics(st, met), row_accepted_hist=row_hist)


class Emitter:
    """Turns a step's committed tokens into a StepEvent for `on_step` (rows with nothing committed get []),
    after timing them on the call's RowClock."""

    def __init__(self, on_step, B: int, clock: RowClock):
        self.on_step, self.B, self.clock = on_step, B, clock

    def __call__(self, new_rows: list[list[int]], keep: list[int], acc: list[int]) -> None:
        self.clock(new_rows, keep, acc)
        if self.on_step is not None:
            self.on_step(StepEvent([new_rows[b][: keep[b]] for b in range(self.B)], acc))
