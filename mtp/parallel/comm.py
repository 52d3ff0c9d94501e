"""The two collectives the parallel model needs, over a torch.distributed group (NCCL on GPUs, gloo on CPU).

Both are issued with static shapes, into fresh or caller-given buffers, with no host-side reads of tensor
values (no .item(), no size exchange): a CUDA-graph capture of a step records them as plain NCCL kernels on
the capturing stream (see DESIGN.md, "CUDA graphs under NCCL"). Every rank issues the same collectives in the
same order because every rank runs the same Python path; nothing here depends on data.

World size 1 needs no process group: every call is the identity, so the parallel modules also run in a
plain single process (and equal the reference model there).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch >= 2.13 renames all_gather_into_tensor to all_gather_single (same semantics); keep both working.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def init_process_group(backend: str, **kwargs) -> None:
    """`torch.distributed.init_process_group`, safe to tear down. Every process group of the project is made here.

    `torch.distributed.nn.functional` evaluates `group=group.WORLD` as default arguments of ten functions when
    it is first imported. Imported after the default group exists (torch imports it with `torch._dynamo`, which
    the first meta-device float op or `torch.compile` pulls in: building a parallel model on the meta device
    does), it holds ten references to that group for the life of the process, so `destroy_process_group`
    cannot free it: gloo's worker threads then outlive it, and at interpreter exit a worker still dropping the
    last collective's tensors needs the GIL and is killed inside a destructor -- `terminate called without an
    active exception`, SIGABRT (seen: 2 runs in 11 of the torchrun test). Importing the module first makes
    those defaults None."""
    import torch.distributed.nn.functional  # noqa: F401  (see above: before the group exists)

    dist.init_process_group(backend, **kwargs)


class Comm:
    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        else:
            self.world, self.rank = 1, 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (t must be contiguous); returns t. All ranks get bit-identical results."""
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's t [..., n] along the last dim, in rank order -> [..., world * n]."""
        if self.world == 1:
            return t
        t = t.contiguous()
        out = torch.empty((self.world * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        _all_gather(out, t, group=self.group)  # concatenated along dim 0: the form gloo and NCCL both take
        return out.view(self.world, *t.shape).movedim(0, -2).flatten(-2)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world={self.world})"


class CountingComm(Comm):
    """`Comm` that counts the collectives it issues and their payload bytes (input bytes per rank), and logs
    each call's (kind, shape, dtype). Host-side: it sees eager calls only (a CUDA-graph replay runs no Python),
    so count one eager step, then capture. `reset()` before the step to count."""

    def __init__(self, group=None):
        super().__init__(group)
        self.reset()

    def reset(self) -> None:
        self.counts = {"all_reduce": 0, "all_gather": 0, "all_reduce_bytes": 0, "all_gather_bytes": 0}
        self.calls: list[tuple[str, tuple[int, ...], str]] = []

    def _note(self, kind: str, t: torch.Tensor) -> None:
        self.counts[kind] += 1
        self.counts[f"{kind}_bytes"] += t.numel() * t.element_size()
        self.calls.append((kind, tuple(t.shape), str(t.dtype).replace("torch.", "")))

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self._note("all_reduce", t)
        return super().all_reduce(t)

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        self._note("all_gather", t)
        return super().all_gather_last(t)
