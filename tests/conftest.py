"""Shared fixtures: tiny checkpoints in the real DeepSeek-V3.2 format, written once per test session."""

from __future__ import annotations

import pytest
import torch

from mtp.checkpoint import load_model, save_checkpoint
from mtp.tiny import random_tensors, tiny_config


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
