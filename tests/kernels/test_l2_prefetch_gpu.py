"""The L2 prefetch kernel (`mtp.kernels.l2_prefetch`) on the device (pytest -m gpu): at a TP=8 rank's weight shapes
(and an odd view, an empty tensor), every hint (line / bulk on Hopper, evict_normal / evict_last), eagerly and
launched from a side stream forked and joined inside a CUDA-graph capture, replayed 20 times: no error, and the
tensors keep their bytes (the kernel writes nothing; its PTX holds no store: tests/kernels/test_l2_prefetch.py).
"""

from __future__ import annotations

import pytest
import torch

from mtp.kernels import available

pytestmark = pytest.mark.gpu
if not available():
    pytest.skip("needs triton and a CUDA device", allow_module_level=True)

from mtp.kernels.l2_prefetch import l2_prefetch  # noqa: E402

HINTS = [(False, False), (False, True), (True, False), (True, True)]  # (bulk, evict_last)


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    w8 = torch.randint(0, 256, (2240, 7168), dtype=torch.uint8, device="cuda", generator=g).view(torch.float8_e4m3fn)
    sw = torch.rand(18, 56, device="cuda", generator=g)
    gate = torch.randn(256, 7168, device="cuda", generator=g).to(torch.bfloat16)
    odd = torch.randn(1000, 7, device="cuda", generator=g)[3:5]  # starts inside a line
    return [w8, sw, gate, odd, torch.empty(0, device="cuda")]


def _bytes(ts):
    return [t.view(torch.uint8).clone() if t.element_size() == 1 else t.clone() for t in ts]


@pytest.mark.parametrize("bulk,evict_last", HINTS)
def test_prefetch_eager_and_captured_on_a_side_stream(bulk, evict_last):
    if bulk and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("cp.async.bulk.prefetch needs sm_90")
    ts = _tensors()
    before = _bytes(ts)
    l2_prefetch(ts, evict_last=evict_last, bulk=bulk)
    l2_prefetch(ts, programs=5, evict_last=evict_last, bulk=bulk)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()

    def forked():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            l2_prefetch(ts, evict_last=evict_last, bulk=bulk)
        main.wait_stream(side)

    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        forked()
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forked()
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    after = _bytes(ts)
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a prefetch changed a tensor"
