"""`DraftConfig`: how drafts are made (mode, k, which hiddens feed the MTP modules, greedy or sampled drafts).
Torch-free: its rules are checked on construction, without a model; `validate(n_mtp)` adds the one check that
needs the loaded model (enough MTP modules)."""

from __future__ import annotations

from dataclasses import dataclass

from ..decode.options import DRAFTS, MAX_K, OptionError, is_int

HIDDEN = ("normed", "prenorm")  # a module's hidden after its final norm | before it
DRAFT_SAMPLING = ("greedy", "sample")  # the argmax | a draw from the draft distribution (sampling verifier)


@dataclass(frozen=True)
class DraftConfig:
    mode: str = "none"  # one of DRAFTS
    k: int = 0
    reuse_modules: bool = False  # vanilla: repeat the last module when K > available (TensorRT-LLM style)
    target_hidden: str = "normed"  # which target hidden feeds module 1 (one of HIDDEN)
    chain_hidden: str = "normed"  # which module output is chained (one of HIDDEN: shared_head.norm or before it)
    sampling: str = "greedy"  # one of DRAFT_SAMPLING
    vocab: tuple[int, ...] | None = None  # draft vocabulary (mtp.draft.vocab): the head scores only these ids

    def __post_init__(self):
        """The rules that need no model; options are named as `mtp.generate` spells them (OptionError)."""
        if self.mode not in DRAFTS:
            raise OptionError("draft", self.mode, f"one of {', '.join(DRAFTS)}")
        if self.mode == "none":
            if self.k != 0 or not is_int(self.k):
                raise OptionError("k", self.k, "0 with draft='none'", "it drafts nothing")
        elif not (is_int(self.k) and 1 <= self.k <= MAX_K):
            raise OptionError("k", self.k, f"an integer in [1, {MAX_K}]",
                              "draft='none' drafts nothing" if is_int(self.k) and self.k < 1 else "")
        for name in ("target_hidden", "chain_hidden"):
            if getattr(self, name) not in HIDDEN:
                raise OptionError(name, getattr(self, name), f"one of {', '.join(HIDDEN)}")
        if self.sampling not in DRAFT_SAMPLING:
            raise OptionError("draft_sampling", self.sampling, f"one of {', '.join(DRAFT_SAMPLING)}")

    def validate(self, n_mtp: int) -> None:
        """The rules that need the loaded model: `n_mtp` MTP modules."""
        if self.mode != "none" and n_mtp == 0:
            raise ValueError(f"draft={self.mode!r} needs MTP modules, but the model has none loaded")
        if self.mode == "vanilla" and self.k > n_mtp and not self.reuse_modules:
            raise ValueError(f"vanilla k={self.k} needs {self.k} MTP modules, the checkpoint has {n_mtp}; "
                             "set reuse_modules=true to repeat the last module (TensorRT-LLM style)")

    @property
    def n_caches(self) -> int:
        return self.k if self.mode == "vanilla" else (1 if self.mode == "eagle" else 0)

    def module_for(self, j: int, n_mtp: int) -> int:
        """Module index (0-based) used at depth j (0-based)."""
        return min(j, n_mtp - 1) if self.mode == "vanilla" else 0

    def window(self) -> int:
        return 2 * self.k if self.mode == "vanilla" else self.k + 1
