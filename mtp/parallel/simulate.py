"""One rank of a TP=N / EP=N group, simulated in a single process: the per-rank model at its real shapes on one
device, every collective a no-op.

    with simulated_rank(world=8, rank=0) as comm:         # comm: a CountingComm over torch's fake group
        model = random_parallel_model(real_config(layers=61, dense_layers=3), comm, device="cuda")
        ...                                                # forwards, graphs, generate: as rank 0 of 8 runs them

torch's fake process group (backend "fake") answers every collective at once without touching the data, so
this process builds and runs exactly what rank r of N builds and runs (same layout, same kernels, same shapes,
same sequence of collectives) but its activations after the first collective are its own partial sums, not
the group's: the numbers it computes are meaningless, their cost is the rank's cost minus communication.
That is what `mtp-bench --tp N` times; the collectives it would issue are counted (`CountingComm`) and their
latency is added separately. tests/parallel/test_simulate.py replays a real gloo run's collective results into
a simulated rank and gets that rank's logits and tokens bit for bit.

The fake group is the process's default group while the context is open; it is destroyed on exit, also on
error, and the context refuses to open inside an existing group.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from .comm import CountingComm, init_process_group


@contextmanager
def simulated_rank(world: int, rank: int) -> Iterator[CountingComm]:
    """Rank `rank` of a fake group of `world` ranks, for the duration of the block; yields its counting Comm."""
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"simulated_rank: world must be an integer >= 1, got {world!r}")
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"simulated_rank: rank must be in [0, {world}), got {rank!r}")
    if not dist.is_available():
        raise RuntimeError("simulated_rank: this torch build has no torch.distributed")
    if dist.is_initialized():
        raise RuntimeError("simulated_rank: a process group is already initialized in this process; the fake "
                           "group must be the default group (run the simulation in its own process)")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # importing it registers backend "fake"

    init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield CountingComm()
    finally:
        dist.destroy_process_group()
