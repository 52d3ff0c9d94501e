"""Prompt sources offline: MT-Bench / SpecBench `turns` rows as multi-turn conversations, the bundled benchmark
subsets with their licences, and mtp-eval answering every turn of a bundled MT-Bench question. Every bad row is
refused by file, line, row and id."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval.data import BENCHMARKS_DIR, DataError, conversation, load_prompts
from eval.run import plan_batches
from eval.schema import BundledDatasetSchema, FieldMap, LocalDatasetSchema
from mtp.text.tokenizer import END_THINK, EOS

from .test_run import _samples, mtp_eval

SPECBENCH = [{"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now make it rhyme."]},
             {"question_id": 82, "category": "math", "turns": ["What is 2+3?"]}]


def _local(tmp_path: Path, rows: list[dict], **kw) -> LocalDatasetSchema:
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return LocalDatasetSchema(name="specbench", path=str(path), fields=FieldMap(id="question_id"), **kw)


def test_turns_rows_become_one_prompt_per_turn(tmp_path):
    prompts = load_prompts(_local(tmp_path, SPECBENCH))
    assert [(p.id, p.turn, p.follows, p.category) for p in prompts] == [
        ("81/t1", 1, None, "writing"), ("81/t2", 2, "81/t1", "writing"), ("82/t1", 1, None, "math")]
    by_id = {p.id: p for p in prompts}
    # turn 2 is asked after turn 1's answer (the end-of-sentence token left out)
    msgs = conversation(by_id["81/t2"], by_id, {"81/t1": f"An old pond.{EOS}"})
    assert msgs == [{"role": "user", "content": "Write a haiku."}, {"role": "assistant", "content": "An old pond."},
                    {"role": "user", "content": "Now make it rhyme."}]
    p1 = by_id["81/t1"]
    thinking = {p.id: p for p in load_prompts(_local(tmp_path, SPECBENCH), thinking=True)}
    for output, answer in ((f"hmm{END_THINK}An old pond.{EOS}", "An old pond."), ("hmm, still think", "")):
        assert conversation(thinking["81/t2"], thinking, {"81/t1": output})[1]["content"] == answer  # no reasoning
    assert conversation(p1, by_id, {}) == p1.messages
    with pytest.raises(DataError, match="turn 2 needs the answer to 81/t1"):
        conversation(by_id["81/t2"], by_id, {})
    # limit counts rows: a conversation is kept whole; turn 2 batches come after turn 1's
    assert [p.id for p in load_prompts(_local(tmp_path, SPECBENCH, limit=1))] == ["81/t1", "81/t2"]
    order = [p.id for _, b in plan_batches(prompts, 4) for p in b]
    assert order.index("81/t2") > order.index("81/t1")


def test_a_row_without_prompt_fields_names_all_three(tmp_path):
    with pytest.raises(DataError, match=r"needs column 'messages' \(messages\), 'prompt' \(prompt text\) or "
                                        r"'turns' \(user turns\); it has \['question_id', 'text'\]"):
        load_prompts(_local(tmp_path, [{"question_id": 1, "text": "hi"}]))
    with pytest.raises(DataError, match="column 'turns' must be a non-empty list of user messages"):
        load_prompts(_local(tmp_path, [{"question_id": 1, "turns": "hi"}]))


@pytest.mark.parametrize("name, file, n_rows, fields", [
    ("mtbench", "mtbench/question.jsonl", 16, FieldMap(id="question_id", prompt=None, messages=None)),
    ("humaneval", "humaneval/HumanEval.jsonl", 16, FieldMap(id="task_id", messages=None, turns=None)),
    ("gsm8k", "gsm8k/test.jsonl", 32, FieldMap(id=None, prompt="question", messages=None, turns=None)),
])
def test_bundled_benchmarks_load_offline_with_their_licence(name, file, n_rows, fields, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prompts = load_prompts(BundledDatasetSchema(name=name, file=file, fields=fields))
    assert sum(p.turn == 1 for p in prompts) == n_rows
    assert (BENCHMARKS_DIR / file).parent.joinpath("LICENSE.txt").is_file()
    if name == "mtbench":
        assert len(prompts) == 32 and len({p.category for p in prompts}) == 8


def test_mtp_eval_answers_every_turn_of_bundled_mtbench(tmp_path):
    out = tmp_path / "run"
    r = mtp_eval(["dataset=mtbench", "dataset.limit=1", "model.numerics=dequant", "max_new_tokens=4",
                  "runtime.warmup=false", "timing.repeats=1", "plots=false", f"output_dir={out}",
                  f"hydra.run.dir={out}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = {s["id"]: s for s in _samples(out / "samples.jsonl")}
    assert sorted(recs) == ["81/t1", "81/t2"]
    # turn 2's prompt holds turn 1, its answer and the new question
    assert recs["81/t2"]["prompt_tokens"] > recs["81/t1"]["prompt_tokens"] + 10
    metrics = json.loads((out / "metrics.json").read_text())
    assert list(metrics["per_category"]) == ["writing"]


def test_parquet_and_hub_without_datasets_name_the_extra(tmp_path, monkeypatch):
    import sys

    from mtp.utils import MissingExtraError

    monkeypatch.setitem(sys.modules, "datasets", None)
    (tmp_path / "p.parquet").write_bytes(b"PAR1")
    with pytest.raises(MissingExtraError, match=r"a Parquet file needs 'datasets'.*pip install 'mtp\[datasets\]'"):
        load_prompts(LocalDatasetSchema(name="local", path=str(tmp_path / "p.parquet")))
    assert len(load_prompts(_local(tmp_path, SPECBENCH))) == 3  # JSON lines need no extra


def test_joblib_launcher_without_its_plugin_names_the_extra(monkeypatch):
    import importlib.util

    from eval.common import check_launcher

    check_launcher(["hydra/launcher=joblib"])  # installed here (the test extra): nothing to say
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("hydra_plugins.hydra_joblib") else real(name, *a))
    check_launcher(["draft.k=2"])
    with pytest.raises(SystemExit, match=r"needs hydra-joblib-launcher.*pip install 'mtp\[sweeps\]'"):
        check_launcher(["-m", "hydra/launcher=joblib", "draft.k=1,2"])

    def no_namespace(name, *a):  # no hydra plugin installed at all: the parent package is missing too
        raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")

    monkeypatch.setattr(importlib.util, "find_spec", no_namespace)
    with pytest.raises(SystemExit, match=r"pip install 'mtp\[sweeps\]'"):
        check_launcher(["hydra/launcher=joblib"])


# ------------------------------------------------------------------------------------------ bad rows
def _rows_file(tmp_path, lines: list[str]) -> LocalDatasetSchema:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return LocalDatasetSchema(name="mine", path=str(path))


def _row(**kw) -> str:
    return json.dumps({"id": "a", "prompt": "hi", **kw})


def test_thinking_column_is_a_strict_boolean(tmp_path):
    """A row "thinking": "false" used to run with thinking on (bool("false") is True)."""
    assert [p.thinking for p in load_prompts(_rows_file(tmp_path, [_row(thinking=False)]))] == [False]
    assert [p.thinking for p in load_prompts(_rows_file(tmp_path, [_row(thinking=True)]))] == [True]
    for bad in ("false", 0, "yes"):
        with pytest.raises(DataError, match=rf"dataset mine row 0 \(id 'a'\): column 'thinking' = {bad!r} must be "
                                            "true or false"):
            load_prompts(_rows_file(tmp_path, [_row(thinking=bad)]))


def test_malformed_jsonl_names_file_and_line(tmp_path):
    ds = _rows_file(tmp_path, [_row(), '{"id": "b", "prompt": '])
    with pytest.raises(DataError, match=r"rows\.jsonl:2: not valid JSON"):
        load_prompts(ds)
    with pytest.raises(DataError, match=r"rows\.jsonl:1: a row must be a JSON object, got list"):
        load_prompts(_rows_file(tmp_path, ["[1, 2]"]))


def test_empty_jsonl_is_named(tmp_path):
    with pytest.raises(DataError, match=r"rows\.jsonl: empty \(no rows\)"):
        load_prompts(_rows_file(tmp_path, ["", "  "]))


def test_unknown_role_names_row_id_and_message(tmp_path):
    row = json.dumps({"id": "q7", "messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]})
    with pytest.raises(DataError, match=r"row 0 \(id 'q7'\): messages\[1\]\.role = 'bot' is not one of \['system'"):
        load_prompts(_rows_file(tmp_path, [row]))
