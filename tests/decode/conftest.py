"""Fixtures of the tree decoding tests: a tiny model whose MTP modules agree with the trunk often (trees accept
drafts), float64 on the CPU."""

from __future__ import annotations

import pytest
import torch

from mtp.checkpoint.files import load_model, save_checkpoint
from mtp.checkpoint.tiny import agreeing_mtp, random_tensors, tiny_config


@pytest.fixture(scope="package")
def agreeing_model(tmp_path_factory):
    cfg = tiny_config(mtp_modules=2)
    path = save_checkpoint(agreeing_mtp(random_tensors(cfg, seed=0), cfg), cfg, tmp_path_factory.mktemp("agree") / "m")
    return load_model(path, dtype=torch.float64, numerics="fp8")

