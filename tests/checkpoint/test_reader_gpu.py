"""`ShardReader` to a CUDA device (pinned staging buffers, asynchronous copies): the bytes safetensors gives, with
staging buffers smaller than a tensor and than a row (every branch of the staged path), and whole loads through
`load_model` / `load_parallel` bit-identical to the mmap reader's on the GPU."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mtp.checkpoint.files import load_model, save_checkpoint
from mtp.checkpoint.random_weights import random_tensors
from mtp.checkpoint.reader import ShardReader, Staging
from mtp.model.presets import tiny_config
from mtp.parallel import ParallelPlan, load_parallel
from mtp.parallel.comm import Comm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
FP8 = torch.float8_e4m3fn


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(a.cpu().contiguous().view(torch.uint8),
                                                                    b.cpu().contiguous().view(torch.uint8))


@pytest.mark.parametrize("staging_bytes", [100, 1000, 1 << 20])  # < a row (300 B), a few rows, everything
def test_staged_reads_same_bytes(tmp_path, staging_bytes):
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "s.safetensors"
    save_file({"w8": (torch.randn(37, 300, generator=g) * 30).to(FP8), "wb": torch.randn(24, 50, generator=g).bfloat16(),
               "v": torch.randn(129, generator=g)}, str(path))
    with safe_open(str(path), framework="pt") as f, \
            ShardReader(path, "cuda", Staging(torch.device("cuda"), staging_bytes)) as r:
        for name in f.keys():
            got = r.get_slice(name)[:]
            assert got.device.type == "cuda" and same(got, f.get_tensor(name)), name
            assert same(r.get_slice(name)[3:11], f.get_slice(name)[3:11]), name
        for name in ("w8", "wb"):
            assert same(r.get_slice(name)[:, 7:29], f.get_slice(name)[:, 7:29]), name


class RankComm(Comm):
    def __init__(self, rank: int, world: int):
        super().__init__()
        self.rank, self.world = rank, world


def test_loads_on_the_gpu_same_bytes(tmp_path):
    cfg = tiny_config()
    ckpt = save_checkpoint(random_tensors(cfg, seed=0), cfg, tmp_path / "c", n_shards=3)

    def params(m):
        return {n: p for n, p in m.named_parameters()}

    pairs = [(load_model(ckpt, "cuda", torch.bfloat16, reader="mmap"), load_model(ckpt, "cuda", torch.bfloat16, reader="pread"))]
    kw = dict(device="cuda", dtype=torch.bfloat16, plan=ParallelPlan(4, expert_layout="split"), numerics="dequant")
    pairs.append((load_parallel(ckpt, RankComm(1, 4), reader="mmap", **kw), load_parallel(ckpt, RankComm(1, 4), reader="pread", **kw)))
    for a, b in pairs:
        pa, pb = params(a), params(b)
        assert pa.keys() == pb.keys()
        bad = [n for n in pa if pb[n].device.type != "cuda" or not same(pa[n], pb[n])]
        assert not bad, bad[:5]
