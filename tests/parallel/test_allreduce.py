"""`Comm.all_reduce_add_norm` on 2 CPU ranks (gloo): the reference primitive equals the all-reduce, the residual add
and the RMSNorm (+ FP8 quant) computed by hand in float64 from every rank's partial; the option refuses what
cannot run the one-shot path. The one-shot kernel itself is held to this primitive on GPUs
(tests/parallel/test_allreduce_gpu.py)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.multiprocessing as mp

from mtp.model import fp8
from mtp.parallel.comm import ALLREDUCE_IMPLS, AddNorm, Comm, CountingComm, init_process_group

WORLD = 2
SHAPES = [(1, 1, 256), (1, 3, 384), (2, 5, 128), (1, 4, 200)]  # D = 200: no quant (not a multiple of 128)


def partial(rank: int, shape, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64).to(dtype)


def by_hand(shape, residual, weight, eps, round_dtype, quant):
    """float64: sum of every rank's partial, (rounded,) added, normed; quantized as act_quant does."""
    s = sum(partial(r, shape) for r in range(WORLD))
    if round_dtype is not None:
        s = s.to(round_dtype).double()
    h = residual + s
    y = h * (h.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * weight
    return (h, y, *(fp8.act_quant(y) if quant else (None, None)))


def _worker(rank: int, init: str, out: str) -> None:
    init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD,
                       timeout=datetime.timedelta(seconds=60))
    try:
        comm = Comm()
        res = {}
        for shape in SHAPES:
            D = shape[-1]
            g = torch.Generator().manual_seed(7)
            residual = torch.randn(shape, generator=g, dtype=torch.float64)
            weight = torch.rand(D, generator=g, dtype=torch.float64) + 0.5
            for round_dtype in (None, torch.bfloat16):
                quant = D % fp8.BLOCK == 0
                r = comm.all_reduce_add_norm(partial(rank, shape), residual, weight, 1e-6, torch.float64,
                                             round_dtype=round_dtype, quant=quant)
                res[(shape, round_dtype)] = tuple(r)
            a = comm.all_reduce_add_norm(partial(rank, shape), residual, None, 1e-6)  # the add alone
            res[(shape, "add")] = tuple(a)
        errors = {}
        for impl, call in [("oneshot", lambda: comm.set_allreduce("oneshot")),
                           ("ring", lambda: comm.set_allreduce("ring"))]:
            try:
                call()
                errors[impl] = None
            except ValueError as e:
                errors[impl] = str(e)
        errors["still"] = comm.allreduce
        for name, call in [("shape", lambda: comm.all_reduce_add_norm(torch.zeros(1, 4), torch.zeros(1, 5), None, 1e-6)),
                           ("weight", lambda: comm.all_reduce_add_norm(torch.zeros(1, 4), torch.zeros(1, 4),
                                                                       torch.ones(3), 1e-6)),
                           ("quant", lambda: comm.all_reduce_add_norm(torch.zeros(1, 4), torch.zeros(1, 4),
                                                                      torch.ones(4), 1e-6, quant=True))]:
            try:
                call()
                errors[name] = None
            except ValueError as e:
                errors[name] = str(e)
        torch.save({"res": res, "errors": errors}, f"{out}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    d = tmp_path_factory.mktemp("allreduce")
    mp.start_processes(_worker, args=(str(d / "init"), str(d)), nprocs=WORLD, start_method="spawn")
    return [torch.load(d / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("round_dtype", [None, torch.bfloat16], ids=["fp64", "bf16-rounded"])
def test_reference_primitive_equals_by_hand(ranks, shape, round_dtype):
    g = torch.Generator().manual_seed(7)
    residual = torch.randn(shape, generator=g, dtype=torch.float64)
    weight = torch.rand(shape[-1], generator=g, dtype=torch.float64) + 0.5
    quant = shape[-1] % fp8.BLOCK == 0
    h, y, x8, sx = by_hand(shape, residual, weight, 1e-6, round_dtype, quant)
    for rank, got in enumerate(ranks):
        r = AddNorm(*got["res"][(shape, round_dtype)])
        torch.testing.assert_close(r.residual, h, rtol=0, atol=1e-12, msg=lambda m: f"rank {rank} residual: {m}")
        torch.testing.assert_close(r.normed, y, rtol=0, atol=1e-12, msg=lambda m: f"rank {rank} normed: {m}")
        if quant:
            assert torch.equal(r.sx, sx), f"rank {rank}: scales differ"
            assert torch.equal(r.x8.float(), x8.float()), f"rank {rank}: fp8 values differ"
        else:
            assert r.x8 is None and r.sx is None
    assert torch.equal(ranks[0]["res"][(shape, round_dtype)][1], ranks[1]["res"][(shape, round_dtype)][1])


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_add_alone(ranks, shape):
    residual = torch.randn(shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    want = residual + sum(partial(r, shape) for r in range(WORLD))
    for got in ranks:
        a = AddNorm(*got["res"][(shape, "add")])
        assert a.normed is None
        torch.testing.assert_close(a.residual, want, rtol=0, atol=1e-12)


def test_oneshot_refused_over_gloo(ranks):
    for got in ranks:
        e = got["errors"]
        assert e["oneshot"] is not None and "'gloo'" in e["oneshot"] and "use allreduce='nccl'" in e["oneshot"]
        assert e["ring"] == f"allreduce must be one of {list(ALLREDUCE_IMPLS)}, got 'ring'"
        assert e["still"] == "nccl"
        assert "x_partial [1, 4] must match the residual [1, 5]" in e["shape"]
        assert "norm_weight must be [4], got [3]" in e["weight"]
        assert "quant needs a norm and D % 128 == 0, got D = 4" in e["quant"]


def test_world1_is_the_formulas():
    """No process group: the all-reduce is the identity and the rest are the same formulas."""
    x, h, w = torch.randn(3, 256, dtype=torch.float64), torch.randn(3, 256, dtype=torch.float64), torch.rand(256) + 1
    r = Comm().all_reduce_add_norm(x.clone(), h, w.double(), 1e-6, torch.float64)
    want = h + x
    torch.testing.assert_close(r.residual, want, rtol=0, atol=0)
    torch.testing.assert_close(r.normed, want * (want.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt() * w.double(),
                               rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="cannot run here: no process group"):
        Comm().set_allreduce("oneshot", "cpu")


def test_counting_comm_counts_an_unfused_all_reduce_add_norm_once():
    """`CountingComm` sees the all-reduce inside `all_reduce_add_norm` once: here (no one-shot kernel) through
    the formulas' own `all_reduce`, so not as fused (`all_reduce_fused` counts the one-shot kernel's calls)."""
    c = CountingComm()
    x, h, w = torch.randn(2, 256), torch.randn(2, 256), torch.rand(256) + 1
    c.all_reduce_add_norm(x.clone(), h, w, 1e-6)
    c.all_reduce(x.clone())
    assert c.counts["all_reduce"] == 2 and c.counts["all_reduce_fused"] == 0
    assert c.counts["all_reduce_bytes"] == 2 * x.numel() * 4
    assert [k for k, _, _ in c.calls] == ["all_reduce", "all_reduce"]


@pytest.mark.parametrize("D,groups,rows,want", [(7168, 64, 1, (64, 1)), (7168, 8, 1, (8, 7)), (7168, 2, 1, (2, 28)),
                                                (7168, 16, 1, (16, 4)), (1000, 64, 1, (8, 1)), (1000, 2, 1, (2, 4)),
                                                (200, 64, 1, (2, 1)), (128, 1, 1, (1, 1)), (7168, 4, 18, (4, 14)),
                                                (7168, 4, 19, (8, 7)), (7168, 4, 64, (16, 4)), (7168, 4, 73, (32, 2))])
def test_oneshot_row_split(D, groups, rows, want):
    """A fused row's programs: G groups of 128 channels each (never more than the row needs), C of them covering D;
    wider programs where `rows` rows would pass MAX_PROGRAMS."""
    from mtp.parallel.oneshot import MAX_PROGRAMS, row_split

    G, C = row_split(D, groups, rows)
    assert (G, C) == want and G * C * 128 >= D > (C - 1) * G * 128 and (rows * C <= MAX_PROGRAMS or C == 1)
