"""Rank 0 drives a sharded model: it starts (or joins) the ranks, tells them what to load and run, and alone
talks to the person and the files -- the executor / worker pattern of vLLM and SGLang's TP workers.

    peers = start(tp=2, device_type="cuda")           # spawns ranks 1..N-1 here, or joins torchrun's ranks
    model = peers.load(LoadSpec(path, dtype="bfloat16"))
    out = mtp.generate(model, [ids], 64, draft="eagle", k=2)   # every rank runs it; rank 0 gets the result
    peers.close()                                      # also at interpreter exit

The model rank 0 gets back is its own shard with `model.peers` set: `mtp.generate` sees it and sends the call
(prompts and the resolved `GenerationConfig`) to the other ranks before running it locally, so applications
call `mtp.generate` exactly as on one device. An `on_step` callback runs on rank 0; one marked
`mtp.decode.engine.stops` (the chat's) may raise to stop: every step then ends with rank 0's verdict broadcast, so
every rank stops at the same step.

Failure handling (`mtp.distributed.group` explains the layers): loading ends in an agreement, so a rank that fails
to load makes every rank raise the same `RankFailure`. A rank that fails inside a generation leaves its process
(`mtp.distributed.worker`); rank 0 watches the ranks it spawned and, when one exits, aborts the data group so its own
blocked collective returns, then raises that rank's error. An error on rank 0 inside a generation ends the run
(the others may be inside a collective nobody will finish): `close(force=True)` stops them.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from ..placement import AUTO, LAYOUT_CHOICES
from ..spec.options import DEFAULT_LOAD_READER, LOAD_READERS
from .group import TIMEOUT_ENV, RankFailure, RankGroup, abort_data_group, collective_timeout, describe, init_group

ERROR_DIR_ENV = "MTP_RANK_ERROR_DIR"  # where spawned ranks leave their last error (rank{r}.err) and log
ARRIVED = "mtp/arrived/"  # a spawned rank's key in rank 0's rendezvous store


@dataclass(frozen=True)
class LoadSpec:
    """What every rank loads: the checkpoint and the settings of `mtp.parallel.load.load_parallel`."""

    path: str
    dtype: str = "float32"  # a torch dtype name
    numerics: str = "fp8"
    n_mtp: int | None = None
    mlp_split: str = "blocks"
    fast_path: bool = False
    elementwise: str = "triton"  # the fast path's elementwise ops: mtp.kernels.dispatch.ELEMENTWISE_IMPLS
    allreduce: str = "nccl"  # mtp.parallel.comm.ALLREDUCE_IMPLS
    expert_layout: str = AUTO  # mtp.placement ('auto': split where the experts' blocks divide, else contiguous)
    reader: str = DEFAULT_LOAD_READER  # how the shards are read: mtp.spec.options.LOAD_READERS

    def __post_init__(self) -> None:
        from ..kernels.dispatch import ELEMENTWISE_IMPLS

        if self.elementwise not in ELEMENTWISE_IMPLS:
            raise ValueError(f"LoadSpec: elementwise must be one of {ELEMENTWISE_IMPLS}, got {self.elementwise!r}")
        if self.reader not in LOAD_READERS:
            raise ValueError(f"LoadSpec: reader must be one of {list(LOAD_READERS)}, got {self.reader!r}")
        if self.expert_layout not in LAYOUT_CHOICES:
            raise ValueError(f"LoadSpec: expert_layout must be one of {list(LAYOUT_CHOICES)}, got "
                             f"{self.expert_layout!r}")


def progress_wanted() -> bool:
    """Rank 0 draws a load progress bar when its stderr is a terminal, or when MTP_PROGRESS=1 asks for one (logs)."""
    flag = os.environ.get("MTP_PROGRESS")
    return flag == "1" if flag in ("0", "1") else sys.stderr.isatty()


class StopAgreed(Exception):
    """Rank 0's step callback asked to stop; raised on every rank at the same step."""


def disk_read_bytes() -> int | None:
    """Bytes this process has read from storage so far (Linux `/proc/self/io` read_bytes: page-cache hits do not
    count), or None where the kernel does not say."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


@contextmanager
def load_progress(show: bool):
    """A rich progress bar of this rank's checkpoint bytes (rank 0, on stderr), as a `load_parallel` callback."""
    if not show:
        yield None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn,
                               TransferSpeedColumn)

    with Progress(TextColumn("loading rank 0's shard"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True)) as bar:
        task = bar.add_task("load", total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def load_rank(spec: LoadSpec, group: RankGroup, show_progress: bool = False):
    """This rank's shard of `spec` (the same call on every rank); `model.load_stats` says what the load took:
    seconds, checkpoint bytes of this rank's slices, bytes read from storage (None where unknown)."""
    import torch

    from ..parallel.layout import ParallelPlan
    from ..parallel.load import load_parallel

    t0, io0 = time.perf_counter(), disk_read_bytes()
    read = [0]

    def count(done: int, total: int) -> None:
        read[0] = done
        if bar is not None:
            bar(done, total)

    with load_progress(show_progress) as bar:
        model = load_parallel(spec.path, group.comm, plan=ParallelPlan(group.world, spec.mlp_split, spec.expert_layout),
                              device=group.device, dtype=getattr(torch, spec.dtype), numerics=spec.numerics,
                              n_mtp=spec.n_mtp, progress=count, reader=spec.reader)
    if group.device.type == "cuda":
        torch.cuda.synchronize(group.device)
    io1 = disk_read_bytes()
    model.load_stats = {"rank": group.rank, "seconds": time.perf_counter() - t0, "bytes": read[0],
                        "disk_read_bytes": None if io0 is None or io1 is None else io1 - io0}
    if spec.fast_path:
        from ..backends.fast_path import enable_fast_path

        enable_fast_path(model, elementwise=spec.elementwise)
    if spec.allreduce != "nccl":
        from ..parallel.modules import set_allreduce

        set_allreduce(model, spec.allreduce)
    return model


def stoppable(group: RankGroup, on_step):
    """The step callback every rank runs in a streamed generation: rank 0 calls `on_step`, then all ranks get
    rank 0's verdict (stop if the callback raised) and raise StopAgreed together."""
    raised: list[BaseException] = []

    def step(event) -> None:
        if group.rank == 0:
            try:
                on_step(event)
            except BaseException as e:  # noqa: BLE001  (the chat's stop and Ctrl-C: re-raised on rank 0 below)
                raised.append(e)
        if group.broadcast(bool(raised)):
            raise StopAgreed

    return step, raised


class Peers:
    """Rank 0's handle on the other ranks (spawned here or by torchrun)."""

    def __init__(self, group: RankGroup, procs: dict[int, subprocess.Popen] | None = None,
                 error_dir: Path | None = None):
        self.group, self.procs, self.error_dir = group, procs or {}, error_dir  # group: None until formed
        self.failure: RankFailure | None = None
        self._closing = False
        if self.procs:
            threading.Thread(target=self._watch, name="mtp-rank-watch", daemon=True).start()
        atexit.register(self.close)

    # ------------------------------------------------------------------------------------ failure watch
    def _rank_file(self, name: str) -> str:
        path = self.error_dir / name if self.error_dir else None
        return path.read_text(errors="replace").strip() if path is not None and path.is_file() else ""

    def _rank_error(self, r: int, code: int) -> str:
        """What a spawned rank that exited with `code` said: its recorded error, its signal, or its log's last line."""
        err = self._rank_file(f"rank{r}.err")
        if err:
            return err
        if code < 0:
            return f"killed by signal {signal.Signals(-code).name}"
        tail = self._rank_file(f"rank{r}.log").splitlines()[-1:]
        return f"exited with status {code}" + (f" ({tail[0]})" if tail else "")

    def _dead(self) -> RankFailure | None:
        """The first spawned rank that has exited, as a RankFailure (None: all alive)."""
        for r, p in self.procs.items():
            code = p.poll()
            if code is not None:
                return RankFailure(r, "the run", self._rank_error(r, code))
        return None

    def _watch(self) -> None:
        while not self._closing:
            dead = self._dead()
            if dead is not None and not self._closing:
                self.failure = dead
                abort_data_group()  # rank 0's own collective, if it waits on the dead rank, now fails
                return
            time.sleep(0.2)

    def _failure(self, e: BaseException, phase: str) -> RankFailure:
        """What an error on rank 0 means: a spawned rank that died (the watch may not have seen it yet), a peer
        that left (a collective error under torchrun), or rank 0's own error."""
        if self.failure is None and self.procs:
            time.sleep(0.5)  # a dead peer's socket errors reach rank 0 before its exit status does
            self.failure = self._dead()
        if self.failure is not None:
            return self.failure
        if isinstance(e, dist.DistBackendError):
            return RankFailure(None, phase, describe(e))
        return RankFailure(0, phase, describe(e))

    def _send(self, command: str, payload=None) -> None:
        if self.failure is not None:
            raise self.failure
        try:
            self.group.broadcast((command, payload))
        except Exception as e:
            failure = self._failure(e, f"'{command}'")
            self.close(force=True)
            raise failure from e

    @property
    def closed(self) -> bool:
        """The ranks were ended (`close`, or a failure): this model can run nothing more."""
        return self._closing

    # ------------------------------------------------------------------------------------------ commands
    def load(self, spec: LoadSpec, progress: bool | None = None):
        """Every rank loads its shard; all succeed or all raise RankFailure (exit status 2: bad input).
        progress: rank 0's progress bar (default: `progress_wanted()`)."""
        self._send("load", spec)
        with self.group.phase("loading", exit_code=2):
            model = load_rank(spec, self.group, show_progress=progress_wanted() if progress is None else progress)
        model.load_report = self.group.gather(model.load_stats)  # every rank's, rank 0 reports them
        model.peers = self
        return model

    def generate(self, model, prompts, gcfg, seed, on_step):
        """`mtp.generate` on every rank (called by it when `model.peers` is set)."""
        from ..decode.engine import run_generation
        from ..decode.state import check_prompts

        check_prompts(prompts, model.cfg.vocab_size)  # bad input fails here, before the others start
        agreed = getattr(on_step, "may_stop", False)  # `mtp.decode.engine.stops`: all ranks stop at one step
        self._send("generate", (list(map(list, prompts)), gcfg, seed, agreed))
        step, raised = stoppable(self.group, on_step) if agreed else (on_step, [])
        try:
            return run_generation(model, prompts, gcfg, seed, step)
        except StopAgreed:
            raise raised[0] from None
        except KeyboardInterrupt:  # Ctrl-C on rank 0 inside a step: the others may wait in it; end them, stay Ctrl-C
            self.close(force=True)
            raise
        except BaseException as e:
            failure = self._failure(e, "generation")
            self.close(force=True)  # the others may wait inside a collective that will never complete
            raise failure from e

    def check_tokens(self, tokens: list[list[int]]) -> None:
        """RankFailure naming every rank whose last generation's tokens differ from rank 0's `tokens`."""
        self._send("check")
        every: list = [None] * self.group.world
        dist.all_gather_object(every, tokens, group=self.group.ctl)
        bad = [r for r, t in enumerate(every) if t != tokens]
        if bad:
            raise RankFailure(bad[0], "the token check", f"ranks {bad} generated other tokens than rank 0")

    def release(self) -> None:
        """Drop every rank's kept engines and graphs (`mtp.decode.engine.release`)."""
        from ..decode.keep import release

        self._send("release")
        release()

    def close(self, force: bool = False) -> None:
        """End every rank: a shutdown command and a clean teardown, or (force, or a rank already failed) stop
        the spawned ranks and leave. Safe to call twice."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.close)
        force = force or self.failure is not None or self.group is None
        if not force:
            try:
                self.group.broadcast(("shutdown", None))
                self.group.close()
            except Exception:  # noqa: BLE001  (a peer vanished during teardown: stop what is left below)
                force = True
        deadline = time.monotonic() + (2 if force else 30)
        for p in self.procs.values():
            if force and p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if force and self.group is not None:
            self.group.abandon()
        if self.error_dir is not None:
            shutil.rmtree(self.error_dir, ignore_errors=True)


def start(tp: int, device_type: str) -> Peers:
    """Rank 0 of a `tp`-rank run: under torchrun (RANK set) join its group; otherwise spawn ranks 1..tp-1 on this
    node (`python -m mtp.distributed.worker`, one GPU each) and form the group with them."""
    if "RANK" in os.environ:
        if int(os.environ["RANK"]) != 0:
            raise RuntimeError("start() is rank 0's; the other ranks run mtp.distributed.worker.serve()")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != tp:
            raise RuntimeError(f"runtime.tp = {tp} but torchrun started {world} ranks (WORLD_SIZE); make them equal")
        return Peers(init_group(device_type))
    if device_type == "cuda":
        import torch

        if torch.cuda.device_count() < tp:
            raise RuntimeError(f"runtime.tp = {tp} needs {tp} GPUs on this node, {torch.cuda.device_count()} are "
                               "visible; for several nodes start every rank with torchrun (README)")
    error_dir = Path(tempfile.mkdtemp(prefix="mtp-ranks-"))
    # rank 0 holds the rendezvous store, so it can tell a rank that never arrives (dead at import, no GPU) from
    # a slow one instead of waiting out the timeout inside init_process_group
    store = dist.TCPStore("127.0.0.1", 0, tp, is_master=True, timeout=collective_timeout(), wait_for_workers=False)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": str(tp),
           ERROR_DIR_ENV: str(error_dir), "MTP_DEVICE_TYPE": device_type, "MTP_PARENT_PID": str(os.getpid())}
    procs = {}
    for r in range(1, tp):
        with open(error_dir / f"rank{r}.log", "wb") as log:
            procs[r] = subprocess.Popen(
                [sys.executable, "-m", "mtp.distributed.worker"], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                start_new_session=True)  # the terminal's Ctrl-C reaches rank 0 only; rank 0 decides
    peers = Peers(None, procs, error_dir)
    try:
        deadline = time.monotonic() + collective_timeout().total_seconds()
        while not store.check([f"{ARRIVED}{r}" for r in procs]):
            dead = peers._dead()
            if dead is not None:
                raise RankFailure(dead.rank, "start-up", dead.message, exit_code=2)
            if time.monotonic() > deadline:
                late = [r for r in procs if not store.check([f"{ARRIVED}{r}"])]
                raise RankFailure(late[0], "start-up", f"ranks {late} did not arrive in {TIMEOUT_ENV}")
            time.sleep(0.05)
        peers.group = init_group(device_type, rank=0, world=tp, local_rank=0, store=store)
    except BaseException:
        peers.close(force=True)
        raise
    return peers

