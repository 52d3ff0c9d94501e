"""The process groups of a multi-rank run, and the control plane that keeps one rank's error from hanging the rest.

Two groups per run:
- the data group (NCCL on GPUs, gloo on CPU) carries the model's collectives (`Comm`), inside captured graphs too;
- the control group (always gloo, CPU) carries what rank 0 tells the others (commands, inputs: `broadcast`) and
  the agreement after every phase that can fail (`phase`): each rank contributes its error or None, every rank
  gets every rank's outcome, and all of them raise the same `RankFailure` (the first failing rank's message) or
  none does. A rank's error therefore becomes every rank's clean exit instead of a wait inside a collective.

What the agreement cannot catch -- a rank dying or failing *inside* a data collective, where its peers wait on
the GPU -- ends the run instead of stalling it: workers leave the process on such an error (`mtp.distributed.worker`),
the local driver watches its workers and aborts the data group when one dies (`mtp.distributed.driver`), torchrun
stops every rank when one exits non-zero, and the data group has a timeout (`MTP_COLLECTIVE_TIMEOUT_S`, default
180 s) so even a lost peer nobody watches is an error.

Teardown (`RankGroup.close`): every rank synchronizes its device, drops the CUDA graphs it keeps (they hold NCCL
kernels), meets the others on the control group, then *aborts* the NCCL communicator instead of destroying it.
`ncclCommDestroy` after a graph capture of NCCL collectives blocks (pytorch/pytorch#115388: the destroy waits
on work the captured graphs registered) -- the teardown hang the NCCL tests showed on 2 x H200. By then every
rank has passed the barrier with an idle stream, so nothing is in flight and the abort loses nothing.
"""

from __future__ import annotations

import datetime
import gc
import os
import traceback
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..parallel.comm import Comm, init_process_group

TIMEOUT_ENV = "MTP_COLLECTIVE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 180.0
# The control group waits for rank 0's next command as long as a person may sit at a chat prompt; a dead peer
# still ends the wait at once (gloo sees its sockets close).
CONTROL_TIMEOUT = datetime.timedelta(days=7)


class RankFailure(RuntimeError):
    """A rank failed a phase; raised on every rank, naming the (first) failing rank, the phase and its error."""

    def __init__(self, rank: int | None, phase: str, message: str, exit_code: int = 1):
        who = f"rank {rank}" if rank is not None else "a rank"  # None: a peer left, which one unknown (torchrun)
        super().__init__(f"{who} failed during {phase}: {message}")
        self.rank, self.phase, self.message, self.exit_code = rank, phase, message, exit_code


def describe(e: BaseException) -> str:
    """One line for an exception, as a person reads it: its type and message, and where a bare one came from."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, KeyboardInterrupt):
        return "interrupted (Ctrl-C)"
    if msg:
        return f"{type(e).__name__}: {msg}"
    tb = traceback.extract_tb(e.__traceback__)
    where = f" at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else ""
    return f"{type(e).__name__}{where}"


def collective_timeout() -> datetime.timedelta:
    raw = os.environ.get(TIMEOUT_ENV, "")
    try:
        secs = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is invalid: expected seconds (a number > 0)") from None
    if not secs > 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is invalid: expected seconds (a number > 0)")
    return datetime.timedelta(seconds=secs)


@dataclass
class RankGroup:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    comm: Comm  # the data group's collectives
    ctl: dist.ProcessGroup  # the control group (gloo)
    closed: bool = False

    def broadcast(self, obj=None):
        """Rank 0's `obj` on every rank (the others pass nothing)."""
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.ctl)
        return box[0]

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank (the control group: small picklable values)."""
        every: list = [None] * self.world
        dist.all_gather_object(every, obj, group=self.ctl)
        return every

    def agree(self, phase: str, error: BaseException | None, exit_code: int = 1) -> None:
        """Every rank's outcome of `phase` on every rank; raises RankFailure (the lowest failing rank) if any failed."""
        mine = None if error is None else (describe(error), getattr(error, "exit_code", exit_code))
        every: list = [None] * self.world
        dist.all_gather_object(every, mine, group=self.ctl)
        for r, outcome in enumerate(every):
            if outcome is not None:
                raise RankFailure(r, phase, outcome[0], outcome[1]) from error

    @contextmanager
    def phase(self, name: str, exit_code: int = 1):
        """Run the body on every rank, then agree: all ranks leave normally, or all raise the same RankFailure.
        The body must not run data collectives that a failing rank could leave half-done (loading, checks)."""
        try:
            yield
        except (Exception, KeyboardInterrupt) as e:
            self.agree(name, e, exit_code)
            raise  # unreachable: agree raised
        self.agree(name, None)

    def close(self) -> None:
        """Leave the groups with every rank (module doc): idle device, graphs freed, barrier, abort, destroy."""
        if not self.closed:
            self.closed = True
            leave(self.device, self.ctl)

    def abandon(self) -> None:
        """Leave the groups after a peer failed: no barrier (it may never come), the communicator aborted first (a
        collective still waiting on the dead peer then ends), graphs freed, groups destroyed locally."""
        if not self.closed:
            self.closed = True
            leave(self.device, self.ctl, peers=False)


def leave(device: torch.device, ctl: dist.ProcessGroup | None = None, peers: bool = True) -> None:
    """This rank's exit from the default group. With its peers (`peers`): an idle device, every captured graph freed,
    a barrier (on `ctl`, or the default group), then the NCCL communicator aborted rather than destroyed and the groups
    destroyed. Without them: abort first, then free and destroy."""
    from ..decode.keep import release

    try:
        if peers:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            release()  # kept engines and every captured graph (NCCL kernels inside) go before the communicator
            gc.collect()
            dist.barrier(group=ctl)
        else:
            abort_data_group()
            release()
    finally:
        if peers:
            abort_data_group()
        if dist.is_initialized():
            dist.destroy_process_group()


def abort_data_group() -> None:
    """Abort the NCCL communicators of the default group (a local call: it never waits for peers); a collective
    blocked in another thread then fails instead of waiting. No-op for gloo and when no group exists."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "nccl":
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        abort()


def init_group(device_type: str, *, rank: int | None = None, world: int | None = None,
               local_rank: int | None = None, store: dist.Store | None = None) -> RankGroup:
    """Join the run described by the environment (torchrun's, or `mtp.distributed.driver`'s for local ranks):
    RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; or through `store` (the driver's rendezvous).
    device_type 'cuda': NCCL, one GPU per local rank."""
    env = os.environ
    try:
        rank = int(env["RANK"]) if rank is None else rank
        world = int(env["WORLD_SIZE"]) if world is None else world
        local_rank = int(env.get("LOCAL_RANK", rank)) if local_rank is None else local_rank
        if store is None:
            env["MASTER_ADDR"], env["MASTER_PORT"]  # noqa: B018  (named in the error below when missing)
    except KeyError as e:
        raise RuntimeError(f"a multi-rank run needs the environment variable {e.args[0]} (set by torchrun or by "
                           "runtime.tp=N's own launcher)") from None
    timeout = collective_timeout()
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"rank {rank}: local rank {local_rank} needs GPU {local_rank}, but "
                               f"{torch.cuda.device_count()} are visible")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        init_process_group("nccl", rank=rank, world_size=world, timeout=timeout, device_id=device, store=store)
    else:
        device = torch.device("cpu")
        init_process_group("gloo", rank=rank, world_size=world, timeout=timeout, store=store)
    ctl = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return RankGroup(rank, world, local_rank, device, Comm(), ctl)
