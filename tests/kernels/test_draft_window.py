"""A chain step's draft window in one launch (`mtp.kernels.draft_window`, switch `FastPathOptions.draft_window`) and a
tree step's (its TREE mode, switch tree_window): the same integers and hidden rows as the torch ops of
`Proposer.propose` / `TreeProposer._window_inputs` it replaces, on the CPU.

Shape legend: B rows, S buffer positions, W window, K drafts, D width.

- In-process: the switch (on by default) and its bench variant; a CPU without the interpreter keeps the torch ops; the
  kernel compiles for sm_90 with PDL waiting before its first load.
- Under the Triton interpreter (a subprocess, this file as a script): random windows (B = 1..3, W = 1..5, K = 0..4,
  odd D past one block of channels, rows whose window starts at 0 with n < W + 1, tokens read past the buffer's end
  clamped, hidden rows of a buffer with a row stride past S x D, fp32 and bf16): every output torch.equal to
  `draft_window_ref`, which is the proposer's own ops (`Proposer._window` with the switch off, held equal here too),
  and the cache lengths it sets (the first window module's `truncate(p0)`) equal to p0; the tree mode (`tree_window`,
  switch tree_window): two windows (B = 2, 3; W = 2, 4; rows of n = 1 and n = S) against `tree_window_ref` and
  `TreeProposer._window_inputs` with the switch on and off.
Whole steps with every glue switch on and off: tests/bench/test_step_launches.py (`--compare`), tests/kernels/
test_step_commit.py's engine runs; GPU twin: tests/backends/test_glue_gpu.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`
from tests.interp import interpreted_main, run_interpreted  # noqa: E402


def test_switch_is_on_by_default_with_a_bench_variant():
    from mtp.bench.rank import KERNEL_VARIANTS
    from mtp.bench.step_launches import GLUE_SWITCHES
    from mtp.kernels.dispatch import FastPathOptions

    o = FastPathOptions()
    for name in ("draft_window", "strict_commit", "tree_window"):
        assert getattr(o, name) and name in GLUE_SWITCHES
        assert KERNEL_VARIANTS[f"{name}_off"][0] == {name: False}


def test_cpu_tensors_keep_the_torch_ops():
    from mtp.kernels.draft_window import window_takes

    if os.environ.get("TRITON_INTERPRET") != "1":
        z = torch.zeros(2, dtype=torch.long)
        assert not window_takes(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, 4), z, z)


def test_kernel_compiles_for_hopper():
    """sm_90 (triton's own ptxas, no GPU), no local-memory spill; with PDL it waits before its first global access."""
    pytest.importorskip("triton")
    from tests.kernels.test_fused_kernels import _compile_for_hopper
    from tests.kernels.test_pdl import _order

    from mtp.kernels.draft_window import ROW_BLOCK, _draft_window_kernel

    ptrs = {"tok_ptr": "*i64", "n_ptr": "*i64", "p0_ptr": "*i64", "tok_out_ptr": "*i64", "idx_out_ptr": "*i64",
            "at_out_ptr": "*i64", "last_out_ptr": "*i64", "lens_ptr": "*i64"}
    for pdl, tree in ((0, False), (2, True)):
        ptx = _compile_for_hopper(_draft_window_kernel, ptrs, dict(BLOCK=ROW_BLOCK, BLOCK_K=4, TREE=tree,
                                                                   HAS_LENS=True, PDL=pdl),
                                  num_warps=4).asm["ptx"]
        assert ".local" not in ptx
        if pdl:
            assert _order(ptx)[:2] == ["griddepcontrol.wait", "griddepcontrol.launch_dependents"], _order(ptx)[:4]


def test_draft_window_interpreted():  # the chain's windows, then the tree's (`_tree_checks`)
    run_interpreted(__file__, 300, "kernel")


# ----------------------------------------------------------------------------- run under TRITON_INTERPRET=1
def _kernel_checks() -> None:
    from mtp.draft.proposer import Proposer
    from mtp.kernels.dispatch import FastPathOptions
    from mtp.kernels.draft_window import draft_window, draft_window_ref

    g = torch.Generator().manual_seed(0)
    cases = 0
    for B, W, K, D, dtype in ((1, 4, 3, 1100, torch.float32), (3, 5, 4, 33, torch.bfloat16),
                              (2, 1, 0, 7, torch.float32), (3, 2, 1, 1030, torch.bfloat16)):
        S = 12
        tokens = torch.randint(0, 100, (B, S), generator=g)
        hidden = torch.randn(B, S + 1, D, generator=g).to(dtype)[:, 1:]  # a row stride past S x D
        n = torch.randint(1, S - K + 1, (B,), generator=g)
        n[0] = min(int(n[0]), W)  # a row whose window starts at 0 and whose logits row clamps
        p0 = (n - 1 - W).clamp_min(0)
        p0[-1] = S - W  # a window at the buffer's end: its last token position clamps
        lens_want, lens_got = torch.randint(0, S, (B,), generator=g), torch.full((B,), -1)
        want = draft_window_ref(tokens, hidden, n, p0, W, K, lens_want)
        got = draft_window(tokens, hidden, n, p0, W, K, lens_B=lens_got)
        bad = [i for i, (a, b) in enumerate(zip(want, got)) if a.dtype != b.dtype or not torch.equal(a, b)]
        assert not bad and torch.equal(lens_want, p0) and torch.equal(lens_got, p0), (B, W, K, D, dtype, bad)
        for flag in (False, True):  # the proposer's window: its torch ops (switch off) and the kernel (on)
            prop = SimpleNamespace(cfg=SimpleNamespace(k=K),
                                   model=SimpleNamespace(fast_options=FastPathOptions(draft_window=flag)))
            cache = SimpleNamespace(seq_lens=torch.full((B,), -1))
            cache.truncate = lambda lens, c=cache: c.seq_lens.copy_(lens)
            out = Proposer._window(prop, tokens, hidden, n, p0, W, cache)
            assert all(torch.equal(a, b) for a, b in zip(want, out)), (B, W, K, D, flag)
            assert torch.equal(cache.seq_lens, p0), (B, W, K, D, flag)
        cases += 1
    print(f"kernel checks ok ({cases} windows)")


def _tree_checks() -> None:
    """`tree_window` against `tree_window_ref` and the tree proposer's module-0 window (switch on / off): the start
    written into the cache lengths, tokens, hidden rows, logits row and root token; rows of n = 1 (a window from 0
    whose logits row clamps) and n at the buffer's end (its last token position clamps)."""
    from mtp.draft.tree_proposer import TreeProposer
    from mtp.kernels.dispatch import FastPathOptions
    from mtp.kernels.draft_window import tree_window, tree_window_ref

    g = torch.Generator().manual_seed(1)
    for B, W, D, dtype in ((3, 4, 1030, torch.bfloat16), (2, 2, 7, torch.float32)):
        S = 9
        tokens = torch.randint(0, 100, (B, S), generator=g)
        hidden = torch.randn(B, S + 1, D, generator=g).to(dtype)[:, 1:]  # a row stride past S x D
        n = torch.randint(1, S + 1, (B,), generator=g)
        n[0], n[-1] = 1, S
        lens_want, lens_got = torch.full((B,), 7), torch.full((B,), 7)
        want = tree_window_ref(tokens, hidden, n, lens_want, W)
        got = tree_window(tokens, hidden, n, lens_got, W)
        bad = [i for i, (a, b) in enumerate(zip(want, got)) if a.dtype != b.dtype or not torch.equal(a, b)]
        assert not bad and torch.equal(lens_want, lens_got), (B, W, D, dtype, bad, lens_want, lens_got)
        for flag in (False, True):  # the proposer's window: its torch ops (switch off) and the kernel (on)
            cache = SimpleNamespace(seq_lens=torch.full((B,), 7))
            cache.truncate = lambda lens, c=cache: c.seq_lens.copy_(lens)
            opts = FastPathOptions(tree_window=flag)
            prop = SimpleNamespace(caches=[cache], model=SimpleNamespace(fast_options=opts))
            out = TreeProposer._window_inputs(prop, 0, tokens, hidden, n, W)
            assert all(torch.equal(a, b) for a, b in zip(want, out)), (B, W, D, flag)
            assert torch.equal(cache.seq_lens, lens_want), (B, W, D, flag)
    print("tree window checks ok")


if __name__ == "__main__":
    interpreted_main({"kernel": lambda: (_kernel_checks(), _tree_checks())})
