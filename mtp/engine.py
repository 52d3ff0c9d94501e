"""The speculative decoding loop: prefill -> [propose -> verify -> accept -> commit/rollback] until done.

Shape legend: B batch, S buffer positions, K drafts, D width, V vocabulary.

Per row the engine keeps n committed tokens in `tokens_BS` and the target's hidden state of every position
in `hidden_BSD` (valid up to n-2). The target cache holds n-1 positions: the last committed token is fed at
the next verify together with the K drafts, so one target forward scores K+1 positions. After verification
the accepted drafts plus one target token are committed and the target cache is rolled back to n-1 by
lowering its lengths (no copy). Rows advance independently; finished rows stay frozen so every tensor keeps
its shape. `draft='none'` (K = 0) is plain autoregressive decoding through the same code (the baseline).

Host syncs: one per step to read (n, finished) for the loop condition and cache bounds; plus, when
`on_step` is given, the committed tokens for streaming. Everything else stays on the device.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .draft.proposer import DraftConfig, Proposer, pick_hidden
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
        V = model.cfg.vocab_size
        for t in tuple(self.stop_ids) + tuple(self.think_ids or ()):
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
    draft_sampling, seed (sampling); reuse_modules, target_hidden, chain_hidden (drafts); eos_id, stop_ids."""
    known = {"top_n", "delta", "think_ids", "temperature", "top_p", "top_k", "draft_sampling", "seed",
             "reuse_modules", "target_hidden", "chain_hidden", "eos_id", "stop_ids"}
    unknown = set(options) - known
    if unknown:
        raise TypeError(f"generate: unknown options {sorted(unknown)}; known: {sorted(known)}")
    k = (0 if draft == "none" else 1) if k is None else k
    dcfg = DraftConfig(mode=draft, k=k, reuse_modules=options.get("reuse_modules", False),
                       target_hidden=options.get("target_hidden", "normed"),
                       chain_hidden=options.get("chain_hidden", "normed"),
                       sampling=options.get("draft_sampling", "greedy"))
    sp = SamplingParams(options.get("temperature", 1.0), options.get("top_k", 0), options.get("top_p", 1.0)) \
        if verify == "sample" else SamplingParams()
    think = options.get("think_ids")
    gcfg = GenerationConfig(max_new_tokens=max_new_tokens, draft=dcfg, verify=verify,
                            top_n=options.get("top_n", 10), delta=options.get("delta", 0.6),
                            think_ids=tuple(think) if think is not None else None, sampling=sp,
                            seed=options.get("seed", 0), eos_id=options.get("eos_id"),
                            stop_ids=tuple(options.get("stop_ids", ())))
    return Engine(model, gcfg).run(prompts, on_step=on_step)


class Engine:
    """`proposer_factory(model, draft_cfg, batch, max_len)` replaces the MTP proposer (tests use oracle and
    adversarial drafters through it); anything with `propose(...)` and `draft_forwards` works."""

    def __init__(self, model: DeepseekV32, gcfg: GenerationConfig, proposer_factory: Callable | None = None):
        gcfg.validate(model)
        self.model, self.g = model, gcfg
        self.proposer_factory = proposer_factory or Proposer
        self.dev = model.device
        self.gen = torch.Generator(device=self.dev).manual_seed(gcfg.seed)
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

    # ------------------------------------------------------------------ loop
    @torch.no_grad()
    def run(self, prompts, on_step: Callable[[StepEvent], None] | None = None) -> GenerateResult:
        m, g, dev = self.model, self.g, self.dev
        prompts = self._check_prompts(prompts)
        K, dcfg = g.draft.k, g.draft
        B = len(prompts)
        P_B = torch.tensor([len(p) for p in prompts], device=dev)
        Tp = max(len(p) for p in prompts)
        max_len = Tp + g.max_new_tokens + 3 * K + 2
        if max_len > m.cfg.max_position_embeddings:
            raise ValueError(f"prompt ({Tp}) + max_new_tokens ({g.max_new_tokens}) exceed "
                             f"max_position_embeddings ({m.cfg.max_position_embeddings})")
        met = SpecMetrics(k=K, draft=dcfg.mode, verify=g.verify, n_rows=B, prompt_tokens=int(sum(map(len, prompts))),
                          hidden_options={"target_hidden": dcfg.target_hidden, "chain_hidden": dcfg.chain_hidden})
        tokens = torch.zeros(B, max_len, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            tokens[b, : len(p)] = torch.tensor(p, device=dev)
        hidden = torch.zeros(B, max_len, m.cfg.hidden_size, dtype=m.dtype, device=dev)
        cache = m.new_cache(B, max_len)
        proposer = self.proposer_factory(m, dcfg, B, max_len) if K else None
        rows = torch.arange(B, device=dev)

        # ---- prefill (right-padded; padding sits after each row's prompt, so it never affects it)
        t0 = self._clock()
        out = m(tokens[:, :Tp], cache, kv_len=Tp, logits_at=(P_B - 1).unsqueeze(1))
        hidden[:, :Tp] = pick_hidden(out, dcfg.target_hidden)
        cache.truncate(P_B)
        think_B = torch.zeros(B, dtype=torch.bool, device=dev)
        if g.think_ids is not None:
            th, eth = g.think_ids
            think_B = update_think_state(think_B, tokens[:, :Tp], torch.arange(Tp, device=dev) < P_B.unsqueeze(1),
                                         th, eth)
        first = self._verify(tokens[:, :0], None, out.logits, think_B).next_token_B
        tokens[rows, P_B] = first
        n_B = P_B + 1
        gen_B = torch.ones(B, dtype=torch.long, device=dev)
        finished_B = torch.isin(first, self.stop_ids) | (gen_B >= g.max_new_tokens)
        if g.think_ids is not None:
            think_B = update_think_state(think_B, first.unsqueeze(1), torch.ones(B, 1, dtype=torch.bool, device=dev),
                                         *g.think_ids)
        t1 = self._clock()
        met.time_prefill_s = met.ttft_s = t1 - t0
        if on_step is not None:
            on_step(StepEvent([[t] for t in first.tolist()], [0] * B))
        host = torch.stack((n_B, finished_B.long())).cpu()  # sync: loop condition
        p0_B = torch.zeros(B, dtype=torch.long, device=dev)
        W = Tp

        ar = torch.arange(K + 1, device=dev)
        while not bool(host[1].all()):
            max_n = int(host[0].max())
            active_B = ~finished_B
            ta = self._clock()
            if K:
                drafts, q = proposer.propose(tokens, hidden, n_B, p0_B, W, self._draw, max_n=max_n)
            else:
                drafts, q = tokens[:, :0], None
            tb = self._clock()
            vin = tokens.gather(1, (n_B - 1).unsqueeze(1) + ar)  # [x_{n-1}, d_1..d_K]
            out = m(vin, cache, kv_len=max_n + K)
            hidden.scatter_(1, ((n_B - 1).unsqueeze(1) + ar).unsqueeze(-1).expand(-1, -1, hidden.shape[-1]),
                            pick_hidden(out, dcfg.target_hidden))
            v = self._verify(drafts, q, out.logits, think_B)
            tc = self._clock()

            # ---- accept: drafts d_1..d_a then the target token, cut at a stop token and at max_new_tokens
            a_B = torch.where(active_B, v.accept_len_B, torch.zeros_like(v.accept_len_B))
            new_BK1 = torch.cat((drafts, torch.zeros_like(a_B).unsqueeze(1)), 1)
            new_BK1[rows, a_B] = v.next_token_B
            valid_BK1 = ar.unsqueeze(0) <= a_B.unsqueeze(1)
            is_stop = torch.isin(new_BK1, self.stop_ids) & valid_BK1
            first_stop = torch.where(is_stop.any(1), is_stop.long().argmax(1), torch.full_like(a_B, K + 1))
            keep_B = torch.minimum(torch.minimum(a_B + 1, first_stop + 1), g.max_new_tokens - gen_B)
            keep_B = torch.where(active_B, keep_B, torch.zeros_like(keep_B))
            kept_BK1 = ar.unsqueeze(0) < keep_B.unsqueeze(1)
            # ---- commit + rollback
            pos = (n_B.unsqueeze(1) + ar).clamp_max(max_len - 1)
            tokens.scatter_(1, pos, torch.where(kept_BK1, new_BK1, tokens.gather(1, pos)))
            if g.think_ids is not None:
                think_B = update_think_state(think_B, new_BK1, kept_BK1, *g.think_ids)
            n_B = n_B + keep_B
            gen_B = gen_B + keep_B
            finished_B = finished_B | (is_stop & kept_BK1).any(1) | (gen_B >= g.max_new_tokens)
            cache.truncate(n_B - 1)
            W = dcfg.window()
            p0_B = (n_B - 1 - W).clamp_min(0)

            # ---- metrics (host)
            host = torch.stack((n_B, finished_B.long())).cpu()  # sync: loop condition + cache bounds
            act = active_B.cpu()
            hist = torch.bincount(a_B.cpu()[act], minlength=K + 1).tolist()
            met.accepted_hist = [x + y for x, y in zip(met.accepted_hist, hist)]
            met.row_steps += int(act.sum())
            met.relaxed_only_accepts += int(v.relaxed_only_B.cpu()[act].sum())
            met.target_forwards += 1
            if on_step is not None:
                kept, newl = keep_B.tolist(), new_BK1.tolist()
                on_step(StepEvent([newl[b][: kept[b]] for b in range(B)],
                                  [min(x, y) for x, y in zip(a_B.tolist(), kept)]))
            td = time.perf_counter()
            met.time_draft_s += tb - ta
            met.time_verify_s += tc - tb
            met.time_host_s += td - tc
        met.time_decode_s = time.perf_counter() - t1
        met.draft_forwards = proposer.draft_forwards if proposer else 0
        n_host, P_host = host[0].tolist(), P_B.tolist()
        toks = tokens.cpu()
        result, reasons = [], []
        stop_set = set(self.stop_ids.tolist())
        for b in range(B):
            seq = toks[b, P_host[b]: n_host[b]].tolist()
            result.append(seq)
            reasons.append("stop" if seq and seq[-1] in stop_set else "length")
        met.new_tokens = sum(len(s) for s in result)
        return GenerateResult(result, reasons, met)
