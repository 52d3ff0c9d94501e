"""The chain step: K drafts -> one target forward over [x_{n-1}, d_1..d_K] -> verify -> accept -> commit (rollback
by lowering lengths). Device work only, every update in place, so `GraphRunner` captures it as one CUDA graph.

Shape legend: B batch, S buffer positions, K drafts, K1 = K + 1, D width, V vocabulary.

The engine (engine.py) runs this or the tree step (tree_step.py) through the same loop; both use accept.py's
accept / commit / count and the `DecodeState` base (state.py). This file holds what only a chain does: its
proposer (`mtp.draft.proposer.Proposer`, or a test's drafter through `proposer_factory`), its draft window and
draft prefill, its per-row counter-based draws.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..draft.policy import DraftSampler
from ..draft.proposer import Proposer, pick_hidden
from ..model.deepseek import DeepseekV32
from ..model.static import arange
from ..spec.draws import RowDraws
from .accept import accept, commit, count, fused_commit, fused_commit_takes
from .config import GenerationConfig
from .health import logits_nonfinite, scan
from .state import DecodeState, StatePool


class ChainRule:
    """A verifier's chain rule with the health check of the target's logits (`mtp.decode.health`), as the step and the
    prefill's first token call it: a greedy verifier's rule of the argmax (`Verifier.chain_argmax`) gets the argmax
    taken in the check's scan (one launch on the fast path, switch `logits_scan`); another rule gets the logits after
    the check. A registered name whose rule does not load fails here, at construction."""

    def __init__(self, g: GenerationConfig):
        self.rule, self.of_argmax = g.verifier.chain_rule(), g.verifier.chain_argmax_rule()
        self.argmax_prefix = g.verifier.argmax_prefix

    def argmax_only(self, opts) -> bool:
        """Whether the call returns the target's argmax [B, K1] alone, for the commit kernel to make strict's verdict
        of it (`Verifier.argmax_prefix`, switch strict_commit of the model's `opts`)."""
        return self.argmax_prefix and opts is not None and opts.strict_commit

    def __call__(self, model, g, drafts_BK, q_BKV, logits_BKV, think_B, rng, flag: torch.Tensor,
                 argmax_only: bool = False):
        """The verdict; with `argmax_only` (where `argmax_only(opts)` says so) the argmax it is made of."""
        opts = getattr(model, "fast_options", None)  # read at call time: the switches may change between calls
        if self.of_argmax is not None:
            target_BK1 = scan(logits_BKV, opts, flag)
            return target_BK1 if argmax_only else self.of_argmax(g, drafts_BK, target_BK1)
        logits_nonfinite(flag, logits_BKV, opts)
        return self.rule(g, drafts_BK, q_BKV, logits_BKV, think_B, rng)


class ChainStep:
    """`proposer_factory(model, draft_cfg, batch, max_len)` replaces the MTP proposer (tests use oracle and
    adversarial drafters through it); anything with `propose(...)` (which writes its drafts into the token
    buffer at n.., as `Proposer.propose` does, and returns them) and `draft_forwards` works, and an optional
    `prefill(tokens, hidden, n, W, max_n, chunk)` fills its caches over the prompt."""

    def __init__(self, model: DeepseekV32, g: GenerationConfig, stops: torch.Tensor, clock: Callable[[], float],
                 proposer_factory: Callable | None = None):
        self.model, self.g, self.stops, self.clock = model, g, stops, clock
        self.factory = proposer_factory or Proposer
        self.rule = ChainRule(g)
        self.draw = DraftSampler(g.draft.sampling, g.sampling)
        self.reach = g.draft.k  # a step writes K positions past the bound it is given
        self.W = g.draft.window()

    def pool(self, on_drop) -> StatePool:
        return StatePool(self.model, self.g, self.factory, on_drop)

    def seed(self, seeds: list[int]) -> None:
        """Nothing to seed: every draw hashes (row seed, position, stream) (`DecodeState.seed_B`)."""

    def first_rng(self, st: DecodeState) -> RowDraws:
        return RowDraws(st.seed_B, st.P_B)  # the first token's draws sit at position P

    def check(self, prompts: list[list[int]]) -> None:
        """Every prompt serves a chain."""

    def draft_prefill(self, st: DecodeState, max_n: int) -> None:
        """Run the draft modules over the whole prompt (window p0 = 0, W = longest prompt) so their caches hold
        every committed position; from then on each step, the first included, recomputes only the steady
        window, so one captured graph serves them all. The drafts made here are scratch (argmax, no random
        draws); the first step drafts again from its own window."""
        prefill = getattr(st.proposer, "prefill", None)  # custom proposers without caches need none
        if prefill is None:
            return
        prefill(st.tokens, st.hidden, st.n_B, st.Tp, max_n=max_n, chunk=self.g.prefill_chunk)
        st.p0_B.copy_((st.n_B - 1 - self.W).clamp_min(0))

    def draft_forwards(self, st: DecodeState, target_forwards: int, drafting: bool, fw0: int) -> int:
        """MTP forwards of a call: the drafter's per step, plus the draft prefill (each cache once per prompt
        chunk). Counted, not read from the proposer: graph replays do not run its Python, and a reused proposer's
        counter spans earlier calls. A custom proposer's own counter otherwise (`fw0`: its value at the start)."""
        if isinstance(st.proposer, Proposer):
            d, K = self.g.draft.drafter, self.g.draft.k
            chunks = -(-st.Tp // (self.g.prefill_chunk or st.Tp))
            return d.chain_forwards(K) * target_forwards + d.n_caches(K) * chunks * drafting
        return 0 if st.proposer is None else st.proposer.draft_forwards - fw0

    def extra_metrics(self, st: DecodeState, met):
        """A chain has no metrics beyond `SpecMetrics`."""
        return None

    def __call__(self, st: DecodeState, W: int, max_n: int, marks: list | None = None) -> None:
        """One speculative step, device ops only, every update in place (so a CUDA graph can replay it).
        `max_n` bounds the positions touched (host-known max of n, or the buffer length for graphs).
        `marks`: eager timing only; gets a clock reading between drafting and verification."""
        m, g, K = self.model, self.g, self.g.draft.k
        n_B = st.n_B
        draws = RowDraws(st.seed_B, n_B)  # read before the commit below moves n_B: this step's position
        opts = getattr(m, "fast_options", None)
        verify = None
        if K:  # propose: the proposer writes the drafts at n.. of `tokens` (where verify reads them)
            drafts, q = st.proposer.propose(st.tokens, st.hidden, n_B, st.p0_B, W,
                                            self.draw.bind(draws, lambda lg: scan(lg, opts)), max_n=max_n)
            verify = getattr(st.proposer, "verify_input", None)  # `Proposer`'s: the ids and slots below, made
        else:
            drafts, q = st.tokens[:, :0], None
        if marks is not None:
            marks.append(self.clock())
        # verify: one target forward over [x_{n-1}, d_1..d_K] at positions n-1.. (read, then written with the hidden)
        if verify is not None:
            ids_BK1, at_BK1 = verify
        else:
            at_BK1 = n_B.unsqueeze(1) + arange(K + 1, n_B.device, start=-1)
            ids_BK1 = st.tokens.gather(1, at_BK1)
        out = m(ids_BK1, st.cache, kv_len=min(max_n + K, st.max_len))
        st.hidden.scatter_(1, at_BK1.unsqueeze(-1).expand(-1, -1, st.hidden.shape[-1]),
                           pick_hidden(out, g.draft.target_hidden))
        # accept + commit (rolling back is lowering lengths: no copy), then the device counters (no sync): one
        # launch on the fast path (switch step_commit; strict's verdict inside it too, switch strict_commit), else
        # the torch ops of accept.py
        if self.rule.argmax_only(opts):
            target_BK1 = self.rule(m, g, drafts, q, out.logits, st.think_B, draws, st.nonfinite, argmax_only=True)
            if fused_commit_takes(opts, g.think_ids, st, drafts, target_BK1, self.stops):
                fused_commit(st, drafts, target_BK1, self.stops, self.W, opts.glue_pdl_at(st.B))
                return
            v = self.rule.of_argmax(g, drafts, target_BK1)
        else:
            v = self.rule(m, g, drafts, q, out.logits, st.think_B, draws, st.nonfinite)
        if fused_commit_takes(opts, g.think_ids, st, drafts, v, self.stops):
            fused_commit(st, drafts, v, self.stops, self.W, opts.glue_pdl_at(st.B))
            return
        active_B = ~st.finished_B
        acc = accept(drafts, v, active_B, self.stops, st.max_new_B - st.gen_B)
        commit(st, acc, g.think_ids, window=self.W)
        count(st, acc, v.relaxed_only_B, active_B)
