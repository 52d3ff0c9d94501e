"""`python -m mtp.distributed.launch` on the bundled model split over 2 ranks (gloo, CPU): under torchrun and with
`--tp 2` (rank 0 spawns rank 1) it prints exactly what one process prints, every rank agrees (--check), and bad
options are refused before any rank starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mtp.checkpoint.tiny import default_checkpoint

pytestmark = pytest.mark.slow
PROMPT = "def parse_args(argv):\n    "
LAUNCH = ["-m", "mtp.distributed.launch", str(default_checkpoint()), "--prompt", PROMPT, "--max-new-tokens", "12",
          "--draft", "eagle", "--k", "2"]


def _run(args, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    r = _run(LAUNCH, tmp_path_factory.mktemp("one"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[world 1," in r.stderr and r.stdout.strip()
    return r.stdout


@pytest.mark.parametrize("how", ["torchrun", "spawn"])
def test_two_ranks_print_what_one_process_prints(one_process, how, tmp_path):
    args = ([*LAUNCH, "--check", "--tp", "2"] if how == "spawn" else
            ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *LAUNCH, "--check"])
    r = _run(args, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[world 2," in r.stderr and "accepted/step" in r.stderr
    assert r.stdout == one_process
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("args,message", [
    (["--max-new-tokens", "-3"], "max_new_tokens"),
    (["--tp", "8"], "splits over [1, 2, 4]"),
    (["--elementwise", "compile", "--no-fast-path"], "--elementwise compile picks the fast path's ops"),
    # every expert layout has the fast path: what refuses it here is the CPU, not the layout
    (["--tp", "2", "--fast-path", "--expert-layout", "interleaved"], "--fast-path needs triton and a CUDA device"),
])
def test_bad_options_are_refused_before_any_rank_starts(args, message, tmp_path):
    r = _run([*LAUNCH, *args], tmp_path)
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
    assert "[world" not in r.stderr and r.stderr.count("error:") == 1


def test_a_drafter_or_verifier_registered_before_main_is_a_choice(registered):
    """The launcher's --draft / --verify choices are the live registries, not the names known at its import."""
    from mtp.distributed.launch import _args
    from mtp.verify.registry import Verifier
    from tests.draft.test_modes import FirstModule

    with pytest.raises(SystemExit):
        _args(["ck", "--prompt", "x", "--draft", "first_module"])
    registered(FirstModule())
    registered(Verifier("accept_none", "tests.verify.test_registry:chain"))
    a = _args(["ck", "--prompt", "x", "--draft", "first_module", "--verify", "accept_none"])
    assert (a.draft, a.verify) == ("first_module", "accept_none")
