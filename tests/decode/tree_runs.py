"""A whole tree decode through the engine with fast-path switches set, and the decode state it leaves: what the GPU
tests of the tree step's glue kernels compare with a switch on and off (tests/kernels/test_tree_commit_gpu.py,
tests/kernels/test_tree_slots_gpu.py, tests/kernels/test_tree_verdict_gpu.py)."""

from __future__ import annotations


def tree_run(model, prompts: list[list[int]], draft: str, tree: str, mode: str, flags: dict, max_new: int = 24,
             **options):
    """(the engine's result, its state's tensors after the run: every decode buffer and every cache's, the target's and
    the proposer's, FP8 ones as bytes so that torch.equal compares bits: `step_launches.state_snapshot`) of a strict
    `tree` decode of `prompts` with the switches `flags` (`set_kernels`; restored after); `options`: more of
    `GenerationConfig.from_options`' (min_draft_prob: dead nodes)."""
    from mtp.backends.fast_path import set_kernels
    from mtp.bench.step_launches import state_snapshot
    from mtp.decode.config import GenerationConfig
    from mtp.decode.engine import Engine

    old = set_kernels(model, **flags)
    try:
        engine = Engine(model, GenerationConfig.from_options(max_new, draft, None, "strict", mode=mode, tree=tree,
                                                             reuse_modules=True, **options))
        res = engine.run(prompts)
        return res, state_snapshot(next(iter(engine.pool.states.values())))
    finally:
        set_kernels(model, **vars(old))
