"""MTP draft proposers: vanilla (K modules in depth) and eagle (one module chained along the sequence).

Shape legend: B batch, S buffer positions, W window, K drafts, D width, V vocabulary.

Notation (facts section 4): MTP module j at position i takes hidden g^{j-1}_i (g^0 = the target's hidden h_i)
and the token x_{i+j}, and predicts x_{i+j+1}. A row has n committed tokens x_0..x_{n-1}; the target has
hidden states for positions <= n-2 (x_{n-1} is fed at the next verify).

Static windows instead of ragged bookkeeping: each step every module recomputes a right-aligned window of W
positions ending at n-2 (entries before it are final, entries inside are rewritten, so the draft caches
roll back for free). Why the widths: a row advances by at most K+1 per step, and an entry of module j is
final once x_{i+j} is committed, so
- eagle: W = K+1 covers every newly committed position (module 1 only needs committed tokens);
- vanilla: W = 2K also re-runs the entries of module j that used drafted tokens last step.
The first step after prefill uses p0 = 0 and W = longest prompt. Eagle then chains K-1 single-token steps
at positions n-1, n, ..., feeding the module its own output hidden and its previous draft.
"""

from __future__ import annotations

import torch

from ..model.cache import KVCache
from ..model.deepseek import DeepseekV32
from ..model.static import arange
from .config import DraftConfig  # also importable from here, its old home
from .head_fp8 import check_model, shared_fp8_head
from .vocab import check_ids, shared_sub_head


def pick_hidden(out, which: str) -> torch.Tensor:
    return out.hidden if which == "normed" else out.hidden_prenorm.to(out.hidden.dtype)


def draft_heads(model: DeepseekV32, dcfg: DraftConfig) -> dict:
    """The head each MTP module used drafts with, where it is not the module's own (`mtp_forward(head=)`): the rows of
    a draft vocabulary (`vocab.SubHead`), an FP8 copy of the head (`head_fp8.Fp8Head`), or an FP8 copy of the
    vocabulary's rows; {} for the modules' own heads. Shared by every proposer that asks (`shared_sub_head`,
    `shared_fp8_head`)."""
    if dcfg.vocab is not None:
        check_ids(dcfg.vocab, model.cfg.vocab_size)
    if dcfg.head_fp8:
        check_model(model, dcfg.modules(model.n_mtp))
        return {j: shared_fp8_head(model, j, dcfg.vocab) for j in dcfg.modules(model.n_mtp)}
    if dcfg.vocab is not None:
        return {j: shared_sub_head(model.mtp[j].shared_head.head, dcfg.vocab, model.cfg.vocab_size, model.device)
                for j in dcfg.modules(model.n_mtp)}
    return {}


class Proposer:
    """Owns the draft caches; `propose` writes drafts [B, K] into the token buffer at n.. (the only write of
    them: the verify stage reads them there) and returns them (and their distributions when sampled). It also keeps
    the last call's `verify_input`: (ids [B, K+1] = [x_{n-1}, the drafts], their slots n-1..n+K-1), which the chain
    step feeds the target as they are (a gather and an add fewer; the drafts returned are a view of those ids)."""

    verify_input: tuple[torch.Tensor, torch.Tensor] | None = None

    def __init__(self, model: DeepseekV32, dcfg: DraftConfig, batch: int, max_len: int):
        self.model, self.cfg = model, dcfg
        self.caches: list[KVCache] = [model.new_cache(batch, max_len, n_layers=1) for _ in range(dcfg.n_caches)]
        self.draft_forwards = 0
        self.V = model.cfg.vocab_size
        self.heads = draft_heads(model, dcfg)
        # a draft vocabulary's entry -> model id (-1: padding, never drawn)
        self.vocab_ids = self.heads[min(self.heads)].ids_M if dcfg.vocab is not None else None

    def _draw(self, draw, logits_BN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`draw` over the module's logits; with a draft vocabulary, back to model ids and a full-vocabulary
        distribution (zero outside the draft vocabulary: what the drafts were actually drawn from)."""
        d, q = draw(logits_BN)
        if self.vocab_ids is None:
            return d, q
        d = self.vocab_ids[d]
        if q is not None:  # padding entries (-1) have probability 0: sent to an extra column, dropped
            cols = torch.where(self.vocab_ids < 0, self.V, self.vocab_ids)
            full = q.new_zeros(q.shape[0], self.V + 1)
            q = full.scatter_(1, cols.unsqueeze(0).expand(q.shape[0], -1), q)[:, : self.V]
        return d, q

    def prefill(self, tokens_BS: torch.Tensor, hidden_BSD: torch.Tensor, n_B: torch.Tensor, W: int,
                max_n: int, chunk: int | None = None) -> None:
        """Fill the draft caches over the prompt: windows from 0 covering W positions (the longest prompt), in
        chunks of `chunk` positions if given (each chunk's window appends to the caches). Its drafts are
        scratch: argmax (no random draws), and eagle does not chain."""
        C = chunk or W
        for s in range(0, W, C):
            p0 = torch.full_like(n_B, s)
            self.propose(tokens_BS, hidden_BSD, n_B, p0, min(C, W - s), lambda lg: (lg.argmax(-1), None),
                         max(max_n, s + C + 1), chain=False)

    def _window(self, tokens_BS: torch.Tensor, hidden_BSD: torch.Tensor, n_B: torch.Tensor, p0_B: torch.Tensor,
                W: int, cache: KVCache | None = None):
        """(tok_BW, hid_BWD, out_idx_B, at_BK1, last_B): the first window module's tokens (positions p0 + 1.., clamped
        to the buffer), the target's hidden rows over the window, the window's row whose logits draft (n - 2 - p0, in
        range for the prefill's chunks too), the verify's slots n-1..n+K-1 (the drafts' from column 1) and the last
        committed token x_{n-1}; and `cache` (the first window module's) truncated to p0. One launch on the fast path
        (switch draft_window, `mtp.kernels.draft_window`: the same integers and rows), else these torch ops (10
        launches, and the truncate's copy)."""
        K, dev = self.cfg.k, tokens_BS.device
        opts = getattr(self.model, "fast_options", None)  # read at call time: the switches may change between calls
        if opts is not None and opts.draft_window:
            from ..kernels.draft_window import draft_window, window_takes  # the fast path's: no Triton import here

            if window_takes(tokens_BS, hidden_BSD, n_B, p0_B) and (cache is None or cache.seq_lens.shape == n_B.shape):
                return draft_window(tokens_BS, hidden_BSD, n_B, p0_B, W, K, pdl=opts.glue_pdl_at(n_B.shape[0] * W),
                                    lens_B=None if cache is None else cache.seq_lens)
        if cache is not None:
            cache.truncate(p0_B)
        pos_BW = p0_B.unsqueeze(1) + arange(W, dev)
        out_idx_B = (n_B - 2 - p0_B).clamp(0, W - 1)
        at_BK1 = n_B.unsqueeze(1) + arange(K + 1, dev, start=-1)
        hid = hidden_BSD.gather(1, pos_BW.unsqueeze(-1).expand(-1, -1, hidden_BSD.shape[-1]))
        tok = tokens_BS.gather(1, (pos_BW + 1).clamp_max(tokens_BS.shape[1] - 1))
        return tok, hid, out_idx_B, at_BK1, tokens_BS.gather(1, at_BK1[:, :1])[:, 0]

    def propose(self, tokens_BS: torch.Tensor, hidden_BSD: torch.Tensor, n_B: torch.Tensor, p0_B: torch.Tensor,
                W: int, draw, max_n: int, chain: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens_BS holds committed tokens (drafts are written at n.. by the end of the call); hidden_BSD the
        target hidden per position. `draw(logits_BV) -> (token_B, probs_BV | None)` picks each draft.
        `max_n`: host-known max of n_B, bounding the cache positions touched (no sync inside).
        `chain=False` (eagle) stops after the window: the engine's draft prefill only fills the cache.
        A draft is written into tokens_BS as it is made only where a later window module reads it (vanilla); the
        others in one scatter at the end (the chained ones read the drafts themselves): one launch for all, where
        a write each was two (an add and an index_put)."""
        K, m = self.cfg.k, self.model
        dev = tokens_BS.device
        rows = arange(n_B.shape[0], dev)
        tok0, hid, out_idx_B, at_BK1, last_B = self._window(tokens_BS, hidden_BSD, n_B, p0_B, W, self.caches[0])
        at_BK = at_BK1[:, 1:]
        drafts, probs = [], []
        kv_len = max(max_n - 1, W)  # max over rows of p0 + W
        drafter = self.cfg.drafter
        J = drafter.window_modules(K)
        for j in range(J):
            cache = self.caches[j]
            if j == 0:  # its cache truncated to p0 by `_window`
                tok = tok0
            else:  # a vanilla drafter's later module: its window reads the drafts written above
                cache.truncate(p0_B)
                pos_BW = p0_B.unsqueeze(1) + arange(W, dev)
                tok = tokens_BS.gather(1, (pos_BW + (j + 1)).clamp_max(tokens_BS.shape[1] - 1))
            mod = self.cfg.module_for(j, m.n_mtp)
            out = m.mtp_forward(mod, tok, hid, cache, kv_len=kv_len, head=self.heads.get(mod),
                                logits_at=out_idx_B.unsqueeze(1))
            self.draft_forwards += 1
            d, q = self._draw(draw, out.logits[:, 0])
            if j + 1 < J:  # module j + 1's window reads it
                tokens_BS.scatter_(1, at_BK[:, j:j + 1], d.unsqueeze(1))
            drafts.append(d)
            probs.append(q)
            hid = pick_hidden(out, self.cfg.chain_hidden)
        if drafter.chained and chain:
            cache = self.caches[0]
            if self.cfg.chain_hidden == "normed":  # the window's drafting row, gathered for the head already
                g = out.hidden_at
            else:
                g = pick_hidden(out, self.cfg.chain_hidden)[rows, out_idx_B].unsqueeze(1)
            cache.truncate(n_B, 1)  # drop the window's padding past n-2; the chain appends from n-1
            for j in range(1, K):
                mod = self.cfg.module_for(j, m.n_mtp)  # the drafter's chained module (eagle: the first)
                out = m.mtp_forward(mod, drafts[-1].unsqueeze(1), g, cache, kv_len=max_n - 1 + j,
                                    head=self.heads.get(mod))
                self.draft_forwards += 1
                d, q = self._draw(draw, out.logits[:, 0])
                drafts.append(d)
                probs.append(q)
                g = pick_hidden(out, self.cfg.chain_hidden)
        ids_BK1 = torch.stack([last_B, *drafts], 1)  # the verify's input [x_{n-1}, d_1..d_K]: one launch for both
        drafts_BK = ids_BK1[:, 1:]
        tokens_BS.scatter_(1, at_BK[:, J - 1:len(drafts)], drafts_BK[:, J - 1:])
        self.verify_input = (ids_BK1, at_BK1) if len(drafts) == K else None  # (a draft prefill's: scratch)
        q_BKV = torch.stack(probs, 1) if probs and probs[0] is not None else None
        return drafts_BK, q_BKV
