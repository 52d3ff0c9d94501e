"""The verifiers' options, torch-free so `GenerationConfig` and the front ends' schemas check them without loading
the verifiers: the sampling verifier's `SamplingParams` (sampling.py) and the relaxed verifier's span rules
(relaxed.py explains them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..decode.options import OptionError, is_int, is_number

SPAN_RULES = ("tracked", "trtllm")


@dataclass(frozen=True)
class SamplingParams:
    """Temperature, then top-k, then top-p (nucleus) filtering of the target's distribution; checked on
    construction (`OptionError`)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self):
        t, p = self.temperature, self.top_p
        if not (is_number(t) and math.isfinite(t) and t > 0):
            raise OptionError("temperature", t, "a number > 0",
                              "greedy decoding is verify='strict'" if is_number(t) and t == 0 else "")
        if not (is_int(self.top_k) and self.top_k >= 0):
            raise OptionError("top_k", self.top_k, "an integer >= 0 (0 = off)")
        if not (is_number(p) and 0 < p <= 1):
            raise OptionError("top_p", p, "a number in (0, 1] (1 = off)")

