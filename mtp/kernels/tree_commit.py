"""A tree step's glue after the commit kernel in one launch (Triton): the kept path's cache compaction, its target
hidden rows and the tree's counters.

Reference: `mtp.model.cache.KVCache.compact` and `mtp.decode.tree_step.keep_path`, plain PyTorch
(tests/kernels/test_tree_commit.py holds this kernel to them, tensor for tensor). Shape legend: L layers, B rows,
S cache slots (the target cache's and the decode buffers' length), A = D + 1 nodes on a path (root first), D the
tree's depth, C sibling ranks, N tree nodes, H hidden width, X a cache buffer's channels.

Why: after `step_commit.chain_commit` a tree step ran ~37 torch launches (`python -m mtp.bench.step_launches --tree
2x1x1`, session 22): the compaction (aranges, adds, an index and an index_put per cache buffer, the lengths' copy:
16), the path's hidden rows (positions, clamp, gathers, where, scatter) and the counters (compare, and, index,
scatter_add; and, sum, add), each ~1-3 us of GPU in a TP=8 rank's step graph. All of it is copies and integer sums:
one grid does it, bit for bit.

It runs after the commit kernel, which has advanced n by keep: the path's root sat at slot base = n - keep - 1 (the
`n - 1` the step read before the commit) and row b's node i at base + i. Programs (one launch, one 1-D grid):
- (layer, row), L x B of them: every cache buffer of the layer (kv, kv_scale, pe, idx_k, idx_k_scale, moved as
  integers of their element size: FP8 as bytes, no float arithmetic touches a bit) moves slot base + path[b, i] to
  base + i for every i < A, kept or not, as `compact` does: all A source slots are loaded before any is stored (a
  later node's source can be an earlier node's destination); a program owns its (layer, row) alone.
- (row, block of H channels), B x cdiv(H, BLOCK_H): hidden[b, min(n0 + i, S_h - 1) - 1] = h[b, path[b, i]] where i <
  keep (n0 = n - keep, the row's length before the commit; S_h the hidden buffer's length; `keep_path`'s positions,
  clamped as `commit` clamps: the kept ones never reach the buffer's end).
- one more: the counters, row after row in registers (no atomics): rank_DC[d, rank[path[b, d + 1]]] += 1 where d <
  accepted[b] and the row was active; live_nodes += the row's live nodes if active; and the cache's lengths = base +
  keep (= n - 1, what the commit kernel wrote: `compact`'s last write, kept so that this kernel is `compact` whole).
PDL (`_triton.pdl_launch` / `pdl_wait`, switches pdl and glue_pdl): every input is an earlier kernel's (the forward's
cache entries and hidden states, the verdict, the commit kernel's n and keep), so each program waits first thing.
"""

from __future__ import annotations

import torch

from mtp.kernels._triton import (HAS_TRITON, interpreting, pdl_kwargs, pdl_launch, pdl_mode, pdl_wait, require, tl,
                                 triton)

__all__ = ["tree_commit", "tree_commit_takes", "MAX_A", "MAX_WIDTH", "MAX_RANK_CELLS", "MAX_NODES"]

MAX_A = 64  # path nodes a program holds ([A, X] tiles)
MAX_WIDTH = 4096  # a cache buffer's channels in one tile (the real model's widest: 512)
MAX_RANK_CELLS = 4096  # depth x ranks of the counters' tile
MAX_NODES = 1024  # a row's live mask in one load
HIDDEN_BLOCK = 1024  # hidden channels per program (the real 7168: 7 programs a row)

# an integer view of each element size: the bits move, never a float
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _slot_ptrs(ptr, row, src, dst, ok, W: tl.constexpr, BLOCK: tl.constexpr):
    """[A, BLOCK] pointers of the source and destination slots' channels (row: the (layer, row)'s first slot), mask."""
    c = tl.arange(0, BLOCK)[None, :]
    m = ok[:, None] & (c < W)
    return ptr + (row + src)[:, None] * W + c, ptr + (row + dst)[:, None] * W + c, m


@triton.jit
def _tree_commit_kernel(kv_ptr, kvs_ptr, pe_ptr, ik_ptr, iks_ptr, lens_ptr, n_ptr, keep_ptr, path_ptr,
                        hid_ptr, h_ptr, act_ptr, acc_ptr, rank_ptr, rdc_ptr, live_ptr, lnodes_ptr,
                        L, B, A, S, SH, H, D, C, N, HB, stride_path, stride_hid_b, stride_hid_s, stride_h_b, stride_h_n,
                        stride_live,
                        KV_W: tl.constexpr, KVS_W: tl.constexpr, PE_W: tl.constexpr, IK_W: tl.constexpr,
                        BLOCK_A: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_KVS: tl.constexpr,
                        BLOCK_PE: tl.constexpr, BLOCK_IK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    pdl_launch(PDL)
    pdl_wait(PDL)  # the cache entries, hidden states, verdict and the commit's n / keep are earlier kernels'
    pid = tl.program_id(0)
    i = tl.arange(0, BLOCK_A)
    ma = i < A
    if pid < L * B:  # the compaction of one (layer, row): `KVCache.compact`
        b = pid % B
        n = tl.load(n_ptr + b)
        base = n - tl.load(keep_ptr + b) - 1
        src = base + tl.load(path_ptr + b * stride_path + i, mask=ma, other=0)
        dst = base + i
        ok = ma & (src >= 0) & (src < S) & (dst < S)  # in range on every step (its room); never a stray address
        row = pid.to(tl.int64) * S  # buffers [L, B, S, X], contiguous: (layer, row) = pid
        kv_s, kv_d, kv_m = _slot_ptrs(kv_ptr, row, src, dst, ok, KV_W, BLOCK_KV)
        kvs_s, kvs_d, kvs_m = _slot_ptrs(kvs_ptr, row, src, dst, ok, KVS_W, BLOCK_KVS)
        pe_s, pe_d, pe_m = _slot_ptrs(pe_ptr, row, src, dst, ok, PE_W, BLOCK_PE)
        ik_s, ik_d, ik_m = _slot_ptrs(ik_ptr, row, src, dst, ok, IK_W, BLOCK_IK)
        # every source slot of every buffer loaded before any store (the five loads in flight together)
        x_kv = tl.load(kv_s, mask=kv_m)
        x_kvs = tl.load(kvs_s, mask=kvs_m)
        x_pe = tl.load(pe_s, mask=pe_m)
        x_ik = tl.load(ik_s, mask=ik_m)
        x_iks = tl.load(iks_ptr + row + src, mask=ok)
        tl.store(kv_d, x_kv, mask=kv_m)
        tl.store(kvs_d, x_kvs, mask=kvs_m)
        tl.store(pe_d, x_pe, mask=pe_m)
        tl.store(ik_d, x_ik, mask=ik_m)
        tl.store(iks_ptr + row + dst, x_iks, mask=ok)
    elif pid < L * B + B * HB:  # the path's target hidden rows (`keep_path`)
        q = pid - L * B
        b = q // HB
        c = (q % HB) * BLOCK_H + tl.arange(0, BLOCK_H)[None, :]
        n = tl.load(n_ptr + b)
        keep = tl.load(keep_ptr + b)
        pos = tl.minimum(n - keep + i, SH - 1) - 1
        kept = (ma & (i < keep))[:, None] & (c < H)
        node = tl.load(path_ptr + b * stride_path + i, mask=ma, other=0)
        b64 = b.to(tl.int64)
        x = tl.load(h_ptr + b64 * stride_h_b + node[:, None] * stride_h_n + c, mask=kept)
        tl.store(hid_ptr + b64 * stride_hid_b + pos[:, None].to(tl.int64) * stride_hid_s + c, x, mask=kept)
    else:  # the counters and the cache's lengths, every row in this one program
        d = tl.arange(0, BLOCK_D)
        md = d < D
        r = tl.arange(0, BLOCK_C)[None, :]
        j = tl.arange(0, BLOCK_N)
        cnt = tl.zeros([BLOCK_D, BLOCK_C], dtype=tl.int64)
        live = tl.sum(tl.zeros([BLOCK_N], dtype=tl.int64), axis=0)
        for b in range(B):
            on = tl.load(act_ptr + b).to(tl.int64)  # 1: the row was active when the step began
            hit = md & (d < tl.load(acc_ptr + b)) & (on != 0)
            node = tl.load(path_ptr + b * stride_path + 1 + d, mask=md, other=0)
            rank = tl.load(rank_ptr + node, mask=md, other=-1)
            cnt += ((rank[:, None] == r) & hit[:, None]).to(tl.int64)
            lv = tl.load(live_ptr + b * stride_live + j, mask=j < N, other=0)
            live += tl.sum((lv != 0).to(tl.int64), axis=0) * on
            tl.store(lens_ptr + b, tl.load(n_ptr + b) - 1)
        cells = rdc_ptr + d[:, None] * C + r
        mc = md[:, None] & (r < C)
        tl.store(cells, tl.load(cells, mask=mc, other=0) + cnt, mask=mc)
        tl.store(lnodes_ptr, tl.load(lnodes_ptr) + live)


def _ints(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bits as integers of its element size (a view)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def tree_commit_takes(cache, hidden_BSD: torch.Tensor, h_BND: torch.Tensor, path_BA: torch.Tensor,
                      rank_DC: torch.Tensor, live_BN: torch.Tensor) -> bool:
    """Whether `tree_commit` takes a step of these shapes: triton on a CUDA device (or its interpreter); the cache's
    buffers contiguous with at most MAX_WIDTH channels each; hidden and h of one dtype, unit last strides; a path of
    D + 1 <= MAX_A int64 nodes; the counters' D x C <= MAX_RANK_CELLS; at most MAX_NODES tree nodes."""
    if not HAS_TRITON or not (hidden_BSD.is_cuda or interpreting()):
        return False
    bufs = (cache.kv, cache.kv_scale, cache.pe, cache.idx_k, cache.idx_k_scale)
    D, C = rank_DC.shape
    return (all(t.is_contiguous() and t.element_size() in _INT_OF_SIZE for t in bufs)
            and max(t.shape[-1] for t in bufs[:4]) <= MAX_WIDTH and h_BND.dtype == hidden_BSD.dtype
            and hidden_BSD.stride(-1) == 1 and h_BND.stride(-1) == 1 and path_BA.dtype == torch.long
            and path_BA.shape[1] == D + 1 <= MAX_A and D * C <= MAX_RANK_CELLS and live_BN.shape[1] <= MAX_NODES
            and live_BN.stride(1) == 1 and rank_DC.is_contiguous())


def tree_commit(cache, n_B: torch.Tensor, keep_B: torch.Tensor, path_BA: torch.Tensor, hidden_BSD: torch.Tensor,
                h_BND: torch.Tensor, active_B: torch.Tensor, accepted_B: torch.Tensor, rank_N: torch.Tensor,
                rank_DC: torch.Tensor, live_BN: torch.Tensor, live_nodes: torch.Tensor, pdl: int = 0) -> None:
    """A tree step's glue after its commit in one launch, every output in place: `cache.compact(n - keep - 1, path,
    keep)` (a `KVCache`: its five buffers and seq_lens) and `tree_step.keep_path` (hidden_BSD [B, S, H] rows of the
    path's h_BND [B, N, H] where kept; rank_DC [D, C] and live_nodes 0-d counted). Read: n_B and keep_B (the commit
    kernel's: n already advanced), path_BA [B, D + 1] (root first), active_B bool (rows not finished when the step
    began), accepted_B (the verdict's accept length), rank_N [N], live_BN bool [B, N]. int64 but the bools and the
    float buffers. pdl: programmatic dependent launch (`_triton.pdl_kwargs`; `FastPathOptions.glue_pdl_at`)."""
    require(hidden_BSD, "tree_commit")
    if not tree_commit_takes(cache, hidden_BSD, h_BND, path_BA, rank_DC, live_BN):
        raise ValueError(f"tree_commit: takes contiguous cache buffers of <= {MAX_WIDTH} channels, hidden and h of one "
                         f"dtype with unit last strides, an int64 path of D + 1 <= {MAX_A} nodes, D x C <= "
                         f"{MAX_RANK_CELLS}, <= {MAX_NODES} nodes; got path {path_BA.dtype} {list(path_BA.shape)}, "
                         f"rank_DC {list(rank_DC.shape)}, hidden {hidden_BSD.dtype} h {h_BND.dtype}, live "
                         f"{list(live_BN.shape)}")
    L, B, S = cache.kv.shape[:3]
    A, (D, C), N, H = path_BA.shape[1], rank_DC.shape, live_BN.shape[1], hidden_BSD.shape[-1]
    rows = (n_B, keep_B, active_B, accepted_B, cache.seq_lens)
    if (any(t.shape != (B,) or t.stride(0) != 1 for t in rows) or path_BA.shape[0] != B or path_BA.stride(1) != 1
            or hidden_BSD.shape[0] != B or h_BND.shape[0] != B or h_BND.shape[-1] != H or live_BN.shape[0] != B
            or active_B.dtype != torch.bool or live_BN.dtype != torch.bool or live_nodes.numel() != 1
            or rank_N.shape != (N,) or rank_N.stride(0) != 1
            or any(t.dtype != torch.long
                   for t in (n_B, keep_B, accepted_B, cache.seq_lens, rank_N, rank_DC, live_nodes))):
        raise ValueError(f"tree_commit: rows of {B} (unit stride, active_B bool), path [{B}, A], hidden [{B}, S, H], "
                         f"h [{B}, N, H], live bool [{B}, N], rank_N [N], 0-d live_nodes, int64 but the bools; got "
                         f"rows {[(tuple(t.shape), t.dtype) for t in rows]}, path {list(path_BA.shape)}, hidden "
                         f"{list(hidden_BSD.shape)}, h {list(h_BND.shape)}, live {list(live_BN.shape)} "
                         f"{live_BN.dtype}, rank_N {list(rank_N.shape)}")
    HB = triton.cdiv(H, HIDDEN_BLOCK)
    widths = [cache.kv.shape[-1], cache.kv_scale.shape[-1], cache.pe.shape[-1], cache.idx_k.shape[-1]]
    blocks = [max(2, triton.next_power_of_2(w)) for w in widths]
    launch = pdl_kwargs(pdl, hidden_BSD)
    _tree_commit_kernel[(L * B + B * HB + 1,)](
        _ints(cache.kv), _ints(cache.kv_scale), _ints(cache.pe), _ints(cache.idx_k), _ints(cache.idx_k_scale),
        cache.seq_lens, n_B, keep_B, path_BA, _ints(hidden_BSD), _ints(h_BND), active_B.view(torch.uint8), accepted_B,
        rank_N, rank_DC, live_BN.view(torch.uint8), live_nodes,
        L, B, A, S, hidden_BSD.shape[1], H, D, C, N, HB, path_BA.stride(0), hidden_BSD.stride(0),
        hidden_BSD.stride(1), h_BND.stride(0), h_BND.stride(1), live_BN.stride(0),
        *widths, BLOCK_A=max(2, triton.next_power_of_2(A)), BLOCK_KV=blocks[0], BLOCK_KVS=blocks[1],
        BLOCK_PE=blocks[2], BLOCK_IK=blocks[3], BLOCK_H=min(HIDDEN_BLOCK, max(2, triton.next_power_of_2(H))),
        BLOCK_D=max(2, triton.next_power_of_2(D)), BLOCK_C=max(2, triton.next_power_of_2(C)),
        BLOCK_N=max(2, triton.next_power_of_2(N)), PDL=pdl_mode(pdl, launch), num_warps=4, **launch)
