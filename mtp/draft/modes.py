"""The drafters: what each draft mode implies, owned by one class per mode and found by name in `DRAFTERS`.

Torch-free (a `DraftConfig` checks its mode without loading the model code; the front ends' schemas list the names).
A drafter answers what the engine, the proposers and the memory plan would otherwise branch on: how many draft
caches it keeps, how wide its draft window is, which MTP module drafts depth j, whether one module is chained along
the sequence, how many module forwards a chain or a tree step costs, and what a loaded model must have for it.
The forward passes themselves are the proposers' (`proposer.py` for chains, `tree_proposer.py` for trees), which
ask their drafter these questions.

Adding a drafter: a subclass of `Drafter` answering them, `register_drafter(MyDrafter())`, and a proposer that
follows its answers (`Engine(..., proposer_factory=...)` for chains). `DRAFTERS[name]` or `drafter(name)` finds it;
an unregistered name is an error (`OptionError` naming the `draft` option), never a fallback to another mode.
"""

from __future__ import annotations

from ..spec.options import OptionError


class Drafter:
    """One draft mode. `name` is the `draft=` option; `chained`: one module applied K times along the sequence
    (eagle) rather than K modules in depth (vanilla)."""

    name: str = ""
    drafts: bool = True  # False only for 'none' (K = 0)
    chained: bool = False

    def n_caches(self, k: int) -> int:
        """Draft KV caches (one layer each) for K drafts or a tree of depth K."""
        raise NotImplementedError(f"drafter {self.name!r} does not say how many caches it keeps")

    def window(self, k: int) -> int:
        """Positions each chain step re-runs per module (mtp/DESIGN.md, "Draft windows")."""
        raise NotImplementedError(f"drafter {self.name!r} does not say its draft window")

    def module_for(self, j: int, n_mtp: int) -> int:
        """The MTP module (0-based) that drafts depth j (0-based) on a model with `n_mtp` modules."""
        raise NotImplementedError(f"drafter {self.name!r} does not say which module drafts depth {j}")

    def modules_needed(self, k: int) -> int:
        """Distinct MTP modules K drafts read; a model with fewer is refused unless reuse_modules (`check_model`)."""
        return 1 if self.drafts else 0

    def window_modules(self, k: int) -> int:
        """Modules run over the draft window each chain step (the rest of the K drafts are chained)."""
        return self.n_caches(k)

    def chain_forwards(self, k: int) -> int:
        """MTP module forwards per chain step of K drafts."""
        return k

    def tree_forwards(self, depth: int) -> int:
        """MTP module forwards per tree step of a tree of this depth (mtp/draft/tree_proposer.py)."""
        raise NotImplementedError(f"drafter {self.name!r} does not draft trees")

    def tree_min_prompt(self, depth: int) -> int:
        """The shortest prompt a tree of this depth can start from."""
        return 1

    def check_model(self, k: int, n_mtp: int, reuse_modules: bool) -> None:
        """Refuse a loaded model that cannot serve K drafts (ValueError naming what is missing)."""
        if n_mtp == 0:
            raise ValueError(f"draft={self.name!r} needs MTP modules, but the model has none loaded")


class NoDraft(Drafter):
    """`draft='none'`: plain autoregressive decoding through the same step (K = 0)."""

    name = "none"
    drafts = False

    def n_caches(self, k: int) -> int:
        return 0

    def window(self, k: int) -> int:
        return 1

    def module_for(self, j: int, n_mtp: int) -> int:
        raise ValueError("draft='none' drafts nothing")

    def chain_forwards(self, k: int) -> int:
        return 0

    def check_model(self, k: int, n_mtp: int, reuse_modules: bool) -> None:
        return None


class Vanilla(Drafter):
    """K MTP modules in depth: module j drafts position j; W = 2K re-runs the entries that read drafted tokens."""

    name = "vanilla"

    def n_caches(self, k: int) -> int:
        return k

    def window(self, k: int) -> int:
        return 2 * k

    def module_for(self, j: int, n_mtp: int) -> int:
        return min(j, n_mtp - 1)

    def tree_forwards(self, depth: int) -> int:
        return 2 * depth - 1  # a window per module, and a tree forward for each module past the first

    def tree_min_prompt(self, depth: int) -> int:
        return max(depth - 1, 1)  # module m reads position n-1-m

    def modules_needed(self, k: int) -> int:
        return k

    def check_model(self, k: int, n_mtp: int, reuse_modules: bool) -> None:
        super().check_model(k, n_mtp, reuse_modules)
        if self.modules_needed(k) > n_mtp and not reuse_modules:
            raise ValueError(f"vanilla k={k} needs {k} MTP modules, the checkpoint has {n_mtp}; "
                             "set reuse_modules=true to repeat the last module (TensorRT-LLM style)")


class Eagle(Drafter):
    """One MTP module chained K times along the sequence; W = K + 1 covers every newly committed position."""

    name = "eagle"
    chained = True

    def n_caches(self, k: int) -> int:
        return 1

    def window(self, k: int) -> int:
        return k + 1

    def module_for(self, j: int, n_mtp: int) -> int:
        return 0

    def tree_forwards(self, depth: int) -> int:
        return depth  # the window, then one forward per depth past the first


DRAFTERS: dict[str, Drafter] = {}


def register_drafter(d: Drafter) -> Drafter:
    """Make `d` the drafter of `draft=d.name` (a name registered twice is refused: two modes, one name)."""
    if not (isinstance(d, Drafter) and isinstance(d.name, str) and d.name):
        raise TypeError(f"register_drafter takes a Drafter with a name, got {d!r}")
    if d.name in DRAFTERS and DRAFTERS[d.name] is not d:
        raise ValueError(f"a drafter named {d.name!r} is already registered ({DRAFTERS[d.name]!r})")
    DRAFTERS[d.name] = d
    return d


def drafts(name: str) -> bool:
    """Whether draft mode `name` drafts (False for 'none', plain decoding: the registry's `Drafter.drafts`). An
    unregistered name counts as drafting, so its options go on to `GenerationConfig`, which refuses the name."""
    d = DRAFTERS.get(name)
    return d is None or d.drafts


def drafter(mode) -> Drafter:
    """The registered drafter of `mode`: its name, or the registered object itself."""
    if isinstance(mode, Drafter):
        if DRAFTERS.get(mode.name) is not mode:
            raise OptionError("draft", mode, "a registered drafter (mtp.draft.modes.register_drafter) or its name",
                              f"registered: {', '.join(DRAFTERS)}")
        return mode
    if isinstance(mode, str) and mode in DRAFTERS:
        return DRAFTERS[mode]
    raise OptionError("draft", mode, f"one of {', '.join(DRAFTERS)}")


for _d in (NoDraft(), Vanilla(), Eagle()):
    register_drafter(_d)
DRAFTS = tuple(DRAFTERS)  # the built-in names, for the front ends' choices (argparse, schema enums)
