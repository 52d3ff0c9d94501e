"""DeepSeek-V3.2 prompt format against hand-written id sequences (facts section 6)."""

from __future__ import annotations

import pytest

from mtp.text.prompt import encode_chat, initial_think_state, render_chat
from mtp.text.tokenizer import Tokenizer, default_corpus, train_bpe_tokenizer

SYSTEM = {"role": "system", "content": "You are helpful."}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(train_bpe_tokenizer(default_corpus(max_files=6, max_chars=60_000), 512))


def user(text):
    return {"role": "user", "content": text}


def assistant(text, reasoning=None):
    return {"role": "assistant", "content": text, "reasoning_content": reasoning}


def test_single_turn_thinking(tok):
    bos, u, a, think, enc = tok.bos_id, tok.user_id, tok.assistant_id, tok.think_id, tok.encode
    ids = encode_chat([SYSTEM, user("Hi")], tok, thinking=True)
    assert ids == [bos] + enc("You are helpful.") + [u] + enc("Hi") + [a, think]


def test_single_turn_chat_mode_without_system(tok):
    ids = encode_chat([user("Hi")], tok, thinking=False)
    assert ids == [tok.bos_id, tok.user_id] + tok.encode("Hi") + [tok.assistant_id, tok.end_think_id]


def test_render_matches_reference_string():
    text = render_chat([SYSTEM, user("Hi")], thinking=True)
    assert text == "<｜begin▁of▁sentence｜>You are helpful.<｜User｜>Hi<｜Assistant｜><think>"
    no_gen = render_chat([user("Hi")], thinking=False, add_generation_prompt=False)
    assert no_gen == "<｜begin▁of▁sentence｜><｜User｜>Hi"


def test_multi_turn_drops_earlier_reasoning(tok):
    enc = tok.encode
    messages = [SYSTEM, user("Hi"), assistant("Hello!", reasoning="They greet me."), user("2+2?")]
    ids = encode_chat(messages, tok, thinking=True)
    expected = (
        [tok.bos_id] + enc("You are helpful.")
        + [tok.user_id] + enc("Hi") + [tok.assistant_id, tok.end_think_id] + enc("Hello!") + [tok.eos_id]
        + [tok.user_id] + enc("2+2?") + [tok.assistant_id, tok.think_id]
    )
    assert ids == expected
    assert "They greet me." not in render_chat(messages, thinking=True)
    # Chat mode differs only in the final marker.
    assert encode_chat(messages, tok, thinking=False) == expected[:-1] + [tok.end_think_id]


def test_final_assistant_turn_keeps_reasoning_only_in_thinking_mode(tok):
    enc = tok.encode
    messages = [user("2+2?"), assistant("4", reasoning="Add them.")]
    assert encode_chat(messages, tok, thinking=True) == (
        [tok.bos_id, tok.user_id] + enc("2+2?") + [tok.assistant_id, tok.think_id]
        + enc("Add them.") + [tok.end_think_id] + enc("4") + [tok.eos_id]
    )
    assert encode_chat(messages, tok, thinking=False) == (
        [tok.bos_id, tok.user_id] + enc("2+2?") + [tok.assistant_id, tok.end_think_id] + enc("4") + [tok.eos_id]
    )


def test_consecutive_user_messages_follow_reference_encoder(tok):
    # DeepSeek's encoding_dsv32.py closes every user turn with <｜Assistant｜> plus a think marker.
    enc = tok.encode
    ids = encode_chat([user("a"), user("b")], tok, thinking=True)
    assert ids == (
        [tok.bos_id, tok.user_id] + enc("a") + [tok.assistant_id, tok.end_think_id]
        + [tok.user_id] + enc("b") + [tok.assistant_id, tok.think_id]
    )


def test_generation_prompt_can_be_left_out(tok):
    ids = encode_chat([SYSTEM, user("Hi")], tok, thinking=True, add_generation_prompt=False)
    assert ids == [tok.bos_id] + tok.encode("You are helpful.") + [tok.user_id] + tok.encode("Hi")


def test_leading_system_messages_are_concatenated(tok):
    messages = [SYSTEM, {"role": "system", "content": " Be brief."}, user("Hi")]
    ids = encode_chat(messages, tok, thinking=False)
    assert ids == (
        [tok.bos_id] + tok.encode("You are helpful. Be brief.")
        + [tok.user_id] + tok.encode("Hi") + [tok.assistant_id, tok.end_think_id]
    )


def test_piecewise_ids_equal_encoding_the_rendered_string(tok):
    messages = [SYSTEM, user("Hi 你好"), assistant("Hello 🎉", reasoning="r"), user("x")]
    for thinking in (True, False):
        assert encode_chat(messages, tok, thinking) == tok.encode(render_chat(messages, thinking))


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "messages is empty"),
        ([user("Hi"), {"role": "robot", "content": "x"}], r"messages\[1\]: unknown role 'robot'"),
        ([{"role": "user", "content": None}], r"messages\[0\] \(user\): content must be a str, got NoneType"),
        ([{"role": "user", "content": ["Hi"]}], r"messages\[0\] \(user\): content must be a str, got list"),
        ([{"role": "developer", "content": ""}], r"messages\[0\] \(developer\): content must be a non-empty str"),
        ([user("Hi"), assistant("a", reasoning=3)], r"messages\[1\] \(assistant\): reasoning_content must be a"),
        (["Hi"], r"messages\[0\] must be a dict"),
        ("Hi", "messages must be a list of dicts, got str"),
    ],
)
def test_bad_messages_raise(tok, messages, match):
    with pytest.raises(ValueError, match=match):
        encode_chat(messages, tok, thinking=True)


def test_initial_think_state(tok):
    t, e = tok.think_id, tok.end_think_id
    history = [SYSTEM, user("Hi"), assistant("Hello!"), user("More")]
    assert initial_think_state(encode_chat(history, tok, thinking=True), t, e) is True
    assert initial_think_state(encode_chat(history, tok, thinking=False), t, e) is False
    assert initial_think_state([], t, e) is False
    assert initial_think_state([9, 10], t, e) is False
    assert initial_think_state([t, 9, e, 9], t, e) is False
    assert initial_think_state([e, 9, t, 9, 9], t, e) is True
