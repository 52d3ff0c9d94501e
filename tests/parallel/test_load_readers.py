"""The two shard readers of a load (`reader='mmap'`: safetensors' memory map; `'pread'`: `mtp.checkpoint.reader`) give
every parameter bit for bit, whole (world 1, `mtp.load_model`) and as each rank's slices: rows, columns, expert
ranges, re-blocked scales (row slices that start inside a 128-block: finer scale rows), an fp8 and a bf16 checkpoint.

A rank's load issues no collective, so rank r of W is loaded here in this one process with a Comm that only says
(rank, world): the same code path as a real group's rank, without starting W processes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from mtp.checkpoint import reader
from mtp.checkpoint.files import CheckpointError, load_model, save_checkpoint
from mtp.checkpoint.random_weights import random_tensors
from mtp.model.config import ModelConfig
from mtp.model.presets import tiny_config, tiny_parallel_config
from mtp.parallel import ParallelPlan, load_parallel
from mtp.parallel.comm import Comm
from mtp.parallel.layout import RankLayout
from mtp.parallel.reblock import scale_rows


class RankComm(Comm):
    """Rank `rank` of `world` for a load (which issues no collective); no process group behind it."""

    def __init__(self, rank: int, world: int):
        super().__init__()
        self.rank, self.world = rank, world


def mismatches(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """Parameters of `a` and `b` that differ in name, dtype, shape, device or any byte."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    if pa.keys() != pb.keys():
        return sorted(set(pa) ^ set(pb))
    bad = []
    for n, x in pa.items():
        y = pb[n]
        if (x.dtype, x.shape, x.device) != (y.dtype, y.shape, y.device):
            bad.append(n)
        elif not torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)):
            bad.append(n)
    assert len(pa) > 50  # a real model's worth of parameters was compared
    return bad


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    cfg = tiny_config()
    return save_checkpoint(random_tensors(cfg, seed=0), cfg, tmp_path_factory.mktemp("fp8") / "c", n_shards=3)


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    cfg = tiny_config(fp8_weights=False)
    return save_checkpoint(random_tensors(cfg, seed=1), cfg, tmp_path_factory.mktemp("bf16") / "c", n_shards=2)


@pytest.fixture(scope="module")
def even_ckpt(tmp_path_factory):
    """tiny_parallel_config(2): with mlp_split='even' the 128-wide shared expert is cut 64 + 64 (inside a block)."""
    cfg = tiny_parallel_config(2)
    return save_checkpoint(random_tensors(cfg, seed=2), cfg, tmp_path_factory.mktemp("even") / "c", n_shards=2)


def both(ckpt, rank: int, world: int, **kw) -> list[str]:
    comm = RankComm(rank, world)
    a = load_parallel(ckpt, comm, reader="mmap", **kw)
    b = load_parallel(ckpt, comm, reader="pread", **kw)
    return mismatches(a, b)


@pytest.mark.parametrize("which", ["fp8_ckpt", "bf16_ckpt"])
def test_world1_load_model_same_bytes(request, which):
    ckpt = request.getfixturevalue(which)
    for dtype in (torch.float32, torch.bfloat16):  # bf16 tensors converted, or kept as read
        assert mismatches(load_model(ckpt, dtype=dtype, reader="mmap"), load_model(ckpt, dtype=dtype, reader="pread")) == []


def test_tp2_every_rank_same_bytes(fp8_ckpt, bf16_ckpt):
    for r in range(2):
        assert both(fp8_ckpt, r, 2, numerics="dequant") == [], f"fp8, rank {r}"
    assert both(bf16_ckpt, 1, 2, numerics="dequant") == []


def test_tp4_split_experts_and_reblocked_scales_same_bytes(fp8_ckpt):
    """World 4 of 4 heads: rank 1's q_b_proj rows [96, 192) start inside a 128-block (32-row scale blocks), and
    expert_layout='split' cuts every expert's gate / up by rows and down by columns."""
    cfg = ModelConfig.from_json(fp8_ckpt / "config.json")
    plan = ParallelPlan(4, expert_layout="split")
    assert scale_rows(RankLayout(cfg, plan, 1), "model.layers.0.self_attn.q_b_proj.weight") == 32
    for r in (1, 3):
        assert both(fp8_ckpt, r, 4, plan=plan, numerics="dequant") == [], f"rank {r}"
    assert both(fp8_ckpt, 2, 4, plan=ParallelPlan(4, expert_layout="permuted", expert_seed=3), numerics="dequant") == []


def test_even_split_cuts_inside_a_block_same_bytes(even_ckpt):
    assert both(even_ckpt, 1, 2, plan=ParallelPlan(2, mlp_split="even"), numerics="dequant") == []


def test_unknown_reader_refused(fp8_ckpt):
    with pytest.raises(ValueError, match="reader must be one of"):
        load_parallel(fp8_ckpt, RankComm(0, 1), reader="mmapp")
    with pytest.raises(ValueError, match="reader must be one of"):
        load_model(fp8_ckpt, reader="direct")


def test_truncated_shard_named_before_any_read(fp8_ckpt, tmp_path, monkeypatch):
    ckpt = shutil.copytree(fp8_ckpt, tmp_path / "c")
    shard = sorted(ckpt.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    reads = []
    monkeypatch.setattr(reader, "read_at", lambda fd, buf, off: reads.append(off) or 0)
    with pytest.raises(CheckpointError, match="truncated") as ei:
        load_parallel(ckpt, RankComm(1, 2), reader="pread", numerics="dequant")
    assert str(shard) in str(ei.value) and "tensor '" in str(ei.value)
    assert reads == []  # the shard headers are validated before any tensor is read


@pytest.mark.parametrize("which", ["mmap", "pread"])
def test_each_shard_is_read_front_to_back(fp8_ckpt, monkeypatch, which):
    """Both readers take a shard's tensors in the order their bytes lie in the file (not parameter order: experts
    are stored by name, 0, 1, 10, 100, ...), so a rank's reads of one shard go front to back."""
    from mtp.checkpoint.header import shard_header
    from mtp.parallel import load as pload

    seen: list[tuple[str, str]] = []
    real_open = pload.open_shard

    class Recording:
        def __init__(self, f, file):
            self.f, self.file = f, file

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, name):
            seen.append((self.file, name))
            return self.f.get_tensor(name)

        def get_slice(self, name):
            seen.append((self.file, name))
            return self.f.get_slice(name)

        def __getattr__(self, attr):
            return getattr(self.f, attr)

    monkeypatch.setattr(pload, "open_shard", lambda file, *a: Recording(real_open(file, *a), str(file)))
    load_parallel(fp8_ckpt, RankComm(1, 2), reader=which)
    files = list(dict.fromkeys(f for f, _ in seen))
    assert len(files) == 3 and len(seen) > 50
    for file in files:
        _, header = shard_header(Path(file))
        offsets = [int(header[n]["data_offsets"][0]) for f, n in seen if f == file]
        assert offsets == sorted(offsets), f"{file}: read out of file order"
