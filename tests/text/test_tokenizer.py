"""Tiny DeepSeek-shaped tokenizer: special ids, exact round trips, determinism, loaders, streaming."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import tokenizers

from mtp.text.tokenizer import (
    SPECIAL_TOKENS,
    THINK,
    USER,
    StreamDecoder,
    Tokenizer,
    deepseek_v32_special_ids,
    default_corpus,
    match_model,
    save_tokenizer,
    train_bpe_tokenizer,
)

REPO = Path(__file__).resolve().parents[2]
VOCAB = 512
UNICODE_SAMPLES = [
    "plain ascii, with  two spaces\tand a tab\n",
    "héllo wörld – naïve café",
    "中文测试：你好，世界！ 日本語のテキスト 한국어",
    "emoji 🎉👩‍💻🇫🇷 and a family 👨‍👩‍👧",
    "combining e\u0301 and zero\u200bwidth, NUL \x00, CRLF \r\n, U+FFFD \ufffd itself",
    "  leading and trailing spaces  ",
    "",
]


def corpus() -> list[str]:
    return default_corpus(max_files=6, max_chars=60_000)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return save_tokenizer(train_bpe_tokenizer(corpus(), VOCAB), tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


def test_special_tokens_get_ids_0_to_6(tok):
    assert [tok.backend.token_to_id(s) for s in SPECIAL_TOKENS] == list(range(7))
    ids = [tok.bos_id, tok.eos_id, tok.pad_id, tok.user_id, tok.assistant_id, tok.think_id, tok.end_think_id]
    assert ids == list(range(7))
    assert tok.vocab_size == VOCAB


def test_exact_strings_match_deepseek():
    # Full-width bar U+FF5C and lower one-eighth block U+2581, as in DeepSeek's tokenizer.json.
    assert SPECIAL_TOKENS[0] == "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
    assert SPECIAL_TOKENS[1] == "<\uff5cend\u2581of\u2581sentence\uff5c>"
    assert SPECIAL_TOKENS[2] == "<\uff5c\u2581pad\u2581\uff5c>"
    assert SPECIAL_TOKENS[3:] == ("<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>", "<think>", "</think>")


@pytest.mark.parametrize("text", UNICODE_SAMPLES)
def test_round_trip_is_exact(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.bos_id not in ids  # encode never adds BOS


def test_special_strings_in_text_are_single_ids(tok):
    ids = tok.encode(f"a{USER}b{THINK}")
    assert ids == tok.encode("a") + [tok.user_id] + tok.encode("b") + [tok.think_id]
    assert tok.decode(ids) == f"a{USER}b{THINK}"
    assert tok.decode(ids, skip_special_tokens=True) == "ab"


def test_training_is_deterministic_in_and_across_processes():
    first = train_bpe_tokenizer(corpus(), VOCAB).to_str()
    assert train_bpe_tokenizer(corpus(), VOCAB).to_str() == first
    # A fresh process has fresh Rust hash seeds: the place where hidden nondeterminism would show.
    code = (
        "import hashlib; from mtp.text.tokenizer import default_corpus, train_bpe_tokenizer as t;"
        f"print(hashlib.sha256(t(default_corpus(6, 60_000), {VOCAB}).to_str().encode()).hexdigest())"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == hashlib.sha256(first.encode()).hexdigest()


def test_default_corpus_is_bounded_and_stable():
    texts = default_corpus(max_files=3, max_chars=5_000)
    assert 1 <= len(texts) <= 3
    assert sum(map(len, texts)) <= 5_000
    assert texts == default_corpus(max_files=3, max_chars=5_000)


def test_training_rejects_bad_arguments():
    with pytest.raises(ValueError, match="vocab_size must be >= 263"):
        train_bpe_tokenizer(["abc"], 100)
    with pytest.raises(ValueError, match="texts is empty"):
        train_bpe_tokenizer([], VOCAB)


def test_saved_files_match_deepseek_layout(tok_dir):
    assert sorted(p.name for p in tok_dir.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]  # no temp
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["tokenizer_class"] == "LlamaTokenizerFast"
    assert cfg["add_bos_token"] is False and cfg["add_eos_token"] is False
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == SPECIAL_TOKENS[:3]
    assert cfg["legacy"] is True and cfg["clean_up_tokenization_spaces"] is False
    assert cfg["model_max_length"] == 131072


def test_save_overwrites_in_place(tok, tmp_path):
    save_tokenizer(tok.backend, tmp_path)
    save_tokenizer(tok.backend, tmp_path, model_max_length=64)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))["model_max_length"] == 64
    assert tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json")).to_str() == tok.backend.to_str()


def test_transformers_autotokenizer_agrees(tok, tok_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_dir)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    for text in UNICODE_SAMPLES + [f"{USER}hi{THINK}"]:
        assert hf(text)["input_ids"] == tok.encode(text)  # add_bos_token false: no BOS from transformers
        assert hf.decode(tok.encode(text)) == text


def test_missing_and_unreadable_files_raise_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json not found"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a readable"):
        Tokenizer.from_dir(tmp_path)


def test_missing_special_token_is_named(tok_dir, tmp_path):
    data = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    for added in data["added_tokens"]:
        if added["content"] == THINK:
            added["content"] = "<thinking>"
    data["model"]["vocab"]["<thinking>"] = data["model"]["vocab"].pop(THINK)
    (tmp_path / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    with pytest.raises(ValueError, match="THINK '<think>' is missing") as err:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(err.value)


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_stream_decoder_reproduces_full_decode(tok, skip_special_tokens):
    text = f"{USER}Hi 你好 🎉👩‍💻!{THINK}ok é\u0301</think> done"
    ids = tok.encode(text)
    assert len(tok.encode("🎉")) > 1  # the emoji really is split across byte-level tokens here
    stream = StreamDecoder(tok, skip_special_tokens=skip_special_tokens)
    chunks = [stream.push(i) for i in ids]
    chunks.append(stream.flush())
    assert "".join(chunks) == tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert not any("\ufffd" in c for c in chunks)
    assert "" in chunks[:-1]  # something was held back mid-character


def test_stream_decoder_flushes_incomplete_character(tok):
    first_byte = tok.encode("🎉")[0]
    stream = StreamDecoder(tok)
    assert stream.push(first_byte) == ""
    assert stream.flush() == "\ufffd"
    assert stream.push(tok.encode("a")[0]) == "a"  # usable again after a flush


def _full_size_tokenizer(tmp_path, ids: dict[str, int]) -> Path:
    """A word-level stand-in as large as DeepSeek-V3.2's vocabulary, its special tokens at `ids`."""
    from tokenizers import models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(max(ids.values()) + 2) if i not in ids.values()}
    vocab.update(ids)
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="w3"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(list(ids) + [s for s in SPECIAL_TOKENS if s not in ids])
    backend.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_deepseek_v32_special_ids(tmp_path):
    ids = deepseek_v32_special_ids()
    # The published model config agrees on BOS / EOS; the strings are the ones this package uses.
    cfg = json.loads((REPO / "mtp" / "data" / "deepseek_v32_671b_config.json").read_text(encoding="utf-8"))
    assert (ids[SPECIAL_TOKENS[0]], ids[SPECIAL_TOKENS[1]]) == (cfg["bos_token_id"], cfg["eos_token_id"])
    assert set(ids) == set(SPECIAL_TOKENS) - {SPECIAL_TOKENS[2]}
    tok = Tokenizer.from_dir(_full_size_tokenizer(tmp_path, ids))
    assert (tok.user_id, tok.assistant_id, tok.think_id, tok.end_think_id) == (128803, 128804, 128798, 128799)
    assert tok.encode(f"{USER}w5{THINK}") == [128803, 5, 128798]


def test_full_size_tokenizer_with_wrong_special_ids_is_refused(tmp_path):
    ids = deepseek_v32_special_ids()
    ids[USER], ids[THINK] = ids[THINK], ids[USER]
    with pytest.raises(ValueError, match=r"tokenizer\.json: '<think>' has id 128803, but DeepSeek-V3\.2's tokenizer has "
                                         r"it at 128798"):
        Tokenizer.from_dir(_full_size_tokenizer(tmp_path, ids))


def test_ids_past_the_tokenizer_decode_to_a_visible_placeholder(tok):
    """A model's vocabulary may be padded past its tokenizer (DeepSeek-V3.2: 129280 rows, 128815 tokens): an id
    there used to decode to nothing; now it shows, in whole and streamed decodes alike."""
    ids = tok.encode("import os")
    mixed = ids[:1] + [VOCAB + 5] + ids[1:] + [VOCAB]
    want = tok.decode(ids[:1]) + f"<unk id={VOCAB + 5}>" + tok.decode(ids[1:]) + f"<unk id={VOCAB}>"
    assert tok.decode(mixed) == want and tok.decode(mixed, skip_special_tokens=True) == want
    stream = StreamDecoder(tok)
    assert "".join(stream.push(i) for i in mixed) + stream.flush() == want
    assert tok.decode(ids) == "import os"


def test_tokenizer_against_the_model_vocabulary(tok):
    """Larger than the model's vocabulary: refused (ids the model cannot embed). Smaller: one warning naming both
    sizes (the real checkpoint is so), none when they match."""
    with pytest.raises(ValueError, match=f"{VOCAB} ids, more than the model's vocab_size {VOCAB - 1} \\(cfg.json\\)"):
        match_model(tok, VOCAB - 1, "cfg.json")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        match_model(tok, VOCAB, "cfg.json")
        assert not seen
        match_model(tok, VOCAB + 100, "cfg.json")
    assert len(seen) == 1
    msg = str(seen[0].message)
    assert f"{VOCAB} ids, fewer than the model's vocab_size {VOCAB + 100} (cfg.json)" in msg and "<unk id=" in msg
