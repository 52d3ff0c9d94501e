"""The persistent experts' gate / up, down and combine in ONE launch (`moe.moe_experts(layout='persistent',
one_launch=True)`, switch `FastPathOptions.moe_one_launch`).

Shape legend: `mtp.kernels.moe` (T tokens, D hidden, I expert width, J routed slots, TOPK = J (+ 1 for the implicit
shared slot), P = T * TOPK pairs, n_act <= P distinct experts computed, NB = I / 128 gate / up N-blocks, NBD = D / 128
output blocks, KS_GU / KS_DOWN K slices).

Why: the three launches of the persistent layout (gate / up, down, combine) each pay a ramp (launch gap, DRAM ramp,
~3-5 us in a CUDA graph), and down starts only when the slowest gate / up item has ended. Here ~one program per SM
runs its gate / up items (exactly `moe._moe_gate_up_persistent`'s: `moe_tiles._gate_up_item`), then its down items
(`moe_tiles._down_item`), and the last down item of each output block to arrive sums that block in the combine's
order (`moe_tiles._combine_sum`) and writes y. The slices are the three-launch path's (`moe_experts` computes the
same `splits`, 'waves' included, from the same grid sizes), every partial is summed in the same order, so y is
bit-identical to it (tests/kernels/test_moe_one_launch.py; on the GPU test_moe_one_launch_gpu.py).

Readiness, counters (int32, from `fp8_gemm._counters`, each left at 0 by its last user, so CUDA-graph replays and
other MoE layers' calls in the same graph find them armed):
- gu_cnt [n_act * NB]: the gate / up slice arrivals of (a, nb), as in the three-launch kernel; its last slice writes
  h of (a, nb), then (CTA barrier: every thread's stores issued) bumps ready[a] with release semantics;
- ready [n_act]: a down item of expert a spins on an acquire load (an atomic add of 0) until ready[a] == NB, i.e.
  every gate / up N-block of a (all of the K groups it reads) is written; it then reads h past L1 (.cg);
- comb [NBD]: arrivals of down items at output block nb (after their partial's store and a CTA barrier, acq_rel);
  the n_act * KS_DOWN-th sums the block's partials (.cg) and writes y, then re-arms comb[nb] and adds one to done;
- done [1]: combined blocks; the NBD-th (acq_rel: every down item has passed its wait by then) re-arms ready and done.
With no expert at all (every slot -1, no shared slot) nobody arrives: each program writes its share of y's blocks.

Why the spin cannot deadlock: the grid is at most one program per SM (`one_launch_grid`: min(SMs, work items); a
kernel that does not fit an SM fails its launch whole), so once the kernels before it in the stream have finished,
every program is resident at once; a program waits only in its down phase, only for gate / up items, and gate / up
items never wait, so every awaited item runs to its end. A PDL successor cannot take the SMs of programs not yet
started: dependents launch only after every program of this grid has executed `launch_dependents`, which each does
first thing, i.e. after all of them are resident. (Its PDL predecessor may still hold SMs when this grid starts; it
waits on nothing of this kernel and frees them when it ends.)
Under the Triton interpreter (CPU tests) programs run one after another, so a spin on a later program's item would
never end: there the grid is ONE program, whose gate / up items all precede its down items (every wait is already
satisfied), and which is every block's last arrival; the many-program grid runs on the GPU only.

Prediction (one TP=8 'split' rank of DeepSeek-V3.2, H200; three launches 31.1 / 56.5 / 62.6 / 77.0 us at 1..4 tokens
plus combine 2.4-3.4 us): per call it saves the down and combine launches' ramps (~3-5 us for down, whose weights
stream at the same rate either way; the combine's 2.4-3.4 us, which shrinks to 56 block sums of T x 9 x 128 fp32 each
at the tail) and overlaps down with gate / up's tail (at 1 token gate / up is one round of 126 items of 8 K groups on
132 SMs, so ~1/4 of its ~20 us is the ramp and the slowest item's tail; the 6 idle programs and each expert's down
items start as soon as that expert's 14 items are in). Expected: ~33.5 -> ~26-28 us at 1 token (-5 to -7), and the
same ~5-7 us absolute at 2..4 tokens (56.5 / 62.6 / 77.0 + ~3 -> ~53 / ~59 / ~73), where gate / up dominates (2 slices,
several rounds) and only the two ramps and the combine go; x 58 MoE layers: ~0.3-0.4 ms a step. What could eat it:
the spin's acquire loads (one per down item, ~4 a program) and a down item waiting for a late gate / up item of its
expert, which at 1 token is the same wait the kernel boundary imposed, but per expert.
"""

from __future__ import annotations

import torch

from mtp.kernels._triton import interpreting, pdl_launch, pdl_wait, tl, triton
from mtp.kernels.fp8_gemm import _counters
from mtp.kernels.moe_tiles import _combine_sum, _down_item, _gate_up_item, _leader_pairs, _shared_prefetch

__all__ = ["one_launch_grid", "experts_one_launch"]


@triton.jit
def _write_block(part_ptr, idx_ptr, add_ptr, y_ptr, nb, T, D, KS: tl.constexpr, TOPK: tl.constexpr,
                 J: tl.constexpr, BM: tl.constexpr, ADD: tl.constexpr):
    """y[:, nb * 128 + (0..127)] for every token: the combine's sum (`_combine_sum`), the partials read past L1."""
    t = tl.arange(0, BM)[:, None]
    offs = nb * 128 + tl.arange(0, 128)[None, :]
    tmask = t < T
    mask = tmask & (offs < D)
    acc = _combine_sum(part_ptr, idx_ptr, add_ptr, t, tmask, offs, mask, D, T * TOPK, KS, TOPK, J, ADD, ".cg")
    tl.store(y_ptr + t.to(tl.int64) * D + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _moe_one_launch_kernel(x_ptr, idx_ptr, rw_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, w2_ptr, s2_ptr, h8_ptr, hs_ptr,
                           gu_part_ptr, part_ptr, add_ptr, y_ptr, gu_cnt_ptr, ready_ptr, comb_ptr, done_ptr,
                           T, D, I, stride_xm, stride_w1e, stride_s1e, stride_s1n, stride_w2e, stride_s2e, stride_s2n,
                           KS_GU, S, KS_DOWN: tl.constexpr, TOPK: tl.constexpr, J: tl.constexpr, BM: tl.constexpr,
                           PPAD: tl.constexpr, KPAD: tl.constexpr, ADD: tl.constexpr, PDL: tl.constexpr,
                           PREFETCH: tl.constexpr):
    pdl_launch(PDL)  # first: see the module docstring for why a dependent cannot starve this grid
    _shared_prefetch(w1_ptr, S, stride_w1e, I * D, TOPK, J, PDL, PREFETCH)
    _shared_prefetch(w3_ptr, S, stride_w1e, I * D, TOPK, J, PDL, PREFETCH)
    _shared_prefetch(w2_ptr, S, stride_w2e, D * I, TOPK, J, PDL, PREFETCH)
    pdl_wait(PDL)  # the router's ids and weights, x, add; the counters, re-armed by their last user
    q, lead, rank, n_act = _leader_pairs(idx_ptr, T * TOPK, S, TOPK, J, PPAD)
    NB = I // 128
    NBD = tl.cdiv(D, 128)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for w in range(pid, n_act * NB * KS_GU, nprog):
        a, wrote = _gate_up_item(w, q, lead, rank, x_ptr, idx_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, h8_ptr, hs_ptr,
                                 gu_part_ptr, gu_cnt_ptr, T, D, I, stride_xm, stride_w1e, stride_s1e, stride_s1n,
                                 KS_GU, S, TOPK, J, BM, PPAD, KPAD)
        if wrote:  # h of (a, nb) is out: every thread's stores issued, then one release add
            tl.debug_barrier()
            tl.atomic_add(ready_ptr + a, 1, sem="release", scope="gpu")
    for w in range(pid, n_act * NBD * KS_DOWN, nprog):
        a = w // (NBD * KS_DOWN)
        while tl.atomic_add(ready_ptr + a, 0, sem="acquire", scope="gpu") < NB:  # every N-block of a's h written
            pass
        nb = _down_item(w, q, lead, rank, h8_ptr, hs_ptr, idx_ptr, rw_ptr, w2_ptr, s2_ptr, part_ptr, T, D, I,
                        stride_w2e, stride_s2e, stride_s2n, KS_DOWN, S, TOPK, J, BM, PPAD, KPAD, ".cg")
        tl.debug_barrier()
        if tl.atomic_add(comb_ptr + nb, 1, sem="acq_rel", scope="gpu") == n_act * KS_DOWN - 1:
            _write_block(part_ptr, idx_ptr, add_ptr, y_ptr, nb, T, D, KS_DOWN, TOPK, J, BM, ADD)
            tl.atomic_xchg(comb_ptr + nb, 0, sem="relaxed", scope="gpu")
            if tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu") == NBD - 1:  # every down item is past its wait
                tl.atomic_xchg(ready_ptr + q, 0, mask=q < n_act, sem="relaxed", scope="gpu")
                tl.atomic_xchg(done_ptr, 0, sem="relaxed", scope="gpu")
    if n_act == 0:  # no expert, so no arrival: y is add (or 0), each program its share of the blocks
        for nb in range(pid, NBD, nprog):
            _write_block(part_ptr, idx_ptr, add_ptr, y_ptr, nb, T, D, KS_DOWN, TOPK, J, BM, ADD)


def one_launch_grid(P: int, E: int, D: int, I: int, splits: tuple[int, int], sms: int,
                    programs: int | None = None) -> int:
    """Programs of the one-launch kernel: `programs` (default: the SM count) but never more than the work items of
    its longer phase (for min(P, E) distinct experts, the bound the kernel is sized for), at least 1; ONE under the
    Triton interpreter (its programs run one after another: module docstring). More programs than SMs are refused:
    the kernel spins, so all of its programs must be resident at once."""
    if programs is not None and not 1 <= programs <= sms:
        raise ValueError(f"moe_experts(one_launch=True): programs must be in [1, {sms}] (the SMs: the kernel spins, "
                         f"all of its programs must be resident at once), got {programs}")
    if interpreting():
        return 1
    n = min(P, E)
    items = max(n * (I // 128) * splits[0], n * triton.cdiv(D, 128) * splits[1])
    return max(1, min(programs or sms, items))


def experts_one_launch(x: torch.Tensor, idx: torch.Tensor, rw: torch.Tensor, ws: tuple, h8: torch.Tensor,
                       hs: torch.Tensor, add: torch.Tensor | None, out_dtype: torch.dtype, splits: tuple[int, int],
                       grid: int, S: int, TOPK: int, J: int, stages: int, launch: dict, prefetch: bool) -> torch.Tensor:
    """y [T, D] of the persistent layout in one launch (`moe.moe_experts(one_launch=True)`, which checks the
    arguments and sizes `splits` and `grid`): ws the six expert tensors (gate, its scales, up, its scales, down, its
    scales), h8 / hs the [P, I] fp8 h and its scales, launch `pdl_kwargs`'s options."""
    w1, s1, w3, s3, w2, s2 = ws
    T, D = x.shape
    E, I = w1.shape[0], w1.shape[1]
    P = T * TOPK
    n = min(P, E)
    NB, NBD = I // 128, triton.cdiv(D, 128)
    ks_gu, ks_down = splits
    dev = x.device
    gu_part = torch.empty(n * NB * ks_gu * 2 * 128 * T, dtype=torch.float32, device=dev)
    part = torch.empty(ks_down, P, D, dtype=torch.float32, device=dev)
    y = torch.empty(T, D, dtype=out_dtype, device=dev)
    cnt = _counters(dev, n * NB + n + NBD + 1)
    gu_cnt, ready, comb, done = cnt[:n * NB], cnt[n * NB:n * NB + n], cnt[n * NB + n:-1], cnt[-1:]
    _moe_one_launch_kernel[(grid,)](
        x, idx, rw, w1, s1, w3, s3, w2, s2, h8, hs, gu_part, part, y if add is None else add, y, gu_cnt, ready, comb,
        done, T, D, I, x.stride(0), w1.stride(0), s1.stride(0), s1.stride(1), w2.stride(0), s2.stride(0),
        s2.stride(1), ks_gu, S, KS_DOWN=ks_down, TOPK=TOPK, J=J, BM=max(16, triton.next_power_of_2(T)),
        PPAD=triton.next_power_of_2(P), KPAD=triton.next_power_of_2(TOPK), ADD=add is not None, PDL=bool(launch),
        PREFETCH=bool(launch) and prefetch, num_stages=stages, num_warps=4, **launch)
    return y
