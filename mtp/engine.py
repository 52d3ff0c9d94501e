"""The speculative decoding loop: prefill -> [propose -> verify -> accept -> commit/rollback] until done.

Shape legend: B batch, S buffer positions, K drafts, D width, V vocabulary.

Per row the engine keeps n committed tokens in `tokens_BS` and the target's hidden state of every position
in `hidden_BSD` (valid up to n-2). The target cache holds n-1 positions: the last committed token is fed at
the next verify together with the K drafts, so one target forward scores K+1 positions. After verification
the accepted drafts plus one target token are committed and the target cache is rolled back to n-1 by
lowering its lengths (no copy). Rows advance independently; finished rows stay frozen so every tensor keeps
its shape. `draft='none'` (K = 0) is plain autoregressive decoding through the same code (the baseline).

Host syncs (eager mode): one per step to read (n, finished) for the loop condition and cache bounds, plus the
step's committed tokens for `on_step`. graph / overlap modes (mtp/runner.py) replay the step as one CUDA graph
and read the same values from pinned buffers, overlap one step late. Design notes: mtp/DESIGN.md.
"""

from __future__ import annotations

import dataclasses
import os
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .draft.proposer import DraftConfig, Proposer, pick_hidden
from .health import logits_nonfinite, raise_nonfinite
from .metrics import SpecMetrics
from .model import DeepseekV32
from .verify import SamplingParams, Verdict, relaxed_verify, sampling_verify, strict_verify, update_think_state
from .verify.sampling import filter_probs, sample

VERIFIERS = ("strict", "relaxed", "sample")


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 64
    draft: DraftConfig = field(default_factory=DraftConfig)
    verify: str = "strict"
    top_n: int = 10  # relaxed
    delta: float = 0.6  # relaxed, probability space
    think_ids: tuple[int, int] | None = None  # (<think>, </think>) ids, relaxed
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    eos_id: int | None = None  # default: the model's eos_token_id
    stop_ids: tuple[int, ...] = ()
    mode: str = "eager"  # eager | graph (whole step in one CUDA graph) | overlap (graph + pipelined host)
    prefill_chunk: int | None = None  # prefill (target and drafts) in chunks of this many tokens; None: one pass

    def validate(self, model: DeepseekV32) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.verify not in VERIFIERS:
            raise ValueError(f"verify must be one of {VERIFIERS}, got {self.verify!r}")
        self.draft.validate(model.n_mtp)
        if self.verify == "relaxed":
            if self.think_ids is None:
                raise ValueError("verify='relaxed' needs think_ids=(<think> id, </think> id): the relaxed rule "
                                 "only applies inside thinking spans")
            if self.top_n < 1:
                raise ValueError(f"relaxed top_n must be >= 1, got {self.top_n}")
            if not 0 <= self.delta <= 1:
                raise ValueError(f"relaxed delta must be in [0, 1] (probability space), got {self.delta}")
        if self.draft.sampling == "sample" and self.verify != "sample":
            raise ValueError("sampled drafts (draft sampling='sample') need verify='sample' to stay lossless")
        if self.prefill_chunk is not None and (not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be None or an integer >= 1, got {self.prefill_chunk!r}")
        if self.mode not in ("eager", "graph", "overlap"):
            raise ValueError(f"mode must be 'eager', 'graph' or 'overlap', got {self.mode!r}")
        if self.mode != "eager" and model.device.type != "cuda":
            raise ValueError(f"mode={self.mode!r} captures CUDA graphs and needs the model on a CUDA device "
                             f"(it is on {model.device}); use mode='eager'")
        V = model.cfg.vocab_size
        eos = () if self.eos_id is None else (self.eos_id,)
        for t in tuple(self.stop_ids) + tuple(self.think_ids or ()) + eos:
            if not 0 <= t < V:
                raise ValueError(f"token id {t} is outside the vocabulary [0, {V})")


@dataclass
class GenerateResult:
    tokens: list[list[int]]  # new tokens per prompt (stop token included when it ended the row)
    finish_reasons: list[str]  # 'stop' | 'length'
    metrics: SpecMetrics


@dataclass
class StepEvent:
    """What one step committed, for streaming front ends (rows that were already finished get [])."""

    new_tokens: list[list[int]]
    accepted: list[int]  # drafts accepted per row (the rest of new_tokens is the target's own token)


def generate(model: DeepseekV32, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64, draft: str = "none",
             k: int | None = None, verify: str = "strict", *, on_step: Callable[[StepEvent], None] | None = None,
             **options) -> GenerateResult:
    """Speculative generation. Options: top_n, delta, think_ids (relaxed); temperature, top_p, top_k,
    draft_sampling, seed (sampling); reuse_modules, target_hidden, chain_hidden, draft_vocab (drafts: token ids
    or a vocabulary file, `mtp.draft.vocab`; ignored when nothing is drafted); eos_id, stop_ids."""
    known = {"top_n", "delta", "think_ids", "temperature", "top_p", "top_k", "draft_sampling", "seed",
             "reuse_modules", "target_hidden", "chain_hidden", "eos_id", "stop_ids", "mode", "prefill_chunk",
             "draft_vocab"}
    unknown = set(options) - known
    if unknown:
        raise TypeError(f"generate: unknown options {sorted(unknown)}; known: {sorted(known)}")
    k = (0 if draft == "none" else 1) if k is None else k
    dcfg = DraftConfig(mode=draft, k=k, reuse_modules=options.get("reuse_modules", False),
                       target_hidden=options.get("target_hidden", "normed"),
                       chain_hidden=options.get("chain_hidden", "normed"),
                       sampling=options.get("draft_sampling", "greedy"),
                       vocab=_draft_vocab(options.get("draft_vocab")) if draft != "none" else None)
    sp = SamplingParams(options.get("temperature", 1.0), options.get("top_k", 0), options.get("top_p", 1.0)) \
        if verify == "sample" else SamplingParams()
    think = options.get("think_ids")
    gcfg = GenerationConfig(max_new_tokens=max_new_tokens, draft=dcfg, verify=verify,
                            top_n=options.get("top_n", 10), delta=options.get("delta", 0.6),
                            think_ids=tuple(think) if think is not None else None, sampling=sp,
                            seed=options.get("seed", 0), eos_id=options.get("eos_id"),
                            stop_ids=tuple(options.get("stop_ids", ())), mode=options.get("mode", "eager"),
                            prefill_chunk=options.get("prefill_chunk"))
    if gcfg.mode == "eager":
        return Engine(model, gcfg).run(prompts, on_step=on_step)
    # graph / overlap: keep the engine (buffers + captured step graphs) for the next call with these settings
    per_model = _ENGINES.setdefault(model, {})
    key = dataclasses.replace(gcfg, max_new_tokens=1)
    engine = per_model.pop(key, None) or Engine(model, gcfg)
    per_model[key] = engine
    while len(per_model) > 4:
        del per_model[next(iter(per_model))]
    return engine.run(prompts, on_step=on_step, max_new_tokens=max_new_tokens)


def _draft_vocab(v) -> tuple[int, ...] | None:
    """`draft_vocab` option: None, token ids, or the path of a vocabulary file (all its ids)."""
    if v is None:
        return None
    if isinstance(v, (str, os.PathLike)):
        from .draft.vocab import load_ids

        return load_ids(v)
    return tuple(int(i) for i in v)


# model -> {settings: Engine}; weak, so the buffers and graphs go with the model. `release(model)` frees them.
_ENGINES: "weakref.WeakKeyDictionary[DeepseekV32, dict]" = weakref.WeakKeyDictionary()


def release(model: DeepseekV32 | None = None) -> None:
    """Drop the engines (decode buffers, captured CUDA graphs) `generate` keeps for `model`, or for every model.
    Call it with no model before `torch.distributed.destroy_process_group()`: NCCL's teardown waits while
    captured graphs holding its collectives are alive (seen: ranks hung in destroy_process_group)."""
    if model is None:
        _ENGINES.clear()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    else:
        _ENGINES.pop(model, None)


class Engine:
    """`proposer_factory(model, draft_cfg, batch, max_len)` replaces the MTP proposer (tests use oracle and
    adversarial drafters through it); anything with `propose(...)` and `draft_forwards` works, and an optional
    `prefill(tokens, hidden, n, W, max_n)` fills its caches over the prompt."""

    def __init__(self, model: DeepseekV32, gcfg: GenerationConfig, proposer_factory: Callable | None = None):
        gcfg.validate(model)
        self.model, self.g = model, gcfg
        self.proposer_factory = proposer_factory or Proposer
        self.dev = model.device
        self.gen = torch.Generator(device=self.dev).manual_seed(gcfg.seed)
        self._states: dict[tuple[int, int], DecodeState] = {}  # (batch, buffer length) -> buffers, LRU order
        self.graphs: dict[tuple[int, int], tuple] = {}  # same key -> (CUDA graph, capture s, pool bytes)
        eos = model.cfg.eos_token_id if gcfg.eos_id is None else gcfg.eos_id
        self.stop_ids = torch.tensor(sorted({eos, *gcfg.stop_ids}), device=self.dev)

    # ------------------------------------------------------------------ pieces
    def _clock(self) -> float:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)  # timing split only; the graph path measures with events
        return time.perf_counter()

    def _draw(self, logits_BV: torch.Tensor):
        if self.g.draft.sampling == "sample":
            q = filter_probs(logits_BV, self.g.sampling)
            return sample(q, self.gen), q
        return logits_BV.argmax(dim=-1), None

    def _verify(self, drafts_BK, q_BKV, logits_BKV, think_B) -> Verdict:
        g = self.g
        if g.verify == "strict":
            return strict_verify(drafts_BK, logits_BKV)
        if g.verify == "relaxed":
            return relaxed_verify(drafts_BK, logits_BKV, think_B, g.top_n, g.delta, *g.think_ids)
        return sampling_verify(drafts_BK, q_BKV, logits_BKV, g.sampling, self.gen)

    def _check_prompts(self, prompts) -> list[list[int]]:
        V = self.model.cfg.vocab_size
        if len(prompts) == 0:
            raise ValueError("prompts is empty")
        out = []
        for i, p in enumerate(prompts):
            p = [int(t) for t in p]
            if not p:
                raise ValueError(f"prompts[{i}] is empty")
            bad = [t for t in p if not 0 <= t < V]
            if bad:
                raise ValueError(f"prompts[{i}] has token ids outside [0, {V}): {bad[:5]}")
            out.append(p)
        return out

    # ------------------------------------------------------------------ state
    STATE_ROUND = 512  # buffer lengths are rounded up to this, so calls of similar length share buffers
    MAX_STATES = 4  # buffer sets (and their captured graphs) kept per engine, least recently used dropped

    def _state_for(self, prompts: list[list[int]], max_new: int) -> "DecodeState":
        """The buffers for this call: reused when a previous call had the same batch and rounded length (its
        captured step graph then replays as is), else allocated. Buffer length depends only on this call, so
        eager, graph and overlap runs of the same call see the same shapes (bitwise-equal outputs)."""
        m, K = self.model, self.g.draft.k
        B, Tp = len(prompts), max(len(p) for p in prompts)
        need = Tp + max_new + 3 * K + 2
        limit = m.cfg.max_position_embeddings
        if need > limit:
            raise ValueError(f"prompt ({Tp}) + max_new_tokens ({max_new}) + draft room ({3 * K + 2}) exceed "
                             f"max_position_embeddings ({limit})")
        key = (B, min(-(-need // self.STATE_ROUND) * self.STATE_ROUND, limit))
        st = self._states.pop(key, None) or self._new_state(*key)
        self._states[key] = st  # most recently used last
        while len(self._states) > self.MAX_STATES:
            old = next(iter(self._states))
            del self._states[old]
            self.graphs.pop(old, None)
        self._reset(st, prompts, max_new)
        return st

    def _new_state(self, B: int, max_len: int) -> "DecodeState":
        m, g, dev, K = self.model, self.g, self.dev, self.g.draft.k

        def z(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=dev)

        return DecodeState(
            tokens=z(B, max_len), hidden=z(B, max_len, m.cfg.hidden_size, dtype=m.dtype),
            cache=m.new_cache(B, max_len),
            proposer=self.proposer_factory(m, g.draft, B, max_len) if K else None,
            P_B=z(B), Tp=0, max_len=max_len, n_B=z(B), gen_B=z(B), max_new_B=z(B), p0_B=z(B),
            finished_B=z(B, dtype=torch.bool), think_B=z(B, dtype=torch.bool), hist_K1=z(K + 1),
            relaxed_only=z(()), row_steps=z(()), new_BK1=z(B, K + 1), keep_B=z(B), acc_B=z(B),
            nonfinite=z((), dtype=torch.bool),
        )

    def _reset(self, st: "DecodeState", prompts: list[list[int]], max_new: int) -> None:
        """Load a call's prompts; every counter back to its start (stale buffer contents past a row's length
        are never read)."""
        st.Tp = max(len(p) for p in prompts)
        for b, p in enumerate(prompts):
            st.tokens[b, : len(p)] = torch.tensor(p, device=self.dev)
        st.P_B.copy_(torch.tensor([len(p) for p in prompts]))
        st.max_new_B.fill_(max_new)
        st.gen_B.fill_(1)
        for t in (st.n_B, st.p0_B, st.finished_B, st.think_B, st.hist_K1, st.relaxed_only, st.row_steps,
                  st.new_BK1, st.keep_B, st.acc_B, st.nonfinite):
            t.zero_()
        st.cache.reset()  # the prefill writes from position 0
        for c in getattr(st.proposer, "caches", ()):
            c.reset()

    def _sync(self, st: "DecodeState", where: str) -> torch.Tensor:
        """The step's one host sync: [n_B, finished_B] for the loop condition and cache bounds; stops the run when
        the logits went non-finite (`where` names the prefill or the step in the error)."""
        host = torch.cat((torch.stack((st.n_B, st.finished_B.long())), st.nonfinite.long().expand(1, st.B))).cpu()
        if host[2, 0]:
            raise_nonfinite(self.model, st.tokens, st.n_B, where)
        return host[:2]

    def _bound(self, st: "DecodeState", host: torch.Tensor) -> int:
        """Bound on the positions a step touches. On CUDA always the buffer length, so eager, graph and overlap
        run the very same kernels on the same shapes (bitwise-equal outputs); on CPU the host-known max of n."""
        return st.max_len - self.g.draft.k if self.dev.type == "cuda" else int(host[0].max())

    def _prefill(self, st: "DecodeState") -> None:
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
            st.think_B.copy_(update_think_state(st.think_B, st.tokens[:, :Tp],
                                                torch.arange(Tp, device=dev) < P_B.unsqueeze(1), *g.think_ids))
        first = self._verify(st.tokens[:, :0], None, last, st.think_B).next_token_B
        st.tokens[torch.arange(B, device=dev), P_B] = first
        st.n_B.copy_(P_B + 1)
        st.finished_B.copy_(torch.isin(first, self.stop_ids) | (st.gen_B >= st.max_new_B))
        if g.think_ids is not None:
            st.think_B.copy_(update_think_state(st.think_B, first.unsqueeze(1),
                                                torch.ones(B, 1, dtype=torch.bool, device=dev), *g.think_ids))
        st.new_BK1[:, 0] = first
        st.keep_B.fill_(1)

    def _draft_prefill(self, st: "DecodeState", host: torch.Tensor) -> None:
        """Run the draft modules over the whole prompt (window p0 = 0, W = longest prompt) so their caches hold
        every committed position; from then on each step, the first included, recomputes only the steady
        window, so one captured graph serves them all. The drafts made here are scratch (argmax, no random
        draws); the first step drafts again from its own window."""
        prefill = getattr(st.proposer, "prefill", None)  # custom proposers without caches need none
        if prefill is None:
            return
        prefill(st.tokens, st.hidden, st.n_B, st.Tp, max_n=self._bound(st, host), chunk=self.g.prefill_chunk)
        st.p0_B.copy_((st.n_B - 1 - self.g.draft.window()).clamp_min(0))

    def _step(self, st: "DecodeState", W: int, max_n: int, marks: list | None = None) -> None:
        """One speculative step, device ops only, every update in place (so a CUDA graph can replay it).
        `max_n` bounds the positions touched (host-known max of n, or the buffer length for graphs).
        `marks`: eager timing only; gets a clock reading between drafting and verification."""
        m, g, dcfg = self.model, self.g, self.g.draft
        K, B = dcfg.k, st.B
        rows = torch.arange(B, device=self.dev)
        ar = torch.arange(K + 1, device=self.dev)
        n_B = st.n_B
        active_B = ~st.finished_B
        if K:
            drafts, q = st.proposer.propose(st.tokens, st.hidden, n_B, st.p0_B, W, self._draw, max_n=max_n)
            # The verify input is read from `tokens`: write the returned drafts there, so what is verified
            # is exactly what was proposed, whether or not the proposer wrote them itself.
            st.tokens.scatter_(1, n_B.unsqueeze(1) + ar[:K], drafts)
        else:
            drafts, q = st.tokens[:, :0], None
        if marks is not None:
            marks.append(self._clock())
        vin = st.tokens.gather(1, (n_B - 1).unsqueeze(1) + ar)  # [x_{n-1}, d_1..d_K]
        out = m(vin, st.cache, kv_len=min(max_n + K, st.max_len))
        st.hidden.scatter_(1, ((n_B - 1).unsqueeze(1) + ar).unsqueeze(-1).expand(-1, -1, st.hidden.shape[-1]),
                           pick_hidden(out, dcfg.target_hidden))
        logits_nonfinite(st.nonfinite, out.logits)
        v = self._verify(drafts, q, out.logits, st.think_B)

        # ---- accept: drafts d_1..d_a then the target token, cut at a stop token and at max_new_tokens
        a_B = torch.where(active_B, v.accept_len_B, torch.zeros_like(v.accept_len_B))
        new_BK1 = torch.cat((drafts, torch.zeros_like(a_B).unsqueeze(1)), 1)
        new_BK1[rows, a_B] = v.next_token_B
        valid_BK1 = ar.unsqueeze(0) <= a_B.unsqueeze(1)
        is_stop = torch.isin(new_BK1, self.stop_ids) & valid_BK1
        first_stop = torch.where(is_stop.any(1), is_stop.long().argmax(1), torch.full_like(a_B, K + 1))
        keep_B = torch.minimum(torch.minimum(a_B + 1, first_stop + 1), st.max_new_B - st.gen_B)
        keep_B = torch.where(active_B, keep_B, torch.zeros_like(keep_B))
        kept_BK1 = ar.unsqueeze(0) < keep_B.unsqueeze(1)
        # ---- commit + rollback (rolling back is lowering lengths: no copy)
        pos = (n_B.unsqueeze(1) + ar).clamp_max(st.max_len - 1)
        st.tokens.scatter_(1, pos, torch.where(kept_BK1, new_BK1, st.tokens.gather(1, pos)))
        if g.think_ids is not None:
            st.think_B.copy_(update_think_state(st.think_B, new_BK1, kept_BK1, *g.think_ids))
        st.n_B.add_(keep_B)
        st.gen_B.add_(keep_B)
        st.finished_B.copy_(st.finished_B | (is_stop & kept_BK1).any(1) | (st.gen_B >= st.max_new_B))
        st.cache.truncate(st.n_B - 1)
        st.p0_B.copy_((st.n_B - 1 - dcfg.window()).clamp_min(0))
        # ---- metrics, on the device (no sync)
        st.hist_K1.scatter_add_(0, a_B, active_B.long())
        st.relaxed_only.add_((v.relaxed_only_B * active_B).sum())
        st.row_steps.add_(active_B.long().sum())
        st.new_BK1.copy_(new_BK1)
        st.keep_B.copy_(keep_B)
        st.acc_B.copy_(torch.minimum(a_B, keep_B))

    # ------------------------------------------------------------------ loop
    @torch.no_grad()
    def run(self, prompts, on_step: Callable[[StepEvent], None] | None = None,
            max_new_tokens: int | None = None) -> GenerateResult:
        """Generate for `prompts`; `max_new_tokens` overrides the config's for this call. An Engine kept across
        calls reuses its buffers and, in graph / overlap mode, the captured step graph."""
        g, dcfg = self.g, self.g.draft
        prompts = self._check_prompts(prompts)
        max_new = g.max_new_tokens if max_new_tokens is None else max_new_tokens
        if not isinstance(max_new, int) or max_new < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new!r}")
        K, B = dcfg.k, len(prompts)
        met = SpecMetrics(k=K, draft=dcfg.mode, verify=g.verify, n_rows=B, prompt_tokens=int(sum(map(len, prompts))),
                          hidden_options={"target_hidden": dcfg.target_hidden, "chain_hidden": dcfg.chain_hidden})
        st = self._state_for(prompts, max_new)
        self.gen.manual_seed(g.seed)  # every call draws as a fresh engine would (reused engines included)
        fw0 = getattr(st.proposer, "draft_forwards", 0)
        t0 = self._clock()
        self._prefill(st)
        t1 = self._clock()
        met.time_prefill_s = met.ttft_s = t1 - t0
        emit = _Emitter(on_step, B)
        host = self._sync(st, "the prefill")
        emit(st.new_BK1.tolist(), st.keep_B.tolist(), [0] * B)
        drafting = K > 0 and not bool(host[1].all())
        if drafting:  # nothing to draft for when every row ended at its first token
            self._draft_prefill(st, host)
        W = dcfg.window()
        if self.g.mode == "eager":
            while not bool(host[1].all()):
                marks = [self._clock()]
                self._step(st, W, self._bound(st, host), marks)
                ta, tm, tb = marks[0], marks[1], self._clock()
                host = self._sync(st, f"step {met.target_forwards + 1}")
                met.target_forwards += 1
                emit(st.new_BK1.tolist(), st.keep_B.tolist(), st.acc_B.tolist())
                met.time_draft_s += tm - ta
                met.time_verify_s += tb - tm
                met.time_host_s += time.perf_counter() - tb
        else:
            from .runner import run_captured

            run_captured(self, st, met, emit, host, W)
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
        return GenerateResult(result, reasons, met)


@dataclass
class DecodeState:
    """Every tensor a step reads or writes; allocated once per (batch, buffer length), reused by later calls of
    the same Engine, updated in place."""

    tokens: torch.Tensor  # [B, S] committed tokens (drafts scratch past n)
    hidden: torch.Tensor  # [B, S, D] target hidden per position (valid < n-1)
    cache: object  # KVCache of the target
    proposer: object | None
    P_B: torch.Tensor  # prompt lengths
    Tp: int  # longest prompt of the current call
    max_len: int
    n_B: torch.Tensor  # committed length
    gen_B: torch.Tensor  # generated so far
    max_new_B: torch.Tensor  # this call's max_new_tokens (a tensor, so a captured step serves any value)
    p0_B: torch.Tensor  # draft window start
    finished_B: torch.Tensor
    think_B: torch.Tensor  # inside a thinking span after the last committed token
    hist_K1: torch.Tensor  # accepted-count histogram (device)
    relaxed_only: torch.Tensor
    row_steps: torch.Tensor
    new_BK1: torch.Tensor  # last step: candidate tokens; first keep_B of each row were committed
    keep_B: torch.Tensor
    acc_B: torch.Tensor  # last step: committed drafts per row
    nonfinite: torch.Tensor  # [] bool: some target logits of this call were NaN / inf (mtp.health)

    @property
    def B(self) -> int:
        return self.tokens.shape[0]


class _Emitter:
    """Turns a step's committed tokens into a StepEvent for `on_step` (rows with nothing committed get [])."""

    def __init__(self, on_step, B: int):
        self.on_step, self.B = on_step, B

    def __call__(self, new_rows: list[list[int]], keep: list[int], acc: list[int]) -> None:
        if self.on_step is not None:
            self.on_step(StepEvent([new_rows[b][: keep[b]] for b in range(self.B)], acc))
