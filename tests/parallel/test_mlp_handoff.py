"""The fast path's FFN all-reduce handed to the next block's norm (`FastTrunk`, `FastBlock(hand_off=True)`,
`mtp.backends.pending.Pending`; switch `mlp_reduce_norm`) on 2 CPU ranks over gloo, the kernels under the
Triton interpreter: a bf16 TP=2 model (a dense and an MoE layer) with the hand-off gives the unfused fast path's
logits (so its greedy tokens), normed hidden and pre-norm hidden (what the MTP modules read) bit for bit, with
the same collectives; bf16, so that every rounding of a reduced sum before its residual add is exercised. So does
the casts' fold (switch `fuse_out_cast`: a reduced fp32 sum rounded to bf16 inside the kernel that adds it, under
'nccl' and in each `Pending`'s fallback) against the cast launches; under 'nccl' with the fold the FFN's sum is
handed off too (the group's all-reduce, then the next block's add + norm + quant: no `add_rounded`).

Over gloo the one-shot kernel cannot run (`Comm.fuses` is False), so each `Pending` takes its own fallback: the
all-reduce alone, then the fast path's add + norm + quant kernel -- the code path of the hand-off (which block
hands what to which, the rounding before the add, the last block's resolve before the final norm) with the
kernels of the unfused path; and 'oneshot' equals 'nccl' bit for bit. The one-shot kernel itself, and TP=2
strict tokens with 'oneshot' (both all-reduces of a block fused) equal to 'nccl' in eager and graph mode, are
GPU tests (tests/parallel/test_allreduce_gpu.py).

The interpreter is chosen when a kernel is decorated (at import): the ranks are spawned with TRITON_INTERPRET=1 in
their environment and import the kernels only then. 25-45 s on 2 cores (a forward costs ~5 s there).
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch

from tests.interp import patch_interpreter_bf16_rounding, patch_interpreter_loop_bounds

WORLD = 2
# (all-reduce, switch mlp_reduce_norm, switch fuse_out_cast): 'nccl' is the group's own all-reduce (gloo here);
# 'oneshot' with mlp_reduce_norm off is the fast path before the hand-off (o_proj fused only); on, the FFN's
# all-reduce moves to the next block. fuse_out_cast off: the reduced sums' casts to the model dtype are launches of
# their own (under 'nccl': o_proj's `.to` and the dense MLP's, then the adds), the base every run must equal
RUNS = (("oneshot", False, False), ("nccl", True, False), ("nccl", True, True), ("oneshot", False, True),
        ("oneshot", True, False), ("oneshot", True, True))
BASE = RUNS[0]


@pytest.mark.slow
def test_hand_off_equals_the_unfused_trunk_over_gloo(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the spawned ranks' environment (this process imports no kernel)
    _checks(tmp_path)


def _run(model, comm) -> dict:
    """One forward of 2 x 3 tokens (<= SMALL_M rows: the fused blocks run; the interpreter costs ~5 s a forward
    here, so one): logits, hidden, pre-norm hidden (what the MTP modules read), its collectives, and what each
    trunk block returned ('Pending': its FFN all-reduce handed to the next block's norm)."""
    ids = torch.randint(0, model.cfg.vocab_size, (2, 3), generator=torch.Generator().manual_seed(1))
    kinds = []
    hooks = [b.register_forward_hook(lambda mod, inp, out: kinds.append(type(out).__name__))
             for b in model.model.layers]
    try:
        comm.reset()
        with torch.no_grad():
            o = model(ids, model.new_cache(2, 8))
    finally:
        for hk in hooks:
            hk.remove()
    return {"logits": o.logits, "hidden": o.hidden, "prenorm": o.hidden_prenorm, "tokens": o.logits.argmax(-1),
            "collectives": dict(comm.counts), "hand_offs": kinds}


def _worker(rank: int, init: str, out: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_interpreter_loop_bounds()
    patch_interpreter_bf16_rounding()  # the unfused MoE rounds in a kernel, the hand-off with torch (as CUDA does)
    from mtp.backends.fast_path import FastTrunk, install_fast_modules, set_kernels
    from mtp.model.presets import tiny_parallel_config
    from mtp.parallel import ParallelPlan
    from mtp.parallel.comm import CountingComm, init_process_group
    from mtp.parallel.synthetic import random_parallel_model

    init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD,
                       timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    try:
        comm = CountingComm()
        # a dense and an MoE layer: the dense ParallelMLP's hand-off to the MoE block, the expert-parallel MoE's
        # to the final norm
        model = random_parallel_model(tiny_parallel_config(WORLD, layers=2), comm, ParallelPlan(WORLD), device="cpu",
                                      dtype=torch.bfloat16, seed=0)
        install_fast_modules(model)
        assert isinstance(model.model, FastTrunk)
        res = {}
        for allreduce, on, cast in RUNS:
            # set directly: gloo refuses `set_allreduce('oneshot')`; without its buffers `fuses` is False, so
            # every fused call takes the formulas after the group's all-reduce (module docstring)
            comm.allreduce = allreduce
            set_kernels(model, mlp_reduce_norm=on, fuse_out_cast=cast)
            res[allreduce, on, cast] = _run(model, comm)
        torch.save(res, f"{out}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def _same(name: str, a, b) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{name}: {sorted(a)} != {sorted(b)}"
        for k in a:
            _same(f"{name}/{k}", a[k], b[k])
    elif isinstance(a, torch.Tensor):
        if not torch.equal(a, b):
            d = (a.double() - b.double()).abs()
            where = [int(i) for i in torch.unravel_index(d.argmax(), d.shape)]
            raise AssertionError(f"{name}: not bit-identical, max |diff| {d.max().item():.3g} at {where} "
                                 f"({(d > 0).sum().item()} of {d.numel()} differ)")
    else:
        assert a == b, f"{name}: {a} != {b}"


def _checks(d: Path) -> None:
    from tests.parallel.test_parallel import run_ranks

    run_ranks(_worker, (str(d / "init"), str(d)), timeout_s=280.0)
    got = [torch.load(d / f"rank{r}.pt") for r in range(WORLD)]
    layers = 2
    for rank, res in enumerate(got):
        base = res[BASE]
        for run in RUNS:
            _same(f"rank {rank} {run} vs {BASE}", res[run], {**base, "hand_offs": res[run]["hand_offs"]})
        # the hand-off happens where it should: every trunk block with the switch on under 'oneshot', and under
        # 'nccl' with fuse_out_cast (its add + norm + quant rounds and adds the sum); none else
        for cast in (False, True):
            assert res["oneshot", True, cast]["hand_offs"] == ["Pending"] * layers, res["oneshot", True, cast]
            assert res["oneshot", False, cast]["hand_offs"] == ["Tensor"] * layers
            assert res["nccl", True, cast]["hand_offs"] == ["Pending" if cast else "Tensor"] * layers
        # the same collectives: the embedding's, then 2 per block (o_proj, FFN); none fused over gloo
        c = base["collectives"]
        assert c["all_reduce"] == 1 + 2 * layers and c["all_reduce_fused"] == 0, c
    _same("rank 1 vs rank 0", got[1], got[0])
