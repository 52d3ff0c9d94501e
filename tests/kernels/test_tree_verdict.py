"""The strict tree verdict in one launch (`mtp.kernels.tree_verdict`, switch `FastPathOptions.tree_verdict`), integer
for integer against its torch reference (`verify.tree.tree_strict_verdict`), on the CPU.

Shape legend: B rows, N tree nodes, A path nodes (root first), V vocabulary.

- In-process: the switch (on by default), its bench variant, the torch ops kept without a GPU or the interpreter, the
  kernel compiled for sm_90 (PDL: one wait before any global access).
- Under the Triton interpreter (a subprocess, this file as a script; one check of a few seconds): trees 2x1x1, 3x2,
  chain3, one with sibling-rank gaps and 2x2x2 (N = 7..15, A = 3..4), B = 1 / 3 / 5 rows, tokens matching their
  parent's target argmax often (a small vocabulary) with sibling tokens repeated (ties: the lower node index wins),
  live masks with dead nodes and a dead root, tokens and targets with row strides past N: the accept length, next
  token, path and inexact count torch.equal to the reference's; `strict_argmax` with the switch on / off / no
  options gives the same verdict.
GPU twin (CUDA graphs, the engine's strict trees with the switch on and off): tests/kernels/test_tree_verdict_gpu.py.
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

SHAPES = ("2x1x1", "3x2", "chain3", "0/1/0.0/0.1/1.1", "2x2x2")


def test_switch_is_on_by_default_with_a_bench_variant():
    from mtp.bench.rank import KERNEL_VARIANTS
    from mtp.bench.step_launches import GLUE_SWITCHES
    from mtp.kernels.dispatch import FastPathOptions

    assert FastPathOptions().tree_verdict and "tree_verdict" in GLUE_SWITCHES
    assert KERNEL_VARIANTS["tree_verdict_off"][0] == {"tree_verdict": False}


def test_without_a_gpu_or_the_interpreter_the_torch_ops_stay():
    from mtp.kernels.dispatch import FastPathOptions
    from mtp.kernels.tree_verdict import tree_verdict_takes
    from mtp.verify.tree import strict_argmax, tree_strict_verdict

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter takes CPU tensors")
    tt, tokens, target, live = random_case(torch.Generator().manual_seed(0), "2x1x1", 2)
    assert not tree_verdict_takes(tokens, target, tt.path_NA, live)
    a = strict_argmax(None, tt, SimpleNamespace(tokens_BN=tokens), target, live, FastPathOptions())
    assert all(torch.equal(x, y) for x, y in zip(vars(a).values(), vars(tree_strict_verdict(tt, tokens, target,
                                                                                             live)).values()))


def test_kernel_compiles_for_hopper():
    """sm_90 (triton's own ptxas, no GPU), with and without the live mask: no local-memory spill; with PDL (switch
    glue_pdl), its trigger at the start (PDL_EARLY) or after its wait (PDL_AFTER_WAIT), it waits once, before its
    first global load or store (`test_pdl._order`)."""
    pytest.importorskip("triton")
    from tests.kernels.test_fused_kernels import _compile_for_hopper
    from tests.kernels.test_pdl import _order

    from mtp.kernels.tree_verdict import _tree_verdict_kernel

    ptrs = {n: "*i64" for n in ("tok_ptr", "tgt_ptr", "parent_ptr", "depth_ptr", "path_ptr", "a_ptr", "next_ptr",
                                "out_path_ptr", "inexact_ptr")} | {"live_ptr": "*u8"}
    gdc = ["griddepcontrol.launch_dependents", "griddepcontrol.wait"]
    for pdl, live in ((1, True), (2, False)):
        consts = dict(LIVE=live, BLOCK_N=8, BLOCK_A=4, PDL=pdl)
        ptx = _compile_for_hopper(_tree_verdict_kernel, ptrs, consts, num_warps=1).asm["ptx"]
        assert ".local" not in ptx
        order = _order(ptx)
        assert order[:2] == (gdc if pdl == 1 else gdc[::-1]) and order.count("griddepcontrol.wait") == 1, order[:4]


def test_tree_verdict_interpreted():
    run_interpreted(__file__, 300)


# ----------------------------------------------------------------------------- run under TRITON_INTERPRET=1 too
def random_case(g: torch.Generator, shape: str, B: int, V: int = 3, device: str = "cpu"):
    """(tt, tokens_BN, target_BN, live_BN) of a random strict verify: the target's argmax over a V-token vocabulary
    (small: nodes match their parent's often); each node's token its parent's target with probability 0.7, else
    random; a node repeats its previous sibling's token with probability 0.3 (ties); tokens and target views of rows
    longer than N; live nodes with probability 0.8, row 0's root dead when B > 2."""
    from mtp.spec.tree_shape import TreeShape

    tt = TreeShape.parse(shape).tensors(device)
    N = tt.shape.n_nodes
    target = torch.randint(0, V, (B, N + 3), generator=g).to(device)[:, 1:N + 1]
    tokens = torch.randint(0, V, (B, N + 2), generator=g).to(device)[:, :N]
    match = torch.rand(B, N, generator=g).to(device) < 0.7
    tokens.copy_(torch.where(match, target[:, tt.parent_N.clamp_min(0)], tokens))
    for kids in tt.shape.children:
        for prev, c in zip(kids, kids[1:]):
            same = torch.rand(B, generator=g).to(device) < 0.3
            tokens[:, c] = torch.where(same, tokens[:, prev], tokens[:, c])
    live = torch.rand(B, N, generator=g).to(device) < 0.8
    if B > 2:
        live[0, 0] = False
    return tt, tokens, target, live


def _fields(v) -> list[torch.Tensor]:
    return [v.accept_len_B, v.next_token_B, v.path_BA, v.relaxed_only_B]


def _kernel_checks() -> None:
    from mtp.kernels.dispatch import FastPathOptions
    from mtp.kernels.tree_verdict import MAX_CELLS, tree_verdict, tree_verdict_takes
    from mtp.verify.tree import strict_argmax, tree_strict_verdict

    g = torch.Generator().manual_seed(0)
    cases, ties, deep = 0, 0, 0
    for shape in SHAPES:
        for B in (1, 3, 5):
            tt, tokens, target, live = random_case(g, shape, B)
            for lv in (None, live):
                want = tree_strict_verdict(tt, tokens, target, lv)
                got = tree_verdict(tokens, target, tt.parent_N, tt.depth_N, tt.path_NA, lv)
                bad = [n for n, x, y in zip(("accept_len", "next", "path", "inexact"), _fields(want), got)
                       if not torch.equal(x, y)]
                assert not bad, (shape, B, lv is not None, bad, _fields(want), got)
                cases += 1
                deep += int((want.accept_len_B > 0).sum())
            ties += int(sum((tokens[:, kids[0]] == tokens[:, c]).sum() for kids in tt.shape.children
                            for c in kids[1:]))
    assert ties > 10 and deep > 10, (ties, deep)  # the cases hold tied siblings and accepted drafts
    # the registry's rule: the switch on (the kernel), off and no options (the torch ops) give one verdict
    tt, tokens, target, live = random_case(g, "2x1x1", 3)
    draft = SimpleNamespace(tokens_BN=tokens)
    runs = [strict_argmax(None, tt, draft, target, live, opts)
            for opts in (FastPathOptions(), FastPathOptions(tree_verdict=False), None)]
    assert all(torch.equal(x, y) for v in runs[1:] for x, y in zip(_fields(runs[0]), _fields(v)))
    # what the kernel does not take keeps the torch ops; a direct call of such a step is refused by name
    assert not tree_verdict_takes(tokens.int(), target, tt.path_NA, live)
    assert not tree_verdict_takes(tokens, target, tt.path_NA, live.long())
    assert not tree_verdict_takes(tokens, target, torch.zeros(MAX_CELLS, 2, dtype=torch.long), None)
    with pytest.raises(ValueError, match="tree_verdict: takes int64 tokens"):
        tree_verdict(tokens.int(), target, tt.parent_N, tt.depth_N, tt.path_NA, live)
    with pytest.raises(ValueError, match=r"tree_verdict: tokens, target and live \[B, N\]"):
        tree_verdict(tokens, target[:, :-1], tt.parent_N, tt.depth_N, tt.path_NA, live)
    print(f"kernel checks ok ({cases} verdicts, {ties} tied siblings, {deep} rows with drafts accepted)")


if __name__ == "__main__":
    interpreted_main([_kernel_checks])
