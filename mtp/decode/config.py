"""Generation options: `GenerationConfig`, the one place they are validated, and the limits they imply.

Torch-free. Every rule that needs no model runs when a config is built (`__post_init__`, with `DraftConfig`'s and
`SamplingParams`'), raising `OptionError` (options.py) named by the option as `generate` spells it;
`validate(model)` adds the rules that need the loaded model (MTP modules, device, vocabulary). The keyword form of
`mtp.generate` (`GenerationConfig.from_options`), `mtp-eval`'s schema and `mtp-chat`'s settings all build one and
word its OptionError their own way (config key, command); option names and limits are in options.py.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..draft.config import DraftConfig
from ..draft.modes import drafter
from ..spec.options import MODES, SPAN_RULES, OptionError, SamplingParams, is_int, is_number
from ..spec.tree_shape import TreeShape
from ..verify.registry import Verifier, verifier

if TYPE_CHECKING:
    from ..model.deepseek import DeepseekV32

OPTIONS = frozenset({"top_n", "delta", "think_ids", "span_rule", "temperature", "top_p", "top_k", "draft_sampling", "seed",
                     "reuse_modules", "target_hidden", "chain_hidden", "eos_id", "stop_ids", "mode",
                     "prefill_chunk", "draft_vocab", "draft_head_fp8", "tree", "min_draft_prob",
                     "posterior_threshold", "posterior_alpha"})  # generate()'s keyword options


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 64
    draft: DraftConfig = field(default_factory=DraftConfig)
    verify: str = "strict"  # a registered verifier's name (mtp.verify.registry; a registered Verifier is taken too)
    top_n: int = 10  # relaxed
    delta: float = 0.6  # relaxed, probability space
    think_ids: tuple[int, int] | None = None  # (<think>, </think>) ids, relaxed
    span_rule: str = "tracked"  # relaxed: where thinking spans are, 'tracked' | 'trtllm' (mtp/verify/relaxed.py)
    posterior_threshold: float = 0.09  # typical (mtp/verify/typical.py; Medusa's defaults)
    posterior_alpha: float = 0.3  # typical
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0  # sampling: row b of a call draws from seed + b unless the call gives per-row seeds
    eos_id: int | None = None  # default: the model's eos_token_id
    stop_ids: tuple[int, ...] = ()
    mode: str = "eager"  # one of MODES
    prefill_chunk: int | None = None  # prefill (target and drafts) in chunks of this many tokens; None: one pass

    def __post_init__(self):
        """The rules that need no model (the draft's and sampling's own ran when those were built)."""
        check_max_new_tokens(self.max_new_tokens)
        object.__setattr__(self, "verify", verifier(self.verify).name)  # unregistered: OptionError naming `verify`
        if not (is_int(self.top_n) and self.top_n >= 1):
            raise OptionError("top_n", self.top_n, "an integer >= 1")
        if not (is_number(self.delta) and 0 <= self.delta <= 1):
            raise OptionError("delta", self.delta, "a probability in [0, 1]")
        for name in ("posterior_threshold", "posterior_alpha"):
            if not (is_number(getattr(self, name)) and 0 < getattr(self, name) <= 1):
                raise OptionError(name, getattr(self, name), "a probability in (0, 1]")
        if self.think_ids is None and self.verifier.needs_think_ids:
            raise OptionError("think_ids", None, f"a (<think> id, </think> id) pair with verify={self.verify!r}",
                              "the relaxed rule only applies inside thinking spans")
        if self.think_ids is not None and not (isinstance(self.think_ids, tuple) and len(self.think_ids) == 2
                                               and all(map(is_int, self.think_ids))):
            raise OptionError("think_ids", self.think_ids, "None or a (<think> id, </think> id) pair")
        if self.span_rule not in SPAN_RULES:
            raise OptionError("span_rule", self.span_rule, f"one of {', '.join(SPAN_RULES)}")
        if not is_int(self.seed):
            raise OptionError("seed", self.seed, "an int", "per-row seeds go to the call")
        if self.draft.sampling == "sample" and not self.verifier.exact_with_sampled_drafts:
            raise OptionError("draft_sampling", "sample", "'greedy' unless verify='sample'",
                              "sampled drafts stay lossless only under the sampling verifier")
        if self.prefill_chunk is not None and not (is_int(self.prefill_chunk) and self.prefill_chunk >= 1):
            raise OptionError("prefill_chunk", self.prefill_chunk, "None or an integer >= 1")
        if self.mode not in MODES:
            raise OptionError("mode", self.mode, f"one of {', '.join(MODES)}")
        if self.draft.tree is not None:
            self._check_tree()

    def _check_tree(self) -> None:
        """What tree decoding (mtp.decode.tree) serves of the options beyond the draft's own."""
        name = self.draft.tree.name
        if self.verifier.tree is None:
            raise OptionError("verify", self.verify, f"a verifier with a tree rule with tree {name!r}",
                              "mtp.verify.registry: this one verifies chains only")
        if self.mode != "eager" and not self.verifier.tree_graphs:
            raise OptionError("mode", self.mode, f"'eager' with tree {name!r} and verify={self.verify!r}",
                              "tree sampling draws from a torch.Generator, which a replayed CUDA graph would not "
                              "advance; graph modes take verify='strict' or 'relaxed'")
        if self.span_rule != "tracked":
            raise OptionError("span_rule", self.span_rule, f"'tracked' with tree {name!r}",
                              "tree verification follows <think> spans along each node's own path")
        if self.prefill_chunk is not None:
            raise OptionError("prefill_chunk", self.prefill_chunk, f"None with tree {name!r}",
                              "tree decoding prefills in one pass")

    @property
    def verifier(self) -> Verifier:
        """The registered verifier of `verify`: its rules and what it needs."""
        return verifier(self.verify)

    def validate(self, model: DeepseekV32) -> None:
        """The rules that need the loaded model. Graph modes need CUDA, for chains and trees alike (one policy:
        refused, never silently run eagerly). An FP8 draft head needs a head to copy (`draft.head_fp8.check_model`)."""
        self.draft.validate(model.n_mtp)
        if self.draft.head_fp8:
            from ..draft.head_fp8 import check_model

            check_model(model, self.draft.modules(model.n_mtp))
        if self.mode != "eager" and model.device.type != "cuda":
            raise ValueError(f"mode={self.mode!r} captures CUDA graphs and needs the model on a CUDA device "
                             f"(it is on {model.device}); use mode='eager'")
        V = model.cfg.vocab_size
        eos = () if self.eos_id is None else (self.eos_id,)
        for t in tuple(self.stop_ids) + tuple(self.think_ids or ()) + eos:
            if not 0 <= t < V:
                raise ValueError(f"token id {t} is outside the vocabulary [0, {V})")

    @classmethod
    def from_options(cls, max_new_tokens: int = 64, draft: str = "none", k: int | None = None,
                     verify: str = "strict", **options) -> "GenerationConfig":
        """The keyword form of `mtp.generate`: `draft` and `verify` by registered name or object
        (mtp.draft.modes, mtp.verify.registry). Options: top_n, delta, think_ids, span_rule (relaxed); temperature,
        top_p, top_k, draft_sampling, seed (sampling: an int; a list of per-prompt seeds is taken by `generate`,
        which passes it to the call); reuse_modules, target_hidden, chain_hidden, draft_vocab (drafts:
        token ids or a vocabulary file, `mtp.draft.vocab`), draft_head_fp8 (the drafts' logits from an FP8 copy of the
        head, `mtp.draft.head_fp8`), both ignored when nothing is drafted; eos_id, stop_ids;
        mode, prefill_chunk; tree (a `TreeShape` or its text form: k defaults to its depth) and min_draft_prob
        (adaptive length) for tree decoding."""
        unknown = set(options) - OPTIONS
        if unknown:
            raise TypeError(f"generate: unknown options {sorted(unknown)}; known: {sorted(OPTIONS)}")
        tree = options.get("tree")
        drafts = drafter(draft).drafts  # an unregistered draft is refused here, naming `draft`
        if k is None:
            k = 0 if not drafts else _depth(tree) if tree is not None else 1
        dcfg = DraftConfig(mode=draft, k=k, reuse_modules=options.get("reuse_modules", False),
                           target_hidden=options.get("target_hidden", "normed"),
                           chain_hidden=options.get("chain_hidden", "normed"),
                           sampling=options.get("draft_sampling", "greedy"),
                           vocab=_draft_vocab(options.get("draft_vocab")) if drafts else None,
                           head_fp8=options.get("draft_head_fp8", False) if drafts else False,
                           tree=tree, min_draft_prob=options.get("min_draft_prob", 0.0))
        # checked whichever the verifier (a bad value is refused even where unused), kept only for 'sample'
        sp = SamplingParams(options.get("temperature", 1.0), options.get("top_k", 0), options.get("top_p", 1.0))
        think = options.get("think_ids")
        return cls(max_new_tokens=max_new_tokens, draft=dcfg, verify=verify,
                   top_n=options.get("top_n", 10), delta=options.get("delta", 0.6),
                   think_ids=tuple(think) if think is not None else None,
                   span_rule=options.get("span_rule", "tracked"),
                   sampling=sp if verifier(verify).samples else SamplingParams(),
                   posterior_threshold=options.get("posterior_threshold", 0.09),
                   posterior_alpha=options.get("posterior_alpha", 0.3),
                   seed=options.get("seed", 0), eos_id=options.get("eos_id"),
                   stop_ids=tuple(options.get("stop_ids", ())), mode=options.get("mode", "eager"),
                   prefill_chunk=options.get("prefill_chunk"))


def check_max_new_tokens(v) -> None:
    """The one rule of max_new_tokens: a config's and a kept engine's per-call value (Engine.run) alike."""
    if not (is_int(v) and v >= 1):
        raise OptionError("max_new_tokens", v, "an integer >= 1")


def _depth(tree) -> int:
    """The depth of the `tree` option (the default k of a tree); a bad shape is reported by DraftConfig."""
    try:
        return (TreeShape.parse(tree) if isinstance(tree, str) else tree).max_depth
    except (ValueError, AttributeError):
        return 1


def _draft_vocab(v) -> tuple[int, ...] | None:
    """`draft_vocab` option: None, token ids, or the path of a vocabulary file (all its ids)."""
    if v is None:
        return None
    if isinstance(v, (str, os.PathLike)):
        from ..draft.vocab import load_ids

        return load_ids(v)
    return tuple(int(i) for i in v)


def row_seeds(seed, B: int) -> list[int]:
    """Per-row sampling seeds: `seed` + row index for an int, else one int per prompt (a row's output then
    depends only on its prompt and its seed: mtp/spec/draws.py)."""
    if isinstance(seed, bool) or not isinstance(seed, int) and not isinstance(seed, Sequence):
        raise ValueError(f"seed must be an int or one int per prompt, got {seed!r}")
    if isinstance(seed, int):
        return [seed + b for b in range(B)]
    if len(seed) != B or not all(isinstance(s, int) and not isinstance(s, bool) for s in seed):
        raise ValueError(f"seed as a list needs one int per prompt ({B}), got {list(seed)!r:.80}")
    return list(seed)
