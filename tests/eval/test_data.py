"""Dataset rows -> prompts: every bad row refused by file, line, row and id (eval/data.py)."""

from __future__ import annotations

import json

import pytest

from eval.data import DataError, load_prompts
from eval.schema import LocalDatasetSchema


def _local(tmp_path, lines: list[str]) -> LocalDatasetSchema:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return LocalDatasetSchema(name="mine", path=str(path))


def _row(**kw) -> str:
    return json.dumps({"id": "a", "prompt": "hi", **kw})


def test_thinking_column_is_a_strict_boolean(tmp_path):
    """A row "thinking": "false" used to run with thinking on (bool("false") is True)."""
    assert [p.thinking for p in load_prompts(_local(tmp_path, [_row(thinking=False)]))] == [False]
    assert [p.thinking for p in load_prompts(_local(tmp_path, [_row(thinking=True)]))] == [True]
    for bad in ("false", 0, "yes"):
        with pytest.raises(DataError, match=rf"dataset mine row 0 \(id 'a'\): column 'thinking' = {bad!r} must be "
                                            "true or false"):
            load_prompts(_local(tmp_path, [_row(thinking=bad)]))


def test_malformed_jsonl_names_file_and_line(tmp_path):
    ds = _local(tmp_path, [_row(), '{"id": "b", "prompt": '])
    with pytest.raises(DataError, match=r"rows\.jsonl:2: not valid JSON"):
        load_prompts(ds)
    with pytest.raises(DataError, match=r"rows\.jsonl:1: a row must be a JSON object, got list"):
        load_prompts(_local(tmp_path, ["[1, 2]"]))


def test_empty_jsonl_is_named(tmp_path):
    with pytest.raises(DataError, match=r"rows\.jsonl: empty \(no JSONL rows\)"):
        load_prompts(_local(tmp_path, ["", "  "]))


def test_unknown_role_names_row_id_and_message(tmp_path):
    row = json.dumps({"id": "q7", "messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]})
    with pytest.raises(DataError, match=r"row 0 \(id 'q7'\): messages\[1\]\.role = 'bot' is not one of \['system'"):
        load_prompts(_local(tmp_path, [row]))
