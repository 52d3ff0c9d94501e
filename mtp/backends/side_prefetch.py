"""The fast path's side-stream L2 prefetch (switch `FastPathOptions.l2_prefetch`): which weights a decode layer asks
L2 for, where, and the stream it asks on. The kernel and the prediction with its arithmetic: `kernels.l2_prefetch`.

A decode layer's small kernels (kv prologue, q absorb, mla stages, absorb, norms, combine) move little data, so HBM
idles while they run and the next GEMV pays its whole DRAM ramp. Per layer of the trunk (`fast_path.FastTrunk`,
`FastBlock`), for decode / verify blocks (the absorbed attention, at most SMALL_M rows), the main stream forks to
the trunk's side stream (`SidePrefetch`: one per trunk and device, created once) and launches there:
- the tail (switch `l2_prefetch_tail`): this layer's o_proj weight + scales, the router's gate and the shared
  expert's weights (its slot of the stacked experts, or its own gate | up and down where it runs apart); at the
  layer's start, or with `l2_prefetch_tail_late` right after the q_b GEMV, where only latency-bound kernels run
  until o_proj; not a dense MLP's weights (50 MB at TP=8: the size of L2);
- the head (switch `l2_prefetch_next`): the next layer's q_a | wk | kv_a and q_b (| wq_b where its indexer scores)
  weights + scales (and the indexer's weights_proj then), at the start of this layer's MoE / MLP half.
The main stream never waits for the side stream but once, at the end of the trunk's forward (`join`), so a CUDA
graph capture that forked joins again (torch captures fork / join through events) and no allocation outlives a
stream that reads it: the side stream reads only weights and allocates nothing. The prefetch is a hint: the
kernels' results are bit for bit those without it (tests/backends/test_side_prefetch_gpu.py holds eager and
replayed steps to it).
"""

from __future__ import annotations

import torch

from ..kernels._triton import interpreting
from ..kernels.l2_prefetch import l2_prefetch
from ..model.moe import MoE

PROJS = ("gate_proj", "up_proj", "down_proj")


def _fp8_weights(*linears) -> list[torch.Tensor]:
    """Each FP8 linear's weight and block scales (others: none)."""
    return [t for lin in linears if lin is not None and getattr(lin, "is_fp8", False)
            for t in (lin.weight, lin.weight_scale_inv)]


def shared_weights(moe: MoE, tokens: int) -> list[torch.Tensor]:
    """The shared expert's weights + scales a MoE of `tokens` tokens reads: its slot of the stacked experts where the
    expert kernels run it (`FastMoE.shared_in_stack`), else its gate | up stack and down_proj."""
    stacked = getattr(moe, "stacked", None)
    if stacked is not None and moe.shared_in_stack(tokens):
        s = moe.shared_index
        return [stacked[f"{p}.{a}"][s] for p in PROJS for a in ("weight", "weight_scale_inv")]
    se = getattr(moe, "shared_experts", None)
    fused = getattr(se, "fused_gate_up", None)
    if se is None or fused is None:
        return []
    return [*fused, *_fp8_weights(se.down_proj)]


def tail_weights(block, tokens: int) -> list[torch.Tensor]:
    """A fast block's tail, what it reads after its attention's small kernels: o_proj's weight + scales and, for a
    MoE, the router's gate and the shared expert (`shared_weights`). A dense MLP adds nothing (at TP=8 its gate |
    up and down are ~50 MB, all of L2)."""
    out = _fp8_weights(getattr(block.self_attn, "o_proj", None))
    if isinstance(block.mlp, MoE):
        out.append(block.mlp.gate.weight)
        out += shared_weights(block.mlp, tokens)
    return out


def head_weights(block, S: int) -> list[torch.Tensor]:
    """A fast block's head, its attention's input projections at S keys: q_a | wk | kv_a, q_b's rows and, where the
    indexer scores (its top-k < S), wq_b's and the head weights' (`mla_forward_fast` reads no more); none for None
    (the trunk's last block has no next)."""
    if block is None:
        return []
    attn = block.self_attn
    ix = attn.indexer
    score = ix.topk < S
    fused_a, fused_qb = getattr(attn, "fused_a", None), getattr(attn, "fused_qb", None)
    out = list(fused_a) if fused_a is not None else _fp8_weights(attn.q_a_proj, ix.wk, attn.kv_a_proj_with_mqa)
    if fused_qb is not None and score:
        out += fused_qb
    else:  # q_b's rows alone (of the stack, where there is one), and wq_b apart where it scores
        out += _fp8_weights(attn.q_b_proj, ix.wq_b if score else None)
    if score:
        out.append(ix.weights_proj.weight)
    return out


class SidePrefetch:
    """A trunk's side stream on one device and the prefetches of a forward (`ask`), joined once at its end (`join`).
    `opts`: the model's switches, read at each point."""

    def __init__(self, device: torch.device, opts) -> None:
        self.device = device
        self.opts = opts
        self.stream: torch.cuda.Stream | None = None
        self.forked = False

    def ask(self, tensors: list[torch.Tensor]) -> None:
        """Fork: the side stream waits for what the main stream has queued so far, then asks L2 for `tensors`."""
        if not tensors:
            return
        main = torch.cuda.current_stream(self.device)
        for _ in range(64):  # torch hands streams out of a pool: never the caller's own (a capture's, a warm-up's)
            if self.stream is not None and self.stream != main:
                break
            self.stream = torch.cuda.Stream(self.device)
        self.stream.wait_stream(main)
        o = self.opts
        with torch.cuda.stream(self.stream):
            l2_prefetch(tensors, programs=o.l2_prefetch_programs, evict_last=o.l2_evict_last, bulk=o.l2_bulk)
        self.forked = True

    def at_start(self, block, tokens: int) -> None:
        """A block's start: its tail (switch `l2_prefetch_tail`, unless `l2_prefetch_tail_late`)."""
        if self.opts.l2_prefetch_tail and not self.opts.l2_prefetch_tail_late:
            self.ask(tail_weights(block, tokens))

    def after_qb(self, block, tokens: int) -> None:
        """Right after a block's q_b GEMV (its attention's small kernels follow): its tail with
        `l2_prefetch_tail_late`."""
        if self.opts.l2_prefetch_tail and self.opts.l2_prefetch_tail_late:
            self.ask(tail_weights(block, tokens))

    def at_ffn(self, next_block, S: int) -> None:
        """A block's MoE / MLP half starts: the next block's head (switch `l2_prefetch_next`)."""
        if self.opts.l2_prefetch_next:
            self.ask(head_weights(next_block, S))

    def join(self) -> None:
        """The main stream waits for the side stream's prefetches of this forward (once, at its end)."""
        if self.forked:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self.forked = False


def side_prefetch(trunk, opts, h: torch.Tensor) -> SidePrefetch | None:
    """The trunk's `SidePrefetch` for a forward on h's device (created once and kept on the trunk), or None: switch
    `l2_prefetch` off or neither point on, h not on a CUDA device, or kernels interpreted (no streams on the CPU)."""
    if opts is None or not opts.l2_prefetch or not (opts.l2_prefetch_tail or opts.l2_prefetch_next):
        return None
    if not h.is_cuda or interpreting():
        return None
    sp = trunk.__dict__.get("side_prefetch")
    if sp is None or sp.device != h.device:
        sp = SidePrefetch(h.device, opts)
        trunk.side_prefetch = sp
    sp.opts = opts
    return sp
