"""Training corpus: the running Python's standard library as plain files and as chat examples.

`prepare(out_dir)` writes a self-contained data folder, so a training machine needs no corpus of its own
(and a GPU image with another Python trains on exactly the text measured here):

    tokenizer.json, tokenizer_config.json   byte-level BPE trained on the training files, DeepSeek specials
    train.safetensors, val.safetensors      {"tokens": int16/int32 [N]}: documents concatenated in a seeded order
    eval_prompts.jsonl                      held-out chat examples (user, reasoning, code, module, function)
    meta.json                               corpus root, Python version, counts, split rule

Documents: each source file is `BOS text EOS`; each function with a docstring becomes a DeepSeek-V3.2
chat example `BOS <User>docstring<Assistant><think>plan</think>code EOS` (the plan names module, function
and arguments), so generation has thinking spans for the relaxed verifier. The held-out split is by file:
a file and every example cut from it land on the same side, chosen by a hash of its relative path.
"""

from __future__ import annotations

import ast
import hashlib
import json
import platform
import random
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..text.prompt import encode_chat
from ..text.tokenizer import Tokenizer, save_tokenizer, train_bpe_tokenizer

SKIP_DIRS = frozenset({"site-packages", "__pycache__", "test", "tests", "idle_test"})
MAX_FUNC_LINES = 60
MIN_DOC_CHARS = 16


@dataclass(frozen=True)
class SourceFile:
    rel: str  # path relative to the corpus root, '/'-separated
    module: str  # dotted module name
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel: str, val_permille: int) -> bool:
    """Stable across machines and Python versions: a hash of the relative path, not `hash()`."""
    return int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16) % 1000 < val_permille


def collect_sources(root: Path, include_tests: bool = False, max_files: int | None = None) -> list[SourceFile]:
    """Every readable *.py under root in sorted path order (tests and site-packages skipped by default)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root {root} is not a directory")
    skip = SKIP_DIRS - ({"test", "tests", "idle_test"} if include_tests else set())
    out = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p in skip for p in parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        rel = "/".join(parts)
        mod = rel[:-3].replace("/", ".").removesuffix(".__init__")
        out.append(SourceFile(rel, mod, text))
        if max_files is not None and len(out) >= max_files:
            break
    if not out:
        raise FileNotFoundError(f"no readable *.py files under corpus root {root}")
    return out


def _signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, list[str]]:
    args = fn.args
    names = [a.arg for a in args.posonlyargs + args.args]
    defaults = [None] * (len(names) - len(args.defaults)) + list(args.defaults)
    parts = [n if d is None else f"{n}={ast.unparse(d)}" for n, d in zip(names, defaults)]
    if args.vararg:
        parts.append("*" + args.vararg.arg)
    parts += [a.arg if d is None else f"{a.arg}={ast.unparse(d)}" for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        parts.append("**" + args.kwarg.arg)
    plain = [n for n in names if n not in ("self", "cls")] + [a.arg for a in args.kwonlyargs]
    return ", ".join(parts), plain


def _plan(module: str, owner: str | None, fn, sig: str, plain: list[str]) -> str:
    where = f"method `{owner}.{fn.name}({sig})`" if owner else f"function `{fn.name}({sig})`"
    argtxt = ", ".join(f"`{a}`" for a in plain) if plain else "no arguments"
    returns = any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(fn))
    yields = any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in ast.walk(fn))
    result = "yields values" if yields else ("returns a value" if returns else "returns nothing")
    kind = "async " if isinstance(fn, ast.AsyncFunctionDef) else ""
    return (f"Module `{module}`, {kind}{where}. It takes {argtxt} and {result}. "
            f"Write the def line, the docstring, then the body.")


def chat_examples(src: SourceFile) -> list[dict]:
    """One chat example per function or method with a docstring and at most MAX_FUNC_LINES lines."""
    try:
        tree = ast.parse(src.text)
    except (SyntaxError, ValueError):
        return []
    out = []

    def visit(node, owner):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, child.name)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(child)
                n_lines = (child.end_lineno or child.lineno) - child.lineno + 1
                if doc and len(doc) >= MIN_DOC_CHARS and n_lines <= MAX_FUNC_LINES:
                    code = ast.get_source_segment(src.text, child, padded=True)
                    if code:
                        sig, plain = _signature(child)
                        out.append({"user": doc, "reasoning": _plan(src.module, owner, child, sig, plain),
                                    "code": textwrap.dedent(code), "module": src.module, "function": child.name,
                                    "file": src.rel})

    visit(tree, None)
    return out


def chat_messages(ex: dict, with_answer: bool = True) -> list[dict]:
    msgs = [{"role": "user", "content": ex["user"]}]
    if with_answer:
        msgs.append({"role": "assistant", "content": ex["code"], "reasoning_content": ex["reasoning"]})
    return msgs


def encode_example(ex: dict, tok: Tokenizer) -> list[int]:
    return encode_chat(chat_messages(ex), tok, thinking=True, add_generation_prompt=False)


def encode_prompt(ex: dict, tok: Tokenizer) -> list[int]:
    """`BOS <User>doc<Assistant><think>`: the generation prompt of a held-out example."""
    return encode_chat(chat_messages(ex, with_answer=False), tok, thinking=True)


def _stream(docs: list[list[int]], seed: int, vocab: int) -> torch.Tensor:
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    flat = [t for i in order for t in docs[i]]
    return torch.tensor(flat, dtype=torch.int16 if vocab <= 2 ** 15 else torch.int32)


def prepare(out_dir: str | Path, root: str | Path | None = None, vocab: int = 2048, val_permille: int = 50,
            include_tests: bool = False, max_files: int | None = None, seed: int = 0) -> Path:
    """Build the data folder described in the module docstring; returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(root) if root is not None else stdlib_root()
    files = collect_sources(root, include_tests, max_files)
    split = {"train": [f for f in files if not is_heldout(f.rel, val_permille)],
             "val": [f for f in files if is_heldout(f.rel, val_permille)]}
    if not split["val"] or not split["train"]:
        raise ValueError(f"split of {len(files)} files under {root} left an empty side "
                         f"(val_permille={val_permille}); use more files or another val_permille")
    tok = Tokenizer(train_bpe_tokenizer([f.text for f in split["train"]], vocab_size=vocab))
    save_tokenizer(tok.backend, out)
    meta = {"root": str(root), "python": platform.python_version(), "vocab_size": tok.vocab_size,
            "val_permille": val_permille, "include_tests": include_tests, "seed": seed,
            "split_rule": "sha1(relative path)[:8] % 1000 < val_permille -> val"}
    for name, group in split.items():
        plain = tok.backend.encode_batch([f.text for f in group], add_special_tokens=False)
        docs = [[tok.bos_id, *e.ids, tok.eos_id] for e in plain]
        examples = [ex for f in group for ex in chat_examples(f)]
        docs += [encode_example(ex, tok) for ex in examples]
        tokens = _stream(docs, seed, tok.vocab_size)
        save_file({"tokens": tokens}, str(out / f"{name}.safetensors"))
        meta[name] = {"files": len(group), "chat_examples": len(examples), "tokens": int(tokens.numel()),
                      "chars": sum(len(f.text) for f in group)}
        if name == "val":
            with open(out / "eval_prompts.jsonl", "w", encoding="utf-8") as fh:
                for ex in examples:
                    fh.write(json.dumps(ex, ensure_ascii=False) + "\n")
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


# ---------------------------------------------------------------------------------------------- reading
@dataclass
class Dataset:
    root: Path
    tokenizer: Tokenizer
    train: torch.Tensor  # [N] int64
    val: torch.Tensor
    meta: dict

    @classmethod
    def load(cls, path: str | Path) -> "Dataset":
        path = Path(path)
        for name in ("tokenizer.json", "train.safetensors", "val.safetensors", "meta.json"):
            if not (path / name).is_file():
                raise FileNotFoundError(f"{path / name}: missing; build the data folder with `mtp-train prepare`")
        tr = load_file(str(path / "train.safetensors"))["tokens"].long()
        va = load_file(str(path / "val.safetensors"))["tokens"].long()
        return cls(path, Tokenizer.from_dir(path), tr, va, json.loads((path / "meta.json").read_text()))

    def eval_examples(self, n: int | None = None) -> list[dict]:
        text = (self.root / "eval_prompts.jsonl").read_text(encoding="utf-8")
        rows = [json.loads(line) for line in text.splitlines()]
        return rows if n is None else rows[:n]


def random_windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, length] windows at uniform random offsets of a token stream."""
    if stream.numel() <= length:
        raise ValueError(f"token stream of {stream.numel()} tokens is too short for windows of {length}")
    start = torch.randint(0, stream.numel() - length, (batch,), generator=gen)
    return stream[start.unsqueeze(1) + torch.arange(length)]


def fixed_windows(stream: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """n evenly spaced [length] windows: the same held-out batch in every evaluation."""
    if stream.numel() <= length:
        raise ValueError(f"token stream of {stream.numel()} tokens is too short for windows of {length}")
    starts = torch.linspace(0, stream.numel() - length - 1, n).long()
    return stream[starts.unsqueeze(1) + torch.arange(length)]
