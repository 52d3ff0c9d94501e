"""mtp-eval end to end on the CPU (subprocesses, as a user runs it): a two-point sweep with its summary, a W&B
offline run read back from its run file, kill -9 + resume == an uninterrupted run, and bad overrides that stop
before writing metrics. Plus the crash-safety rules of the sample store, in process.

Runs are tiny (2-4 prompts, 6 new tokens, dequantized numerics) to keep the suite fast on a shared CPU.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eval.data import Prompt
from eval.run import plan_batches
from eval.store import SampleStore, StoreError
from eval.wandb_offline import find_run_file, read_run

ROOT = Path(__file__).resolve().parent.parent
FAST = ["model.numerics=dequant", "max_new_tokens=6", "runtime.warmup=false"]
# The uninterrupted reference and the killed/resumed run share these (4 prompts, baseline on).
RESUME_ARGS = FAST + ["dataset.suites=[chat]", "dataset.per_category=null", "dataset.limit=4", "baseline=true"]
DETERMINISTIC = ("accept/", "count/", "quality/")  # metric families that must not depend on timing


def _env(tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_DIR=str(tmp), WANDB_CACHE_DIR=str(tmp / "wandb-cache"), WANDB_CONFIG_DIR=str(tmp / "wandb-cfg"),
               WANDB_DATA_DIR=str(tmp / "wandb-data"), PYTHONPATH=str(ROOT), HYDRA_FULL_ERROR="0")
    return env


def mtp_eval(args: list[str], tmp: Path, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eval.run", *args], cwd=ROOT, env=_env(tmp), capture_output=True,
                          text=True, timeout=300, **kw)


def _deterministic(m: dict) -> dict:
    out = {key: v for key, v in m["overall"].items() if key.startswith(DETERMINISTIC)}
    for cat, cm in m["per_category"].items():
        out.update({f"{cat}/{key}": v for key, v in cm.items() if key.startswith(DETERMINISTIC)})
    out.update(per_position=m["per_position"], hist=m["accepted_hist"], finish=m["finish_reasons"],
               mismatch=m["strict_mismatch"])
    return out


def _samples(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------- end to end
def test_two_point_sweep_writes_runs_and_summary(tmp_path):
    sweep = tmp_path / "sweep"
    r = mtp_eval(["-m", "draft.k=1,2", "dataset.limit=2", "baseline=false", *FAST, f"hydra.sweep.dir={sweep}"],
                 tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    for job, k in (("0", 1), ("1", 2)):
        m = json.loads((sweep / job / "metrics.json").read_text())
        assert m["run"]["k"] == k and m["overall"]["count/prompts"] == 2
        assert len(m["per_position"]) == k
        assert len(_samples(sweep / job / "samples.jsonl")) == 2
        for png in ("acceptance_per_position.png", "accepted_length_hist.png"):
            assert (sweep / job / png).read_bytes()[:4] == b"\x89PNG"
    rows = json.loads((sweep / "sweep_summary.json").read_text())
    assert sorted(r["k"] for r in rows) == [1, 2]
    assert all(row["checkpoint"].startswith("dsv32_stdlib_mini@") and "commit" in row for row in rows)
    assert (sweep / "sweep_summary.png").read_bytes()[:4] == b"\x89PNG"
    assert (sweep / "sweep_summary.csv").read_text().startswith("job,")
    assert "AL" in r.stdout and "acc@2" in r.stdout  # the per-run tables went to stdout


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """Uninterrupted run, logged to W&B in auto mode without an API key (so: offline)."""
    tmp = tmp_path_factory.mktemp("reference")
    r = mtp_eval([*RESUME_ARGS, "logger=wandb", f"hydra.run.dir={tmp / 'run'}"], tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "run", r


def test_reference_run_metrics_and_baseline(reference_run):
    run, r = reference_run
    m = json.loads((run / "metrics.json").read_text())
    assert m["overall"]["count/prompts"] == 4 and m["baseline"]["overall"]["count/draft_forwards"] == 0
    assert m["speedup"]["overall"]["decode"] > 0
    assert m["strict_mismatch"]["count"] == len(m["strict_mismatch"]["ids"])
    assert "acc@1" in r.stdout and "speedup" in r.stdout


def test_reference_run_says_what_produced_it(reference_run):
    """Provenance in metrics.json and the W&B config; the bundled model shown by its own name, not `tiny`."""
    run, r = reference_run
    m = json.loads((run / "metrics.json").read_text())
    prov = m["provenance"]
    assert prov["checkpoint"]["name"] == "dsv32_stdlib_mini" and len(prov["checkpoint"]["fingerprint"]) == 16
    assert prov["code"]["torch"] and prov["code"]["device"].startswith("cpu")
    assert "git_commit" in prov["code"] and "git_dirty" in prov["code"]
    assert m["run"]["model"] == "dsv32_stdlib_mini" and "model=dsv32_stdlib_mini" in r.stdout
    logged = read_run(find_run_file(run / "wandb"))
    assert logged["config"]["provenance"]["checkpoint"]["fingerprint"] == prov["checkpoint"]["fingerprint"]


def test_wandb_offline_run_holds_the_logged_metrics(reference_run):
    run, _ = reference_run
    m = json.loads((run / "metrics.json").read_text())
    logged = read_run(find_run_file(run / "wandb"))
    s = logged["summary"]
    for key in ("accept/mean_len", "accept/pos_1", "accept/pos_2", "count/new_tokens", "speed/speedup_decode"):
        assert s[key] == pytest.approx(m["overall"][key]), key
    assert s["speed/decode_tok_s"] > 0
    assert s["category/chat/count/prompts"] == 4
    for chart in ("charts/accept_per_position", "charts/accepted_len_hist", "samples/"):  # bar charts, table
        assert any(key.startswith(chart) for key in s), chart
    assert logged["config"]["draft"]["name"] == "eagle" and logged["config"]["max_new_tokens"] == 6
    assert logged["run"]["job_type"] == "eval" and logged["run"]["name"].startswith("eagle-k2-strict")
    assert any("sample/accept_len" in h for h in logged["history"])  # per-prompt logging during the run


def test_killed_run_resumes_to_the_same_metrics(reference_run, tmp_path):
    ref_run, _ = reference_run
    run = tmp_path / "run"
    args = [*RESUME_ARGS, f"hydra.run.dir={run}"]
    samples = run / "samples.jsonl"
    p = subprocess.Popen([sys.executable, "-m", "eval.run", *args], cwd=ROOT, env=_env(tmp_path),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not (samples.exists() and samples.read_text().count("\n") >= 1):
            assert p.poll() is None, "the run ended before writing its first sample"
            assert time.monotonic() < deadline, "no sample written in time"
            time.sleep(0.02)
        p.send_signal(signal.SIGKILL)
    finally:
        p.wait()
    assert p.returncode == -signal.SIGKILL
    assert not (run / "metrics.json").exists()
    n_killed = len(_samples(samples))
    assert 1 <= n_killed < 4, "the kill came too late to test a resume"

    r = mtp_eval([*args, "resume=true"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    got, ref = json.loads((run / "metrics.json").read_text()), json.loads((ref_run / "metrics.json").read_text())
    assert got["run"]["resumed_samples"] == n_killed
    assert _deterministic(got) == _deterministic(ref)
    for name in ("samples.jsonl", "baseline.jsonl"):
        ids = [s["id"] for s in _samples(run / name)]
        assert sorted(ids) == sorted(s["id"] for s in _samples(ref_run / name)) and len(set(ids)) == 4, name
        toks = {s["id"]: s["tokens"] for s in _samples(run / name)}
        assert toks == {s["id"]: s["tokens"] for s in _samples(ref_run / name)}, name


@pytest.mark.parametrize("override,message", [
    ("draft.k=-1", "draft.k = -1"),
    ("verify=nonsense", "Could not find 'verify/nonsense'"),
    ("model=dsv32", "model.path is required"),
])
def test_bad_override_exits_nonzero_without_metrics(override, message, tmp_path):
    run = tmp_path / "run"
    r = mtp_eval([override, f"hydra.run.dir={run}"], tmp_path)
    assert r.returncode != 0
    assert message in r.stderr + r.stdout
    assert not (run / "metrics.json").exists() and not (run / "samples.jsonl").exists()


# ---------------------------------------------------------------------------------------------- in process
def _rec(pid: str, batch: str) -> dict:
    return {"id": pid, "batch": batch, "category": "c", "tokens": [1]}


def test_store_drops_a_torn_line_and_incomplete_batches(tmp_path):
    path = tmp_path / "samples.jsonl"
    s = SampleStore(path, "h", resume=False)
    s.append([_rec("a", "b0")])
    s.append([_rec("b", "b1"), _rec("c", "b1")])
    lines = path.read_text().splitlines()
    path.write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][:10])  # kill during the second batch's write
    s2 = SampleStore(path, "h", resume=True)
    assert s2.ids == {"a"} and s2.has(["a"]) and not s2.has(["b", "c"])
    assert len(path.read_text().splitlines()) == 1  # the partial batch is gone from disk too


def test_store_refuses_existing_file_without_resume_and_other_settings(tmp_path):
    path = tmp_path / "samples.jsonl"
    SampleStore(path, "h", resume=False).append([_rec("a", "b0")])
    with pytest.raises(StoreError, match="resume=true"):
        SampleStore(path, "h", resume=False)
    with pytest.raises(StoreError, match="other settings"):
        SampleStore(path, "other", resume=True)


def test_batches_never_mix_categories_and_are_deterministic():
    ps = [Prompt(f"{c}{i}", c, [], False) for i in range(3) for c in "xy"]
    batches = plan_batches(ps, 2)
    assert all(len({p.category for p in b}) == 1 for _, b in batches)
    assert sorted(p.id for _, b in batches for p in b) == sorted(p.id for p in ps)
    assert [n for n, _ in batches] == [n for n, _ in plan_batches(ps, 2)]


# ---------------------------------------------------------------------------------------------- degenerate outputs
def _spec_rec(pid: str, cat: str, tokens: list[int], batch: str) -> dict:
    from mtp.metrics import SpecMetrics

    m = SpecMetrics(k=2, draft="eagle", verify="strict", n_rows=1, new_tokens=len(tokens),
                    accepted_hist=[0, 0, len(tokens) // 3], target_forwards=len(tokens) // 3, row_steps=len(tokens) // 3)
    return {"id": pid, "category": cat, "batch": batch, "tokens": tokens, "finish_reason": "length",
            "batch_metrics": m.raw(), "batch_wall_s": 1.0}


def _table_text(metrics: dict) -> str:
    from rich.console import Console

    from eval.report import acceptance_table

    con = Console(width=200, record=True, file=open(os.devnull, "w"))
    con.print(acceptance_table(metrics, "t"))
    return con.export_text()


def test_degenerate_outputs_are_flagged_in_metrics_and_table():
    """Every output token 0 is what NaN logits gave: AL 3.00 with nothing meaningful. The run is not failed,
    but metrics.json and the table say which outputs are one token repeated."""
    from eval.aggregate import metrics_json

    recs = [_spec_rec("a", "chat", [0] * 6, "b0"), _spec_rec("b", "chat", [5, 9, 5, 2, 7, 1], "b1"),
            _spec_rec("c", "code", [0] * 6, "b2")]
    m = metrics_json({}, recs, None, compare_tokens=False)
    assert m["degenerate"] == {"count": 2, "ids": ["a", "c"], "all_rows_identical": False}
    assert m["overall"]["quality/degenerate_rows"] == 2
    assert m["per_category"]["chat"]["quality/degenerate_rows"] == 1
    assert "degenerate" in _table_text(m)

    same = metrics_json({}, [_spec_rec("a", "chat", [4, 8, 4], "b0"), _spec_rec("b", "chat", [4, 8, 4], "b1")],
                        None, compare_tokens=False)
    assert same["degenerate"] == {"count": 0, "ids": [], "all_rows_identical": True}


def test_healthy_outputs_are_not_flagged():
    from eval.aggregate import metrics_json

    recs = [_spec_rec("a", "chat", [5, 9, 5, 2, 7, 1], "b0"), _spec_rec("b", "chat", [3], "b1"),
            _spec_rec("c", "chat", [3, 4, 5], "b2")]
    m = metrics_json({}, recs, None, compare_tokens=False)
    assert m["degenerate"] == {"count": 0, "ids": [], "all_rows_identical": False}
    assert "degenerate" not in _table_text(m)
