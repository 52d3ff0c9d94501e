"""Start-up of the loaders: the device starts on a thread while the checkpoint is read (`DeviceInit`), waited for
before the first copy, its error raised as it was; and loading imports no torch._dynamo (1.4-3.4 s)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import mtp.checkpoint.files as files
from mtp.checkpoint import device_init
from mtp.checkpoint.device_init import DeviceInit, resolve
from mtp.checkpoint.files import CheckpointError, load_model

REPO = Path(__file__).resolve().parents[2]


class Recorder:
    """A fake starter for the meta device: records its thread and the order of events against the loader's; it
    blocks until the loader has read its first tensor (so the two ran together) or `release` is set."""

    def __init__(self, error: BaseException | None = None):
        self.events: list[str] = []
        self.read_first = threading.Event()
        self.error = error
        self.thread: threading.Thread | None = None

    def __call__(self, device: torch.device) -> None:
        self.thread = threading.current_thread()
        self.events.append(f"start {device}")
        assert self.read_first.wait(30), "the loader never read a tensor while the device started"
        time.sleep(0.1)  # a loader that did not wait would copy now
        self.events.append("started")
        if self.error is not None:
            raise self.error


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setitem(device_init.STARTERS, "meta", rec)
    real_iter, real_set = files.iter_tensors, files._set_param

    def iter_tensors(path, headers, *how):  # how: the reader and device
        for item in real_iter(path, headers, *how):
            if not rec.read_first.is_set():
                rec.events.append("first tensor read")
                rec.read_first.set()
            yield item

    def set_param(model, name, value):
        rec.events.append("copy")
        real_set(model, name, value)

    monkeypatch.setattr(files, "iter_tensors", iter_tensors)
    monkeypatch.setattr(files, "_set_param", set_param)
    return rec


def test_load_starts_the_device_on_a_thread_and_waits_before_the_first_copy(tiny_ckpt, recorder):
    model = load_model(tiny_ckpt, device="meta")
    assert recorder.thread is not None and recorder.thread is not threading.main_thread()
    assert not recorder.thread.daemon  # a daemon killed inside CUDA init at exit aborts the process
    ev = recorder.events
    assert ev[:3] == ["start meta", "first tensor read", "started"] and ev[3] == "copy", ev[:5]
    assert ev.count("start meta") == 1 and ev.count("copy") == len(list(model.parameters()))


def test_the_init_error_is_raised_by_the_load(tiny_ckpt, recorder):
    recorder.error = RuntimeError("CUDA error: no CUDA-capable device is detected")
    with pytest.raises(RuntimeError) as e:
        load_model(tiny_ckpt, device="meta")
    assert e.value is recorder.error and "copy" not in recorder.events  # the very exception, before any copy


def test_a_checkpoint_error_comes_first_and_does_not_wait(tmp_path, monkeypatch):
    release = threading.Event()
    monkeypatch.setitem(device_init.STARTERS, "meta", lambda device: release.wait(30))
    try:
        with pytest.raises(CheckpointError, match="does not exist"):
            load_model(tmp_path / "missing", device="meta")  # raised while the starter still blocks
    finally:
        release.set()


def test_cpu_starts_nothing(monkeypatch):
    monkeypatch.setattr(device_init, "STARTERS", {})
    d = DeviceInit("cpu")
    assert d._thread is None
    d.wait()


def test_the_thread_starts_the_loaders_device():
    assert resolve("cuda:3") == torch.device("cuda", 3) and resolve("cpu") == torch.device("cpu")
    if not torch.cuda.is_initialized():  # then every thread's current device is 0
        assert resolve("cuda") == torch.device("cuda", 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where CUDA cannot start")
def test_a_real_cuda_init_error_keeps_its_message(tiny_ckpt):
    with pytest.raises(Exception) as inline:
        torch.empty(1, device="cuda")
    with pytest.raises(type(inline.value)) as loaded:
        load_model(tiny_ckpt, device="cuda")
    assert str(loaded.value) == str(inline.value)


LOAD_SCRIPT = textwrap.dedent("""
    import sys
    import mtp
    from mtp.checkpoint.tiny import default_checkpoint

    mtp.load_model(default_checkpoint())
    print("load_model", "torch._dynamo" in sys.modules)

    from mtp.parallel.comm import Comm, init_process_group
    from mtp.parallel.load import load_parallel
    import torch.distributed as dist

    init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    load_parallel(default_checkpoint(), Comm())
    dist.destroy_process_group()
    print("load_parallel", "torch._dynamo" in sys.modules)
""")


def test_loading_imports_no_dynamo(tmp_path):
    """torch._dynamo costs 1.4-3.4 s of start-up; it came with the random init of nn.Embedding and the rotary
    table's arange on the meta device (torch._refs), not with anything a load needs."""
    r = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(tmp_path / "init")], cwd=REPO, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["load_model", "False", "load_parallel", "False"], r.stdout


def test_an_unfilled_parameter_is_still_an_error(tiny_ckpt, monkeypatch):
    """Embeddings start uninitialized now, as linears did: a tensor the loop never copies must still be refused."""
    real = files.iter_tensors

    def all_but_the_embedding(path, headers, *how):
        return ((n, t) for n, t in real(path, headers, *how) if n != "model.embed_tokens.weight")

    monkeypatch.setattr(files, "iter_tensors", all_but_the_embedding)
    with pytest.raises(CheckpointError, match="left unfilled.*model.embed_tokens.weight"):
        load_model(tiny_ckpt)


def test_the_parallel_loader_raises_the_init_error(tiny_ckpt, monkeypatch):
    from mtp.parallel.load import load_parallel

    error = RuntimeError("CUDA error: no CUDA-capable device is detected")

    def fail(device):
        raise error

    monkeypatch.setitem(device_init.STARTERS, "meta", fail)
    with pytest.raises(RuntimeError) as e:
        load_parallel(tiny_ckpt, device="meta")
    assert e.value is error
