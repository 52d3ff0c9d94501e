"""A draft step's window in one launch (Triton): the first window module's tokens and the target's hidden rows over the
window, with the window's logits row and the drafts' token slots; and, given the window module's cache lengths, their
rollback to the window's start (the cache's `truncate(p0)`).

Reference: `draft_window_ref`, the torch ops `mtp.draft.proposer.Proposer.propose` runs before its first MTP forward:
the window's positions (an add), its logits row (2 subs and a clamp), the drafts' slots (an add), the hidden rows'
gather, the first module's token positions (an add and a clamp) and their gather: 9 launches; with the cache lengths
(`lens_B`) also the first module's cache `truncate(p0)` (a copy): 10. The verify's slots n-1.. (in place of the
drafts' n..) and the last committed token (a gather) also make the chain step's verify input without its own add and
gather (`decode.chain.ChainStep`, `Proposer.verify_input`). Shape legend: B rows,
S buffer positions, W window, K drafts, D width.

Why: a CUDA-graph decode step pays per launch (~1-2 us of GPU plus its gap each; session 20's profile); this runs once
an eagle step (the window), on the path from the last commit to the first draft forward. Exact: integers and copied
rows, the same bits. A vanilla drafter's later window modules read drafts written during the step: their token
gathers stay the torch ops.
A tree step's first window (`tree_window`, reference `tree_window_ref`: `TreeProposer._window_inputs`' torch ops for
module 0, 12 launches) is the same kernel in its TREE mode: the start max(n - 1 - W, 0) from the lengths instead of
read, written into the module's cache lengths (its roll-back), and the root token x_{n-1} beside the logits row.
PDL (`_triton.pdl_launch` / `pdl_wait`, switches pdl and glue_pdl): every address depends on the window start and the
lengths the last commit wrote, so each program waits first thing.
"""

from __future__ import annotations

import torch

from mtp.kernels._triton import (HAS_TRITON, interpreting, pdl_kwargs, pdl_launch, pdl_mode, pdl_wait, require, tl,
                                 triton)

__all__ = ["draft_window", "draft_window_ref", "tree_window", "tree_window_ref", "window_takes"]

ROW_BLOCK = 1024  # hidden channels per program: 7 programs a position at D = 7168


def draft_window_ref(tokens_BS: torch.Tensor, hidden_BSD: torch.Tensor, n_B: torch.Tensor, p0_B: torch.Tensor, W: int,
                     K: int, lens_B: torch.Tensor | None = None):
    """(tok_BW, hid_BWD, out_idx_B, at_BK1, last_B): the window p0..p0+W-1's next tokens (positions + 1, clamped to the
    buffer), its hidden rows, the row of the window whose logits draft (n - 2 - p0 clamped to 0..W-1), the verify's
    slots n-1..n+K-1 (the drafts' are its columns 1..) and the last committed token x_{n-1} (n >= 1): `Proposer`'s
    ops. `lens_B`: a cache's lengths, set to p0 (`KVCache.truncate(p0)`)."""
    dev = n_B.device
    if lens_B is not None:
        lens_B.copy_(p0_B)
    pos_BW = p0_B.unsqueeze(1) + torch.arange(W, device=dev)
    out_idx_B = (n_B - 2 - p0_B).clamp(0, W - 1)
    at_BK1 = n_B.unsqueeze(1) + torch.arange(-1, K, device=dev)
    hid = hidden_BSD.gather(1, pos_BW.unsqueeze(-1).expand(-1, -1, hidden_BSD.shape[-1]))
    tok = tokens_BS.gather(1, (pos_BW + 1).clamp_max(tokens_BS.shape[1] - 1))
    return tok, hid, out_idx_B, at_BK1, tokens_BS.gather(1, at_BK1[:, :1])[:, 0]


@triton.jit
def _draft_window_kernel(tok_ptr, hid_ptr, n_ptr, p0_ptr, tok_out_ptr, hid_out_ptr, idx_out_ptr, at_out_ptr,
                         last_out_ptr, lens_ptr, W, K, S, D, P0_OFF, stride_tb, stride_hb, stride_hs,
                         BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, TREE: tl.constexpr, HAS_LENS: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_launch(PDL)
    pdl_wait(PDL)  # the window start and lengths are the last commit's
    m = tl.program_id(0).to(tl.int64)  # the window entry b * W + w
    c = tl.program_id(1)  # its block of hidden channels
    b, w = m // W, m % W
    if TREE:  # the start from the lengths (p0_ptr not read; the cache's lengths, lens_ptr, written below)
        p0 = tl.maximum(tl.load(n_ptr + b) - P0_OFF, 0)
    else:
        p0 = tl.load(p0_ptr + b)
    pos = p0 + w
    d = c * BLOCK + tl.arange(0, BLOCK)
    md = d < D
    row = tl.load(hid_ptr + b * stride_hb + pos * stride_hs + d, mask=md)
    tl.store(hid_out_ptr + m * D + d, row, mask=md)
    if c == 0:
        tl.store(tok_out_ptr + m, tl.load(tok_ptr + b * stride_tb + tl.minimum(pos + 1, S - 1)))
        if w == 0:
            n = tl.load(n_ptr + b)
            tl.store(idx_out_ptr + b, tl.minimum(tl.maximum(n - 2 - p0, 0), W - 1))
            tl.store(last_out_ptr + b, tl.load(tok_ptr + b * stride_tb + n - 1))  # x_{n-1}: the tree's root
            if not TREE:  # the verify's slots n-1..n+K-1 (the drafts' are columns 1..)
                k = tl.arange(0, BLOCK_K)
                tl.store(at_out_ptr + b * (K + 1) + k, n - 1 + k, mask=k < K + 1)
            if HAS_LENS:  # the cache's lengths: no program reads them (the window's start is p0's)
                tl.store(lens_ptr + b, p0)


def window_takes(tokens_BS: torch.Tensor, hidden_BSD: torch.Tensor, n_B: torch.Tensor, p0_B: torch.Tensor) -> bool:
    """Whether `draft_window` takes these: int64 tokens [B, S] and lengths / window starts [B] (unit strides), hidden
    [B, S', D] with a unit last stride, on a CUDA device (or the interpreter's CPU), without autograd."""
    B = tokens_BS.shape[0]
    return (HAS_TRITON and (tokens_BS.is_cuda or (interpreting() and tokens_BS.device.type == "cpu"))
            and tokens_BS.device == hidden_BSD.device == n_B.device == p0_B.device
            and tokens_BS.dtype == n_B.dtype == p0_B.dtype == torch.long and tokens_BS.dim() == 2
            and tokens_BS.stride(1) == 1 and hidden_BSD.dim() == 3 and hidden_BSD.shape[0] == B
            and hidden_BSD.stride(2) == 1 and all(t.shape == (B,) and t.stride(0) == 1 for t in (n_B, p0_B))
            and not (hidden_BSD.requires_grad and torch.is_grad_enabled()))


def draft_window(tokens_BS: torch.Tensor, hidden_BSD: torch.Tensor, n_B: torch.Tensor, p0_B: torch.Tensor, W: int,
                 K: int, pdl: int = 0, lens_B: torch.Tensor | None = None):
    """`draft_window_ref` in one launch over a (window entry, block of ROW_BLOCK channels) grid. The caller keeps the
    window inside the buffers (p0 + W <= the hidden's positions; no check on the device, as torch's gather on a GPU).
    `lens_B`: int64 [B] (unit stride, not p0_B's memory) lengths set to p0 by the same launch.
    pdl: programmatic dependent launch (`_triton.pdl_kwargs`; `FastPathOptions.glue_pdl_at`'s value)."""
    require(tokens_BS, "draft_window")
    if not window_takes(tokens_BS, hidden_BSD, n_B, p0_B) or W < 1 or K < 0:
        raise ValueError(f"draft_window: takes int64 tokens [B, S], lengths and window starts [B] (unit strides), "
                         f"hidden [B, S, D] (unit last stride) on one device, W >= 1, K >= 0; got tokens "
                         f"{tokens_BS.dtype} {list(tokens_BS.shape)}, n {n_B.dtype} {list(n_B.shape)}, p0 "
                         f"{p0_B.dtype} {list(p0_B.shape)}, hidden {list(hidden_BSD.shape)} {hidden_BSD.stride()}, "
                         f"W {W}, K {K}")
    B = tokens_BS.shape[0]
    if lens_B is not None and not (lens_B.shape == (B,) and lens_B.stride(0) == 1 and lens_B.dtype == torch.long
                                   and lens_B.device == tokens_BS.device and lens_B.data_ptr() != p0_B.data_ptr()):
        raise ValueError(f"draft_window: lens_B must be int64 [{B}] with a unit stride on {tokens_BS.device}, apart "
                         f"from p0_B; got {lens_B.dtype} {list(lens_B.shape)} {lens_B.stride()} on {lens_B.device}")
    return _launch(tokens_BS, hidden_BSD, n_B, p0_B, lens_B, W, K, False, pdl)


def _launch(tokens_BS, hidden_BSD, n_B, p0_B, lens_B, W: int, K: int, tree: bool, pdl: int):
    """`_draft_window_kernel` over a (window entry, block of ROW_BLOCK channels) grid, the wrappers' inputs checked:
    (tok_BW, hid_BWD, out_idx_B, at_BK1, last_B); the tree's mode takes its start from n_B (P0_OFF = 1 + W, p0_B
    not read), writes no slots (K = 0) and sets lens_B (the cache's lengths) to it."""
    B, S = tokens_BS.shape
    D = hidden_BSD.shape[2]
    dev = tokens_BS.device
    tok = torch.empty(B, W, dtype=torch.long, device=dev)
    hid = torch.empty(B, W, D, dtype=hidden_BSD.dtype, device=dev)
    out_idx = torch.empty(B, dtype=torch.long, device=dev)
    at = torch.empty(B, K + 1, dtype=torch.long, device=dev)
    last = torch.empty(B, dtype=torch.long, device=dev)
    if B:
        launch = pdl_kwargs(pdl, tokens_BS)
        _draft_window_kernel[(B * W, max(triton.cdiv(D, ROW_BLOCK), 1))](
            tokens_BS, hidden_BSD, n_B, p0_B, tok, hid, out_idx, at, last, n_B if lens_B is None else lens_B, W, K, S,
            D, 1 + W if tree else 0, tokens_BS.stride(0), hidden_BSD.stride(0), hidden_BSD.stride(1), BLOCK=ROW_BLOCK,
            BLOCK_K=max(2, triton.next_power_of_2(K + 1)), TREE=tree, HAS_LENS=lens_B is not None,
            PDL=pdl_mode(pdl, launch), num_warps=4, **launch)
    return tok, hid, out_idx, at, last


def tree_window_ref(tokens_BS: torch.Tensor, hidden_BSD: torch.Tensor, n_B: torch.Tensor, seq_lens_B: torch.Tensor,
                    W: int):
    """(tok_BW, hid_BWD, out_idx_B, root_B1): an eagle tree's window (`TreeProposer._window_inputs`, module 0's torch
    ops): its start p0 = max(n - 1 - W, 0) (the W positions ending at n - 2) written into seq_lens_B (the module's cache
    rolled back to it), `draft_window_ref`'s tokens, hidden rows and logits row over it, and the root token x_{n-1}."""
    p0_B = (n_B - (1 + W)).clamp_min(0)
    seq_lens_B.copy_(p0_B)
    tok, hid, out_idx_B, _, _ = draft_window_ref(tokens_BS, hidden_BSD, n_B, p0_B, W, 0)
    return tok, hid, out_idx_B, tokens_BS.gather(1, (n_B - 1).unsqueeze(1))


def tree_window(tokens_BS: torch.Tensor, hidden_BSD: torch.Tensor, n_B: torch.Tensor, seq_lens_B: torch.Tensor, W: int,
                pdl: int = 0):
    """`tree_window_ref` in one launch of `draft_window`'s kernel (its TREE mode: the start from the lengths, the
    cache's lengths and the root token written by each row's first program), where the torch ops were 12 (the start's
    sub and clamp, the lengths' copy, the positions' add, the tokens' add, clamp and gather, the hidden rows' gather,
    the logits row's sub and clamp, the root's sub and gather). seq_lens_B: int64 [B], unit stride; the caller keeps
    the window inside the buffers, as `draft_window`'s."""
    require(tokens_BS, "tree_window")
    if not window_takes(tokens_BS, hidden_BSD, n_B, seq_lens_B) or W < 1:
        raise ValueError(f"tree_window: takes int64 tokens [B, S], lengths and cache lengths [B] (unit strides), "
                         f"hidden [B, S, D] (unit last stride) on one device, W >= 1; got tokens {tokens_BS.dtype} "
                         f"{list(tokens_BS.shape)}, n {n_B.dtype} {list(n_B.shape)}, seq_lens {seq_lens_B.dtype} "
                         f"{list(seq_lens_B.shape)}, hidden {list(hidden_BSD.shape)} {hidden_BSD.stride()}, W {W}")
    tok, hid, out_idx, _, root = _launch(tokens_BS, hidden_BSD, n_B, n_B, seq_lens_B, W, 0, True, pdl)
    return tok, hid, out_idx, root.unsqueeze(1)
