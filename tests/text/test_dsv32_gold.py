"""Our chat renderer against DeepSeek's own gold case for its V3.2 encoder, tools included (the fixture and its
origin: tests/text/data/dsv32_encoding/README.md)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from mtp.text.prompt import render_chat

GOLD = Path(__file__).parent / "data" / "dsv32_encoding"


def test_renderer_equals_deepseeks_gold_output():
    case = json.loads((GOLD / "test_input.json").read_text(encoding="utf-8"))
    expected = (GOLD / "test_output.txt").read_text(encoding="utf-8")
    assert expected.endswith("<｜end▁of▁sentence｜>\n")  # the file's last line end, not the encoder's
    expected = expected[:-1]
    # DeepSeek's case carries the request's tools on its system message (rendered after the system text).
    messages = [dict(m) for m in case["messages"]]
    assert messages[0]["role"] == "system"
    messages[0]["tools"] = case["tools"]
    got = render_chat(messages, thinking=True)
    if got != expected:
        at = next(i for i, (a, b) in enumerate(zip(got + "\0", expected + "\0")) if a != b)
        raise AssertionError(f"first difference at char {at}: got {got[at - 40:at + 40]!r}, "
                             f"DeepSeek's {expected[at - 40:at + 40]!r}")


def test_fixture_is_the_recorded_copy_of_deepseeks_files():
    """The fixture is pinned to DeepSeek's own publication (not a downstream copy) by URL and sha256: any edit to
    the two files, or a source that is not DeepSeek's repository, fails here."""
    record = json.loads((GOLD / "provenance.json").read_text(encoding="utf-8"))
    assert set(record["files"]) == {"test_input.json", "test_output.txt"}
    for name, entry in record["files"].items():
        assert entry["url"].startswith("https://huggingface.co/deepseek-ai/DeepSeek-V3.2/"), entry["url"]
        assert record["commit"] in entry["url"] and entry["url"].endswith(f"/encoding/{name}")
        got = hashlib.sha256((GOLD / name).read_bytes()).hexdigest()
        assert got == entry["sha256"], f"{GOLD / name} changed: sha256 {got}, recorded {entry['sha256']}"
