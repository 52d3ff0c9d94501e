"""Process groups made through `mtp.parallel.comm.init_process_group` are really gone after
`destroy_process_group`, even once torch._dynamo has been imported after the group was made (the fast path's
torch.compile imports it; so did building a model on the meta device, before its init ops left torch._refs).
Before, gloo's worker threads outlived the group and a rank could abort at interpreter exit
(`terminate called without an active exception`): the CI flake of tests/distributed/test_launch.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names from /proc")

SCRIPT = textwrap.dedent("""
    import os, sys, time, torch, torch.distributed as dist
    from mtp.parallel.comm import Comm, init_process_group
    from mtp.parallel.load import parallel_skeleton
    from mtp.model.presets import tiny_config

    def threads():
        names = []
        for t in os.listdir("/proc/self/task"):
            try:
                names.append(open(f"/proc/self/task/{t}/comm").read().strip())
            except OSError:
                pass
        return names

    make = init_process_group if sys.argv[1] == "mtp" else dist.init_process_group
    make("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
    for _ in range(500):  # the check below can see them: their names appear shortly after they start
        if sum(n.startswith(("pt_gloo", "gloo")) for n in threads()) >= 2:
            break
        time.sleep(0.01)
    else:
        raise AssertionError(f"no named gloo threads: {threads()}")
    parallel_skeleton(tiny_config(), Comm())
    import torch._dynamo  # what torch.compile imports, after the group exists
    t = torch.ones(3)
    dist.all_reduce(t)
    dist.destroy_process_group()
    print(",".join(sorted(n for n in threads() if n.startswith(("pt_gloo", "gloo")))))
""")


def _live_gloo_threads(how: str, tmp_path) -> str:
    r = subprocess.run([sys.executable, "-c", SCRIPT, how, str(tmp_path / "init")], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip()


def test_gloo_threads_end_with_the_group(tmp_path):
    assert _live_gloo_threads("mtp", tmp_path) == ""


@pytest.mark.parametrize("shape", [(1, 1, 5), (1, 4, 5), (2, 1, 5), (2, 3, 7)])
def test_all_gather_last_casts_in_its_copy(monkeypatch, shape):
    """`Comm.all_gather_last(t, out_dtype)`: the same values as the gather then `.to(out_dtype)` (the reference's two
    launches, `ColumnParallelLinear.forward`), contiguous, with each rank's block in rank order (3 ranks, each block
    rank + t, filled by a stand-in for the collective); the default dtype's result unchanged."""
    import torch

    import mtp.parallel.comm as comm_mod

    world = 3

    def fake_gather(out, t, group=None):
        out.copy_(torch.cat([t + r for r in range(world)]))

    monkeypatch.setattr(comm_mod, "_all_gather", fake_gather)
    c = comm_mod.Comm()
    c.world = world
    t = torch.randn(shape).to(torch.bfloat16)
    want = torch.cat([t + r for r in range(world)], -1)
    assert torch.equal(c.all_gather_last(t), want)
    got = c.all_gather_last(t, torch.float32)
    assert got.dtype == torch.float32 and got.is_contiguous() and torch.equal(got, want.float())
