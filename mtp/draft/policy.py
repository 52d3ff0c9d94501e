"""How a draft token is picked from an MTP module's logits: the argmax, or a draw from the filtered draft
distribution q. The filtering is the sampling verifier's own (`mtp.verify.sampling.filter_probs`), so q is
exactly the law the verifier's rejection step needs."""

from __future__ import annotations

import torch

from ..verify.sampling import SamplingParams, filter_probs, sample


class DraftSampler:
    """`sampler(logits_BV) -> (tokens_B, q_BV | None)`; 'greedy' or 'sample' (from `generator`)."""

    def __init__(self, sampling: str, params: SamplingParams, generator: torch.Generator | None):
        self.sampling, self.params, self.generator = sampling, params, generator

    def __call__(self, logits_BV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.sampling == "sample":
            q = filter_probs(logits_BV, self.params)
            return sample(q, self.generator), q
        return logits_BV.argmax(dim=-1), None
