"""`DraftConfig`: how drafts are made (mode, k, which hiddens feed the MTP modules, greedy or sampled drafts, the
head's rows and format, a chain or a static tree with its adaptive length). Torch-free: its rules are checked on
construction, without a model; `validate(n_mtp)` adds the one check that needs the loaded model (enough MTP modules;
`GenerationConfig.validate` adds the FP8 head's, `head_fp8.check_model`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..spec.options import MAX_K, OptionError, is_int, is_number
from ..spec.tree_shape import TreeShape
from .modes import Drafter, drafter

HIDDEN = ("normed", "prenorm")  # a module's hidden after its final norm | before it
DRAFT_SAMPLING = ("greedy", "sample")  # the argmax | a draw from the draft distribution (sampling verifier)


@dataclass(frozen=True)
class DraftConfig:
    mode: str = "none"  # a registered drafter's name (mtp.draft.modes; a registered Drafter object is taken too)
    k: int = 0
    reuse_modules: bool = False  # vanilla: repeat the last module when K > available (TensorRT-LLM style)
    target_hidden: str = "normed"  # which target hidden feeds module 1 (one of HIDDEN)
    chain_hidden: str = "normed"  # which module output is chained (one of HIDDEN: shared_head.norm or before it)
    sampling: str = "greedy"  # one of DRAFT_SAMPLING
    vocab: tuple[int, ...] | None = None  # draft vocabulary (mtp.draft.vocab): the head scores only these ids
    # the drafts' logits from an FP8 copy of the module's head (mtp.draft.head_fp8; of the vocabulary's rows with one);
    # the verify keeps the model's head
    head_fp8: bool = False
    # a static draft tree (mtp/draft/TREES.md; its text form `TreeShape.parse` is taken too): k is its depth
    tree: TreeShape | None = None
    min_draft_prob: float = 0.0  # adaptive length (trees): nodes drafted below this probability die

    def __post_init__(self):
        """The rules that need no model; options are named as `mtp.generate` spells them (OptionError)."""
        if isinstance(self.tree, str):
            try:
                object.__setattr__(self, "tree", TreeShape.parse(self.tree))
            except ValueError as e:
                raise OptionError("tree", self.tree, "a TreeShape or its text form ('chainK', '2x1x1', '0/1/0.0')",
                                  str(e)) from None
        elif self.tree is not None and not isinstance(self.tree, TreeShape):
            raise OptionError("tree", self.tree, "None, a TreeShape or its text form")
        object.__setattr__(self, "mode", drafter(self.mode).name)  # unregistered: OptionError naming `draft`
        if not self.drafter.drafts:
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
        if not isinstance(self.head_fp8, bool):
            raise OptionError("draft_head_fp8", self.head_fp8, "True or False")
        if self.head_fp8 and not self.drafter.drafts:
            raise OptionError("draft_head_fp8", True, f"False with draft={self.mode!r}",
                              "the FP8 head is the drafts' and nothing is drafted")
        self._check_tree()

    def _check_tree(self) -> None:
        """The rules of a tree and of the adaptive length (which only trees have)."""
        p = self.min_draft_prob
        if not (is_number(p) and 0 <= p < 1):
            raise OptionError("min_draft_prob", p, "a number in [0, 1)")
        if self.tree is None:
            if p:
                raise OptionError("min_draft_prob", p, "0 without a draft tree",
                                  "adaptive length runs through tree decoding: a chain of K drafts is the tree "
                                  "TreeShape.chain(K)")
            return
        name = self.tree.name
        if not self.drafter.drafts:
            raise OptionError("draft", self.mode, f"'eagle' or 'vanilla' with tree {name!r}",
                              "tree drafting needs the MTP modules")
        if self.tree.max_depth < 1:
            raise OptionError("tree", name, "a tree with at least one drafted node")
        if self.k != self.tree.max_depth:
            raise OptionError("k", self.k, f"the depth of tree {name!r}, {self.tree.max_depth}")
        if self.vocab is not None:
            raise OptionError("draft_vocab", f"{len(self.vocab)} ids", f"None with tree {name!r}",
                              "draft trees do not take a draft vocabulary yet")
        if p > 0 and self.sampling == "sample":
            # Pruning a drawn child by its own probability changes the law it was drawn from (q_i restricted to
            # likely tokens), and the sampler's min(1, p / q_i) would no longer be exact.
            raise OptionError("min_draft_prob", p, "0 with draft_sampling='sample'",
                              "pruning drawn children by their own probability would make tree sampling lossy; "
                              "adaptive length needs top-k children")

    def validate(self, n_mtp: int) -> None:
        """The rules that need the loaded model: `n_mtp` MTP modules (the drafter says what it needs)."""
        self.drafter.check_model(self.k, n_mtp, self.reuse_modules)

    def modules(self, n_mtp: int) -> list[int]:
        """The MTP modules (0-based, ascending) that draft some depth on a model with `n_mtp` modules."""
        return sorted({self.module_for(j, n_mtp) for j in range(self.k)})

    @property
    def drafter(self) -> Drafter:
        """The registered drafter of `mode`: what the mode implies (caches, window, modules, forwards)."""
        return drafter(self.mode)

    @property
    def n_caches(self) -> int:
        return self.drafter.n_caches(self.k)

    def module_for(self, j: int, n_mtp: int) -> int:
        """Module index (0-based) used at depth j (0-based)."""
        return self.drafter.module_for(j, n_mtp)

    def window(self) -> int:
        return self.drafter.window(self.k)
