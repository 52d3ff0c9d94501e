"""The decode state: every tensor a speculative step reads or writes, allocated once per (batch, buffer length)
and updated in place (so a captured step replays on it), and the pool that keeps a few of them. One base for chains
and trees: a tree's state (`TreeState`) adds its own counters.

Shape legend: B batch, S buffer positions, D width, K drafts (a tree's depth), K1 = K + 1, C sibling ranks.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from ..model.deepseek import DeepseekV32
from ..spec.draws import seed_tensor
from .config import GenerationConfig
from ..spec.options import draft_room


def check_prompts(prompts, vocab_size: int) -> list[list[int]]:
    """`prompts` as lists of ints, refused with the index of the first empty prompt or of one holding ids
    outside the vocabulary (chain and tree engines alike)."""
    if len(prompts) == 0:
        raise ValueError("prompts is empty")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)):
            raise ValueError(f"prompts[{i}] is a {type(p).__name__}, not token ids (encode it with the tokenizer)")
        if isinstance(p, torch.Tensor):
            p = p.tolist()
        try:  # int(40.5) would truncate, int("x") raise a bare traceback; index() takes only integers
            if any(isinstance(t, bool) for t in p):
                raise TypeError
            p = [operator.index(t) for t in p]
        except TypeError:
            odd = next(t for t in p if isinstance(t, bool) or not hasattr(t, "__index__"))
            raise ValueError(f"prompts[{i}] holds {odd!r} ({type(odd).__name__}); token ids must be integers") from None
        if not p:
            raise ValueError(f"prompts[{i}] is empty")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompts[{i}] has token ids outside [0, {vocab_size}): {bad[:5]}")
        out.append(p)
    return out


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
    seed_B: torch.Tensor  # int64 sampling seed per row (mtp/spec/draws.py)
    hist_BK1: torch.Tensor  # [B, K1] steps of row b that accepted a drafts (device; GenerateResult.row_accepted_hist)
    relaxed_only: torch.Tensor
    row_steps: torch.Tensor
    new_BK1: torch.Tensor  # last step: candidate tokens; first keep_B of each row were committed
    keep_B: torch.Tensor
    acc_B: torch.Tensor  # last step: committed drafts per row
    nonfinite: torch.Tensor  # [] bool: some target logits of this call were NaN / inf (mtp.decode.health)

    @property
    def B(self) -> int:
        return self.tokens.shape[0]


@dataclass
class TreeState(DecodeState):
    """A tree step's state: the chain's, plus the tree's own counters (the proposer is a `TreeProposer`)."""

    rank_DC: torch.Tensor  # [K, C] accepted nodes per depth and sibling rank
    live_nodes: torch.Tensor  # [] nodes the adaptive length kept, summed over active (row, step) pairs


def _extra_fields(st: DecodeState) -> list[str]:
    """The fields a subclass of `DecodeState` adds (its counters, zeroed per call)."""
    return [f.name for f in fields(st)][len(fields(DecodeState)):]


class StatePool:
    """The buffers of one engine (`state_cls` with the fields `extras(B)` gives beyond `DecodeState`'s, all zeroed
    per call; a tree's `TreeState`): reused when a call has the same batch and rounded length as an earlier one (its captured
    step graph then replays as is), else allocated; the least recently used dropped past
    `MAX_STATES`, with `on_drop(key)` (the graph runner drops that key's graph). Buffer length depends only on
    the call, so eager, graph and overlap runs of one call see the same shapes (bitwise-equal outputs)."""

    ROUND = 512  # buffer lengths are rounded up to this, so calls of similar length share buffers
    MAX_STATES = 4

    def __init__(self, model: DeepseekV32, gcfg: GenerationConfig, proposer_factory: Callable,
                 on_drop: Callable[[tuple[int, int]], None] = lambda key: None, state_cls: type = DecodeState,
                 extras: Callable[[int], dict] = lambda B: {}):
        self.model, self.g, self.proposer_factory, self.on_drop = model, gcfg, proposer_factory, on_drop
        self.state_cls, self.extras = state_cls, extras
        self.dev = model.device
        self.states: dict[tuple[int, int], DecodeState] = {}  # (batch, buffer length), LRU order

    def get(self, prompts: list[list[int]], max_new: int, seeds: list[int]) -> DecodeState:
        """The buffers for this call, loaded with its prompts and per-row sampling seeds."""
        m, room = self.model, self.room()
        B, Tp = len(prompts), max(len(p) for p in prompts)
        need = Tp + max_new + room
        limit = m.cfg.max_position_embeddings
        if need > limit:
            raise ValueError(f"prompt ({Tp}) + max_new_tokens ({max_new}) + draft room ({room}) exceed "
                             f"max_position_embeddings ({limit})")
        key = (B, min(-(-need // self.ROUND) * self.ROUND, limit))
        st = self.states.pop(key, None) or self._new(*key)
        self.states[key] = st  # most recently used last
        while len(self.states) > self.MAX_STATES:
            old = next(iter(self.states))
            del self.states[old]
            self.on_drop(old)
        self._reset(st, prompts, max_new, seeds)
        return st

    def room(self) -> int:
        """Buffer positions past prompt + max_new_tokens a call needs (`draft_room`)."""
        tree = self.g.draft.tree
        return draft_room(self.g.draft.k, None if tree is None else tree.n_nodes)

    def discard(self, st: DecodeState) -> None:
        """Drop a state (and, through `on_drop`, its graph) so the next call of its shape allocates fresh buffers."""
        for key, held in list(self.states.items()):
            if held is st:
                del self.states[key]
                self.on_drop(key)

    def _new(self, B: int, max_len: int) -> DecodeState:
        m, g, dev, K = self.model, self.g, self.dev, self.g.draft.k

        def z(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=dev)

        return self.state_cls(
            tokens=z(B, max_len), hidden=z(B, max_len, m.cfg.hidden_size, dtype=m.dtype),
            cache=m.new_cache(B, max_len),
            proposer=self.proposer_factory(m, g.draft, B, max_len) if K else None,
            P_B=z(B), Tp=0, max_len=max_len, n_B=z(B), gen_B=z(B), max_new_B=z(B), p0_B=z(B),
            finished_B=z(B, dtype=torch.bool), think_B=z(B, dtype=torch.bool), seed_B=z(B), hist_BK1=z(B, K + 1),
            relaxed_only=z(()), row_steps=z(()), new_BK1=z(B, K + 1), keep_B=z(B), acc_B=z(B),
            nonfinite=z((), dtype=torch.bool), **self.extras(B),
        )

    def _reset(self, st: DecodeState, prompts: list[list[int]], max_new: int, seeds: list[int]) -> None:
        """Load a call's prompts; every counter back to its start (stale buffer contents past a row's length
        are never read)."""
        st.Tp = max(len(p) for p in prompts)
        for b, p in enumerate(prompts):
            st.tokens[b, : len(p)] = torch.tensor(p, device=self.dev)
        st.P_B.copy_(torch.tensor([len(p) for p in prompts]))
        st.max_new_B.fill_(max_new)
        st.seed_B.copy_(seed_tensor(seeds, self.dev))
        st.gen_B.fill_(1)
        for t in (st.n_B, st.p0_B, st.finished_B, st.think_B, st.hist_BK1, st.relaxed_only, st.row_steps,
                  st.new_BK1, st.keep_B, st.acc_B, st.nonfinite, *(getattr(st, f) for f in _extra_fields(st))):
            t.zero_()
        st.cache.reset()  # the prefill writes from position 0
        for c in getattr(st.proposer, "caches", ()):
            c.reset()
