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
import zlib
from array import array
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


# Head rows a rank sends per build-time all-gather of a balanced draft head (`balanced_rows`): each call receives
# world x GATHER_ROWS rows, 117 MB at W = 8, D = 7168, bf16, where gathering the whole padded list at once would take
# W x 16160 rows, 1.85 GB, for a 32k list that leans to the low ids (rank 0 holds 16160 of them)
GATHER_ROWS = 1024


def rows_per_rank(ids: Sequence[int], vocab_size: int, world: int, by_shard: bool = False) -> int:
    """Rows of a draft vocabulary's head on each rank of a vocabulary-parallel head (`SubHead`): ceil(N / W) balanced,
    the largest shard's count of ids by shard (at least 1)."""
    if not by_shard:
        return -(-len(ids) // world)
    Vl = vocab_size // world
    return max(1, max(Counter(i // Vl for i in ids).values()))


class SubHead:
    """Logits over a draft vocabulary from an MTP module's head: `self(x [..., D]) -> [..., M]`, where entry m
    stands for model id `ids_M[m]`, or for nothing when `ids_M[m]` is -1 (padding, logit -inf).

    One rank: the head's rows of the N ids, copied once ([N, D]). Vocabulary-parallel head (rank r of W holds
    rows [r V/W, (r+1) V/W)): each rank holds n rows, its [.., n] logits are all-gathered in rank order and masked
    where `ids_M` ([W * n], the same on every rank, computed from the ids without communication) is -1.
    - balanced (the default): n = ceil(N / W), rank r holds the rows of ids[r n : (r + 1) n] in list order, the
      tail padded with zero rows (`balanced_rows`: rows held elsewhere come over `comm.all_gather_rows` once, here).
      `ids_M` is the list, padded to W n: the entries of one process in its order, so argmax ties break alike.
    - `by_shard`: rank r holds the ids of its own shard, zero-padded to the largest shard's count; no communication
      at build time, but a list that leans to the low ids (a BPE frequency list) leaves rank 0 nearly its whole
      shard, so the busiest rank reads about as many rows as the full head (BENCHMARKS.md session 23: no gain).
    Bytes read per draft forward on the busiest rank at N = 32768 ids, W = 8, D = 7168 (`mtp-bench --draft-vocab`
    scores ids 0..N-1, all in shards 0..2): by shard n = 16160 (the whole shard, as the full head), bf16 231.7 MB,
    FP8 (`head_fp8`) 115.8 MB; balanced n = 4096, bf16 58.7 MB, FP8 29.4 MB. At ~3.5 TB/s: 66.2 -> 16.8 us (bf16),
    33.1 -> 8.4 us (FP8) a draft forward; predicted -0.15 ms (bf16) / -0.07 ms (FP8) an eagle k = 3 step (3 draft
    forwards), plus the logits all-gather of [.., 8 n]: 4x smaller. Measured in one process on one TP=8 split rank
    (H200, 61 layers, 1k, `mtp-bench --tp 8 --draft-vocab 32768`, BENCHMARKS.md session 24): balanced against by
    shard -0.11 ms (bf16) / -0.08 to -0.09 ms (FP8) an eagle k = 3 step."""

    def __init__(self, head, ids: Sequence[int], vocab_size: int, device, by_shard: bool = False,
                 gather_rows: int = GATHER_ROWS):
        w = head.weight
        ids_t = torch.tensor(ids, dtype=torch.long, device=device)
        comm = getattr(head, "comm", None)
        if w.shape[0] == vocab_size:
            self.weight, self.comm, self.ids_M = w.index_select(0, ids_t).contiguous(), None, ids_t
            return
        world = parallel_world(head, vocab_size, "draft vocabulary")
        self.comm = comm
        if not by_shard:
            self.weight, self.ids_M = balanced_rows(w, ids, vocab_size, comm, gather_rows)
            self.ids_M = self.ids_M.to(device)
            return
        Vl = vocab_size // world
        per_rank = [ids_t[(ids_t >= r * Vl) & (ids_t < (r + 1) * Vl)] for r in range(world)]
        n = rows_per_rank(ids, vocab_size, world, by_shard=True)
        ids_M = torch.full((world, n), -1, dtype=torch.long, device=device)
        for r, p in enumerate(per_rank):
            ids_M[r, : len(p)] = p
        mine = per_rank[comm.rank] - comm.rank * Vl
        self.weight = w.new_zeros(n, w.shape[1])
        self.weight[: len(mine)] = w.index_select(0, mine)
        self.ids_M = ids_M.flatten()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight.to(x.dtype))
        if self.comm is None:
            return y
        return self.comm.all_gather_last(y).masked_fill(self.ids_M < 0, float("-inf"))


def check_same_ids(comm, ids: Sequence[int], device) -> None:
    """Raise on every rank alike when the ranks' id lists differ (their lengths or CRC-32s), before any collective
    whose count or shapes come from the ids: one all-gather of [1, 2] int64, the same call on every rank whatever the
    ids, so ranks that disagree fail together here instead of issuing different collectives and waiting. A rank that
    builds no SubHead while the others build one still leaves them waiting, as for any collective; every rank builds
    the same ones (`generate` runs on every rank of a sharded model, `mtp.distributed.driver`)."""
    mine_12 = torch.tensor([[len(ids), zlib.crc32(array("q", ids).tobytes())]], dtype=torch.long, device=device)
    got_W2 = comm.all_gather_rows(mine_12)
    if not torch.equal(got_W2, mine_12.expand_as(got_W2)):
        raise ValueError(f"draft vocabulary: the ranks hold different id lists ((length, CRC-32) by rank: "
                         f"{got_W2.tolist()}); every rank must pass the same ids")


def balanced_rows(w_VlD: torch.Tensor, ids: Sequence[int], vocab_size: int, comm,
                  gather_rows: int = GATHER_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of a balanced draft head (`SubHead`): (weight [n, D], ids_M [W n]), n = ceil(N / W), row m
    the head row of ids[rank n + m] (zeros past the list's end). w_VlD: this rank's shard of the head.

    Rank s sends the rows it holds of every rank's ids (the list positions p with ids[p] // Vl == s, ascending),
    `c` rows a call (zero-padded), and each rank keeps the received rows whose p falls in its range. Every rank
    computes the positions of every rank from the ids, so all issue ceil(max_s count_s / c) calls of [c, D]
    (c = min(gather_rows, max_s count_s)), after `check_same_ids`. Transient: the call's W c received rows and the
    c sent. Exact: rows are copied, never summed. On a simulated rank (torch's fake group, `parallel.simulate`) the
    gather moves nothing and the rows from other ranks are this rank's own sent rows: random weights anyway, the
    shapes and the bytes read per forward are the real rank's."""
    W, r = comm.world, comm.rank
    Vl, N, D = vocab_size // W, len(ids), w_VlD.shape[1]
    n = rows_per_rank(ids, vocab_size, W)
    dev = w_VlD.device
    check_same_ids(comm, ids, dev)
    held: list[list[int]] = [[] for _ in range(W)]  # held[s]: the list positions whose rows rank s holds
    for p, i in enumerate(ids):
        held[i // Vl].append(p)
    most = max(len(h) for h in held)
    c = max(1, min(gather_rows, most))
    lo = r * n
    out_nD = w_VlD.new_zeros(n, D)
    for start in range(0, most, c):
        send = held[r][start:start + c]
        send_cD = w_VlD.new_zeros(c, D)
        if send:
            rows = torch.tensor([ids[p] - r * Vl for p in send], dtype=torch.long, device=dev)
            send_cD[: len(send)] = w_VlD.index_select(0, rows)
        got_WcD = comm.all_gather_rows(send_cD)
        src, dst = [], []
        for s in range(W):
            for q, p in enumerate(held[s][start:start + c]):
                if lo <= p < lo + n:
                    src.append(s * c + q)
                    dst.append(p - lo)
        if src:
            out_nD[torch.tensor(dst, device=dev)] = got_WcD[torch.tensor(src, device=dev)]
    ids_M = torch.full((W * n,), -1, dtype=torch.long)
    ids_M[:N] = torch.tensor(ids, dtype=torch.long)
    return out_nD, ids_M


_SUBHEADS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, SubHead]]" = weakref.WeakKeyDictionary()


def by_shard(head) -> bool:
    """Whether draft vocabularies on `head` take the by-shard layout (`SubHead`): the head's `draft_vocab_by_shard`,
    set by `parallel.modules.set_draft_vocab_by_shard` (a bench's side-by-side); balanced otherwise."""
    return bool(getattr(head, "draft_vocab_by_shard", False))


def shared_sub_head(head, ids: tuple[int, ...], vocab_size: int, device) -> SubHead:
    """One `SubHead` per (head, ids, layout: `by_shard(head)`), shared by every proposer that asks (an engine keeps
    one proposer per buffer bucket; the real model's rows for 32k ids are 470 MB per copy, 59 MB a rank at TP=8).
    The last two per head are kept, for as long as the head lives; they are copies, so weights changed in place
    afterwards (training) are not seen: `_SUBHEADS.clear()` drops them. On a vocabulary-parallel head the first ask
    is a collective (`balanced_rows`): every rank asks, as every rank builds the same proposers."""
    layout = by_shard(head)
    return kept_per_head(_SUBHEADS, head, (ids, layout), lambda: SubHead(head, ids, vocab_size, device, layout))


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
