"""DeepSeek-V3.2's chat encoding with tools (DSML), the cases where it departs from a plain user/assistant chat,
and the way back (completion -> OpenAI-style message). Expected strings are written by hand from the format
(mtp/text/prompt.py, mtp/text/dsml.py); DeepSeek's own gold case is tests/text/test_dsv32_gold.py."""

from __future__ import annotations

import hashlib
import json

import pytest

from mtp.text.dsml import CompletionFormatError, parse_completion, tools_block
from mtp.text.prompt import encode_chat, render_chat
from mtp.text.tokenizer import Tokenizer, default_corpus, train_bpe_tokenizer

B, E, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
T, ET = "<think>", "</think>"
D = "｜DSML｜"

LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "Find a word in the dictionary",
                                           "parameters": {"type": "object", "properties": {"word": {"type": "string"}},
                                                          "required": ["word"]}}}
LOOKUP_SCHEMA = ('{"name": "lookup", "description": "Find a word in the dictionary", "parameters": {"type": "object", '
                 '"properties": {"word": {"type": "string"}}, "required": ["word"]}}')


def call(name, **args):
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def user(text):
    return {"role": "user", "content": text}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(train_bpe_tokenizer(default_corpus(max_files=6, max_chars=60_000), 512))


@pytest.fixture(scope="module")
def tok_dsml() -> Tokenizer:
    """A tokenizer where the DSML marker is one added token, as it may be in a real vocabulary."""
    backend = train_bpe_tokenizer(default_corpus(max_files=6, max_chars=60_000), 512)
    backend.add_special_tokens([D])
    return Tokenizer(backend)


def test_tools_block_is_the_trained_text():
    block = tools_block([LOOKUP], "tools")
    assert block.startswith("## Tools\n\nYou have access to a set of tools you can use to answer the user's question.\n")
    assert block.endswith(f"<functions>\n{LOOKUP_SCHEMA}\n</functions>\n")
    assert f"\n\n{T}...thinking about results{ET}\n\n" in block
    # The whole instruction text, byte for byte: the block DeepSeek's gold fixture holds (test_dsv32_gold.py),
    # with this test's one tool; DeepSeek's text has 7 blank lines that a downstream copy dropped.
    assert block.count("\n\n") == 7
    digest = hashlib.sha256(block.encode()).hexdigest()
    assert digest == "db6e31ef379221914407edd4c6772489574f04373999bef926f132bf911a1a1f"


def test_tool_conversation_thinking():
    messages = [
        {"role": "system", "content": "Be exact.", "tools": [LOOKUP]},
        user("Define cat and dog"),
        {"role": "assistant", "content": "", "reasoning_content": "Two lookups.",
         "tool_calls": [call("lookup", word="cat"), call("lookup", word="dog", limit=2)]},
        {"role": "tool", "content": "a small feline"},
        {"role": "tool", "content": "a canine"},
    ]
    calls = (f'\n\n<{D}function_calls>\n'
             f'<{D}invoke name="lookup">\n<{D}parameter name="word" string="true">cat</{D}parameter>\n</{D}invoke>\n'
             f'<{D}invoke name="lookup">\n<{D}parameter name="word" string="true">dog</{D}parameter>\n'
             f'<{D}parameter name="limit" string="false">2</{D}parameter>\n</{D}invoke>\n'
             f'</{D}function_calls>')
    results = "\n\n<function_results>\n<result>a small feline</result>\n<result>a canine</result>\n</function_results>"
    head = B + "Be exact.\n\n" + tools_block([LOOKUP], "x") + U + "Define cat and dog" + A
    assert render_chat(messages, thinking=True) == head + T + "Two lookups." + ET + calls + E + results + "\n\n" + T
    # Chat mode: no reasoning, and </think> wherever thinking mode writes <think>.
    assert render_chat(messages, thinking=False) == head + ET + calls + E + results + "\n\n" + ET
    assert render_chat(messages, thinking=True, add_generation_prompt=False) == \
        head + T + "Two lookups." + ET + calls + E + results


def test_tools_argument_goes_first_as_its_own_system_message():
    messages = [{"role": "system", "content": "Be exact."}, user("Hi")]
    assert render_chat(messages, thinking=False, tools=[LOOKUP]) == \
        B + "\n\n" + tools_block([LOOKUP], "x") + "Be exact." + U + "Hi" + A + ET


def test_tool_results_before_the_last_user_close_with_end_think():
    messages = [user("q"), {"role": "assistant", "content": None, "tool_calls": [call("f")]},
                {"role": "tool", "content": "r"}, {"role": "assistant", "content": "done"}, user("thanks")]
    assert render_chat(messages, thinking=True) == (
        B + U + "q" + A + ET + f'\n\n<{D}function_calls>\n<{D}invoke name="f">\n\n</{D}invoke>\n</{D}function_calls>'
        + E + "\n\n<function_results>\n<result>r</result>\n</function_results>\n\n" + ET + "done" + E
        + U + "thanks" + A + T)


def test_developer_role_and_response_format():
    fmt = {"type": "json_object"}
    messages = [{"role": "system", "content": "S", "response_format": fmt},
                {"role": "developer", "content": "Look it up", "tools": [LOOKUP], "response_format": fmt}]
    rf = '## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{"type": "json_object"}'
    assert render_chat(messages, thinking=True) == (
        B + "S\n\n" + rf + U + "\n\n" + tools_block([LOOKUP], "x") + "\n\n" + rf
        + "\n\n# The user's message is: Look it up" + A + T)


def test_assistant_turns_not_after_a_user_have_no_marker():
    # First message, and an assistant right after an assistant: the text follows the previous turn directly.
    messages = [{"role": "assistant", "content": "Welcome."}, user("Hi"), {"role": "assistant", "content": "Hello"},
                {"role": "assistant", "content": None}, user("Bye")]
    assert render_chat(messages, thinking=False) == B + "Welcome." + E + U + "Hi" + A + ET + "Hello" + E + E + U + \
        "Bye" + A + ET
    # The earlier format of this project, kept as an option: such turns get their own opener.
    assert render_chat(messages, thinking=False, label_assistant_turns=True) == \
        B + A + ET + "Welcome." + E + U + "Hi" + A + ET + "Hello" + E + A + ET + E + U + "Bye" + A + ET


def test_thinking_keeps_reasoning_of_every_assistant_turn_after_the_last_user():
    messages = [user("Hi"), {"role": "assistant", "content": "old", "reasoning_content": "dropped"}, user("q"),
                {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
                {"role": "assistant", "content": "a2", "reasoning": "r2"}]
    assert render_chat(messages, thinking=True) == \
        B + U + "Hi" + A + ET + "old" + E + U + "q" + A + T + "r1" + ET + "a1" + E + "r2" + ET + "a2" + E


def test_system_message_mid_conversation_is_text_in_place():
    messages = [user("Hi"), {"role": "assistant", "content": "Yo"}, {"role": "system", "content": "Now be formal."},
                user("Hello")]
    assert render_chat(messages, thinking=False) == B + U + "Hi" + A + ET + "Yo" + E + "Now be formal." + U + \
        "Hello" + A + ET


def test_developer_before_the_last_user_in_thinking_mode_renders_in_place():
    messages = [{"role": "developer", "content": "d"}, user("u")]
    assert render_chat(messages, thinking=True) == \
        B + U + "\n\n# The user's message is: d" + A + ET + U + "u" + A + T


@pytest.mark.parametrize(
    "messages, match",
    [
        ([{"role": "tool", "content": "r"}], r"messages\[0\] \(tool\): a tool result cannot be the first message"),
        ([user("q"), {"role": "tool", "content": "r"}], r"messages\[1\] \(tool\): a tool result must follow an "),
        ([user("q"), {"role": "assistant", "content": "", "tool_calls": [call("f")]}, {"role": "tool", "content": "r"},
          {"role": "tool", "content": "r2"}],
         r"messages\[3\] \(tool\): result 2 after messages\[1\], which made only 1"),
        ([user("q"), {"role": "assistant", "content": "x"}], r"messages\[1\] \(assistant\): in thinking mode .* needs "
                                                             "reasoning_content or tool_calls"),
        ([user("q"), {"role": "tool", "content": None}], r"messages\[1\] \(tool\): content must be a str"),
        ([{"role": "user", "content": "q", "tools": [LOOKUP]}], r"messages\[0\] \(user\): tools belongs on a system "
                                                                "or developer message"),
        ([{"role": "user", "content": "q", "tool_calls": [call("f")]}], r"tool_calls belongs on a assistant"),
        ([user("q"), {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}],
         r"messages\[1\] \(assistant\): tool_calls\[0\]\.function\.arguments must be a JSON string of an object"),
        ([user("q"), {"role": "assistant", "content": "", "tool_calls": [call("f")] + [
            {"type": "function", "function": {"name": "g", "arguments": "[1]"}}]}],
         r"tool_calls\[1\]\.function\.arguments must decode to a JSON object, got list"),
        ([user("q"), {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}],
         r"tool_calls\[0\]\.function\.name must be a non-empty str"),
        ([{"role": "system", "content": "", "tools": [{"name": "f"}]}],
         r"messages\[0\] \(system\): tools\[0\] must be a dict with a 'function' dict"),
    ],
)
def test_what_the_format_cannot_write_is_refused(tok, messages, match):
    with pytest.raises(ValueError, match=match):
        encode_chat(messages, tok, thinking=True)


def test_bad_tools_argument_is_named():
    with pytest.raises(ValueError, match=r"tools: tools must be a list"):
        render_chat([user("q")], thinking=False, tools="lookup")


TOOL_CHAT = [
    {"role": "system", "content": "You help with words.", "tools": [LOOKUP]},
    user("Define 'cat' 🐈"),
    {"role": "assistant", "content": "Checking.", "reasoning_content": "One lookup.",
     "tool_calls": [call("lookup", word="cat", opts={"lang": ["en", "fr"], "n": 2.5, "ok": True, "x": None})]},
    {"role": "tool", "content": '{"definition": "a small feline"}'},
]


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("dsml_token", [False, True])
def test_ids_equal_encoding_the_rendered_string(tok, tok_dsml, thinking, dsml_token):
    t = tok_dsml if dsml_token else tok
    assert encode_chat(TOOL_CHAT, t, thinking) == t.encode(render_chat(TOOL_CHAT, thinking))
    if dsml_token:
        assert t.backend.token_to_id(D) in encode_chat(TOOL_CHAT, t, thinking)


@pytest.mark.parametrize("dsml_token", [False, True])
def test_round_trip_render_tokenize_parse(tok, tok_dsml, dsml_token):
    """A reply rendered into a conversation, cut out as token ids, decoded and parsed is the message again."""
    t = tok_dsml if dsml_token else tok
    reply = {"role": "assistant", "content": "Here:", "reasoning_content": "Let me look 'cat' up.\nTwice.",
             "tool_calls": [call("lookup", word="cat"), call("lookup", word="naïve \"dog\"", n=[1, {"k": None}])]}
    history = TOOL_CHAT + [{"role": "assistant", "content": "A cat is a small feline.",
                            "reasoning_content": "Got it."}, user("And a dog?")]
    for thinking in (True, False):
        prompt = encode_chat(history, t, thinking)
        full = encode_chat(history + [reply], t, thinking, add_generation_prompt=False)
        # The conversation with the reply, minus the prompt, is the completion the model would write.
        assert full[: len(prompt)] == prompt
        got = parse_completion(t.decode(full[len(prompt):]), thinking)
        want_reasoning = reply["reasoning_content"] if thinking else ""
        assert (got["role"], got["content"], got["reasoning_content"]) == ("assistant", "Here:", want_reasoning)
        assert [c["function"]["name"] for c in got["tool_calls"]] == ["lookup", "lookup"]
        assert [json.loads(c["function"]["arguments"]) for c in got["tool_calls"]] == \
            [{"word": "cat"}, {"word": "naïve \"dog\"", "n": [1, {"k": None}]}]
        # Arguments written as json.dumps(..., ensure_ascii=False) writes them come back as the same string.
        assert got["tool_calls"][0] == reply["tool_calls"][0]


def test_parse_plain_answers():
    assert parse_completion(f"Just text.{E}", thinking=False) == \
        {"role": "assistant", "content": "Just text.", "reasoning_content": "", "tool_calls": []}
    # End of sentence optional (a streamed or cut reply), reasoning split at </think>.
    assert parse_completion(f"why{ET}so", thinking=True)["reasoning_content"] == "why"
    got = parse_completion(f'\n\n<{D}function_calls>\n<{D}invoke name="f">\n<{D}parameter name="v" string="false">'
                           f'[1,2]</{D}parameter>\n</{D}invoke>\n</{D}function_calls>', thinking=False)
    assert got["content"] == "" and got["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"v": [1,2]}'}


@pytest.mark.parametrize(
    "text, thinking, match",
    [
        ("no end of thinking", True, "thinking mode: no </think>"),
        (f'r\n\n<{D}function_calls>\n{ET}', True, "thinking mode: no </think> before the answer"),
        (f"a{E}b", False, "text after"),
        (f"a{T}b", False, "content holds '<think>'"),
        (f"x{D}y", False, "content holds"),
        (f'\n\n<{D}function_calls>\n<{D}invoke nam="f">\n', False, "bad invoke header"),
        (f'\n\n<{D}function_calls>\n<{D}invoke name="f">\n<{D}parameter name="a" string="maybe">1</{D}parameter>\n',
         False, "bad parameter"),
        (f'\n\n<{D}function_calls>\n<{D}invoke name="f">\n<{D}parameter name="a" string="false">{{x</{D}parameter>\n'
         f'</{D}invoke>\n</{D}function_calls>', False, "string=\"false\" but is not JSON"),
        (f'\n\n<{D}function_calls>\n<{D}invoke name="f">\n<{D}parameter name="a" string="true">1</{D}parameter>\n'
         f'<{D}parameter name="a" string="true">2</{D}parameter>\n</{D}invoke>\n</{D}function_calls>', False,
         "parameter 'a' given twice"),
        (f'\n\n<{D}function_calls>\n<{D}invoke name="f">\n\n</{D}invoke>\n</{D}function_calls>more', False,
         "text after"),
        (f'\n\n<{D}function_calls>\n<{D}invoke name="f">\n\n</{D}invoke>', False, "expected"),
    ],
)
def test_parse_refuses_what_breaks_the_format(text, thinking, match):
    with pytest.raises(CompletionFormatError, match=match):
        parse_completion(text, thinking)



def test_find_tool_calls():
    from mtp.text.dsml import find_tool_calls, tool_calls_text

    calls = [call("lookup", word="cat")]
    block = tool_calls_text(calls, "t")
    assert find_tool_calls(f"Sure.{block}{E}", thinking=False) == ("Sure.", calls)
    assert find_tool_calls(f"why{ET}{block}", thinking=True) == ("", calls)
    assert find_tool_calls(f"reasoning that mentions {D} but never ends", thinking=True) is None
    assert find_tool_calls(f"plain answer{E}", thinking=False) is None
    with pytest.raises(CompletionFormatError):
        find_tool_calls(block[:-5], thinking=False)  # cut off before the closing tag
