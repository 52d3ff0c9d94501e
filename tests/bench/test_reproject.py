"""`mtp.bench.reproject`: a saved --tp N result priced again from its JSON equals the projection of the same result in
memory under the same flags; flags not given keep the run's; bad input names what is wrong."""

from __future__ import annotations

import argparse
import json

import pytest

from mtp.bench import rank_model as rm
from mtp.bench import reproject as rp
from tests.bench.test_cli import _tp_result
from tests.plan.test_collectives import allreduce_json

RUN_ARGS = dict(tp=8, k=2, accept=[0.8], al=None, allreduce_us=10.0, collective_json=None, allreduce="nccl",
                trees=[], tree_al={}, headline_al=[2.8], real_overhead=1.08, collective_growth=1.45)


def _saved(tmp_path, **over):
    res = _tp_result()
    res["args"] = {**RUN_ARGS, **over}
    res["projection"] = rm.project(res, argparse.Namespace(**res["args"]))
    path = tmp_path / "run.json"
    path.write_text(json.dumps(res))  # integer keys become strings, as rank_report.save writes them
    return res, str(path)


def _flat(row: dict) -> dict:
    return {k: v for k, v in row.items() if not isinstance(v, dict)}


def test_reprojection_equals_the_projection_in_memory(tmp_path, capsys):
    res, path = _saved(tmp_path)
    same = rp.main([path])["projection"]  # no flag: the run's own arguments, the run's own projection
    row, run = same["contexts"][1024]["eagle_k2"], res["projection"]["contexts"][1024]["eagle_k2"]
    assert _flat(row) == pytest.approx(_flat(run)) and row["at_AL"][2.8] == pytest.approx(run["at_AL"][2.8])
    f = allreduce_json(tmp_path)
    out = tmp_path / "new.json"
    got = rp.main([path, "--collective-json", f, "--allreduce", "oneshot", "--al", "2.5", "--out", str(out)])
    want = rm.project(res, argparse.Namespace(**{**RUN_ARGS, "collective_json": f, "allreduce": "oneshot",
                                                 "al": 2.5}))
    for L in (1024, 32768):
        for name in ("plain", "eagle_k1", "eagle_k2"):
            assert _flat(got["projection"]["contexts"][L][name]) == pytest.approx(_flat(want["contexts"][L][name]))
    assert got["projection"]["contexts"][1024]["eagle_k2"]["AL"] == 2.5
    saved = json.loads(out.read_text())
    assert saved["reprojected"]["from"] == path and saved["reprojected"]["flags"]["allreduce"] == "oneshot"
    assert saved["contexts"]["1024"]["widths"]["1"]["graph_ms"] == 11.0  # the measurement itself unchanged
    assert "HEADLINE context 1024, eagle k=2" in capsys.readouterr().out


def test_reproject_refuses_bad_input(tmp_path, capsys):
    _, path = _saved(tmp_path)
    for argv, why in (([str(tmp_path / "nope.json")], "nope.json: no such file"),
                      ([path, "--out", path], "--out must not be the result it reads"),
                      ([path, "--allreduce", "oneshot"], "needs --collective-json"),
                      ([path, "--tree-al", "2x2=2.9"], "must be one of --trees"),
                      ([path, "--accept", "1.5"], "--accept rates must be in [0, 1]")):
        with pytest.raises(SystemExit) as e:
            rp.main(argv)
        assert why in str(e.value) + capsys.readouterr().err
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps({**json.loads(open(path).read()), "device": "cpu"}))
    with pytest.raises(SystemExit, match="a CPU run"):
        rp.main([str(cpu)])
    (tmp_path / "other.json").write_text('{"rows": []}')
    with pytest.raises(SystemExit, match="missing tp, device, args, contexts"):
        rp.main([str(tmp_path / "other.json")])
