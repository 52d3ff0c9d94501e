"""`mtp.bench.spec_ab` on a GPU: a 3-layer TP=8 rank, the tree glue switches on / off in one process; every rep times
the chain and the tree, the JSON holds them and the means."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_switches_alternate_in_one_process(tmp_path, capsys):
    from mtp.bench import spec_ab

    out = tmp_path / "ab.json"
    res = spec_ab.main(["--layers", "3", "--prompt-len", "64", "--k", "2", "--tree", "2x1", "--reps", "2",
                        "--new-tokens", "12", "--switches", "tree_glue,tree_fwd_glue", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert [(r["rep"], r["on"]) for r in saved["reps"]] == [(0, True), (0, False), (1, True), (1, False)]
    for r in saved["reps"]:
        assert r["eagle_k2"] > 0 and r["tree_2x1"] > 0
    assert set(res["mean_ms"]["on"]) == {"eagle_k2", "tree_2x1"}
    assert "tree_2x1: on" in capsys.readouterr().out
