"""mtp-eval with the bundled model split over two ranks (gloo, CPU), as a user runs it: `runtime.tp=2` spawned by
rank 0, and two torchrun "nodes" on this machine (`--nnodes 2`). Each writes one run folder, rank 0's, whose
tokens and acceptance histograms equal the one-process run's; a split the checkpoint cannot take is refused
before any rank starts."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.eval.test_run import ROOT, _env, _samples, mtp_eval

pytestmark = pytest.mark.slow
ARGS = ["max_new_tokens=8", "runtime.warmup=false", "timing.repeats=1", "dataset.limit=2", "baseline=false",
        "plots=false"]  # fp8 numerics: the bundled model's TP=2 slices need the finer scale rows


def _same_run(a: Path, b: Path) -> None:
    sa, sb = _samples(a / "samples.jsonl"), _samples(b / "samples.jsonl")
    assert [s["id"] for s in sa] == [s["id"] for s in sb] and len(sa) == 2
    for x, y in zip(sa, sb):
        assert x["tokens"] == y["tokens"], x["id"]
        assert x["row_accepted_hist"] == y["row_accepted_hist"], x["id"]
    ma, mb = (json.loads((d / "metrics.json").read_text()) for d in (a, b))
    assert ma["accepted_hist"] == mb["accepted_hist"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp1")
    r = mtp_eval(ARGS + [f"hydra.run.dir={tmp / 'run'}"], tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "run"


def test_tp2_run_equals_one_process(one_process, tmp_path):
    r = mtp_eval(ARGS + ["runtime.tp=2", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    _same_run(one_process, tmp_path / "run")
    run = json.loads((tmp_path / "run" / "metrics.json").read_text())["run"]
    ranks = run["startup"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["bytes"] > 0 and r["seconds"] > 0 for r in ranks)
    assert run["expert_layout"] == "contiguous"  # 'auto' on the bundled model: one 128-block per expert, not split
    assert "load: 2 ranks read" in (tmp_path / "run" / "run.log").read_text()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("wandb")) == ["run"]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == sorted(p.name for p in one_process.iterdir())


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_nodes_equal_one_process(one_process, tmp_path):
    """`torchrun --nnodes 2 --nproc-per-node 1` twice on this machine: rank 0 (node 0) runs the experiment, rank 1
    (node 1) serves it without Hydra and writes nothing."""
    port = _port()
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
               "-m", "eval.run", *ARGS, "runtime.tp=2", f"hydra.run.dir={tmp_path / 'run'}"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    _same_run(one_process, tmp_path / "run")


def test_a_split_the_checkpoint_cannot_take_is_refused_first(tmp_path):
    r = mtp_eval(ARGS + ["runtime.tp=8", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()[-1]
    assert "runtime.tp = 8" in err and "num_attention_heads = 4" in err and "splits over [1, 2, 4]" in err, err
    assert not (tmp_path / "run" / "samples.jsonl").exists()


def test_a_sweep_starts_new_ranks_when_a_failed_job_ended_them(monkeypatch):
    """The jobs of a sweep share the loaded model (`_build_once`); once a job's failure ended its ranks
    (`peers.closed`), the next job loads anew instead of sending commands to ranks that are gone."""
    from types import SimpleNamespace

    import eval.run as run

    class Peers:
        closed = False

        def close(self):
            self.closed = True

    built = []
    monkeypatch.setattr(run, "_BUILT", {})
    monkeypatch.setattr(run, "build", lambda cfg: built.append(m := SimpleNamespace(peers=Peers())) or (m, "tok"))
    cfg = SimpleNamespace(model="dsv32", runtime=SimpleNamespace(device="cpu", dtype="float32", tp=2, mlp_split="blocks",
                                                                  expert_layout="contiguous", allreduce="nccl",
                                                                  fast_path=False, elementwise="triton",
                                                                  num_threads=None))
    first = run._build_once(cfg)[0]
    assert run._build_once(cfg)[0] is first and len(built) == 1  # the sweep's next job: no second load
    first.peers.close()  # a failed job ended the ranks
    assert run._build_once(cfg)[0] is not first and len(built) == 2
