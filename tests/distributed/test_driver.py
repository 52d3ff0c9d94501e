"""Rank 0 driving spawned ranks (`mtp.distributed.driver` / `worker`) on the bundled model: the same tokens as one
process, and every failure kind ending every rank within seconds with one message naming the rank.

CPU tests run over gloo (2 ranks); the same tests run over NCCL on 2 GPUs with `-m gpu` (fp32, so strict tokens
must equal one process's exactly)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import mtp
from mtp.checkpoint.files import save_checkpoint
from mtp.checkpoint.tiny import default_checkpoint
from mtp.decode.engine import stops
from mtp.model.config import ModelConfig
from mtp.distributed.driver import LoadSpec, start
from mtp.distributed.group import RankFailure
from mtp.text.prompt import encode_chat
from mtp.text.tokenizer import Tokenizer

pytestmark = pytest.mark.slow
DEVICES = [pytest.param("cpu"),
           pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
               torch.cuda.device_count() < 2, reason="needs 2 GPUs")])]
NEW = 12


def _prompt(path) -> list[int]:
    tok = Tokenizer.from_dir(path)
    return encode_chat([{"role": "user", "content": "Return a copy of the list in reverse order."}], tok,
                       thinking=True)


@pytest.fixture(scope="module")
def bundled():
    path = default_checkpoint()
    ids = _prompt(path)
    torch.set_num_threads(1)
    one = mtp.load_model(path)
    ref = mtp.generate(one, [ids], NEW, draft="eagle", k=2)
    return path, ids, ref


def _spawn(device: str, path, **spec):
    peers = start(2, device)
    return peers, peers.load(LoadSpec(str(path), **spec))


def _ranks_gone(peers, within_s: float = 20.0) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if all(p.poll() is not None for p in peers.procs.values()):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("device", DEVICES)
def test_two_ranks_generate_what_one_process_does(bundled, device):
    """Tokens and acceptance equal one process (fp32); a bad option and a stopped stream leave the ranks in step:
    the next call still equals one process."""
    path, ids, ref = bundled
    peers, model = _spawn(device, path)
    try:
        out = mtp.generate(model, [ids], NEW, draft="eagle", k=2)
        assert out.tokens == ref.tokens
        assert out.metrics.accepted_hist == ref.metrics.accepted_hist
        peers.check_tokens(out.tokens)
        with pytest.raises(ValueError, match="k"):  # refused on rank 0, before the others hear of it
            mtp.generate(model, [ids], NEW, draft="eagle", k=-1)

        class Enough(Exception):
            pass

        seen = []

        @stops
        def stop_at_third(ev):
            seen.append(ev)
            if len(seen) == 3:
                raise Enough

        with pytest.raises(Enough):
            mtp.generate(model, [ids], NEW, draft="eagle", k=2, on_step=stop_at_third)
        assert len(seen) == 3
        again = mtp.generate(model, [ids], NEW, draft="eagle", k=2)
        assert again.tokens == ref.tokens
    finally:
        peers.close()
    assert _ranks_gone(peers)


@pytest.fixture(scope="module")
def bad_rank1_slice(tmp_path_factory):
    """The bundled model with a NaN in rows [192, 384) of layer 1's q_b_proj: rank 1's half at TP = 2."""
    src = default_checkpoint()
    tensors = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        tensors.update(load_file(f))
    name = "model.layers.1.self_attn.q_b_proj.weight"
    w = tensors[name].view(torch.uint8).clone()
    w[300, 5] = 0x7F  # e4m3fn NaN
    tensors[name] = w.view(torch.float8_e4m3fn)
    cfg = ModelConfig.from_json(Path(src) / "config.json")
    extra = {n: Path(src) / n for n in ("tokenizer.json", "tokenizer_config.json")}
    return save_checkpoint(tensors, cfg, tmp_path_factory.mktemp("bad") / "ckpt", extra_files=extra), name


@pytest.mark.parametrize("device", DEVICES)
def test_a_rank_that_cannot_load_ends_every_rank(bad_rank1_slice, device):
    path, name = bad_rank1_slice
    peers = start(2, device)
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as e:
        peers.load(LoadSpec(str(path)))
    assert e.value.rank == 1 and e.value.phase == "loading" and e.value.exit_code == 2
    assert name in str(e.value) and "NaN" in str(e.value) and "rank 1" in str(e.value)
    peers.close()
    assert _ranks_gone(peers) and time.monotonic() - t0 < 60


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("when", ["idle", "mid-generation"])
def test_a_killed_rank_ends_the_run(bundled, device, when):
    """SIGKILL to rank 1 between calls or during a streamed generation: rank 0 raises RankFailure naming rank 1
    within seconds instead of waiting in a collective."""
    path, ids, _ = bundled
    peers, model = _spawn(device, path)
    victim = peers.procs[1]
    steps = []

    def kill_at_second_step(ev):
        steps.append(ev)
        if len(steps) == 2:
            os.kill(victim.pid, signal.SIGKILL)

    if when == "idle":
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(10)
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as e:
        mtp.generate(model, [ids], NEW, draft="eagle", k=2, on_step=kill_at_second_step)
    assert time.monotonic() - t0 < 60
    assert e.value.rank == 1 and "SIGKILL" in str(e.value), str(e.value)
    peers.close()
    assert _ranks_gone(peers)


def test_a_rank_that_never_arrives_is_named_at_once(monkeypatch):
    """A spawned rank that dies before the rendezvous (here: an interpreter that exits at once) ends start()
    with RankFailure naming it, instead of a wait for the rendezvous timeout."""
    monkeypatch.setattr("sys.executable", "/bin/false")
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as e:
        start(2, "cpu")
    assert e.value.rank == 1 and e.value.phase == "start-up" and "status 1" in str(e.value)
    assert time.monotonic() - t0 < 10


def test_load_spec_takes_the_fast_path_with_every_expert_layout():
    """The fast path runs every expert layout (`FastMoE`: tests/parallel/test_layouts_fast_path.py); an unknown
    layout is refused by name before any rank loads."""
    from mtp.distributed.driver import LoadSpec
    from mtp.placement import EXPERT_LAYOUTS

    for layout in EXPERT_LAYOUTS:
        spec = LoadSpec("ckpt", fast_path=True, expert_layout=layout)
        assert spec.fast_path and spec.expert_layout == layout
    with pytest.raises(ValueError, match=r"expert_layout must be one of \[.*'split'\], got 'striped'"):
        LoadSpec("ckpt", fast_path=True, expert_layout="striped")


def test_load_spec_names_the_fast_path_glue():
    from mtp.distributed.driver import LoadSpec

    assert LoadSpec("ckpt").elementwise == "triton" and LoadSpec("ckpt", elementwise="compile").elementwise == "compile"
    with pytest.raises(ValueError, match=r"elementwise must be one of \('triton', 'compile', 'eager'\), got 'fused'"):
        LoadSpec("ckpt", fast_path=True, elementwise="fused")


def test_load_spec_refuses_an_unknown_reader():
    from mtp.distributed.driver import LoadSpec

    assert LoadSpec("ckpt", reader="pread").reader == "pread"
    with pytest.raises(ValueError, match="reader must be one of"):
        LoadSpec("ckpt", reader="mmapp")
