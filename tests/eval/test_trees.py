"""Draft trees through mtp-eval, end to end on the CPU (subprocesses, as a user runs them): a strict tree run
reproduces the greedy baseline token for token and reports its tree metrics in metrics.json, the table, the
plot and the W&B run (offline); a slice of conf/experiment/tree_sweep.yaml runs as a Hydra multirun.
Tiny runs (2 prompts, 6 new tokens, dequantized numerics) of the bundled model.
"""

from __future__ import annotations

import json

import pytest

from eval.wandb_offline import find_run_file, read_run
from tests.eval.test_run import FAST, _samples, mtp_eval

TINY = [*FAST, "dataset.limit=2", "baseline=true", "runtime.batch_size=2"]  # one batch of 2 rows


def test_strict_tree_run_equals_the_baseline_and_reports_the_tree(tmp_path):
    run = tmp_path / "run"
    r = mtp_eval([*TINY, "draft.tree=2x1", "logger=wandb", "logger.mode=offline", f"hydra.run.dir={run}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((run / "metrics.json").read_text())
    spec, base = _samples(run / "samples.jsonl"), _samples(run / "baseline.jsonl")
    assert len(spec) == len(base) == 2 and all(s["new_tokens"] == 6 for s in spec)
    assert [s["tokens"] for s in spec] == [b["tokens"] for b in base]
    assert m["strict_mismatch"] == {"count": 0, "ids": []}
    assert "strict outputs differing from the baseline: 0" in r.stdout
    assert (m["run"]["tree"], m["run"]["k"], m["run"]["min_draft_prob"]) == ("2x1", 2, 0.0)
    t, o = m["tree"], m["overall"]
    assert (t["shape"], t["nodes"], t["max_depth"]) == ("2x1", 5, 2)
    # the tree's own counts and the chain-shaped metrics describe the same steps
    assert t["row_steps"] == o["count/row_steps"] == sum(m["accepted_hist"]) > 0
    assert sum(sum(s["row_accepted_hist"]) for s in spec) == t["row_steps"]
    for d, (p, by_rank) in enumerate(zip(t["accept_depth"], t["accept_depth_rank"]), 1):
        assert p == pytest.approx(o[f"accept/pos_{d}"]) == pytest.approx(sum(by_rank))
        assert [o[f"accept/depth_{d}_rank_{r}"] for r in range(len(by_rank))] == pytest.approx(by_rank)
    assert o["tree/tokens_per_node"] == pytest.approx(o["accept/mean_len"] / 5)
    assert o["speed/decode_tok_s"] > 0
    assert "acceptance by depth and rank" in r.stdout and "tokens per verified node" in r.stdout
    assert (run / "tree_acceptance.png").read_bytes()[:4] == b"\x89PNG"
    logged = read_run(find_run_file(run / "wandb"))
    s = logged["summary"]
    for key in ("accept/depth_1_rank_0", "accept/depth_2_rank_0", "tree/tokens_per_node", "tree/nodes"):
        assert s[key] == pytest.approx(o[key]), key
    assert any(key.startswith("charts/tree_accept_depth_rank") for key in s)
    assert logged["run"]["name"].startswith("eagle-t2x1-strict")


def test_tree_sweep_slice_runs_as_a_multirun(tmp_path):
    """conf/experiment/tree_sweep.yaml with its shape and threshold axes cut to one shape and two thresholds."""
    sweep = tmp_path / "sweep"
    r = mtp_eval(["experiment=tree_sweep", *TINY, "draft.tree=2x1", "draft.min_draft_prob=0.0,0.3",
                  f"hydra.sweep.dir={sweep}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["min_draft_prob"]: row for row in json.loads((sweep / "sweep_summary.json").read_text())}
    assert set(rows) == {0.0, 0.3}
    for p, row in rows.items():
        assert (row["tree"], row["tree/nodes"], row["k"], row["strict_mismatch"]) == ("2x1", 5, 2, 0)
        m = json.loads((sweep / row["job"] / "metrics.json").read_text())
        assert m["run"]["thinking"] is True and m["tree"]["min_draft_prob"] == p
    live = json.loads((sweep / rows[0.3]["job"] / "metrics.json").read_text())["overall"]
    assert rows[0.0]["tree/tokens_per_live_node"] is None
    assert live["tree/live_nodes_per_step"] <= 5 and rows[0.3]["tree/tokens_per_live_node"] == pytest.approx(
        live["accept/mean_len"] / live["tree/live_nodes_per_step"])
    assert (sweep / "sweep_summary.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("verify", ["strict", "relaxed", "sample"])
def test_tree_call_reports_chain_shaped_and_tree_metrics(tiny_model, verify):
    """eval/trees.py in process, every verifier: the run's SpecMetrics (what aggregate.py merges) carry the tree's
    counts with k = its depth, each row's histogram adds up to the call's, and a sampled call repeats itself."""
    from hydra import compose, initialize_config_dir

    from eval import conf_dir, trees
    from eval.common import generate_kwargs
    from mtp.decode.metrics import SpecMetrics

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("eval", overrides=["draft.tree=2x1", f"verify={verify}", "output_dir=unused"])
    kw = generate_kwargs(cfg)
    ids = [[5, 9, 30, 2], [7, 7, 7, 7, 12]][: 1 if verify == "sample" else 2]
    trees.check(kw, batch_size=len(ids))
    run, row_hist = trees.generate(tiny_model, ids, 6, {**kw, "seed": [11] * len(ids)} if verify == "sample" else kw)
    m, t = run.metrics, run.tree
    assert isinstance(m, SpecMetrics) and (m.k, m.n_rows, m.verify) == (2, len(ids), verify)
    assert m.accepted_hist == t.accepted_hist and [sum(c) for c in zip(*row_hist)] == t.accepted_hist
    assert m.mean_accepted_len == pytest.approx(t.mean_accepted_len)
    assert m.new_tokens == sum(map(len, run.tokens)) == 6 * len(ids) and m.decode_tok_s > 0
    if verify == "sample":
        again, _ = trees.generate(tiny_model, ids, 6, {**kw, "seed": [11]})
        assert again.tokens == run.tokens


def test_tree_acceptance_table_and_its_strict_gate(tmp_path, monkeypatch, capsys):
    """eval/tree_acceptance.py: strict and relaxed side by side per shape, adaptive rows with their live nodes,
    and exit status 1 (naming the point) when a strict point did not reproduce plain greedy decoding."""
    from eval import tree_acceptance as ta

    def row(verify, tree, p, al, same):
        depth = tree.count("x") + 1
        return {"draft": "eagle", "verify": verify, "tree": tree, "min_draft_prob": p, "nodes": depth + 1,
                "depth": depth, "AL": al, "tokens_per_node": al / (depth + 1), "live_nodes_per_step": 1.5,
                "tokens_per_live_node": al / 1.5, "accept_depth": [0.5] * depth,
                "accept_depth_rank": [[0.5]] * depth, "identical_to_greedy": same, "engine_AL": al}

    result = {"prompts": 4, "rows": [row("strict", "1x1", 0.0, 2.25, 4), row("relaxed", "1x1", 0.0, 2.5, 1),
                                     row("strict", "1x1", 0.4, 2.0, 3)]}
    monkeypatch.setattr(ta, "run", lambda *a, **kw: dict(result))
    out = tmp_path / "t.json"
    assert ta.main(["--out", str(out)]) == 1
    assert "eagle 1x1 p>=0.4" in capsys.readouterr().err
    assert json.loads(out.read_text())["command"] == f"python -m mtp_eval.tree_acceptance --out {out}"
    lines = ta.markdown(result).splitlines()
    assert lines[4].startswith("| 1x1 | 3 | 0 | 2.250 | 0.750 | 2.500 | 0.833 | 0.500 / 0.500 |")
    assert lines[4].endswith("| 4/4 | 2.250 / 2.500 |")
    assert "| 1.50, 1.333 | 3/4 |" in lines[5]
