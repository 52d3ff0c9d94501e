"""The names and limits of the generation options, the error that reports one, and the options that drafting and
verification share (`SamplingParams`: drafts are sampled with the verifier's filtering). A leaf: draft/, verify/ and
decode/ all import it, it imports none of them; torch-free so the front ends' schemas (`mtp-eval`, `mtp-chat`) read
it without loading the model code. `GenerationConfig` (mtp/decode/config.py), `DraftConfig` (mtp/draft/config.py)
and `SamplingParams` (here) check them."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

MLP_SPLITS = ("blocks", "even")  # how a model split over ranks cuts its MLPs (mtp.parallel.layout)
LOAD_READERS = ("mmap", "pread")  # how a load reads the shards: safetensors' mmap | explicit reads (mtp.checkpoint.reader)
# pread: 1.63 GB/s per node vs mmap 1.01 against 1.47 raw, TP=2 on a 4 x H100 node (BENCHMARKS.md, session 9); equal on CPU
DEFAULT_LOAD_READER = "pread"
MODES = ("eager", "graph", "overlap")  # eager | graph (whole step in one CUDA graph) | overlap (graph + pipelined host)
MAX_K = 16  # the most drafts per step a GenerationConfig takes: far past the point where position k is still accepted


def draft_room(k: int, tree_nodes: int | None = None) -> int:
    """Buffer positions a call needs past prompt + max_new_tokens for K drafts per step (the drafts and the
    verify block written past the committed tokens, and the draft window's slack): 3K + 2; for a draft tree of
    `tree_nodes` nodes (its depth K), the nodes written past the committed tokens: N + 2. Prompt +
    max_new_tokens + this must fit the model's max_position_embeddings."""
    return 3 * k + 2 if tree_nodes is None else tree_nodes + 2


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


class OptionError(ValueError):
    """A generation option outside its rule. `name` is the option as `mtp.generate` spells it (`k`, `top_p`), so
    a front end can say it in its own words: `mtp-eval` names the config key (`verify.top_p`), `mtp-chat` the
    command (`/k`). `expected` completes "must be ..."; `note` (optional) says why or what to do instead."""

    def __init__(self, name: str, value: Any, expected: str, note: str = ""):
        self.name, self.value, self.expected, self.note = name, value, expected, note
        super().__init__(self.say(name))

    def say(self, key: str, verb: str = "must be") -> str:
        """The message with the option called `key`: '<key> <verb> <expected>, got <value> (<note>)'."""
        return f"{key} {verb} {self.expected}, got {self.value!r}" + (f" ({self.note})" if self.note else "")

    def __reduce__(self):  # pickled with its fields (multiprocessing launchers), not only the message
        return type(self), (self.name, self.value, self.expected, self.note)


SPAN_RULES = ("tracked", "trtllm")  # the relaxed verifier's span rules (mtp/verify/relaxed.py)


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
