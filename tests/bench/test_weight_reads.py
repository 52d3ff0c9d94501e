"""`mtp.bench.weight_reads` (a GPU probe) on the CPU: the tiled layout is the row-major stack's tiles, and the
streaming kernel under the Triton interpreter reads every tile of both layouts once (its sum is the stacks' product
with x, whatever the slices and programs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root, for `tests`
from tests.interp import interpreted_main, run_interpreted  # noqa: E402


def test_tiled_layout_holds_each_tile_contiguously():
    from mtp.bench.weight_reads import tiled

    w = torch.arange(2 * 256 * 384, dtype=torch.int32).view(2, 256, 384)
    t = tiled(w)
    assert t.shape == (2, 2, 3, 128, 128) and t.is_contiguous()
    for e, nb, g in ((0, 0, 0), (1, 1, 2), (0, 1, 1)):
        assert torch.equal(t[e, nb, g], w[e, nb * 128:(nb + 1) * 128, g * 128:(g + 1) * 128])


@pytest.mark.slow
def test_stream_reads_every_tile_once_interpreted():
    run_interpreted(__file__, 300)


def _checks() -> None:
    from mtp.bench.weight_reads import stream, tiled

    g = torch.Generator().manual_seed(0)
    E, N, K = 2, 256, 384
    w1, w3 = (torch.randint(0, 64, (E, N, K), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
              for _ in range(2))
    x = (torch.randn(128, 16, generator=g) * 0.1).to(torch.float8_e4m3fn)
    xs = x.float().sum(1)  # every tile's [128, BM] product, summed over its columns
    want = sum((w.float().view(E * N, K // 128, 128) * xs).sum() for w in (w1, w3)).item()
    for ks, programs in ((1, 1), (2, 3), (3, 5)):
        rows = stream(w1, w3, x, ks, programs, "rows")
        tiles = stream(tiled(w1), tiled(w3), x, ks, programs, "tiles")
        assert torch.equal(rows, tiles), (ks, programs)
        assert abs(rows.double().sum().item() - want) <= 1e-4 * abs(want), (ks, programs, rows.sum().item(), want)
    one = sum(stream(w1, None, x, 1, p, "rows", bn=256).double().sum().item() for p in (1,))  # down: one stack
    want1 = (w1.float().view(E * N, K // 128, 128) * xs).sum().item()
    assert abs(one - want1) <= 1e-4 * abs(want1), (one, want1)
    # the down probe with every part of the real kernel's item work on: its stored rows are the reference's
    from mtp.bench.weight_reads import down_probe

    T, I, D = 3, 256, 384
    wd = torch.randint(0, 64, (E, D, I), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    h8 = torch.randint(0, 64, (E * T, I), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    hs, s2 = torch.rand(E * T, I // 128, generator=g) + 0.5, torch.rand(E, D // 128, I // 128, generator=g) + 0.5
    rw, out = torch.rand(E * T, generator=g), torch.zeros(E * T, D)
    down_probe(wd, x, h8, hs, s2, rw, out, T, 3, True, True, True)
    wf = wd.float().view(E, D // 128, 128, I // 128, 128) * s2[:, :, None, :, None]
    hf = h8.float().view(E, T, I // 128, 128) * hs.view(E, T, I // 128, 1)
    ref = torch.einsum("anrgk,atgk->atnr", wf, hf).reshape(E * T, D) * rw[:, None]
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
    late = torch.zeros(E * T, D)
    down_probe(wd, x, h8, hs, s2, rw, late, T, 2, True, True, True, late=True)
    assert torch.equal(late, out)
    for bad, match in ((dict(layout="cols"), "layout"), (dict(ks=4), "ks = 4"), (dict(bn=192), "bn = 192"),
                       (dict(layout="tiles", bn=256), "bn = 256")):
        kw = dict(ks=1, programs=1, layout="rows") | bad
        try:
            stream(tiled(w1) if kw["layout"] == "tiles" else w1, w3, x, **kw)
        except ValueError as e:
            assert match in str(e), (bad, str(e))
        else:
            raise AssertionError(f"stream must refuse {bad}")


if __name__ == "__main__":
    interpreted_main([_checks], seed=None)
