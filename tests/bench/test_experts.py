"""mtp.bench.experts: the busiest rank's expert reads per layout under the group-limited router (CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from mtp.bench import experts
from mtp.model.presets import real_config


def test_uniform_routes_are_group_limited_and_seeded():
    ids = experts.uniform_routes(256, 8, 4, 8, tokens=3, samples=50, seed=1)
    assert ids.shape == (50, 3, 8) and torch.equal(ids, experts.uniform_routes(256, 8, 4, 8, 3, 50, 1))
    groups = ids // 32
    assert all(len(set(g.tolist())) <= 4 for g in groups.reshape(-1, 8))  # top-4 of 8 groups per token
    assert all(len(set(t.tolist())) == 8 for t in ids.reshape(-1, 8))  # 8 distinct experts per token


def test_table_without_the_trained_model(tmp_path, capsys):
    out = tmp_path / "e.json"
    res = experts.main(["--ep", "8", "--widths", "1", "4", "--samples", "400", "--no-trained", "--json", str(out)])
    t = res["uniform"]["table"]
    # a token's 8 experts in 4 groups: contiguous (group = rank) puts >= 2 on one rank, interleaved spreads them
    assert 2.0 <= t["contiguous"][1]["mean"] <= 8.0 and t["interleaved"][1]["mean"] < t["contiguous"][1]["mean"]
    assert t["split"][1]["mean"] == pytest.approx(1.0)  # 8 distinct experts, 1/8 of each
    assert t["contiguous"][4]["mean"] > t["contiguous"][1]["mean"]
    assert json.loads(out.read_text())["uniform"]["ep"] == 8
    assert "mean busiest-rank expert reads" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        experts.main(["--widths", "0", "--no-trained"])


def test_draw_busiest_matches_the_distribution():
    cfg = real_config(layers=4, dense_layers=3)
    d = experts.draw_busiest(cfg, "contiguous", 8, 1, 400, seed=2)
    assert len(d) == 400 and min(d) >= 2 and max(d) <= 8 and all(isinstance(n, int) for n in d)
    assert set(experts.draw_busiest(cfg, "split", 8, 1, 20, seed=2)) == {8}  # every token: 8 distinct experts
