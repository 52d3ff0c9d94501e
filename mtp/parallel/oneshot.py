"""One-shot all-reduce over NVLink peer memory (torch symmetric memory + one Triton kernel), optionally fused
with the residual add + RMSNorm (+ FP8 quant) that follows it in a decoder block.

Shape legend: M rows (tokens), D channels, W ranks, P programs, G groups of 128 channels per program (a row is
ceil(D / 128 / G) programs fused; the unfused all-reduce cuts the flat message into G * 128-element rows).

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

Programs per row. One program pulls W - 1 peers' parts of its elements; the time of a call follows the bytes per
program, not the message (4 x H100, session 9: 2048 elements per program, bf16 ~9 us, fp32 ~16 us; 28 such
programs no slower than 4), so a row is cut into chunks of G groups, one program each. The RMSNorm needs the sum
of squares of the whole row: each program stores its chunk's part in `ss[p]`, the row's programs meet at a
local barrier (a counter and a generation per row, sense-reversing: the last to arrive resets the counter and
bumps the generation; the others spin on the generation they read before arriving), then every program sums
the row's parts in chunk order 0..C-1 (the same order on every rank: bit-identical norms) and normalizes its
own chunk. The row's programs must be resident together; a call has at most `MAX_PROGRAMS` small programs.

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

MAX_PROGRAMS = 256  # programs (flag rows) per call: 256 x 8 ranks x 4 B of flags; 18 fused rows of 7168
# measured on 2 x H100 (BENCHMARKS.md, session 10; `mtp.bench.allreduce --programs`): fp32, w = 1 / 2 / 4 rows of 7168
# fused with add + norm + quant: one program a row 9.9 / 10.1 / 10.4 us, 4 groups per program (14 a row, ld.cg)
# 7.9 / 8.3 / 8.0; unfused: 2048 elements per program 8.5 / 8.7 / 9.3, 1024 6.6-6.7 / 6.8 / 7.3
CHUNK = 1024  # elements per program of an unfused all-reduce (OneShot.ar_chunk): 7168 channels -> 7 programs
ROW_GROUPS = 4  # groups of 128 channels per program of a fused row (OneShot.row_groups): 7168 -> 14 programs
DEFAULT_SLOT_BYTES = 2 << 20  # per slot: 73 rows of 7168 fp32 channels
PEER_LOADS = ("volatile", "cg")  # how a program reads its peers' data: ld.volatile, or ld.global.cg (L2, not L1)
PEER_LOAD = "cg"  # after the flags' acquire, a cached-in-L2-only load sees the peer's data (the GPU tests check it)
DEFAULT_PROGRAMS = dict(ar_chunk=CHUNK, row_groups=ROW_GROUPS, peer_load=PEER_LOAD)  # `OneShot.set_programs`

_ROUND = {None: -1, torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
MODES = {"all_reduce": 0, "add": 1, "add_norm": 2}


@triton.jit
def _oneshot_kernel(x_ptr, out_ptr, h_ptr, hout_ptr, w_ptr, y_ptr, x8_ptr, sx_ptr,
                    buf_ptrs, flag_ptrs, epoch_ptr, cnt_ptr, gen_ptr, ss_ptr, rank, n, D, slot_elems, eps,
                    W: tl.constexpr, WP: tl.constexpr, G: tl.constexpr, C: tl.constexpr, CP: tl.constexpr,
                    MODE: tl.constexpr, ROUND: tl.constexpr, QUANT: tl.constexpr, PEER_CG: tl.constexpr):
    pid = tl.program_id(0)
    row = pid // C  # program pid: chunk pid % C of row pid // C
    g = (pid % C) * G + tl.arange(0, G)  # this program's groups of 128 channels
    k = tl.arange(0, 128)
    col = g[:, None] * 128 + k[None, :]  # [G, 128]: the chunk viewed as its 128-groups (the quant's groups)
    offs = row.to(tl.int64) * D + col
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
    acc = tl.zeros([G, 128], tl.float32)
    for i in tl.static_range(W):  # rank order on every rank: bit-identical sums
        peer = tl.multiple_of(tl.load(buf_ptrs + i).to(tl.pointer_type(dt)), 16)
        if PEER_CG:
            acc += tl.load(peer + base, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        else:
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
            part = tl.sum(tl.sum(h * h, axis=1), axis=0)
            if C == 1:
                ms = part / D
            else:  # the row's C programs meet (module docstring), then each sums the parts in chunk order
                tl.store(ss_ptr + pid, part)
                gen0 = tl.atomic_add(gen_ptr + row, 0, sem="acquire", scope="gpu")  # before arriving
                tl.debug_barrier()  # the part's store and the generation read come before the arrival
                old = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu")
                if old == C - 1:  # the last to arrive: reset the counter, then release the others
                    tl.atomic_xchg(cnt_ptr + row, 0, sem="relaxed", scope="gpu")
                    tl.atomic_add(gen_ptr + row, 1, sem="release", scope="gpu")
                else:
                    cur = gen0
                    while cur == gen0:
                        cur = tl.atomic_add(gen_ptr + row, 0, sem="acquire", scope="gpu")
                tl.debug_barrier()
                j = tl.arange(0, CP)
                parts = tl.load(ss_ptr + row * C + j, mask=j < C, other=0.0, volatile=True)
                ms = tl.sum(parts, axis=0) / D
            wt = tl.load(w_ptr + col, mask=col < D, other=0.0).to(tl.float32)
            y = (h * tl.math.rsqrt(ms + eps) * wt).to(y_ptr.dtype.element_ty)
            tl.store(y_ptr + offs, y, mask=mask)
            if QUANT:
                yf = y.to(tl.float32)
                s, inv = ue8m0_scale(tl.max(tl.abs(yf), axis=1))
                tl.store(x8_ptr + offs, quant_e4m3(yf, inv[:, None]), mask=mask)
                tl.store(sx_ptr + row.to(tl.int64) * (D // 128) + g, s, mask=g * 128 < D)


def row_split(D: int, row_groups: int, rows: int = 1) -> tuple[int, int]:
    """(G, C) for `rows` fused rows of D channels: G groups of 128 per program, `row_groups` or more where rows x C
    would pass MAX_PROGRAMS (every program of a call must be resident at once: they wait for each other), never
    more than a row needs; C programs per row (the last one masked past D)."""
    groups = triton.cdiv(D, BLOCK)
    whole = triton.next_power_of_2(groups)
    G = min(row_groups, whole)
    while G < whole and rows * triton.cdiv(groups, G) > MAX_PROGRAMS:
        G *= 2
    return G, triton.cdiv(groups, G)


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
        # a fused row's local barrier (counter, generation) and its programs' parts of the sum of squares
        self.row_count = torch.zeros(MAX_PROGRAMS, dtype=torch.int32, device=self.device)
        self.row_gen = torch.zeros(MAX_PROGRAMS, dtype=torch.int32, device=self.device)
        self.row_ss = torch.zeros(MAX_PROGRAMS, dtype=torch.float32, device=self.device)
        # programs per call (module docstring); every rank must use the same values (the programs pair up)
        self.ar_chunk, self.row_groups, self.peer_load = CHUNK, ROW_GROUPS, PEER_LOAD  # = DEFAULT_PROGRAMS
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

    def set_programs(self, ar_chunk: int | None = None, row_groups: int | None = None,
                     peer_load: str | None = None) -> None:
        """How calls are cut into programs: `ar_chunk` elements per program of an unfused all-reduce (a multiple
        of 128), `row_groups` groups of 128 channels per program of a fused row (a power of 2), `peer_load` one
        of PEER_LOADS. Set the same on every rank of the group."""
        if ar_chunk is not None and (ar_chunk < 128 or ar_chunk % 128 or ar_chunk & (ar_chunk - 1)):
            raise ValueError(f"OneShot: ar_chunk must be a power of 2 >= 128 elements, got {ar_chunk}")
        if row_groups is not None and (row_groups < 1 or row_groups & (row_groups - 1)):
            raise ValueError(f"OneShot: row_groups must be a power of 2 >= 1, got {row_groups}")
        if peer_load is not None and peer_load not in PEER_LOADS:
            raise ValueError(f"OneShot: peer_load must be one of {PEER_LOADS}, got {peer_load!r}")
        self.ar_chunk = ar_chunk or self.ar_chunk
        self.row_groups = row_groups or self.row_groups
        self.peer_load = peer_load or self.peer_load


    def fits(self, t: torch.Tensor, rows: int | None = None) -> bool:
        """Whether a message of t's size as `rows` rows of t.shape[-1] channels (None: the unfused all-reduce's
        `ar_chunk`-element rows) fits the slots and the flags (else the caller uses NCCL)."""
        programs = (triton.cdiv(t.numel(), self.ar_chunk) if rows is None
                    else rows * row_split(t.shape[-1], self.row_groups, rows)[1])
        return t.numel() * t.element_size() <= self.slot_bytes and 0 < programs <= MAX_PROGRAMS

    def _launch(self, x2, out, h, hout, w, y, x8, sx, D: int, eps: float, mode: str, round_dtype, quant: bool):
        rows = triton.cdiv(x2.numel(), D)
        G, C = (D // BLOCK, 1) if mode == "all_reduce" else row_split(D, self.row_groups, rows)  # unfused: 1 a row
        _oneshot_kernel[(rows * C,)](
            x2, out, h, hout, w, y, x8, sx, self.buf_ptrs, self.flag_ptrs, self.epoch, self.row_count,
            self.row_gen, self.row_ss, self.rank, x2.numel(), D, self.slot_bytes // x2.element_size(), eps,
            W=self.world, WP=triton.next_power_of_2(self.world), G=G, C=C, CP=triton.next_power_of_2(C),
            MODE=MODES[mode], ROUND=_ROUND[round_dtype], QUANT=quant, PEER_CG=self.peer_load == "cg",
            num_warps=16 if G >= 32 else 4)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks into t (contiguous, fp32 / bf16 / fp16, fits); returns t. fp32 accumulation."""
        x = t.view(-1)
        self._launch(x, x, x, x, x, x, x, x, self.ar_chunk, 0.0, "all_reduce", None, False)
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
