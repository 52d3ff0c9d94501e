"""Prompt sets: the built-in suites, local JSONL/JSON/Parquet files and hub datasets -> `Prompt`s.

Every source yields rows (dicts); `dataset.fields` names the columns holding id, messages or prompt,
category, thinking and the reference answer (optional). Built-in suites are read with `json` (they are ours
and tiny; importing `datasets` costs ~2 s per process); everything else goes through `datasets.load_dataset`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtp.text.prompt import ROLES

from .common import reachable
from .schema import BuiltinDatasetSchema, DatasetSchema, LocalDatasetSchema

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "mtp" / "data" / "prompts"


class DataError(ValueError):
    """The dataset cannot be read or a row does not have what a prompt needs."""


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    messages: list  # [{"role", "content"}, ...]
    thinking: bool
    answer: str | None = None  # reference answer (task accuracy: its last number vs the output's)


def builtin_suites() -> list[str]:
    return sorted(p.stem for p in PROMPTS_DIR.glob("*.jsonl"))


def _builtin_rows(suites: Iterable[str]) -> Iterable[dict]:
    for suite in suites:
        path = PROMPTS_DIR / f"{suite}.jsonl"
        if not path.is_file():
            raise DataError(f"dataset.suites: no built-in suite {suite!r}; available: {builtin_suites()}")
        yield from _jsonl_rows(path)


def _jsonl_rows(path: Path) -> Iterable[dict]:
    """Rows of a JSONL file, each refused by its line number when it is not a JSON object."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read ({e})") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not lines:
        raise DataError(f"{path}: empty (no JSONL rows)")
    for n, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not valid JSON ({e})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{n}: a row must be a JSON object, got {type(row).__name__}")
        yield row


def _datasets_rows(ds: DatasetSchema) -> Iterable[dict]:
    local = isinstance(ds, LocalDatasetSchema)
    path = Path(ds.path).expanduser() if local else None
    if local and not path.is_file():
        raise DataError(f"dataset.path = {str(path)!r}: file not found")
    if local and path.suffix == ".jsonl":  # read here: rows and lines named (datasets' errors name neither)
        return _jsonl_rows(path)
    if not local and "HF_HUB_OFFLINE" not in os.environ and \
            not reachable(os.environ.get("HF_ENDPOINT", "https://huggingface.co")):
        os.environ["HF_HUB_OFFLINE"] = "1"  # cache only, instead of ~30 s of retries (read when datasets loads)
    import datasets

    datasets.disable_progress_bars()  # the run has its own progress bar
    try:
        if local:
            builder = "parquet" if path.suffix == ".parquet" else "json"
            data = datasets.load_dataset(builder, data_files=str(path), split="train", keep_in_memory=True)
        else:
            data = datasets.load_dataset(ds.hub, ds.subset, split=ds.split)
    except Exception as e:  # datasets raises many types (network, schema, missing split); name the source
        where = ds.path if local else \
            f"hub dataset {ds.hub!r} (subset {ds.subset}, split {ds.split}; needs network or a warm cache)"
        raise DataError(f"dataset {ds.name}: cannot load {where}: {type(e).__name__}: {e}") from None
    return iter(data)


def _get(row: dict, column: str | None) -> Any:
    return row.get(column) if column else None


def to_prompt(row: dict, index: int, ds: DatasetSchema, thinking: bool | None, system_prompt: str | None) -> Prompt:
    f = ds.fields
    where = f"dataset {ds.name} row {index}"
    messages = _get(row, f.messages)
    if messages is None:
        text = _get(row, f.prompt)
        if not isinstance(text, str):
            raise DataError(f"{where}: needs column {f.messages!r} (messages) or {f.prompt!r} (prompt text); "
                            f"it has {sorted(row)} (map them with dataset.fields.*)")
        messages = [{"role": "user", "content": text}]
    # Arrow fills absent struct keys with None; the prompt builder only wants role/content/reasoning.
    messages = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
    if system_prompt and not any(m.get("role") == "system" for m in messages):
        messages = [{"role": "system", "content": system_prompt}] + messages
    rid = _get(row, f.id)
    pid = str(rid) if rid is not None else f"{ds.name}-{index:05d}"
    where = f"dataset {ds.name} row {index} (id {pid!r})"
    for j, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise DataError(f"{where}: messages[{j}].role = {m.get('role')!r} is not one of {list(ROLES)}")
    row_thinking = _get(row, f.thinking)
    if row_thinking is not None and not isinstance(row_thinking, bool):  # bool("false") is True
        raise DataError(f"{where}: column {f.thinking!r} = {row_thinking!r} must be true or false (a JSON boolean)")
    answer = _get(row, f.answer)
    return Prompt(
        id=pid,
        category=str(_get(row, f.category) or ds.category or ds.name),
        messages=messages,
        thinking=bool(thinking if thinking is not None else (ds.thinking if row_thinking is None else row_thinking)),
        answer=None if answer is None else str(answer),
    )


def load_prompts(ds: DatasetSchema, thinking: bool | None = None, system_prompt: str | None = None) -> list[Prompt]:
    """The dataset's prompts after filtering (categories, per_category, limit); ids must be unique."""
    rows = _builtin_rows(ds.suites) if isinstance(ds, BuiltinDatasetSchema) else _datasets_rows(ds)
    prompts, per_cat, seen = [], {}, {}
    for i, row in enumerate(rows):
        p = to_prompt(row, i, ds, thinking, system_prompt)
        if ds.categories and p.category not in ds.categories:
            continue
        if ds.per_category is not None and per_cat.get(p.category, 0) >= ds.per_category:
            continue
        if p.id in seen:
            raise DataError(f"dataset {ds.name}: id {p.id!r} appears in rows {seen[p.id]} and {i}; ids must be "
                            "unique (resume and the baseline comparison match prompts by id)")
        seen[p.id] = i
        per_cat[p.category] = per_cat.get(p.category, 0) + 1
        prompts.append(p)
        if ds.limit is not None and len(prompts) >= ds.limit:
            break
    if not prompts:
        raise DataError(f"dataset {ds.name}: no prompts left (categories={list(ds.categories)})")
    return prompts
