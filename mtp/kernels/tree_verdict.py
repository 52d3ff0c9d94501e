"""The strict tree verdict in one launch (Triton): the deepest node whose whole path matches the target's argmax.

Reference: `mtp.verify.tree.tree_strict_verdict` (`_exact`, `_live`, `_deepest`, `_verdict`), plain PyTorch
(tests/kernels/test_tree_verdict.py holds this kernel to it, tensor for tensor). Shape legend: B rows, N tree nodes
(node 0 the root), A = max depth + 1 nodes on a path (root first).

Why: that verdict is ~25 small torch launches a tree step (`python -m mtp.bench.step_launches --tree 2x1x1`, session
23: _exact 5, _deepest 10, _verdict 10: gathers, compares, the ancestor reduction, the score's arithmetic, argmax,
the path's gathers and the inexact count), each ~1-2 us of GPU in the step's CUDA graph. Every value is an integer
over a few dozen nodes: one program per row does it in registers, exactly.

Per row b (program b), from the tree's tables (parent_N, depth_N, path_NA: `TreeTensors`):
  exact(i) = tokens[b, i] == target[b, max(parent[i], 0)] or i is the root; ok(i) = exact(i) and live[b, i];
  path_ok(i) = ok on every node of path_NA[i] (the path to i, padded with i itself); last = the path_ok node of the
  largest depth * N + (N - 1 - i) (the deepest, ties to the lower index), node 0 where none is (a dead root: torch's
  argmax of all -1); accept_len = depth[last], next_token = target[b, last], path = path_NA[last],
  inexact = the nodes path[d] with d <= accept_len that are not exact.
PDL (`_triton.pdl_launch` / `pdl_wait`, switches pdl and glue_pdl): the target's argmax is the logits scan's and the
tokens the drafter's, so the program waits first thing.
"""

from __future__ import annotations

import torch

from mtp.kernels._triton import (HAS_TRITON, interpreting, pdl_kwargs, pdl_launch, pdl_mode, pdl_wait, require, tl,
                                 triton)

__all__ = ["tree_verdict", "tree_verdict_takes", "MAX_CELLS"]

MAX_CELLS = 8192  # a row's [N, A] path tile in registers (BLOCK_N x BLOCK_A): 7 x 4 nodes on a 2x1x1 tree


@triton.jit
def _exact(node, tok_row, tgt_row, parent_ptr, mask):
    """Whether each node's token is the target's argmax at its parent (the root: yes), as `verify.tree._exact`."""
    parent = tl.load(parent_ptr + node, mask=mask, other=-1)
    tok = tl.load(tok_row + node, mask=mask, other=0)
    tgt = tl.load(tgt_row + tl.maximum(parent, 0), mask=mask, other=0)
    return (tok == tgt) | (parent < 0)


@triton.jit
def _tree_verdict_kernel(tok_ptr, tgt_ptr, live_ptr, parent_ptr, depth_ptr, path_ptr,
                         a_ptr, next_ptr, out_path_ptr, inexact_ptr,
                         N, A, stride_tok, stride_tgt, stride_live, stride_out,
                         LIVE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, PDL: tl.constexpr):
    pdl_launch(PDL)
    pdl_wait(PDL)  # the target's argmax (the logits scan) and the tokens (the drafter) are earlier kernels'
    b = tl.program_id(0).to(tl.int64)
    tok_row = tok_ptr + b * stride_tok
    tgt_row = tgt_ptr + b * stride_tgt
    i = tl.arange(0, BLOCK_N)
    j = tl.arange(0, BLOCK_A)
    mi = i < N
    mj = j < A
    m2 = mi[:, None] & mj[None, :]
    # every node's path (root first, padded with the node): its nodes' verdicts, then all of them (`_deepest`)
    node = tl.load(path_ptr + i[:, None] * A + j[None, :], mask=m2, other=0)
    ok = _exact(node, tok_row, tgt_row, parent_ptr, m2)
    if LIVE:
        ok = ok & (tl.load(live_ptr + b * stride_live + node, mask=m2, other=0) != 0)
    path_ok = tl.min(tl.where(m2, ok, True).to(tl.int32), axis=1) != 0
    depth = tl.load(depth_ptr + i, mask=mi, other=0)
    score = tl.where(path_ok & mi, depth * N + (N - 1 - i), -1)  # distinct per node: the maximum is one node
    best = tl.max(score, axis=0)
    last = tl.where(best >= 0, N - 1 - best % N, 0)  # none ok (a dead root): node 0, as torch's argmax of all -1
    # the verdict at that node (`_verdict`)
    a = tl.load(depth_ptr + last)
    path = tl.load(path_ptr + last * A + j, mask=mj, other=0)
    exact = _exact(path, tok_row, tgt_row, parent_ptr, mj)
    tl.store(a_ptr + b, a)
    tl.store(next_ptr + b, tl.load(tgt_row + last))
    tl.store(out_path_ptr + b * stride_out + j, path, mask=mj)
    tl.store(inexact_ptr + b, tl.sum((mj & (j <= a) & ~exact).to(tl.int64), axis=0))


def tree_verdict_takes(tokens_BN: torch.Tensor, target_BN: torch.Tensor, path_NA: torch.Tensor,
                       live_BN: torch.Tensor | None) -> bool:
    """Whether `tree_verdict` takes these: triton on a CUDA device (or its interpreter); int64 tokens and target [B, N]
    with unit last strides; an int64 path table [N, A] whose tile fits MAX_CELLS; a bool live mask [B, N] (or None)
    with a unit last stride."""
    if not HAS_TRITON or not (tokens_BN.is_cuda or interpreting()):
        return False
    N, A = path_NA.shape
    cells = max(2, triton.next_power_of_2(N)) * max(2, triton.next_power_of_2(A))
    return (tokens_BN.dtype == target_BN.dtype == path_NA.dtype == torch.long and cells <= MAX_CELLS
            and tokens_BN.stride(-1) == 1 and target_BN.stride(-1) == 1
            and (live_BN is None or (live_BN.dtype == torch.bool and live_BN.stride(-1) == 1)))


def tree_verdict(tokens_BN: torch.Tensor, target_BN: torch.Tensor, parent_N: torch.Tensor, depth_N: torch.Tensor,
                 path_NA: torch.Tensor, live_BN: torch.Tensor | None = None,
                 pdl: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`verify.tree.tree_strict_verdict` in one launch: (accept_len_B, next_token_B, path_BA, inexact_B), int64, the
    reference's values integer for integer. tokens_BN [B, N] (the drafted nodes, node 0 the root), target_BN [B, N]
    (the target's argmax at every node), the tree's tables (`TreeTensors`: parent_N [N] with -1 at the root,
    depth_N [N], path_NA [N, A], contiguous), live_BN bool [B, N] (None: every node). pdl: programmatic dependent
    launch (`_triton.pdl_kwargs`; `FastPathOptions.glue_pdl_at`)."""
    require(tokens_BN, "tree_verdict")
    if not tree_verdict_takes(tokens_BN, target_BN, path_NA, live_BN):
        raise ValueError(f"tree_verdict: takes int64 tokens, target and path table with unit last strides, a bool live "
                         f"mask, an [N, A] tile of <= {MAX_CELLS} cells; got tokens {tokens_BN.dtype} target "
                         f"{target_BN.dtype} path {path_NA.dtype} {list(path_NA.shape)}, live "
                         f"{None if live_BN is None else live_BN.dtype}")
    B, N = tokens_BN.shape
    A = path_NA.shape[1]
    if (target_BN.shape != (B, N) or path_NA.shape[0] != N or not path_NA.is_contiguous()
            or any(t.shape != (N,) or t.dtype != torch.long or t.stride(0) != 1 for t in (parent_N, depth_N))
            or (live_BN is not None and live_BN.shape != (B, N))):
        raise ValueError(f"tree_verdict: tokens, target and live [B, N] = [{B}, {N}], a contiguous path table "
                         f"[{N}, A], int64 parent_N and depth_N [{N}]; got target {list(target_BN.shape)}, path "
                         f"{list(path_NA.shape)}, parent {list(parent_N.shape)} {parent_N.dtype}, depth "
                         f"{list(depth_N.shape)} {depth_N.dtype}, live "
                         f"{None if live_BN is None else list(live_BN.shape)}")
    dev = tokens_BN.device
    a_B, next_B, inexact_B = (torch.empty(B, dtype=torch.long, device=dev) for _ in range(3))
    path_BA = torch.empty(B, A, dtype=torch.long, device=dev)
    live = tokens_BN if live_BN is None else live_BN.view(torch.uint8)  # not read without LIVE
    launch = pdl_kwargs(pdl, tokens_BN)
    _tree_verdict_kernel[(B,)](
        tokens_BN, target_BN, live, parent_N, depth_N, path_NA, a_B, next_B, path_BA, inexact_B,
        N, A, tokens_BN.stride(0), target_BN.stride(0), live.stride(0), path_BA.stride(0),
        LIVE=live_BN is not None, BLOCK_N=max(2, triton.next_power_of_2(N)),
        BLOCK_A=max(2, triton.next_power_of_2(A)), PDL=pdl_mode(pdl, launch), num_warps=1, **launch)
    return a_B, next_B, path_BA, inexact_B
