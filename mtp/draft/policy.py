"""How a draft token is picked from an MTP module's logits: the argmax, or a draw from the filtered draft
distribution q. The filtering is the sampling verifier's own (`mtp.spec.draws.filter_probs`), so q is
exactly the law the verifier's rejection step needs."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..spec.draws import ACCEPT, DRAFT, RowDraws, filter_probs, sample
from ..spec.options import SamplingParams


class DraftSampler:
    """`sampler.bind(draws)` -> `draw(logits_BV) -> (tokens_B, q_BV | None)` for one step; 'greedy' or 'sample'.
    Sampled draft j of a step (its j-th call) uses stream DRAFT + j of the row's counter-based draws, so every
    draw is a function of (row seed, position, stream) alone (mtp/spec/draws.py)."""

    def __init__(self, sampling: str, params: SamplingParams):
        self.sampling, self.params = sampling, params

    def bind(self, draws: RowDraws, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None
             ) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]:
        """argmax: what takes a greedy draft's argmax over the last dim (torch.argmax(dim=-1) by default; the engine
        passes the model's, `mtp.decode.health.scan`: the logits scan kernel on the fast path)."""
        streams = iter(range(DRAFT, ACCEPT))

        def draw(logits_BV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            if self.sampling == "sample":
                q = filter_probs(logits_BV, self.params)
                return sample(q, draws, next(streams)), q
            return (logits_BV.argmax(dim=-1) if argmax is None else argmax(logits_BV)), None

        return draw
