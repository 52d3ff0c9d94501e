"""DeepSeek-V3.2 tokenizer: special tokens, a tiny trainable stand-in, and a thin loader.

The real checkpoint ships a byte-level BPE `tokenizer.json` (129280 ids) with a `tokenizer_config.json`
that names `LlamaTokenizerFast`. Tests and the tiny random model need the same shape without the 7 MB
file, so `train_bpe_tokenizer` builds a small byte-level BPE whose first ids are the DeepSeek special
tokens (BOS 0, EOS 1 as in the real model; the others sit at 2..6 here but at 128798+ in the real
vocabulary, so code must look ids up by string, never hard-code them). `Tokenizer` wraps either file
the same way, and `StreamDecoder` turns a token stream into printable text for a chat CLI.
"""

from __future__ import annotations

import json
import os
import sysconfig
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from ..utils import write_atomic

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"

# Order fixes the ids of a trained tokenizer: BOS=0 and EOS=1 match the real model.
SPECIAL_TOKENS: tuple[str, ...] = (BOS, EOS, PAD, USER, ASSISTANT, THINK, END_THINK)

# The ids these tokens have in the real DeepSeek-V3.2 tokenizer.json; `Tokenizer.from_dir` holds a full-size
# vocabulary to them, so a wrong tokenizer file for the real checkpoint fails at load instead of in the prompts.
DEEPSEEK_V32_SPECIAL_IDS_FILE = Path(__file__).resolve().parents[1] / "data" / "deepseek_v32_special_tokens.json"

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
DEEPSEEK_MODEL_MAX_LENGTH = 131072  # value in the published DeepSeek-V3.x tokenizer_config.json

_BYTE_ALPHABET = 256  # byte-level BPE starts from one symbol per byte

# The text of an id the tokenizer does not have (a model's vocabulary may be padded past it): visible, never "".
UNKNOWN_ID = "<unk id={}>"


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> tokenizers.Tokenizer:
    """Train a byte-level BPE with the DeepSeek special tokens at ids 0..6.

    Byte-level pre-tokenization plus the full 256-byte initial alphabet means every string encodes and
    decodes back exactly, whatever the corpus saw. Training has no randomness: the `tokenizers` trainer
    breaks merge ties by the pair itself, so the same texts give the same file in any process.
    """
    minimum = len(SPECIAL_TOKENS) + _BYTE_ALPHABET
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be >= {minimum} (special tokens + 256 bytes), got {vocab_size}")
    texts = list(texts)
    if not texts:
        raise ValueError("texts is empty; the BPE needs at least one training string")

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[tokenizers.AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    got = [tok.token_to_id(s) for s in SPECIAL_TOKENS]
    if got != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError(f"special tokens must get ids 0..{len(SPECIAL_TOKENS) - 1}, got {got}")
    return tok


def default_corpus(max_files: int = 40, max_chars: int = 400_000) -> list[str]:
    """Source of the running Python's standard library: text every machine has, no download needed.

    Files are taken in sorted path order and the total is cut at `max_chars`, so the corpus (and hence
    the trained tokenizer) depends only on the Python version, not on the machine.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    budget = max_chars
    for path in sorted(stdlib.glob("*.py")):
        if len(texts) == max_files or budget <= 0:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text[:budget])
        budget -= len(texts[-1])
    if not texts:
        raise FileNotFoundError(f"no readable *.py files in the standard library directory {stdlib}")
    return texts


def save_tokenizer(
    tok: tokenizers.Tokenizer, out_dir: str | os.PathLike, model_max_length: int = DEEPSEEK_MODEL_MAX_LENGTH
) -> Path:
    """Write `tokenizer.json` and a DeepSeek-V3.2-shaped `tokenizer_config.json`; return the folder.

    The config mirrors the real one (LlamaTokenizerFast, no automatic BOS/EOS) so code that loads the
    tiny checkpoint through `transformers` takes the same path as with the real model.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "tokenizer_class": "LlamaTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "model_max_length": model_max_length,
        "legacy": True,
        "clean_up_tokenization_spaces": False,
    }
    write_atomic(out / TOKENIZER_FILE, tok.to_str(pretty=True))
    write_atomic(out / CONFIG_FILE, json.dumps(config, ensure_ascii=False, indent=2) + "\n")
    return out


class Tokenizer:
    """The project's view of a tokenizer: plain-text encode/decode plus the special ids by name.

    `encode` never adds BOS (the prompt builder places it), but special-token strings inside the text
    are still matched as single ids, as the real tokenizer does.
    """

    def __init__(self, backend: tokenizers.Tokenizer, source: str = "<in-memory tokenizer>"):
        self.backend = backend
        self.source = source
        self.bos_id = self._special_id(BOS, "BOS")
        self.eos_id = self._special_id(EOS, "EOS")
        self.pad_id = self._special_id(PAD, "PAD")
        self.user_id = self._special_id(USER, "USER")
        self.assistant_id = self._special_id(ASSISTANT, "ASSISTANT")
        self.think_id = self._special_id(THINK, "THINK")
        self.end_think_id = self._special_id(END_THINK, "END_THINK")
        self._size = backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Load `<path>/tokenizer.json` (a tiny trained one or the real DeepSeek-V3.2 file)."""
        file = Path(path) / TOKENIZER_FILE
        if not file.is_file():
            raise FileNotFoundError(f"{file}: {TOKENIZER_FILE} not found in tokenizer folder {path}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # the Rust side raises a bare Exception for bad JSON / schema
            raise ValueError(f"{file}: not a readable tokenizers {TOKENIZER_FILE}: {e}") from e
        tok = cls(backend, source=str(file))
        check_deepseek_v32_ids(tok)
        return tok

    def _special_id(self, token: str, name: str) -> int:
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{self.source}: special token {name} {token!r} is missing from the vocabulary")
        return token_id

    @property
    def vocab_size(self) -> int:
        return self._size

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; an id past the tokenizer (`tokenizers` would drop it) shows as `UNKNOWN_ID`."""
        # `tokenizers` defaults to skipping special tokens; this project wants them visible by default.
        ids = [int(i) for i in ids]
        if not ids or max(ids) < self._size:
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        parts, run = [], []
        for i in ids + [self._size]:  # the sentinel flushes the last run
            if i < self._size:
                run.append(i)
                continue
            parts.append(self.backend.decode(run, skip_special_tokens=skip_special_tokens) if run else "")
            parts.append(UNKNOWN_ID.format(i))
            run = []
        return "".join(parts[:-1])


def match_model(tok: Tokenizer, vocab_size: int, source: str | os.PathLike) -> None:
    """Hold a tokenizer to the model's vocabulary (`vocab_size` from `source`, its config.json). More ids than
    the model embeds: ValueError. Fewer: one warning, not a refusal, since the real DeepSeek-V3.2 is so (128815
    tokens, 129280 rows padded for the GPUs); the model can still emit an id past the tokenizer, and
    `Tokenizer.decode` shows it as `UNKNOWN_ID`."""
    if tok.vocab_size > vocab_size:
        raise ValueError(f"{tok.source} has {tok.vocab_size} ids, more than the model's vocab_size {vocab_size} "
                         f"({source}): tokenizer and checkpoint do not match")
    if tok.vocab_size < vocab_size:
        warnings.warn(f"{tok.source} has {tok.vocab_size} ids, fewer than the model's vocab_size {vocab_size} "
                      f"({source}): ids {tok.vocab_size}..{vocab_size - 1} have no text and decode as "
                      f"{UNKNOWN_ID.format('N')}", stacklevel=2)


def deepseek_v32_special_ids() -> dict[str, int]:
    return json.loads(DEEPSEEK_V32_SPECIAL_IDS_FILE.read_text(encoding="utf-8"))["ids"]


def check_deepseek_v32_ids(tok: Tokenizer) -> None:
    """A vocabulary large enough to hold DeepSeek-V3.2's special ids must hold them there; smaller ones are
    stand-ins (the tiny trained tokenizer) and are not checked."""
    expected = deepseek_v32_special_ids()
    if tok.vocab_size <= max(expected.values()):
        return
    for token, want in expected.items():
        got = tok.backend.token_to_id(token)
        if got != want:
            raise ValueError(f"{tok.source}: {token!r} has id {got}, but DeepSeek-V3.2's tokenizer has it at {want} "
                             f"({DEEPSEEK_V32_SPECIAL_IDS_FILE.name}); this is not DeepSeek-V3.2's tokenizer")


class StreamDecoder:
    """Incremental detokenizer: `push(id)` returns only the text that became printable.

    A byte-level token can hold part of a UTF-8 character (an emoji spans up to four tokens), so text
    is held back while its decode ends in U+FFFD. Each step decodes the previous emitted chunk together
    with the pending ids and emits the difference, so decoders whose output depends on the neighbour
    token stay correct. The concatenation of all pushes plus `flush()` equals `decode(all_ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []  # last emitted chunk (context), then pending ids
        self._context_len = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        context = self._decode(self._ids[: self._context_len])
        full = self._decode(self._ids)
        if full.endswith("\ufffd") or len(full) <= len(context):
            return ""
        del self._ids[: self._context_len]
        self._context_len = len(self._ids)
        return full[len(context) :]

    def flush(self) -> str:
        """End of stream: return whatever is still held (an incomplete character decodes to U+FFFD)."""
        context = self._decode(self._ids[: self._context_len])
        rest = self._decode(self._ids)[len(context) :]
        self._ids.clear()
        self._context_len = 0
        return rest
