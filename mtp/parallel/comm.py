"""The two collectives the parallel model needs, over a torch.distributed group (NCCL on GPUs, gloo on CPU).

Both are issued with static shapes, into fresh or caller-given buffers, with no host-side reads of tensor
values (no .item(), no size exchange): a CUDA-graph capture of a step records them as plain NCCL kernels on
the capturing stream (see DESIGN.md, "CUDA graphs under NCCL"). Every rank issues the same collectives in the
same order because every rank runs the same Python path; nothing here depends on data.

World size 1 needs no process group: every call is the identity, so the parallel modules also run in a
plain single process (and equal the reference model there).

A third, `all_gather_rows`, runs at build time only (a draft vocabulary's head rows gathered from the ranks that
hold them); its shapes come from values every rank holds (the ids), so every rank still issues the same calls.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from ..model.fp8 import BLOCK, act_quant
from ..model.layers import rms_norm

# torch >= 2.13 renames all_gather_into_tensor to all_gather_single (same semantics); keep both working.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def init_process_group(backend: str, **kwargs) -> None:
    """`torch.distributed.init_process_group`, safe to tear down. Every process group of the project is made here.

    `torch.distributed.nn.functional` evaluates `group=group.WORLD` as default arguments of ten functions when
    it is first imported. Imported after the default group exists (torch imports it with `torch._dynamo`, which
    `torch.compile` pulls in, and so does any op torch runs through its Python references, such as `normal_`
    or `arange` on the meta device; the model builders avoid those), it holds ten references to that group for the life of the process, so `destroy_process_group`
    cannot free it: gloo's worker threads then outlive it, and at interpreter exit a worker still dropping the
    last collective's tensors needs the GIL and is killed inside a destructor -- `terminate called without an
    active exception`, SIGABRT (seen: 2 runs in 11 of the torchrun test). Importing the module first makes
    those defaults None."""
    import torch.distributed.nn.functional  # noqa: F401  (see above: before the group exists)

    dist.init_process_group(backend, **kwargs)


ALLREDUCE_IMPLS = ("nccl", "oneshot")  # runtime.allreduce: the group's all-reduce ('oneshot': mtp.parallel.oneshot)
_ONESHOT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class AddNorm(NamedTuple):
    """`Comm.all_reduce_add_norm`'s result: normed = RMSNorm(residual) in out_dtype (None for the add alone),
    residual the new residual stream, (x8, sx) normed's FP8 quant per 128 channels (None unless asked)."""

    normed: torch.Tensor | None
    residual: torch.Tensor
    x8: torch.Tensor | None = None
    sx: torch.Tensor | None = None


class Comm:
    # class defaults, so that stand-ins which skip __init__ (one simulated rank, tests) take the NCCL path
    allreduce = "nccl"
    oneshot = None  # mtp.parallel.oneshot.OneShot, the symmetric buffers, while allreduce == 'oneshot'

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        else:
            self.world, self.rank = 1, 0
        self.allreduce = "nccl"
        self.oneshot = None  # mtp.parallel.oneshot.OneShot, the symmetric buffers, while allreduce == 'oneshot'

    def set_allreduce(self, impl: str, device: torch.device | str | None = None) -> None:
        """Switch this group's all-reduce: 'nccl' (torch.distributed: NCCL on GPUs, gloo on CPU) or 'oneshot'
        (peer memory over NVLink, `mtp.parallel.oneshot`; CUDA ranks over NCCL with peer access only). A
        collective when switching to 'oneshot' (the rendezvous of the symmetric buffers): every rank calls it."""
        if impl not in ALLREDUCE_IMPLS:
            raise ValueError(f"allreduce must be one of {list(ALLREDUCE_IMPLS)}, got {impl!r}")
        if impl == self.allreduce:
            return
        if impl == "nccl":
            self.allreduce, self.oneshot = "nccl", None
            return
        from .oneshot import OneShot, peer_access_problem

        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        problem = peer_access_problem(self.group, device)
        if problem is not None:
            raise ValueError(f"allreduce='oneshot' cannot run here: {problem}; use allreduce='nccl'")
        self.oneshot = OneShot(self.group, device)
        self.allreduce = "oneshot"

    def _oneshot_fits(self, t: torch.Tensor, rows: int | None = None) -> bool:
        """The one-shot kernel takes this message in `rows` programs (None: an unfused all-reduce's chunks). The
        same answer on every rank: it reads shapes and dtypes only."""
        return (self.oneshot is not None and t.is_cuda and t.dtype in _ONESHOT_DTYPES and t.is_contiguous()
                and self.oneshot.fits(t, rows))

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (t must be contiguous); returns t. All ranks get bit-identical results.
        allreduce='oneshot': the one-shot kernel for messages that fit its buffers (fp32 accumulation, rank
        order), NCCL for the others (prefill)."""
        if self.world > 1:
            if self._oneshot_fits(t):
                return self.oneshot.all_reduce(t)
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def fuses(self, x_partial: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether `all_reduce_add_norm(x_partial, residual, ...)` runs as the one-shot kernel (else the formulas
        after `all_reduce`). The same answer on every rank: it reads shapes, dtypes and the option only."""
        D = residual.shape[-1]
        rows = residual.numel() // D if D else 0
        return (self.world > 1 and residual.dtype == torch.float32 and residual.is_contiguous()
                and self._oneshot_fits(x_partial, rows))

    def all_reduce_add_norm(self, x_partial: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor | None,
                            eps: float, out_dtype: torch.dtype | None = None, round_dtype: torch.dtype | None = None,
                            quant: bool = False) -> AddNorm:
        """The all-reduce after a row-parallel projection with the decoder block's residual add + RMSNorm:
        residual' = residual + sum_ranks(x_partial).to(round_dtype).to(residual.dtype) (no rounding when
        round_dtype is None), normed = RMSNorm(residual') in out_dtype (default: the weight's dtype; skipped
        when norm_weight is None), (x8, sx) = act_quant(normed) when quant. x_partial may be overwritten.
        allreduce='nccl': exactly these formulas after `all_reduce` (any backend). 'oneshot': one kernel when
        the message fits (fp32 residual, D % 128 == 0 to quantize), else the same formulas."""
        D = residual.shape[-1]
        if x_partial.shape != residual.shape:
            raise ValueError(f"all_reduce_add_norm: x_partial {list(x_partial.shape)} must match the residual "
                             f"{list(residual.shape)}")
        if norm_weight is not None and tuple(norm_weight.shape) != (D,):
            raise ValueError(f"all_reduce_add_norm: norm_weight must be [{D}], got {list(norm_weight.shape)}")
        if quant and (norm_weight is None or D % BLOCK):
            raise ValueError(f"all_reduce_add_norm: quant needs a norm and D % {BLOCK} == 0, got D = {D}")
        out_dtype = out_dtype or (norm_weight.dtype if norm_weight is not None else residual.dtype)
        if self.fuses(x_partial, residual):
            return AddNorm(*self.oneshot.add_norm(x_partial, residual, norm_weight, eps, out_dtype, round_dtype,
                                                  quant))
        s = self.all_reduce(x_partial.contiguous())
        if round_dtype is not None:
            s = s.to(round_dtype)
        h = residual + s.to(residual.dtype)
        if norm_weight is None:
            return AddNorm(None, h)
        y = rms_norm(h, norm_weight, eps, out_dtype)
        return AddNorm(y, h, *(act_quant(y) if quant else (None, None)))

    def all_gather_last(self, t: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Concatenate every rank's t [..., n] along the last dim, in rank order -> [..., world * n], in `out_dtype`
        (default t's). The ranks' blocks travel in t's dtype; laying them side by side (a copy past one row of
        n) and the cast are then one launch, where the copy and a cast after it were two (the MTP module's eh_proj
        and the heads' logits to fp32 on the fast path: `backends.fast_path.FastColumnParallelLinear`), the same
        values."""
        dtype = out_dtype or t.dtype
        if self.world == 1:
            return t.to(dtype)
        t = t.contiguous()
        out = torch.empty((self.world * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        _all_gather(out, t, group=self.group)  # concatenated along dim 0: the form gloo and NCCL both take
        blocks = out.view(self.world, *t.shape).movedim(0, -2)
        if dtype == t.dtype:
            return blocks.flatten(-2)  # a view where the blocks already lie side by side (one row), else a copy
        y = torch.empty((*t.shape[:-1], self.world * t.shape[-1]), dtype=dtype, device=t.device)
        y.view(blocks.shape).copy_(blocks)
        return y

    def all_gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's t [rows, ...] along dim 0, in rank order -> [world * rows, ...]. For copies made
        once at build time (a draft vocabulary's head rows, `mtp.draft.vocab.SubHead`), not for a step: the output
        starts as `world` copies of t, so a group that moves no data (torch's fake group, `parallel.simulate`) leaves
        finite values, each rank's part equal to this rank's, where an empty buffer would hold whatever was there."""
        if self.world == 1:
            return t
        t = t.contiguous()
        out = t.repeat(self.world, *(1,) * (t.dim() - 1))
        _all_gather(out, t, group=self.group)
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world={self.world})"


class CountingComm(Comm):
    """`Comm` that counts the collectives it issues and their payload bytes (input bytes per rank), and logs
    each call's (kind, shape, dtype). Host-side: it sees eager calls only (a CUDA-graph replay runs no Python),
    so count one eager step, then capture. `reset()` before the step to count. An all-reduce fused with its add
    + norm (the one-shot kernel of `all_reduce_add_norm`) counts as an all-reduce, and in `all_reduce_fused`. The
    build-time `all_gather_rows` counts apart (`all_gather_rows`), not as a step's all-gather."""

    def __init__(self, group=None):
        super().__init__(group)
        self.reset()

    def reset(self) -> None:
        self.counts = {"all_reduce": 0, "all_gather": 0, "all_reduce_bytes": 0, "all_gather_bytes": 0,
                       "all_reduce_fused": 0, "all_gather_rows": 0, "all_gather_rows_bytes": 0}
        self.calls: list[tuple[str, tuple[int, ...], str]] = []

    def all_reduce_add_norm(self, x_partial: torch.Tensor, residual: torch.Tensor, *args, **kwargs) -> AddNorm:
        if self.fuses(x_partial, residual):  # else the formulas call `all_reduce`, which counts itself
            self._note("all_reduce", x_partial)
            self.counts["all_reduce_fused"] += 1
        return super().all_reduce_add_norm(x_partial, residual, *args, **kwargs)

    def _note(self, kind: str, t: torch.Tensor) -> None:
        self.counts[kind] += 1
        self.counts[f"{kind}_bytes"] += t.numel() * t.element_size()
        self.calls.append((kind, tuple(t.shape), str(t.dtype).replace("torch.", "")))

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self._note("all_reduce", t)
        return super().all_reduce(t)

    def all_gather_last(self, t: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        self._note("all_gather", t)
        return super().all_gather_last(t, out_dtype)

    def all_gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        self._note("all_gather_rows", t)
        return super().all_gather_rows(t)
