"""`mtp.bench.load`: the checkpoint it writes is a real-format checkpoint that loads, the raw read covers every
byte, and a TP=2 load through the product path (spawned ranks, gloo) reports every rank's bytes and time."""

import json

import pytest
import torch

import mtp
from mtp.bench import load as bench_load
from mtp.model.presets import tiny_parallel_config
from mtp.parallel.load import load_parallel


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-load") / "ckpt"
    res = bench_load.write(out, tiny_parallel_config(2), seed=3, shard_gb=0.002, device="cpu")
    return out, res


def test_written_checkpoint_is_sharded_and_loads(written):
    out, res = written
    files = bench_load.shard_files(out)
    assert res["shards"] == len(files) > 1  # 2 MB shards: several
    assert sum(f.stat().st_size for f in files) >= res["bytes"]  # headers on top of the tensor bytes
    model = mtp.load_model(out)  # validates names, shapes, dtypes and scale ranges
    assert model.cfg.num_hidden_layers == 3
    assert not list(out.parent.glob(".tmp-ckpt-*"))


def test_shards_never_split_a_tensor():
    shards = bench_load.plan_shards({"a": 5, "b": 5, "c": 20, "d": 1}, 8)
    assert shards == [["a"], ["b"], ["c"], ["d"]]
    assert bench_load.plan_shards({"a": 3, "b": 3, "c": 3}, 8) == [["a", "b"], ["c"]]


def test_raw_read_covers_every_byte(written):
    files = bench_load.shard_files(written[0])
    for readers in (1, 2, 5):
        r = bench_load.raw_read(files, readers, chunk=4096)
        assert r["bytes"] == sum(f.stat().st_size for f in files)
        assert r["gb_per_s"] > 0


def test_progress_reaches_this_ranks_total(written):
    seen = []
    load_parallel(written[0], progress=lambda done, total: seen.append((done, total)))
    dones = [d for d, _ in seen]
    assert dones == sorted(dones) and dones[-1] == seen[-1][1] > 0


def test_tp2_load_reports_every_rank_for_each_loader(written, tmp_path, capsys):
    out_json = tmp_path / "load.json"
    assert bench_load.main(["measure", str(written[0]), "--tp", "2", "--device-type", "cpu", "--dtype", "float32",
                            "--json", str(out_json)]) == 0
    res = json.loads(out_json.read_text())
    assert list(res["loads"]) == ["mmap", "pread"]  # both shard readers by default, in this order
    one = sum(p.numel() * p.element_size() for p in mtp.load_model(written[0], dtype=torch.float32).parameters())
    for name, entry in res["loads"].items():
        ranks = entry["load"]["ranks"]
        assert entry["load"]["reader"] == name
        assert [r["rank"] for r in ranks] == [0, 1]
        assert all(r["bytes"] > 0 and r["seconds"] > 0 for r in ranks)
        assert entry["load"]["checkpoint_bytes_per_node"] < one  # each rank read only its slices
        assert entry["node_vs_raw"] == entry["load"]["node_gb_per_s"] / res["best_raw_gb_per_s"]
        assert entry["extrapolated_690gb"]["seconds"] > 0 and "assumes" in entry["extrapolated_690gb"]
    mm, pr = (res["loads"][n]["load"] for n in ("mmap", "pread"))
    assert [r["bytes"] for r in mm["ranks"]] == [r["bytes"] for r in pr["ranks"]]  # the same slices either way
    assert res["real_checkpoint_bytes"] > 680e9
    table = capsys.readouterr().out
    assert "mmap, TP=2" in table and "pread, TP=2" in table and "raw, 1 thread(s)" in table


def test_median_run_is_a_measured_run():
    runs = [{"x": 3.0}, {"x": 1.0}, {"x": 2.0}, {"x": 5.0}]
    assert bench_load.median_run(runs, "x") == {"x": 2.0}
    assert bench_load.median_run(runs[:3], "x") == {"x": 2.0}
    assert bench_load.median_run(runs[:1], "x") == {"x": 3.0}
