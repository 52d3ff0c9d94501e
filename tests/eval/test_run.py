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
from eval.loggers import NullLogger
from eval.run import plan_batches
from eval.store import SampleStore, StoreError
from eval.wandb_offline import find_run_file, read_run

ROOT = Path(__file__).resolve().parents[2]
FAST = ["model.numerics=dequant", "max_new_tokens=6", "runtime.warmup=false", "timing.repeats=1"]
# The uninterrupted reference and the killed/resumed run share these (4 prompts, baseline on, 2 timing repeats).
RESUME_ARGS = FAST + ["dataset.suites=[chat]", "dataset.per_category=null", "dataset.limit=4", "baseline=true",
                      "timing.repeats=2"]
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


def test_sweep_runs_on_past_a_refused_job_and_lists_it(tmp_path):
    """k=99 is refused (the checkpoint has fewer MTP modules): the other job still runs, the summary lists the
    refused one with its one-line error, and the sweep exits non-zero."""
    sweep = tmp_path / "sweep"
    r = mtp_eval(["-m", "draft.k=99,1", "dataset.limit=1", "baseline=false", *FAST, f"hydra.sweep.dir={sweep}"],
                 tmp_path)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "1 of 2 sweep jobs failed" in r.stderr, r.stderr[-3000:]
    assert json.loads((sweep / "1" / "metrics.json").read_text())["run"]["k"] == 1
    assert not (sweep / "0" / "metrics.json").exists()
    rows = {row["job"]: row for row in json.loads((sweep / "sweep_summary.json").read_text())}
    assert rows["1"]["error"] is None and rows["1"]["k"] == 1
    assert rows["0"]["exit"] == 2 and "draft.k" in rows["0"]["error"] and "\n" not in rows["0"]["error"]
    assert "0," in (sweep / "sweep_summary.csv").read_text()


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
    assert m["strict_mismatch"] == {"count": 0, "ids": []}  # strict speculation == plain greedy, token for token
    assert "acc@1" in r.stdout and "speedup" in r.stdout


def test_reference_run_reports_speed_with_its_spread(reference_run):
    run, r = reference_run
    m = json.loads((run / "metrics.json").read_text())
    assert m["timing"]["repeats"] == 2 and m["timing"]["interleaved_with_baseline"]
    for o in (m["overall"], m["baseline"]["overall"], *m["per_category"].values()):
        assert o["timing/repeats"] == 2
        assert 0 < o["speed/decode_tok_s_min"] <= o["speed/decode_tok_s"] <= o["speed/decode_tok_s_max"]
    assert len(m["per_repeat"]["overall"]) == len(m["baseline"]["per_repeat"]["overall"]) == 2
    sp = m["speedup"]["overall"]
    assert sp["pairs"] == 2 and 0 < sp["decode_min"] <= sp["decode"] <= sp["decode_max"]
    ratios = [s["speed/decode_tok_s"] / b["speed/decode_tok_s"]
              for s, b in zip(m["per_repeat"]["overall"], m["baseline"]["per_repeat"]["overall"])]
    assert (sp["decode_min"], sp["decode_max"]) == pytest.approx((min(ratios), max(ratios)))
    assert m["overall"]["speed/speedup_decode_max"] == sp["decode_max"]
    assert "not indicative" in m["run"]["device_note"]
    assert m["run"]["expert_layout"] == "contiguous"  # the default 'auto', resolved for the layout loaded
    assert "median (min-max) of 2 repeats" in r.stdout and "not indicative" in r.stdout


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
    for key in ("accept/mean_len", "accept/pos_1", "accept/pos_2", "count/new_tokens", "speed/speedup_decode",
                "speed/speedup_decode_min", "speed/speedup_decode_max", "speed/decode_tok_s_min",
                "speed/decode_tok_s_max", "timing/repeats", "accept/rate", "speed/ttft_mean_s", "speed/ttft_p50_s",
                "speed/ttft_p90_s", "speed/ttft_p99_s", "speed/tpot_p99_s", "quality/flagged_rows",
                "count/prompts_with_steps"):
        assert s[key] == pytest.approx(m["overall"][key]), key
    phase = m["breakdown"]["phase"]
    assert phase and all(s[f"breakdown/phase/{g}/accept/mean_len"] == pytest.approx(d["accept/mean_len"])
                         for g, d in phase.items())
    assert (run / "acceptance_breakdown.png").read_bytes()[:4] == b"\x89PNG"
    assert s["baseline/speed/decode_tok_s_max"] == pytest.approx(m["baseline"]["overall"]["speed/decode_tok_s_max"])
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


def _refused(r: subprocess.CompletedProcess, *words: str) -> None:
    """Exit 2 with one line on stderr naming each of words, no traceback."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and all(w in lines[0] for w in words), r.stderr[-3000:]


def test_draft_vocabulary_with_ids_outside_the_model_is_refused_before_the_folder_is_claimed(tmp_path):
    vocab, run = tmp_path / "vocab.json", tmp_path / "run"
    vocab.write_text(json.dumps({"ids": [1, 2, 10**9]}))
    r = mtp_eval([*FAST, "dataset.limit=1", f"draft.vocab_file={vocab}", f"hydra.run.dir={run}"], tmp_path)
    _refused(r, "draft.vocab_file", str(vocab), str(10**9))
    assert not any((run / name).exists() for name in (".hydra", "settings.json", "samples.jsonl", "metrics.json"))


@pytest.mark.parametrize("under", ["file", "read-only"])
def test_run_folder_that_cannot_be_written_is_refused_with_one_line(under, tmp_path):
    """A path under a regular file (mkdir fails, root included) or in a read-only folder (root writes anyway)."""
    if under == "file":
        (tmp_path / "file").write_text("")
        run = tmp_path / "file" / "run"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only folder; the path-under-a-file case covers root")
        (tmp_path / "ro").mkdir(mode=0o555)
        run = tmp_path / "ro" / "run"
    r = mtp_eval([*FAST, "dataset.limit=1", f"hydra.run.dir={run}"], tmp_path)
    _refused(r, "hydra.run.dir", str(run))
    assert not run.exists()


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


def _fake_generate(calls: list):
    """Stands in for mtp.generate: records which setting ran, returns a fixed result (4 tokens per row)."""
    import mtp

    def generate(model, ids, max_new_tokens, on_step=None, **kw):
        calls.append(kw["draft"])
        m = mtp.SpecMetrics(k=kw["k"], draft=kw["draft"], new_tokens=4 * len(ids), n_rows=len(ids), row_steps=3,
                            time_decode_s=0.1 * len(calls))
        m.accepted_hist[0] = 3
        return mtp.GenerateResult([[1, 2, 3, 4] for _ in ids], ["length"] * len(ids), m,
                                  row_accepted_hist=[list(m.accepted_hist) for _ in ids])

    return generate


class _Tok:
    def decode(self, toks):
        return " ".join(map(str, toks))


def test_timing_repeats_interleave_baseline_and_speculative(monkeypatch, tmp_path):
    import types

    import mtp

    from eval import run

    calls: list[str] = []
    monkeypatch.setattr(mtp, "generate", _fake_generate(calls))
    typed = types.SimpleNamespace(runtime=types.SimpleNamespace(warmup=False), timing=types.SimpleNamespace(repeats=3),
                                  max_new_tokens=4, draft=types.SimpleNamespace(name="eagle", k=2, tree=None, min_draft_prob=0.0),
                                  verify=types.SimpleNamespace(name="strict"))
    prompts = [Prompt(f"p{i}", "c", [], False) for i in range(2)]
    stores = {"spec": SampleStore(tmp_path / "s.jsonl", "h", False), "base": SampleStore(tmp_path / "b.jsonl", "h", False)}
    kws = {"spec": {"draft": "eagle", "k": 2}, "base": {"draft": "none", "k": 0}}
    run._generate_all(typed, None, _Tok(), plan_batches(prompts, 1), {p.id: [5] for p in prompts}, stores, kws,
                      NullLogger())
    assert calls == ["none", "eagle"] * 6  # per batch: b, s, b, s, b, s
    for store in stores.values():
        assert [len(r["repeats"]) for r in store.records] == [3, 3]
    # the kept metrics are the first repeat's; every repeat's time is stored
    assert [t[0]["time_decode_s"] for t in stores["spec"].records[0]["repeats"]] == pytest.approx([0.2, 0.4, 0.6])


def _timed_record(pid: str, batch: str, category: str, tok_s: list[float], k: int) -> dict:
    """A record whose batch ran once per tok/s value: 11 new tokens in one row (10 decode tokens)."""
    import mtp

    def raw(t):
        m = mtp.SpecMetrics(k=k, new_tokens=11, n_rows=1, row_steps=5, time_decode_s=10 / t)
        m.accepted_hist[-1] = 5
        return m.raw()

    reps = [[raw(t), 10 / t + 0.5] for t in tok_s]
    return {"id": pid, "batch": batch, "category": category, "finish_reason": "length", "tokens": [1] * 11,
            "batch_metrics": reps[0][0], "batch_wall_s": reps[0][1], "repeats": reps,
            "row_accepted_hist": reps[0][0]["accepted_hist"]}


def test_speedup_is_the_median_of_paired_ratios():
    from eval.aggregate import metrics_json

    spec = [_timed_record("a", "b0", "x", [30.0, 20.0, 33.0], 2)]
    base = [_timed_record("a", "b0", "x", [10.0, 20.0, 30.0], 0)]
    m = metrics_json({}, spec, base, compare_tokens=True)
    o = m["overall"]
    assert (o["speed/decode_tok_s"], o["speed/decode_tok_s_min"], o["speed/decode_tok_s_max"]) == \
        pytest.approx((30.0, 20.0, 33.0))
    assert m["baseline"]["overall"]["speed/decode_tok_s"] == pytest.approx(20.0)
    # pairs: 30/10, 20/20, 33/30 -> median 1.1 (the ratio of the medians would say 1.5)
    sp = m["speedup"]["overall"]
    assert (sp["decode"], sp["decode_min"], sp["decode_max"], sp["pairs"]) == pytest.approx((1.1, 1.0, 3.0, 3))
    assert m["speedup"]["per_category"]["x"]["decode"] == pytest.approx(1.1)
    assert o["speed/speedup_decode"] == pytest.approx(1.1) and o["timing/repeats"] == 3
    assert m["strict_mismatch"]["count"] == 0


def test_sweep_plot_has_the_baseline_and_error_bars():
    from matplotlib.container import ErrorbarContainer

    from eval.plots import sweep_figure

    def row(k, tok_s):
        return {"series": "eagle", "k": k, "accept/mean_len": 1.5, "speed/decode_tok_s": tok_s,
                "speed/decode_tok_s_min": tok_s - 1, "speed/decode_tok_s_max": tok_s + 2,
                "base/decode_tok_s": 10.0, "base/decode_tok_s_min": 9.0, "base/decode_tok_s_max": 11.0,
                "speedup_decode": tok_s / 10, "speedup_decode_min": 0.9, "speedup_decode_max": 1.6,
                "device_note": "CPU timing: not indicative"}

    fig = sweep_figure([row(1, 12.0), row(2, 14.0)])
    _, speed, speedup = fig.axes
    bars = [c for c in speed.containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 2 and any("baseline" in c.get_label() for c in bars)
    assert [c for c in speedup.containers if isinstance(c, ErrorbarContainer)]
    assert "not indicative" in fig._suptitle.get_text()


def test_batches_never_mix_categories_and_are_deterministic():
    ps = [Prompt(f"{c}{i}", c, [], False) for i in range(3) for c in "xy"]
    batches = plan_batches(ps, 2)
    assert all(len({p.category for p in b}) == 1 for _, b in batches)
    assert sorted(p.id for _, b in batches for p in b) == sorted(p.id for p in ps)
    assert [n for n, _ in batches] == [n for n, _ in plan_batches(ps, 2)]


def test_sampled_prompts_do_not_depend_on_their_batch(tiny_model):
    """verify=sample: each prompt is seeded from the run's seed and its id, so batching does not change it."""
    from eval.run import prompt_seed, run_batch
    from mtp.text.tokenizer import Tokenizer, default_corpus, train_bpe_tokenizer

    tok = Tokenizer(train_bpe_tokenizer(default_corpus(max_files=2, max_chars=20_000), 300))
    batch = [Prompt(f"p{i}", "chat", [], False) for i in range(3)]
    ids = [[5, 9, 30], [7, 7, 7, 7, 12], [40, 41]]
    kw = dict(draft="none", k=0, verify="sample", temperature=1.0, top_p=1.0, top_k=0, seed=3)
    together = run_batch(tiny_model, tok, batch, ids, 6, {"spec": kw}, "b0")["spec"]
    alone = [run_batch(tiny_model, tok, [p], [i], 6, {"spec": kw}, "b1")["spec"][0] for p, i in zip(batch, ids)]
    assert [r["tokens"] for r in together] == [r["tokens"] for r in alone]
    assert prompt_seed(3, "p0") != prompt_seed(3, "p1") and prompt_seed(3, "p0") != prompt_seed(4, "p0")


@pytest.mark.parametrize("kw", [dict(draft="eagle", k=2), dict(draft="vanilla", k=2, reuse_modules=True, verify="sample", seed=[3, 4, 5]),
                                dict(draft="eagle", k=2, tree="2x1")])
def test_the_engines_row_histograms_agree_with_the_step_events(tiny_model, kw):
    """mtp-eval records `GenerateResult.row_accepted_hist` (device counters); rebuilt from the step events (what it
    did before) they are the same, and the rows add up to the run's histogram."""
    import mtp
    from eval.breakdown import StepLog

    ids = [[5, 9, 30], [7, 7, 7, 7, 12], [40, 41]]
    steps = StepLog(len(ids))
    res = mtp.generate(tiny_model, ids, 12, on_step=steps, **kw)
    assert res.row_accepted_hist == steps.hists(2)
    assert [sum(c) for c in zip(*res.row_accepted_hist)] == res.metrics.accepted_hist
    assert sum(res.metrics.accepted_hist) == res.metrics.row_steps > len(ids)


def test_sample_records_parse_tool_calls():
    from eval.run import _tool_calls
    from mtp.text.dsml import tool_calls_text

    calls = [{"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]
    assert _tool_calls("ok" + tool_calls_text(calls, "t"), thinking=False) == calls
    assert _tool_calls("r</think>a" + tool_calls_text(calls, "t")[:-4], thinking=True) is None  # cut off
    assert _tool_calls("just text", thinking=False) == []


# ---------------------------------------------------------------------------------------------- in process
@pytest.fixture
def in_process(monkeypatch):
    """`python -m eval.run ARGS` as the Hydra app in this process, so a drafter or verifier the test registers is the
    app's too (a subprocess would not see it); returns the exit status. Hydra's logging set-up (the run's run.log
    handler) and the model the app keeps for a sweep's next job are undone afterwards."""
    import logging

    import eval.run as run

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level

    def go(args: list[str]) -> int:
        monkeypatch.setattr(sys, "argv", ["mtp-eval", *args])
        try:
            run.main()
        except SystemExit as e:  # a refused or failed run (RunExit)
            return e.code
        return 0

    yield go
    run._BUILT.clear()
    for h in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(h)
        h.close()
    for h in handlers:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(level)


def test_a_registered_drafter_runs_end_to_end(in_process, registered, tmp_path, capsys):
    """A drafter registered after eval/ was imported (tests/draft/test_modes.py's `first_module`) is one override away:
    the run's metrics and samples name it, and under strict verification its outputs are the greedy baseline's token
    for token. An unregistered name is refused listing the registered ones: exit 2, one line, no run folder left."""
    from tests.draft.test_modes import FirstModule

    registered(FirstModule())
    run = tmp_path / "run"
    assert in_process(["draft=vanilla", "draft.name=first_module", "draft.k=2", "dataset.limit=2", "baseline=true",
                       "plots=false", *FAST, f"hydra.run.dir={run}"]) == 0
    m = json.loads((run / "metrics.json").read_text())
    assert (m["run"]["draft"], m["run"]["k"], m["config"]["draft"]["name"]) == ("first_module", 2, "first_module")
    assert len(m["per_position"]) == 2 and m["overall"]["count/draft_forwards"] > 0
    spec, base = _samples(run / "samples.jsonl"), _samples(run / "baseline.jsonl")
    assert {s["batch_metrics"]["draft"] for s in spec} == {"first_module"}
    assert {s["batch_metrics"]["draft"] for s in base} == {"none"}
    assert {s["id"]: s["tokens"] for s in spec} == {s["id"]: s["tokens"] for s in base} and len(spec) == 2
    assert m["strict_mismatch"] == {"count": 0, "ids": []}
    assert "first_module k=2 strict" in capsys.readouterr().out

    refused = tmp_path / "refused"
    assert in_process(["draft.name=medusa", *FAST, f"hydra.run.dir={refused}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "mtp-eval: error: draft.name = 'medusa' is invalid: expected one of none, vanilla, eagle, first_module"]
    assert not refused.exists()


def test_typical_verification_runs_from_its_conf_file(in_process, tmp_path):
    """`verify=typical` (conf/verify/typical.yaml) on the bundled model: its options reach the run, and its outputs are
    compared with a strict greedy reference (it is lossy, and its baseline would be its own)."""
    run = tmp_path / "run"
    assert in_process(["verify=typical", "verify.posterior_alpha=0.2", "dataset.limit=2", "baseline=false", *FAST,
                       f"hydra.run.dir={run}"]) == 0
    m = json.loads((run / "metrics.json").read_text())
    assert m["run"]["verify"] == "typical" and m["strict_reference"] == "strict_reference.jsonl"
    assert {k: m["config"]["verify"][k] for k in ("temperature", "posterior_threshold", "posterior_alpha")} == \
        {"temperature": 1.0, "posterior_threshold": 0.09, "posterior_alpha": 0.2}
    assert m["overall"]["quality/strict_compared"] == 2 and m["strict_mismatch"] is None
    assert {s["batch_metrics"]["verify"] for s in _samples(run / "samples.jsonl")} == {"typical"}
    assert {s["batch_metrics"]["verify"] for s in _samples(run / "strict_reference.jsonl")} == {"strict"}


def test_only_a_greedy_verifier_is_held_to_the_baselines_tokens(in_process, tmp_path):
    """`verify.name=typical` in the strict group (how a registered verifier without a conf file runs): its registration,
    not the group's schema, says whether its outputs must equal the greedy baseline's; typical's need not (lossy), so
    no strict mismatch is counted, and its baseline is its own rule without drafts."""
    run = tmp_path / "run"
    assert in_process(["verify.name=typical", "dataset.limit=2", "baseline=true", "compare_strict=false", *FAST,
                       f"hydra.run.dir={run}"]) == 0
    m = json.loads((run / "metrics.json").read_text())
    assert m["run"]["verify"] == "typical" and m["strict_mismatch"] is None and m["baseline"] is not None


# ---------------------------------------------------------------------------------------------- verifier cost
def test_sweep_over_verifiers_measures_their_cost_against_strict(tmp_path):
    """strict, relaxed and sample on the arithmetic suite (answers): relaxed-only accepts, agreement with
    the strict greedy outputs (relaxed: the greedy baseline; sample: a strict reference run), accuracy,
    and in the sweep summary the speed spread next to them."""
    sweep = tmp_path / "sweep"
    r = mtp_eval(["-m", "verify=strict,relaxed,sample", "dataset.suites=[arithmetic]", "dataset.limit=2",
                  "thinking=true", "baseline=true", *FAST, "max_new_tokens=8", "timing.repeats=2",
                  f"hydra.sweep.dir={sweep}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = {json.loads((d / "metrics.json").read_text())["run"]["verify"]: d for d in sweep.iterdir() if d.is_dir()}
    m = {v: json.loads((d / "metrics.json").read_text()) for v, d in jobs.items()}
    tokens = {v: {s["id"]: s["tokens"] for s in _samples(d / "samples.jsonl")} for v, d in jobs.items()}
    base_tokens = {v: {s["id"]: s["tokens"] for s in _samples(d / "baseline.jsonl")} for v, d in jobs.items()}
    ref = _samples(jobs["sample"] / "strict_reference.jsonl")

    # strict speculation == plain greedy == the relaxed run's baseline == the sample run's strict reference
    assert tokens["strict"] == base_tokens["strict"] == base_tokens["relaxed"]
    assert {s["id"]: s["tokens"] for s in ref} == tokens["strict"]
    assert {s["batch_metrics"]["verify"] for s in ref} == {"strict"} and {s["batch_metrics"]["draft"] for s in ref} \
        == {"none"}
    assert m["strict"]["strict_mismatch"]["count"] == 0 and m["strict"]["overall"]["quality/strict_identical"] == 2
    assert not (jobs["relaxed"] / "strict_reference.jsonl").exists()  # its greedy baseline serves
    assert (m["relaxed"]["strict_reference"], m["sample"]["strict_reference"]) == \
        ("baseline.jsonl", "strict_reference.jsonl")

    for v in ("relaxed", "sample"):
        o = m[v]["overall"]
        recs = _samples(jobs[v] / "samples.jsonl")
        assert o["accept/relaxed_only"] == sum(s["batch_metrics"]["relaxed_only_accepts"] for s in recs)
        assert o["accept/relaxed_only_share"] == pytest.approx(o["accept/relaxed_only"] / o["count/accepted_drafts"])
        same = sum(tokens[v][i] == tokens["strict"][i] for i in tokens[v])
        assert (o["quality/strict_compared"], o["quality/strict_identical"]) == (2, same)
        assert 0 <= o["quality/strict_token_agreement"] <= 1
        assert o["quality/answered"] == 2 and 0 <= o["quality/accuracy"] <= 1
        assert m[v]["baseline"]["overall"]["quality/answered"] == 2
        assert o["quality/strict_accuracy"] == m["strict"]["overall"]["quality/accuracy"]
    assert "relaxed-only" in r.stdout and "not argmax" in r.stdout and "= strict" in r.stdout
    assert "strict acc." in r.stdout and "task accuracy" in r.stdout

    rows = {row["verify"]: row for row in json.loads((sweep / "sweep_summary.json").read_text())}
    for v, row in rows.items():
        assert row["repeats"] == 2 and row["speedup_decode_min"] <= row["speedup_decode"] <= row["speedup_decode_max"]
        assert row["base/decode_tok_s"] == m[v]["baseline"]["overall"]["speed/decode_tok_s"]
        assert row["accuracy"] == m[v]["overall"]["quality/accuracy"]
    assert rows["relaxed"]["strict_token_agreement"] == m["relaxed"]["overall"]["quality/strict_token_agreement"]
    assert rows["strict"]["relaxed_only_share"] is None


def test_answer_extraction_gsm8k_style():
    from eval.quality import is_correct, last_number, predicted_answer

    assert last_number("She pays 3 * 4 = 12, then 12 + 2 = 14 dollars.") == 14
    assert last_number("#### 1,234") == 1234 and last_number("-3.5 degrees") == -3.5 and last_number("none") is None
    assert predicted_answer("<think>maybe 12 or 13</think> The answer is 14.") == 14
    assert predicted_answer("thinking about 12 and 14</think> no digits after") == 14  # fall back to all text
    assert is_correct("so the total is 1,234.", "First 1000, then 234 more.\n#### 1234")
    assert is_correct("The answer is 14.0", "14") and not is_correct("The answer is 15", "14")
    assert not is_correct("no number here", "14")
    with pytest.raises(ValueError, match="no number"):
        is_correct("14", "fourteen")


def test_agreement_and_accuracy_per_category():
    from eval.aggregate import metrics_json

    def rec(pid, cat, toks, output, answer):
        r = _timed_record(pid, f"b{pid}", cat, [10.0], 2)
        r.update(tokens=toks, output=output, answer=answer)
        r["batch_metrics"]["relaxed_only_accepts"] = 2  # of 10 accepted drafts (hist: 5 steps accepting 2)
        return r

    spec = [rec("a", "x", [1, 2, 3, 4], "is 14", "14"), rec("b", "x", [1, 9, 9, 9], "is 5", "6"),
            rec("c", "y", [7, 7], "7", None)]
    strict = [rec("a", "x", [1, 2, 3, 4], "is 14", "14"), rec("b", "x", [1, 2, 3, 4, 5], "is 6", "6"),
              rec("c", "y", [7, 7], "7", None)]
    m = metrics_json({"verify": "relaxed"}, spec, strict, compare_tokens=False, strict_records=strict,
                     strict_source="baseline.jsonl")
    o, x = m["overall"], m["per_category"]["x"]
    assert (o["quality/strict_compared"], o["quality/strict_identical"]) == (3, 2)
    assert o["quality/strict_token_agreement"] == pytest.approx((4 + 1 + 2) / (4 + 5 + 2))
    assert x["quality/strict_token_agreement"] == pytest.approx((4 + 1) / (4 + 5))
    assert (o["quality/answered"], o["quality/correct"], o["quality/accuracy"]) == (2, 1, 0.5)
    assert o["quality/strict_accuracy"] == 1.0 and m["baseline"]["overall"]["quality/accuracy"] == 1.0
    assert "quality/accuracy" not in m["per_category"]["y"]  # no answers there
    assert (o["accept/relaxed_only"], o["count/accepted_drafts"], o["accept/relaxed_only_share"]) == (6, 30, 0.2)
    assert m["strict_reference"] == "baseline.jsonl"


def test_strict_reference_is_plain_greedy_and_relaxed_baseline_is_greedy():
    import types

    from eval import run

    relaxed = {"draft": "eagle", "k": 2, "verify": "relaxed", "top_n": 10, "delta": 0.6, "think_ids": (1, 2),
               "target_hidden": "normed", "chain_hidden": "normed", "reuse_modules": False}
    assert run._baseline_kwargs(relaxed) == {"draft": "none", "k": 0, "verify": "strict"}
    sample = {"draft": "eagle", "k": 2, "verify": "sample", "temperature": 0.7, "top_p": 0.9, "top_k": 0, "seed": 1,
              "draft_sampling": "sample", "prefill_chunk": 64}
    assert run._baseline_kwargs(sample)["verify"] == "sample"  # the speed baseline samples too
    assert run._strict_kwargs(sample) == {"draft": "none", "k": 0, "verify": "strict", "prefill_chunk": 64}

    def cfg(verify, baseline, compare=True):
        return types.SimpleNamespace(verify=types.SimpleNamespace(name=verify), baseline=baseline,
                                     compare_strict=compare)

    assert [run.strict_source(cfg(v, b)) for v in ("strict", "relaxed", "sample") for b in (True, False)] == \
        ["base", None, "base", "ref", "ref", "ref"]
    assert run.strict_source(cfg("sample", True, compare=False)) is None


def test_prompts_carry_their_reference_answer(tmp_path):
    from eval.data import load_prompts, to_prompts
    from eval.schema import BuiltinDatasetSchema, LocalDatasetSchema

    arith = load_prompts(BuiltinDatasetSchema(name="builtin", suites=["arithmetic"]))
    assert len(arith) == 12 and all(p.answer is not None and float(p.answer) for p in arith)
    assert all(p.answer is None for p in load_prompts(BuiltinDatasetSchema(name="builtin", suites=["chat"])))
    ds = LocalDatasetSchema(name="local", path="x.jsonl")
    assert to_prompts({"prompt": "2+2?", "answer": 4}, 0, ds, None, None)[0].answer == "4"


# ---------------------------------------------------------------------------------------------- degenerate outputs
def _spec_rec(pid: str, cat: str, tokens: list[int], batch: str) -> dict:
    from mtp.decode.metrics import SpecMetrics

    m = SpecMetrics(k=2, draft="eagle", verify="strict", n_rows=1, new_tokens=len(tokens),
                    accepted_hist=[0, 0, len(tokens) // 3], target_forwards=len(tokens) // 3, row_steps=len(tokens) // 3)
    return {"id": pid, "category": cat, "batch": batch, "tokens": tokens, "finish_reason": "length",
            "batch_metrics": m.raw(), "batch_wall_s": 1.0, "row_accepted_hist": m.accepted_hist}


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
