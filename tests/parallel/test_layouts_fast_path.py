"""The fast path under the expert layouts (`mtp.placement`; one of each id-mapping kind) on 2 CPU ranks over gloo, its
kernels under the Triton interpreter: per layout, the whole fp32 TP=2 model with the fast path installed
(`install_fast_modules`: `FastMoE` with a range, a global -> local table, or every expert's 128-wide slice) gives
- its MoE layer's all-reduced output (router kernel, 2 x 3 tokens) equal to the same layer on the reference path
  (`disable_fast_path`), to fp32 summation order, on both ranks;
- strict greedy tokens (2 rows of 6 and 3 prompt tokens, 3 new each) equal to the single-process fp32 reference
  model's, the same on both ranks.
A 'split' rank without a block of the experts' width, and every layout's rank modules at more token counts and
router variants: tests/parallel/test_moe_ep.py. The expert kernels run the pair grid (`set_kernel_options`): under
the interpreter the persistent grid's 132 programs cost ~1 s a layer, and both read the same local ids
(test_moe_ep.py holds the persistent grid to the pair grid with other ranks' slots). ~30 s on 2 cores.

The interpreter's fp32 -> e4m3 cast is made CUDA's (`tests.interp.patch_interpreter_fp8_rounding`), so the kernels
quantize as the reference does and only the order of fp32 additions differs (fp32 model: the interpreter's bf16
dot is not CUDA's). The interpreter is chosen when a kernel is decorated: the ranks are spawned with
TRITON_INTERPRET=1 and import the kernels only then. The GPU twin: tests/parallel/test_layouts_fast_path_gpu.py.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
from pathlib import Path

import pytest
import torch

WORLD = 2
# 'permuted' is left out: its ranks map ids by a table as 'interleaved' does (the same fast-path code, another
# table); its placement and its fast MoE are held over gloo and under the interpreter in tests/parallel/test_moe_ep.py
LAYOUTS = ("contiguous", "interleaved", "split")
PROMPTS = ([5, 17, 3, 99, 250, 7], [300, 2, 41])
MAX_NEW = 3
MOE_TOL = 1e-5  # relative; observed ~1e-7 (fp32 summation order of the kernels vs torch)


def layout_config():
    """One dense and one MoE layer, 2 ranks, routed experts 256 wide (under 'split' a 128-block on each rank)."""
    from mtp.model.presets import tiny_parallel_config

    cfg = dataclasses.replace(tiny_parallel_config(WORLD, layers=2, dense_layers=1), moe_intermediate_size=256)
    cfg.validate("test_layouts_fast_path")
    return cfg


def greedy(model) -> list[list[int]]:
    import mtp

    with torch.no_grad():
        return mtp.generate(model, [list(p) for p in PROMPTS], max_new_tokens=MAX_NEW, draft="none").tokens


def _moe_output(model) -> torch.Tensor:
    """The MoE layer's forward (routed + shared, all-reduced) on one input of 2 x 3 tokens."""
    x = torch.randn(2, 3, model.cfg.hidden_size, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return model.model.layers[1].mlp(x)


def _worker(rank: int, init: str, out: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from tests.interp import patch_interpreter_fp8_rounding, patch_interpreter_loop_bounds

    patch_interpreter_loop_bounds()
    patch_interpreter_fp8_rounding()
    from mtp.backends.fast_path import FastMoE, install_fast_modules, set_kernel_options
    from mtp.parallel import Comm, ParallelPlan
    from mtp.parallel.comm import init_process_group
    from mtp.parallel.modules import ExpertParallelMoE
    from mtp.parallel.synthetic import random_parallel_model

    init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD,
                       timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    try:
        res = {}
        for layout in LAYOUTS:
            t0 = time.perf_counter()
            model = random_parallel_model(layout_config(), Comm(), ParallelPlan(WORLD, expert_layout=layout,
                                                                                expert_seed=3),
                                          device="cpu", dtype=torch.float32, seed=0)
            ref = _moe_output(model)
            install_fast_modules(model)
            set_kernel_options(model, moe_layout="pairs")  # the interpreter's cost (module docstring)
            moes = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
            assert len(moes) == 2 and all(isinstance(m, FastMoE) for m in moes)  # trunk layer 1, MTP block
            res[layout] = {"ref": ref, "fast": _moe_output(model), "tokens": greedy(model),
                           "held": list(moes[0].local_ids()), "id_map": _kind(moes[0].id_map.router),
                           "width": moes[0].stacked["gate_proj.weight"].shape[1], "s": time.perf_counter() - t0}
        torch.save(res, f"{out}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def _kind(id_map) -> str:
    return "none" if id_map is None else "range" if isinstance(id_map, tuple) else "table"


@pytest.mark.slow
def test_every_layout_on_the_fast_path_over_gloo(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    from mtp.checkpoint.synthetic import random_model
    from tests.parallel.test_parallel import run_ranks

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the spawned ranks' environment (this process imports no kernel)
    run_ranks(_worker, (str(tmp_path / "init"), str(tmp_path)), timeout_s=420.0)
    got = [torch.load(Path(tmp_path) / f"rank{r}.pt") for r in range(WORLD)]
    want = greedy(random_model(layout_config(), device="cpu", dtype=torch.float32, seed=0))
    maps = {"contiguous": "range", "interleaved": "table", "split": "none"}
    for layout in LAYOUTS:
        r0, r1 = got[0][layout], got[1][layout]
        for r, res in enumerate((r0, r1)):
            a, b = res["fast"].double(), res["ref"].double()
            rel = ((a - b).norm() / b.norm()).item()
            assert rel < MOE_TOL, f"{layout} rank {r}: fast MoE vs reference, relative {rel:.3g}"
        assert torch.equal(r0["fast"], r1["fast"]), f"{layout}: ranks disagree"
        assert r0["tokens"] == r1["tokens"] == want, (layout, r0["tokens"], r1["tokens"], want)
        assert r0["id_map"] == r1["id_map"] == maps[layout], (layout, r0["id_map"], r1["id_map"])
        if layout == "split":
            assert r0["held"] == r1["held"] == list(range(16)) and r0["width"] == r1["width"] == 128
        else:
            assert sorted(r0["held"] + r1["held"]) == list(range(16)) and len(r0["held"]) == 8, layout
        print(f"{layout}: rank 0 {r0['s']:.1f} s, rank 1 {r1['s']:.1f} s")
