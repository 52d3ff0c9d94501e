"""Ranks 1..N-1 of a sharded run: wait for rank 0's command, do it, repeat (`mtp.distributed.driver` sends them).

    python -m mtp.distributed.worker       # started by runtime.tp=N's launcher, or by an entry point under torchrun

Commands: `load` (this rank's shard; the phase ends in an agreement, so a failure here is every rank's), `generate`
(`mtp.decode.engine.run_generation` with rank 0's resolved options), `check` (its last tokens to rank 0), `release`,
`shutdown`. A worker prints nothing: rank 0 owns the terminal and every file. An error inside a generation, where
rank 0 may wait inside a collective, ends this process with status 1 after writing the error where rank 0 reads it
(`MTP_RANK_ERROR_DIR`); rank 0 (or torchrun) then ends the run. A worker whose parent, the rank 0 that spawned it,
is gone exits too.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from .driver import ARRIVED, ERROR_DIR_ENV, StopAgreed, load_rank, stoppable
from .group import RankFailure, RankGroup, collective_timeout, describe, init_group


def _record(group_rank: int, message: str) -> None:
    d = os.environ.get(ERROR_DIR_ENV)
    if d:
        Path(d, f"rank{group_rank}.err").write_text(message + "\n")


def _watch_parent(pid: int) -> None:
    """Leave when the process that spawned this rank is gone (killed rank 0: nothing else would end us)."""
    while True:
        if os.getppid() != pid:
            os._exit(1)
        time.sleep(0.5)


def serve(group: RankGroup) -> int:
    """The command loop; returns the exit status."""
    from ..decode.engine import run_generation
    from ..decode.keep import release

    model = last = None
    while True:
        command, payload = group.broadcast()
        if command == "shutdown":
            group.close()
            return 0
        if command == "load":
            model = None  # the previous shard goes before the next one loads
            try:
                with group.phase("loading", exit_code=2):
                    model = load_rank(payload, group)
            except RankFailure:  # every rank knows; rank 0 reports it and decides what comes next
                pass
            else:
                group.gather(model.load_stats)  # to rank 0 (Peers.load)
        elif command == "generate":
            prompts, gcfg, seed, streamed = payload
            step = stoppable(group, None)[0] if streamed else None
            try:
                last = run_generation(model, prompts, gcfg, seed, step).tokens
            except StopAgreed:
                last = None
        elif command == "check":  # rank 0 compares every rank's last tokens with its own
            dist.all_gather_object([None] * group.world, last, group=group.ctl)
        elif command == "release":
            release()
        else:
            raise RuntimeError(f"unknown command {command!r} from rank 0")


def device_type() -> str:
    """The device kind of this rank: rank 0's launcher sets MTP_DEVICE_TYPE; under torchrun it defaults to CUDA
    where there is a GPU (set MTP_DEVICE_TYPE=cpu for a CPU run on a GPU node)."""
    kind = os.environ.get("MTP_DEVICE_TYPE")
    if kind is None:
        import torch

        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind not in ("cuda", "cpu"):
        raise ValueError(f"MTP_DEVICE_TYPE={kind!r} is invalid: expected 'cuda' or 'cpu'")
    return kind


def main() -> int:
    parent = os.environ.get("MTP_PARENT_PID")
    if parent:  # spawned by rank 0 on this node: its Ctrl-C is rank 0's business
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        threading.Thread(target=_watch_parent, args=(int(parent),), daemon=True).start()
    rank = int(os.environ.get("RANK", "-1"))
    try:
        store = None
        if parent:  # rank 0's rendezvous store: check in, so rank 0 knows this rank is up
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  int(os.environ["WORLD_SIZE"]), is_master=False, timeout=collective_timeout())
            store.set(f"{ARRIVED}{rank}", "1")
        group = init_group(device_type(), store=store)
        return serve(group)
    except BaseException as e:  # noqa: BLE001  (record the error for rank 0, then leave)
        _record(rank, describe(e))
        sys.stderr.write(f"rank {rank}: {describe(e)}\n")
        sys.stderr.flush()
        os._exit(1)  # no interpreter teardown: a collective may still hold the group


if __name__ == "__main__":
    sys.exit(main())
