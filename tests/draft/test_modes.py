"""The drafter registry (mtp.draft.modes): each mode's class answers what the engine, the proposers and the memory
plan ask (caches, window, module per depth, forwards per step); an unknown name or an unregistered object is an
error when the config is built; `generate` takes a registered drafter by name or as the object."""

from __future__ import annotations

import pytest

import mtp
from mtp.draft.config import DraftConfig
from mtp.draft.modes import DRAFTERS, DRAFTS, Eagle, Vanilla, drafter
from mtp.spec.options import OptionError


class FirstModule(Vanilla):
    """A drafter of the tests' own (tests/eval, tests/serve and tests/chat register it too): vanilla's K caches and
    windows, but the first MTP module drafts every depth, so K drafts need one module and no reuse_modules."""

    name = "first_module"

    def module_for(self, j: int, n_mtp: int) -> int:
        return 0

    def modules_needed(self, k: int) -> int:
        return 1


def test_each_mode_answers_for_itself():
    none, vanilla, eagle = (DRAFTERS[n] for n in ("none", "vanilla", "eagle"))
    assert DRAFTS == ("none", "vanilla", "eagle")
    assert [d.n_caches(3) for d in (none, vanilla, eagle)] == [0, 3, 1]
    assert [d.window(3) for d in (none, vanilla, eagle)] == [1, 6, 4]  # W = 2K (vanilla), K + 1 (eagle)
    assert [d.chain_forwards(3) for d in (none, vanilla, eagle)] == [0, 3, 3]
    assert [vanilla.module_for(j, 2) for j in range(4)] == [0, 1, 1, 1]  # the last module repeats (reuse_modules)
    assert [eagle.module_for(j, 2) for j in range(4)] == [0, 0, 0, 0]
    assert (vanilla.tree_forwards(3), eagle.tree_forwards(3)) == (5, 3)
    assert (vanilla.window_modules(3), eagle.window_modules(3)) == (3, 1) and eagle.chained and not vanilla.chained
    with pytest.raises(NotImplementedError, match="does not draft trees"):
        none.tree_forwards(2)


def test_draft_config_asks_its_drafter():
    c = DraftConfig(mode="vanilla", k=3)
    assert (c.n_caches, c.window(), c.module_for(2, 1)) == (3, 6, 0) and c.drafter is DRAFTERS["vanilla"]
    with pytest.raises(ValueError, match="vanilla k=3 needs 3 MTP modules, the checkpoint has 2"):
        c.validate(2)
    with pytest.raises(ValueError, match="draft='eagle' needs MTP modules"):
        DraftConfig(mode="eagle", k=1).validate(0)


def test_unknown_or_unregistered_drafters_fail_at_construction():
    with pytest.raises(OptionError, match="draft must be one of none, vanilla, eagle, got 'medusa'"):
        DraftConfig(mode="medusa", k=1)
    with pytest.raises(OptionError, match="draft must be one of none, vanilla, eagle, got 'medusa'"):
        mtp.GenerationConfig.from_options(4, "medusa", 1)
    with pytest.raises(OptionError, match="a registered drafter"):
        drafter(Eagle())  # a second instance is not the registered one


def test_generate_takes_a_drafter_by_name_or_object(tiny_model):
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    by_name = mtp.generate(tiny_model, prompts, 8, draft="eagle", k=2)
    by_object = mtp.generate(tiny_model, prompts, 8, draft=DRAFTERS["eagle"], k=2)
    assert by_object.tokens == by_name.tokens and by_object.metrics.draft == "eagle"
    assert by_object.metrics.accepted_hist == by_name.metrics.accepted_hist
    assert DraftConfig(mode=DRAFTERS["vanilla"], k=2).mode == "vanilla"


@pytest.fixture(scope="module")
def bundled():
    """The bundled model: 3 MTP modules, so a module choice shows."""
    import torch

    from mtp.checkpoint.tiny import default_checkpoint

    return mtp.load_model(default_checkpoint(), device="cpu", dtype=torch.float32)


def _spy_modules(model, monkeypatch) -> list[int]:
    """The MTP module of every draft forward `model` runs from now on."""
    used: list[int] = []
    forward = model.mtp_forward
    monkeypatch.setattr(model, "mtp_forward", lambda j, *a, **kw: used.append(j) or forward(j, *a, **kw))
    return used


def test_a_new_drafter_is_one_registration_away(bundled, registered, monkeypatch):
    """`first_module` drafts both depths with module 0 where vanilla uses modules 0 and 1, needs no reuse_modules for
    more drafts than modules, is taken by name or as the object, and under strict verification its output is greedy
    decoding's; unknown names are refused with it listed."""
    d = registered(FirstModule())
    assert DraftConfig(mode="first_module", k=3).n_caches == 3
    DraftConfig(mode="first_module", k=3).validate(1)  # one module serves every depth
    with pytest.raises(ValueError, match="vanilla k=3 needs 3 MTP modules"):
        DraftConfig(mode="vanilla", k=3).validate(1)
    used = _spy_modules(bundled, monkeypatch)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]]
    greedy = mtp.generate(bundled, prompts, 8, draft="none")
    mtp.generate(bundled, prompts, 8, draft="vanilla", k=2)
    assert set(used) == {0, 1}
    for mode in ("first_module", d):  # by name or as the registered object
        used.clear()
        out = mtp.generate(bundled, prompts, 8, draft=mode, k=2)
        assert out.metrics.draft == "first_module" and out.tokens == greedy.tokens
        assert set(used) == {0} and out.metrics.draft_forwards == len(used) and sum(out.metrics.accepted_hist[1:]) > 0
    with pytest.raises(OptionError, match="draft must be one of none, vanilla, eagle, first_module, got 'medusa'"):
        mtp.GenerationConfig.from_options(4, "medusa", 1)


class LastModuleChained(Eagle):
    """Eagle's chain with the model's last MTP module instead of its first."""

    name = "eagle_last"

    def module_for(self, j: int, n_mtp: int) -> int:
        return n_mtp - 1


def test_a_chained_drafter_drafts_with_the_module_it_names(bundled, registered, monkeypatch):
    """Every forward of a chain (window and chained steps) and of a tree asks the drafter which module: the chained
    steps used to run module 0 whatever the drafter said."""
    registered(LastModuleChained())
    used = _spy_modules(bundled, monkeypatch)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]]
    greedy = mtp.generate(bundled, prompts, 8, draft="none")
    for kw in (dict(k=3), dict(tree="2x1x1")):
        used.clear()
        out = mtp.generate(bundled, prompts, 8, draft="eagle_last", **kw)
        assert out.tokens == greedy.tokens and len(used) > 3 and set(used) == {bundled.n_mtp - 1} == {2}, kw
        used.clear()
        mtp.generate(bundled, prompts, 8, draft="eagle", **kw)
        assert set(used) == {0}, kw
