"""Shared fixtures: tiny checkpoints in the real DeepSeek-V3.2 format, written once per test session."""

from __future__ import annotations

import pytest
import torch

from mtp.checkpoint.files import load_model, save_checkpoint
from mtp.checkpoint.random_weights import random_tensors
from mtp.model.presets import tiny_config

# One intra-op thread: the tiny models are far too small to gain from more, and on shared 2-core CI machines
# OpenMP spinning across processes made torch set-up 10-50x slower.
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
    """Register test verifiers for one test and take them out again (the registry is process-wide); the
    applications' tests use it to show a verifier registered outside them is taken by their option parsing."""
    from mtp.verify.registry import VERIFIER_REGISTRY, register_verifier

    names = []

    def add(v):
        names.append(v.name)
        return register_verifier(v)

    yield add
    for n in names:
        VERIFIER_REGISTRY.pop(n, None)
