"""Shared fixtures: tiny checkpoints in the real DeepSeek-V3.2 format, written once per test session."""

from __future__ import annotations

import os

# Every process the tests start (interpreted kernel scripts, torchrun ranks, CLI runs) inherits one OpenMP thread:
# under `pytest -n 2` on a 2-core CI machine a child that spins 2 threads beside the other worker oversubscribes the
# cores, and small ops then wait on OpenMP barriers (measured: test_step_commit's interpreted engine run 210 s with
# the default threads, 28 s with one, the machine otherwise equally busy). Set before torch is imported here.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from mtp.checkpoint.files import load_model, save_checkpoint
from mtp.checkpoint.random_weights import random_tensors
from mtp.model.presets import tiny_config

# One intra-op thread (also in this process, whatever imported torch first): the tiny models are far too small to gain
# from more, and on shared 2-core CI machines OpenMP spinning across processes made torch set-up 10-50x slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """3 layers (1 dense + 2 MoE), 1 MTP module, index_topk 16 (prompts > 16 tokens use the sparse path)."""
    cfg = tiny_config()
    return save_checkpoint(random_tensors(cfg, seed=0), cfg, tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_ckpt):
    return load_model(tiny_ckpt, dtype=torch.float32, numerics="fp8")


@pytest.fixture(scope="session")
def tiny_model_dequant(tiny_ckpt):
    return load_model(tiny_ckpt, dtype=torch.float32, numerics="dequant")


@pytest.fixture
def registered():
    """Register test verifiers and drafters for one test and take them out again (the registries are process-wide);
    the applications' tests use it to show that one registered outside them is taken by their option parsing."""
    from mtp.draft.modes import DRAFTERS, Drafter, register_drafter
    from mtp.verify.registry import VERIFIER_REGISTRY, register_verifier

    added = []

    def add(x):
        registry, register = (DRAFTERS, register_drafter) if isinstance(x, Drafter) else (VERIFIER_REGISTRY,
                                                                                         register_verifier)
        new = x.name not in registry  # only what the test added goes: never a built-in it registered again
        out = register(x)
        if new:
            added.append((registry, x.name))
        return out

    yield add
    for registry, name in added:
        registry.pop(name, None)
