"""Draft vocabularies: let the MTP draft head score only the N most frequent tokens (FR-Spec style).

Each draft forward of the real model reads the 1.85 GB bf16 shared head (129,280 rows) to pick one token;
on an H100 that is ~0.65 ms of a ~1.4 ms MTP forward (BENCHMARKS.md). Scoring only the N most frequent
tokens reads N / 129,280 of it. Verification is untouched: the target model still scores the full vocabulary,
so strict decoding stays lossless and the sampling verifier stays exact (the draft distribution is the
softmax over the N tokens, zero elsewhere, and rejection sampling corrects any proposal distribution);
only acceptance can drop, when the target's token lies outside the N.

A vocabulary file is JSON: {"ids": [most frequent first, ...], "counts": [...], "tokenizer": ..., "tokens": ...}.
`mtp-draft-vocab --checkpoint CKPT --data FILES... --out vocab.json` counts tokens over text files
(.txt: one document per file line; .json / .jsonl: a text field) with the checkpoint's tokenizer; a bad file
or option is one line naming it, exit 2, and nothing written.
"""

from __future__ import annotations

import argparse
import json
import sys
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from ..utils import write_json_atomic


def load_ids(path: str | Path, size: int | None = None) -> tuple[int, ...]:
    """The first `size` ids (all when None) of a vocabulary file, most frequent first."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"draft vocabulary {p}: cannot read it as JSON ({e})") from None
    ids = raw.get("ids") if isinstance(raw, dict) else raw
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"draft vocabulary {p}: want a JSON list of token ids or {{\"ids\": [...]}}")
    if size is not None:
        if size < 1:
            raise ValueError(f"draft vocabulary size must be >= 1, got {size}")
        if size > len(ids):
            raise ValueError(f"draft vocabulary {p} holds {len(ids)} ids, {size} were asked for")
        ids = ids[:size]
    return tuple(ids)


def check_ids(ids: Sequence[int], vocab_size: int) -> None:
    if not ids:
        raise ValueError("draft vocabulary is empty")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"draft vocabulary: ids outside the model's vocabulary [0, {vocab_size}): {bad[:5]}")
    if len(set(ids)) != len(ids):
        raise ValueError("draft vocabulary: ids must be distinct")


def parallel_world(head, vocab_size: int, what: str) -> int:
    """The world of a vocabulary-parallel head (rank r holds rows [r V/W, (r+1) V/W) and gathers by `head.comm`), or
    a ValueError naming `what` for a head holding neither every row nor such a shard."""
    rows, comm = head.weight.shape[0], getattr(head, "comm", None)
    world = comm.world if comm is not None else 0
    if world < 2 or vocab_size % world or rows != vocab_size // world:
        raise ValueError(f"{what}: the head holds {rows} of {vocab_size} rows and is not a vocabulary-parallel head")
    return world


def kept_per_head(cache: weakref.WeakKeyDictionary, head, key, make):
    """cache[head][key], made by `make()` the first time: one per (head, key), shared by every proposer that asks;
    the last two keys per head are kept, for as long as the head lives."""
    per_head = cache.setdefault(head, {})
    made = per_head.pop(key, None) or make()
    per_head[key] = made
    while len(per_head) > 2:
        del per_head[next(iter(per_head))]
    return made


class SubHead:
    """Logits over a draft vocabulary from an MTP module's head: `self(x [..., D]) -> [..., M]`, where entry m
    stands for model id `ids_M[m]`, or for nothing when `ids_M[m]` is -1 (padding, logit -inf).

    One rank: the head's rows of the N ids, copied once ([N, D]). Vocabulary-parallel head (rank r of W holds
    rows [r V/W, (r+1) V/W)): each rank keeps the rows of the ids in its slice, zero-padded to the largest
    slice's count n, and the ranks' [.., n] logits are all-gathered in rank order, the same layout the full
    head uses; `ids_M` ([W * n]) is the same on every rank (computed from the ids, no communication)."""

    def __init__(self, head, ids: Sequence[int], vocab_size: int, device):
        w = head.weight
        ids_t = torch.tensor(ids, dtype=torch.long, device=device)
        comm = getattr(head, "comm", None)
        if w.shape[0] == vocab_size:
            self.weight, self.comm, self.ids_M = w.index_select(0, ids_t).contiguous(), None, ids_t
            return
        world = parallel_world(head, vocab_size, "draft vocabulary")
        Vl = vocab_size // world
        per_rank = [ids_t[(ids_t >= r * Vl) & (ids_t < (r + 1) * Vl)] for r in range(world)]
        n = max(1, max(len(p) for p in per_rank))
        ids_M = torch.full((world, n), -1, dtype=torch.long, device=device)
        for r, p in enumerate(per_rank):
            ids_M[r, : len(p)] = p
        mine = per_rank[comm.rank] - comm.rank * Vl
        self.weight = w.new_zeros(n, w.shape[1])
        self.weight[: len(mine)] = w.index_select(0, mine)
        self.comm, self.ids_M = comm, ids_M.flatten()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight.to(x.dtype))
        if self.comm is None:
            return y
        return self.comm.all_gather_last(y).masked_fill(self.ids_M < 0, float("-inf"))


_SUBHEADS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, SubHead]]" = weakref.WeakKeyDictionary()


def shared_sub_head(head, ids: tuple[int, ...], vocab_size: int, device) -> SubHead:
    """One `SubHead` per (head, ids), shared by every proposer that asks (an engine keeps one proposer per
    buffer bucket; the real model's rows for 32k ids are 470 MB per copy). The last two vocabularies per head
    are kept, for as long as the head lives; they are copies, so weights changed in place afterwards (training)
    are not seen: `_SUBHEADS.clear()` drops them."""
    return kept_per_head(_SUBHEADS, head, ids, lambda: SubHead(head, ids, vocab_size, device))


def count_tokens(encode, texts: Iterable[str]) -> Counter:
    c: Counter = Counter()
    for t in texts:
        c.update(encode(t))
    return c


def top_ids(counts: Counter, size: int, always: Iterable[int] = ()) -> list[int]:
    """`always` (special tokens such as EOS and the think markers) first, then the most frequent ids; ties
    toward the lower id, so the list is reproducible."""
    head = list(dict.fromkeys(always))
    rest = sorted((i for i in counts if i not in set(head)), key=lambda i: (-counts[i], i))
    return (head + rest)[:size]


DEFAULT_SIZE = 32768  # mtp-draft-vocab --size


class InputError(ValueError):
    """A file or option of `mtp-draft-vocab` is unusable (the message names it)."""


def documents(path: str | Path, field: str = "text") -> Iterator[str]:
    """The non-empty documents of a local file: .jsonl one JSON object per line, .json a JSON array of objects
    (or JSON lines), both taking the string `field`; any other file one document per line. InputError names
    the file and the line or row at fault, or that the file holds no text."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{p}: no such file")
    if not p.is_file():
        raise InputError(f"{p}: not a file")
    found = False
    try:
        for t in _json_texts(p, field) if p.suffix in (".json", ".jsonl") else _lines(p):
            if t:
                found = True
                yield t
    except OSError as e:
        raise InputError(f"{p}: cannot read it ({e.strerror or e})") from None
    if not found:
        raise InputError(f"{p}: holds no text" + (f" in field {field!r}" if p.suffix in (".json", ".jsonl") else ""))


def _numbered_lines(p: Path) -> Iterator[tuple[int, str]]:
    with open(p, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                yield n, raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                raise InputError(f"{p} line {n}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _lines(p: Path) -> Iterator[str]:
    return (line for _, line in _numbered_lines(p))


def _json_texts(p: Path, field: str) -> Iterator[str]:
    rows: Iterable[tuple[str, object]]
    if p.suffix == ".json":
        try:
            whole = json.loads(p.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise InputError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except json.JSONDecodeError:
            whole = None  # JSON lines, as `datasets` reads a .json file too
        if whole is not None:
            if not isinstance(whole, list):
                raise InputError(f"{p}: want a JSON array of objects or JSON lines, got a {type(whole).__name__}")
            rows = ((f"row {n}", r) for n, r in enumerate(whole, 1))
    if p.suffix == ".jsonl" or whole is None:
        rows = _json_lines(p)
    for where, row in rows:
        if not isinstance(row, dict) or field not in row:
            keys = f" (fields: {sorted(row)})" if isinstance(row, dict) else f", got {row!r:.40}"
            raise InputError(f"{p} {where}: no field {field!r}{keys}; pick one with --field")
        if not isinstance(row[field], str):
            raise InputError(f"{p} {where}: field {field!r} = {row[field]!r:.40} must be a string")
        yield row[field]


def _json_lines(p: Path) -> Iterator[tuple[str, object]]:
    for n, line in _numbered_lines(p):
        if not line.strip():
            continue
        try:
            yield f"line {n}", json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{p} line {n}: not JSON ({e.msg}, column {e.colno})") from None


def _check_out(out: Path, force: bool) -> None:
    if out.is_dir():
        raise InputError(f"--out {out} is a folder; name the file to write")
    if not out.parent.is_dir():
        raise InputError(f"--out {out}: {out.parent}: no such folder")
    if out.exists() and not force:
        raise InputError(f"--out {out} exists; pass --force to replace it")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mtp-draft-vocab", description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True, help="checkpoint folder (config.json and the tokenizer)")
    ap.add_argument("--data", nargs="+", required=True, help=".txt / .json / .jsonl files")
    ap.add_argument("--field", default="text", help="text field of json/jsonl records")
    ap.add_argument("--size", type=int, default=None,
                    help=f"ids kept, most frequent first (default: {DEFAULT_SIZE} or the whole vocabulary if smaller)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--force", action="store_true", help="replace --out if it exists")
    a = ap.parse_args(argv)
    try:
        _run(a)
    except (InputError, ValueError, OSError) as e:  # ConfigError and the tokenizer's errors name their file
        print(f"mtp-draft-vocab: error: {e}", file=sys.stderr)
        return 2
    return 0


def _run(a: argparse.Namespace) -> None:
    from ..model.config import ModelConfig
    from ..text.tokenizer import Tokenizer, match_model

    if a.size is not None and a.size < 1:
        raise InputError(f"--size = {a.size} must be >= 1")
    out = Path(a.out)
    _check_out(out, a.force)
    config = Path(a.checkpoint) / "config.json"
    vocab_size = ModelConfig.from_json(config).vocab_size
    if a.size is not None and a.size > vocab_size:
        raise InputError(f"--size = {a.size} exceeds the model's vocab_size {vocab_size} ({config})")
    size = min(DEFAULT_SIZE, vocab_size) if a.size is None else a.size
    tok = Tokenizer.from_dir(a.checkpoint)
    match_model(tok, vocab_size, config)  # so every id counted below is one the model has
    counts = count_tokens(tok.encode, (t for f in a.data for t in documents(f, a.field)))
    specials = [i for i in (tok.eos_id, tok.think_id, tok.end_think_id, tok.bos_id) if i is not None]
    ids = top_ids(counts, size, always=specials)
    total = sum(counts.values())
    covered = sum(counts[i] for i in ids)
    write_json_atomic(out, {"ids": ids, "counts": [counts[i] for i in ids], "tokenizer": str(a.checkpoint),
                            "data": list(a.data), "tokens_counted": total, "coverage": covered / total})
    print(f"{len(ids)} ids cover {100 * covered / total:.2f}% of {total} tokens -> {out}")


if __name__ == "__main__":
    raise SystemExit(main())
