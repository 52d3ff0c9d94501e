"""One-shot all-reduce over NVLink peer memory (torch symmetric memory + one Triton kernel), optionally fused
with the residual add + RMSNorm (+ FP8 quant) that follows it in a decoder block.

Shape legend: M rows (tokens), D channels, W ranks, P programs (one per row; C-element chunks when unfused).

Why: the decode step's all-reduces carry 14-114 KB (w = 1..4 rows of 7168 channels, bf16 or fp32) and NCCL's
ring spends 12-20 us on each (BENCHMARKS.md, graph-captured), far above what NVLink needs to move them. Here
every rank writes its partial into its own symmetric buffer, signals every peer, waits for every peer's
signal and then reads all W partials straight from the peers' memory: one kernel, one NVLink round trip.

The barrier, per program p (all ranks launch the same grid, so program p of every rank owns the same rows):
- epoch: a local int32 counter per program, read and bumped by the program itself, so it lives on the device
  and a CUDA-graph replay advances it (a host counter would be frozen into the graph). Every rank issues the
  same calls in the same order, so program p's epoch e is the same number on every rank.
- data: slot e % 2 of two slots. A rank writes slot s of call e + 2 only after call e + 1's barrier, which
  its peers pass only after their call e (an earlier kernel on their stream) has finished reading slot s;
  so no second barrier at the end of the kernel is needed (torch's one-shot kernel has one).
- flags: flag[p, src] in each rank's symmetric flag buffer holds the latest epoch src has signalled for
  program p. Program p stores e into flag[p, rank] of every peer (release, system scope, after a CTA barrier
  so every thread's data store is ordered before it) and spins until its own flag[p, q] >= e for every q
  (acquire). Values only grow, so a fast rank that signals e + 1 before a slow one has seen e does no harm.
Partials are summed in fp32 in rank order 0..W-1 (not own-first), so every rank gets bit-identical results,
as the parallel model needs (identical routing and top-k on every rank; DESIGN.md).

Limits: messages up to `slot_bytes` and `MAX_PROGRAMS` programs per call; `Comm` sends larger ones (prefill)
through NCCL. NVLink multicast is not used (multicast stays off on these machines).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from ..kernels._triton import tl, triton
from ..kernels.act_quant import quant_e4m3, ue8m0_scale
from ..model.fp8 import BLOCK, FP8_DTYPE

MAX_PROGRAMS = 256  # programs (flag rows) per call: 256 x 8 ranks x 4 B of flags
CHUNK = 2048  # elements per program of an unfused all-reduce: 7168 channels -> 4 programs
DEFAULT_SLOT_BYTES = 2 << 20  # per slot: 73 rows of 7168 fp32 channels

_ROUND = {None: -1, torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
MODES = {"all_reduce": 0, "add": 1, "add_norm": 2}


@triton.jit
def _oneshot_kernel(x_ptr, out_ptr, h_ptr, hout_ptr, w_ptr, y_ptr, x8_ptr, sx_ptr,
                    buf_ptrs, flag_ptrs, epoch_ptr, rank, n, D, slot_elems, eps,
                    W: tl.constexpr, WP: tl.constexpr, BG: tl.constexpr, MODE: tl.constexpr,
                    ROUND: tl.constexpr, QUANT: tl.constexpr):
    pid = tl.program_id(0)
    g = tl.arange(0, BG)
    k = tl.arange(0, 128)
    col = g[:, None] * 128 + k[None, :]  # [BG, 128]: the row viewed as its 128-groups (the quant's groups)
    offs = pid.to(tl.int64) * D + col
    mask = (col < D) & (offs < n)
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    e = tl.load(epoch_ptr + pid) + 1
    tl.store(epoch_ptr + pid, e)
    base = (e % 2).to(tl.int64) * slot_elems + offs
    own = tl.multiple_of(tl.load(buf_ptrs + rank).to(tl.pointer_type(dt)), 16)  # symmetric buffers: 16-B aligned
    tl.store(own + base, x, mask=mask)
    tl.debug_barrier()  # every thread's store is ordered before the release below
    r = tl.arange(0, WP)
    rm = r < W
    peer_flags = tl.load(flag_ptrs + r, mask=rm, other=0).to(tl.pointer_type(tl.int32))
    tl.atomic_xchg(peer_flags + pid * W + rank, tl.full([WP], 0, tl.int32) + e, mask=rm, sem="release",
                   scope="sys")
    my_flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32))
    done = tl.full([], 0, tl.int32)
    while done == 0:
        seen = tl.atomic_add(my_flags + pid * W + r, tl.zeros([WP], tl.int32), mask=rm, sem="acquire",
                             scope="sys")
        done = (tl.min(tl.where(rm, seen, e), axis=0) >= e).to(tl.int32)
    acc = tl.zeros([BG, 128], tl.float32)
    for i in tl.static_range(W):  # rank order on every rank: bit-identical sums
        peer = tl.multiple_of(tl.load(buf_ptrs + i).to(tl.pointer_type(dt)), 16)
        acc += tl.load(peer + base, mask=mask, other=0.0, volatile=True).to(tl.float32)
    if ROUND == 0:  # the reduced sum rounded to the model dtype, as `.to(x.dtype)` after an all-reduce
        acc = acc.to(tl.bfloat16).to(tl.float32)
    elif ROUND == 1:
        acc = acc.to(tl.float16).to(tl.float32)
    if MODE == 0:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        h = tl.load(h_ptr + offs, mask=mask, other=0.0) + acc  # the residual stream is fp32
        tl.store(hout_ptr + offs, h, mask=mask)
        if MODE == 2:
            ms = tl.sum(tl.sum(h * h, axis=1), axis=0) / D
            wt = tl.load(w_ptr + col, mask=col < D, other=0.0).to(tl.float32)
            y = (h * tl.math.rsqrt(ms + eps) * wt).to(y_ptr.dtype.element_ty)
            tl.store(y_ptr + offs, y, mask=mask)
            if QUANT:
                yf = y.to(tl.float32)
                s, inv = ue8m0_scale(tl.max(tl.abs(yf), axis=1))
                tl.store(x8_ptr + offs, quant_e4m3(yf, inv[:, None]), mask=mask)
                tl.store(sx_ptr + pid.to(tl.int64) * (D // 128) + g, s, mask=g * 128 < D)


class OneShot:
    """The symmetric buffers of one process group: two data slots of `slot_bytes` and the flags, rendezvoused
    once (a collective: every rank of the group builds it, in the same order as its other collectives)."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, slot_bytes: int = DEFAULT_SLOT_BYTES):
        import torch.distributed._symmetric_memory as symm_mem

        if slot_bytes <= 0 or slot_bytes % 16:
            raise ValueError(f"OneShot: slot_bytes must be a positive multiple of 16, got {slot_bytes}")
        self.group = group or dist.group.WORLD
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.device, self.slot_bytes = torch.device(device), slot_bytes
        self.buf = symm_mem.empty(2 * slot_bytes, dtype=torch.uint8, device=self.device)
        self.flags = symm_mem.empty(MAX_PROGRAMS * self.world, dtype=torch.int32, device=self.device)
        self.flags.zero_()
        self.epoch = torch.zeros(MAX_PROGRAMS, dtype=torch.int32, device=self.device)
        name = self.group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # older torch needs it; newer deprecates it (not needed)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(name)
        self._handles = (symm_mem.rendezvous(self.buf, name), symm_mem.rendezvous(self.flags, name))
        hb, hf = self._handles
        self.buf_ptrs = torch.tensor(list(hb.buffer_ptrs), dtype=torch.int64, device=self.device)
        self.flag_ptrs = torch.tensor(list(hf.buffer_ptrs), dtype=torch.int64, device=self.device)
        torch.cuda.synchronize(self.device)  # zeroed flags on every rank before any peer signals
        dist.barrier(group=self.group)

    def fits(self, t: torch.Tensor, rows: int | None = None) -> bool:
        """Whether a message of t's size in `rows` programs (None: `CHUNK`-element chunks, the unfused
        all-reduce) fits the slots and flags (else the caller uses NCCL)."""
        rows = triton.cdiv(t.numel(), CHUNK) if rows is None else rows
        return t.numel() * t.element_size() <= self.slot_bytes and 0 < rows <= MAX_PROGRAMS

    def _launch(self, x2, out, h, hout, w, y, x8, sx, D: int, eps: float, mode: str, round_dtype, quant: bool):
        rows = triton.cdiv(x2.numel(), D)
        bg = triton.next_power_of_2(triton.cdiv(D, BLOCK))
        _oneshot_kernel[(rows,)](
            x2, out, h, hout, w, y, x8, sx, self.buf_ptrs, self.flag_ptrs, self.epoch, self.rank, x2.numel(), D,
            self.slot_bytes // x2.element_size(), eps, W=self.world, WP=triton.next_power_of_2(self.world),
            BG=bg, MODE=MODES[mode], ROUND=_ROUND[round_dtype], QUANT=quant, num_warps=16 if bg >= 32 else 4)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks into t (contiguous, fp32 / bf16 / fp16, fits); returns t. fp32 accumulation."""
        x = t.view(-1)
        self._launch(x, x, x, x, x, x, x, x, CHUNK, 0.0, "all_reduce", None, False)
        return t

    def add_norm(self, x_partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
                 out_dtype: torch.dtype, round_dtype: torch.dtype | None, quant: bool):
        """(normed, new_residual, x8, sx): new_residual = residual + sum_ranks(x_partial) (rounded to round_dtype
        first when given); normed = RMSNorm(new_residual) in out_dtype (None when weight is None: the add only);
        x8, sx its FP8 quant per 128 channels (None unless quant)."""
        D = residual.shape[-1]
        x2, h2 = x_partial.reshape(-1, D), residual.reshape(-1, D)
        M = h2.shape[0]
        hout = torch.empty_like(h2)
        norm = weight is not None
        y = torch.empty(M, D, dtype=out_dtype, device=h2.device) if norm else h2
        x8 = torch.empty(M, D, dtype=FP8_DTYPE, device=h2.device) if quant else h2
        sx = torch.empty(M, D // BLOCK, dtype=torch.float32, device=h2.device) if quant else h2
        if M:
            self._launch(x2, x2, h2, hout, weight if norm else h2, y, x8, sx, D, eps,
                         "add_norm" if norm else "add", round_dtype, quant)
        lead = residual.shape[:-1]
        return (y.view(*lead, D) if norm else None, hout.view(*lead, D),
                x8.view(*lead, D) if quant else None, sx.view(*lead, D // BLOCK) if quant else None)


def peer_access_problem(group: dist.ProcessGroup | None, device: torch.device) -> str | None:
    """Why the one-shot path cannot run on this group and device, or None. The same answer on every rank
    (each rank's verdict is all-reduced), so no rank goes on to the rendezvous alone."""
    if not dist.is_available() or not dist.is_initialized():
        return "no process group (world size 1 needs no all-reduce)"
    world = dist.get_world_size(group)
    if world < 2:
        return "world size 1 needs no all-reduce"
    backend = dist.get_backend(group)
    if backend != "nccl":
        return f"the process group's backend is {backend!r}; peer memory needs CUDA ranks over 'nccl'"
    device = torch.device(device)
    if device.type != "cuda":
        return f"the model is on {device}; peer memory needs CUDA"
    here = torch.cuda.current_device() if device.index is None else device.index
    local = [i for i in range(torch.cuda.device_count()) if i != here]
    bad = [i for i in local if not torch.cuda.can_device_access_peer(here, i)]
    ok = torch.tensor([0 if bad else 1], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if ok.item() == 0:  # setup only, not a hot path: every rank must agree before the rendezvous
        mine = f"cuda:{here} cannot access {['cuda:%d' % i for i in bad]}" if bad else "a peer rank reported it"
        return f"GPUs without peer access ({mine})"
    return None
