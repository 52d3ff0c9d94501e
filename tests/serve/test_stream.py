"""A reply's tokens -> OpenAI deltas (mtp/serve/stream.py) on the bundled tokenizer: reasoning and answer split at
</think>, a possible tool-call block or stop string held back until known, calls read at the end."""

from __future__ import annotations

import json

import pytest

from mtp.checkpoint.tiny import default_checkpoint
from mtp.serve.stream import ReplyText
from mtp.text.dsml import tool_calls_text
from mtp.text.tokenizer import END_THINK, EOS, Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(default_checkpoint())


def feed(r: ReplyText, tok: Tokenizer, text: str, step: int = 2) -> list:
    ids = tok.encode(text)
    deltas = [r.push(ids[i:i + step]) for i in range(0, len(ids), step)]
    return deltas + [r.finish()]


def test_reasoning_then_answer_and_the_end_of_sentence_left_out(tok):
    r = ReplyText(tok, thinking=True, tools=False)
    deltas = feed(r, tok, f"first think{END_THINK}then answer{EOS}")
    assert "".join(d.reasoning for d in deltas) == "first think"
    assert "".join(d.content for d in deltas) == "then answer"
    assert r.message == {"role": "assistant", "content": "then answer", "reasoning_content": "first think",
                         "tool_calls": []}


def test_a_stop_string_ends_the_reply_and_is_left_out(tok):
    r = ReplyText(tok, thinking=False, tools=False, stop=("\nEND",))
    deltas = []
    for i, t in enumerate(tok.encode("one two\nEND three")):
        deltas.append(r.push([t]))
        if r.stopped:
            break
    deltas.append(r.finish())
    assert r.stopped and "".join(d.content for d in deltas) == "one two" == r.message["content"]
    # a partial stop string is held back, then sent once it is known not to be one
    r = ReplyText(tok, thinking=False, tools=False, stop=("\nEND",))
    streamed = "".join(d.content for d in feed(r, tok, "a\nEN b", step=1)[:-1])
    assert not r.stopped and r.message["content"] == "a\nEN b" and streamed.endswith("b")


def test_tool_calls_are_held_back_and_read_at_the_end(tok):
    call = [{"type": "function", "function": {"name": "f", "arguments": json.dumps({"x": 1, "s": "a"})}}]
    r = ReplyText(tok, thinking=False, tools=True)
    deltas = feed(r, tok, "Calling." + tool_calls_text(call, "test") + EOS)
    assert "".join(d.content for d in deltas) == "Calling."  # the DSML block is never sent as text
    (got,) = deltas[-1].tool_calls
    assert got["function"]["name"] == "f" and json.loads(got["function"]["arguments"]) == {"x": 1, "s": "a"}
    # a block that does not parse stays text, as mtp-chat keeps it
    r = ReplyText(tok, thinking=False, tools=True)
    text = "Calling." + tool_calls_text(call, "test")[:-12]
    deltas = feed(r, tok, text)
    assert "".join(d.content for d in deltas) == text and not deltas[-1].tool_calls
