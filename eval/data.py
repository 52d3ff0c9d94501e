"""Prompt sets: the built-in suites, the bundled benchmark subsets, local JSONL/JSON/Parquet files and hub
datasets -> `Prompt`s.

Every source yields rows (dicts); `dataset.fields` names the columns holding id, messages, prompt or turns,
category, thinking and the reference answer (optional). JSON lines / JSON files are read with `json` (importing
`datasets` costs ~2 s per process, and it is an optional extra); Parquet files and the hub go through
`datasets.load_dataset` (`pip install 'mtp[datasets]'`).

Multi-turn rows (MT-Bench / SpecBench `turns`: a list of user messages) become one `Prompt` per turn, with ids
`<id>/t1`, `<id>/t2`, ...; turn j+1 `follows` turn j, and its conversation is only known once turn j is answered:
`conversation()` builds it from the answers (the speculative run's outputs), as MT-Bench does.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtp.text.prompt import ROLES

from .common import reachable
from .schema import BuiltinDatasetSchema, BundledDatasetSchema, DatasetSchema, LocalDatasetSchema

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "mtp" / "data" / "prompts"
BENCHMARKS_DIR = PROMPTS_DIR.parent / "benchmarks"


class DataError(ValueError):
    """The dataset cannot be read or a row does not have what a prompt needs."""


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    messages: list  # [{"role", "content"}, ...]
    thinking: bool
    answer: str | None = None  # reference answer (task accuracy: its last number vs the output's)
    turn: int = 1  # multi-turn rows: which user turn this prompt asks
    follows: str | None = None  # the id of the turn before (its answer goes into this prompt)


def builtin_suites() -> list[str]:
    return sorted(p.stem for p in PROMPTS_DIR.glob("*.jsonl"))


def _builtin_rows(suites: Iterable[str]) -> Iterable[dict]:
    for suite in suites:
        path = PROMPTS_DIR / f"{suite}.jsonl"
        if not path.is_file():
            raise DataError(f"dataset.suites: no built-in suite {suite!r}; available: {builtin_suites()}")
        yield from _json_rows(path)


def _json_rows(path: Path) -> Iterable[dict]:
    """Rows of a JSON-lines file, or of a .json file holding a list of objects; each refused by its line number
    (its index for a .json list) when it is not a JSON object."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read ({e})") from None
    if path.suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(rows, list):
            raise DataError(f"{path}: expected a JSON list of rows, got {type(rows).__name__}")
        numbered = [(f": row {n}", row) for n, row in enumerate(rows)]
    else:
        numbered = []
        for n, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    numbered.append((f":{n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{n}: not valid JSON ({e})") from None
    if not numbered:
        raise DataError(f"{path}: empty (no rows)")
    for n, row in numbered:
        if not isinstance(row, dict):
            raise DataError(f"{path}{n}: a row must be a JSON object, got {type(row).__name__}")
        yield row


def _file_rows(ds: DatasetSchema) -> Iterable[dict]:
    """A bundled benchmark or a local .jsonl / .json file (Parquet goes through `datasets`)."""
    if isinstance(ds, BundledDatasetSchema):
        path, key = BENCHMARKS_DIR / ds.file, "dataset.file"
    else:
        path, key = Path(ds.path).expanduser(), "dataset.path"
    if not path.is_file():
        raise DataError(f"{key} = {str(path)!r}: file not found")
    return _json_rows(path)


def _datasets_rows(ds: DatasetSchema) -> Iterable[dict]:
    local = isinstance(ds, LocalDatasetSchema)
    path = Path(ds.path).expanduser() if local else None
    if local and not path.is_file():
        raise DataError(f"dataset.path = {str(path)!r}: file not found")
    if not local and "HF_HUB_OFFLINE" not in os.environ and \
            not reachable(os.environ.get("HF_ENDPOINT", "https://huggingface.co")):
        os.environ["HF_HUB_OFFLINE"] = "1"  # cache only, instead of ~30 s of retries (read when datasets loads)
    from mtp.utils import require

    datasets = require("datasets", "datasets", "a Parquet file" if local else f"hub dataset {ds.hub!r}")

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


def to_prompts(row: dict, index: int, ds: DatasetSchema, thinking: bool | None,
               system_prompt: str | None) -> list[Prompt]:
    """The prompt of a row, or one per turn of a multi-turn row."""
    f = ds.fields
    where = f"dataset {ds.name} row {index}"
    messages, turns = _get(row, f.messages), None
    if messages is None:
        text, turns = _get(row, f.prompt), _get(row, f.turns)
        if isinstance(text, str):
            turns = None
            messages = [{"role": "user", "content": text}]
        elif turns is not None:
            if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t for t in turns)):
                raise DataError(f"{where}: column {f.turns!r} must be a non-empty list of user messages (str), "
                                f"got {turns!r:.80}")
            messages = [{"role": "user", "content": turns[0]}]
        else:
            raise DataError(f"{where}: needs column {f.messages!r} (messages), {f.prompt!r} (prompt text) or "
                            f"{f.turns!r} (user turns); it has {sorted(row)} (map them with dataset.fields.*)")
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
    first = Prompt(
        id=pid,
        category=str(_get(row, f.category) or ds.category or ds.name),
        messages=messages,
        thinking=bool(thinking if thinking is not None else (ds.thinking if row_thinking is None else row_thinking)),
        answer=None if answer is None else str(answer),
    )
    if turns is None:
        return [first]
    out = [dataclasses.replace(first, id=f"{first.id}/t1")]
    for j, text in enumerate(turns[1:], start=2):
        out.append(dataclasses.replace(first, id=f"{first.id}/t{j}", messages=[{"role": "user", "content": text}],
                                       turn=j, follows=out[-1].id))
    return out


def answer_text(output: str, thinking: bool) -> str:
    """The answer of an output decoded with its special tokens: after `</think>` in thinking mode (nothing when
    the reasoning never ended), up to the end-of-sentence token. Earlier turns enter a prompt with their answer
    only (mtp.text.prompt)."""
    from mtp.text.tokenizer import END_THINK, EOS

    if thinking:
        _, found, output = output.partition(END_THINK)
        if not found:
            return ""
    return output.split(EOS, 1)[0]


def conversation(p: Prompt, by_id: dict[str, Prompt], outputs: dict[str, str]) -> list[dict]:
    """The messages of prompt `p`: for a later turn, the conversation of the turn before with its answer (from
    `outputs`, id -> output text) appended, then this turn's user message."""
    if p.follows is None:
        return list(p.messages)
    prev = by_id[p.follows]
    if prev.id not in outputs:
        raise DataError(f"prompt {p.id}: turn {p.turn} needs the answer to {prev.id}, which has not run")
    return conversation(prev, by_id, outputs) + [{"role": "assistant", "content": answer_text(outputs[prev.id],
                                                                                             prev.thinking)}] \
        + list(p.messages)


def load_prompts(ds: DatasetSchema, thinking: bool | None = None, system_prompt: str | None = None) -> list[Prompt]:
    """The dataset's prompts after filtering (categories, per_category, limit); ids must be unique."""
    if isinstance(ds, BuiltinDatasetSchema):
        rows = _builtin_rows(ds.suites)
    elif isinstance(ds, BundledDatasetSchema) or (isinstance(ds, LocalDatasetSchema)
                                                   and ds.path.endswith((".jsonl", ".json"))):
        rows = _file_rows(ds)
    else:
        rows = _datasets_rows(ds)
    prompts, per_cat, seen, n_rows = [], {}, {}, 0
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"dataset {ds.name} row {i}: expected an object, got {type(row).__name__}")
        turns = to_prompts(row, i, ds, thinking, system_prompt)
        cat = turns[0].category
        if ds.categories and cat not in ds.categories:
            continue
        if ds.per_category is not None and per_cat.get(cat, 0) >= ds.per_category:
            continue
        for p in turns:
            if p.id in seen:
                raise DataError(f"dataset {ds.name}: id {p.id!r} appears in rows {seen[p.id]} and {i}; ids must be "
                                "unique (resume and the baseline comparison match prompts by id)")
            seen[p.id] = i
        per_cat[cat] = per_cat.get(cat, 0) + 1
        prompts += turns
        n_rows += 1
        if ds.limit is not None and n_rows >= ds.limit:  # rows: a conversation is kept whole
            break
    if not prompts:
        raise DataError(f"dataset {ds.name}: no prompts left (categories={list(ds.categories)})")
    return prompts
