"""DeepSeek-V3.2's tool-call format (DSML), both ways: OpenAI-style tools and tool calls to the text the model
reads, and a completion the model wrote back to an OpenAI-style assistant message.

What the model sees (DSML = the marker `｜DSML｜`, plain text to the format; `mtp.text.prompt` places these pieces):
- tools: one instruction block, `tools_block(tools)`, ending in the functions' JSON schemas, one per line
  (`json.dumps(tool["function"], ensure_ascii=False)`), inside `<functions>` .. `</functions>`;
- an assistant's tool calls, after its answer text:
      \\n\\n<DSML function_calls>\\n<DSML invoke name="get_weather">\\n
      <DSML parameter name="city" string="true">Paris</DSML parameter>\\n
      <DSML parameter name="days" string="false">3</DSML parameter>\\n</DSML invoke>\\n</DSML function_calls>
  (`<DSML x>` standing for `<｜DSML｜x>`): one invoke per call joined by newlines, one parameter per argument
  joined by newlines; a string argument is written as is with string="true", any other value as JSON with
  string="false". The call's `arguments` must be a JSON string of an object, as in the OpenAI API;
- tool results: `\\n\\n<function_results>`, then `\\n<result>TEXT</result>` per result, then
  `\\n</function_results>` after the last result the calls asked for.

`parse_completion` reads a completion back. The DSML markers, `</think>` and the end-of-sentence token must
appear only where the format puts them; anything else is refused with `CompletionFormatError` naming the place
(the format is parsed as written, never repaired).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .tokenizer import BOS, END_THINK, EOS, THINK

DSML = "｜DSML｜"
CALLS_OPEN = f"\n\n<{DSML}function_calls"  # ">\n" follows
CALLS_CLOSE = f"</{DSML}function_calls>"
INVOKE_OPEN = f"<{DSML}invoke"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAM_OPEN = f"<{DSML}parameter"
PARAM_CLOSE = f"</{DSML}parameter>"
RESULTS_OPEN = "\n\n<function_results>"
RESULTS_CLOSE = "\n</function_results>"

# The instruction text the model was trained with ({d} = DSML marker; the schemas go last), as DeepSeek publishes
# it in TOOLS_SYSTEM_TEMPLATE of encoding/encoding_dsv32.py (huggingface.co/deepseek-ai/DeepSeek-V3.2), blank lines
# included (some downstream copies drop them). It must stay byte for byte as it is: the prompt's tokens are what
# acceptance is measured on; tests/text/test_dsv32_gold.py holds it to DeepSeek's gold fixture.
_TOOLS_INSTRUCTIONS = """## Tools

You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{d}function_calls>" block like the following as part of your reply to the user:
<{d}function_calls>
<{d}invoke name="$FUNCTION_NAME">
<{d}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}parameter>
...
</{d}invoke>
<{d}invoke name="$FUNCTION_NAME2">
...
</{d}invoke>
</{d}function_calls>

String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects \
should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" \
for other types (numbers, booleans, arrays, objects).

If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking \
block. Here is an example:

<{d}function_calls>
...
</{d}function_calls>

<function_results>
...
</function_results>

{think}...thinking about results{end_think}

Here are the functions available in JSONSchema format:
<functions>
"""
_RESPONSE_FORMAT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


class CompletionFormatError(ValueError):
    """A completion that does not follow the DSML format where it claims to."""


def to_json(value: Any, where: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: not JSON-serializable ({e})") from None


def tools_block(tools: Sequence[Mapping[str, Any]], where: str) -> str:
    """The tools instruction block for OpenAI-style tools `[{"type": "function", "function": {...}}, ...]`."""
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise ValueError(f"{where}: tools must be a list of {{'type': 'function', 'function': {{...}}}}, "
                         f"got {type(tools).__name__}")
    schemas = []
    for j, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or not isinstance(tool.get("function"), Mapping):
            raise ValueError(f"{where}: tools[{j}] must be a dict with a 'function' dict (OpenAI format), got "
                             f"{tool!r:.80}")
        schemas.append(to_json(dict(tool["function"]), f"{where}: tools[{j}].function"))
    head = _TOOLS_INSTRUCTIONS.format(d=DSML, think=THINK, end_think=END_THINK)
    return head + "\n".join(schemas) + "\n</functions>\n"


def response_format_block(response_format: Any, where: str) -> str:
    return _RESPONSE_FORMAT + to_json(response_format, f"{where}: response_format")


def tool_calls_text(tool_calls: Sequence[Mapping[str, Any]], where: str) -> str:
    """The DSML block of OpenAI-style tool calls (with its leading blank line)."""
    if isinstance(tool_calls, (str, bytes)) or not isinstance(tool_calls, Sequence):
        raise ValueError(f"{where}: tool_calls must be a list, got {type(tool_calls).__name__}")
    invokes = []
    for j, call in enumerate(tool_calls):
        name, args = call_name_and_args(call, f"{where}: tool_calls[{j}]")
        params = [f'{PARAM_OPEN} name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
                  f'{v if isinstance(v, str) else to_json(v, where)}{PARAM_CLOSE}' for k, v in args.items()]
        invokes.append(f'{INVOKE_OPEN} name="{name}">\n' + "\n".join(params) + f"\n{INVOKE_CLOSE}")
    return f"{CALLS_OPEN}>\n" + "\n".join(invokes) + f"\n{CALLS_CLOSE}"


def call_name_and_args(call: Any, where: str) -> tuple[str, dict]:
    """(name, decoded arguments) of one OpenAI-style tool call, refusing what the format cannot write."""
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping):
        raise ValueError(f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}, "
                         f"got {call!r:.80}")
    name, raw = fn.get("name"), fn.get("arguments")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.function.name must be a non-empty str, got {name!r}")
    if not isinstance(raw, str):
        raise ValueError(f"{where}.function.arguments must be a JSON string of an object (OpenAI format), "
                         f"got {type(raw).__name__}")
    try:
        args = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}.function.arguments is not valid JSON ({e}): {raw!r:.80}") from None
    if not isinstance(args, dict):
        raise ValueError(f"{where}.function.arguments must decode to a JSON object, got {type(args).__name__}")
    return name, args


def tool_result_text(content: str, first: bool, last: bool) -> str:
    """One tool result inside the results block (`first` opens the block, `last` closes it)."""
    return (RESULTS_OPEN if first else "") + f"\n<result>{content}</result>" + (RESULTS_CLOSE if last else "")


# ---------------------------------------------------------------------------------------------- parsing
_INVOKE_HEAD = re.compile(r'\s*name="([^"]*)">\n')
_PARAM = re.compile(r' name="([^"]*)" string="(true|false)">(.*?)' + re.escape(PARAM_CLOSE) + "\n", re.DOTALL)


def parse_completion(text: str, thinking: bool) -> dict[str, Any]:
    """A completion (decoded with its special tokens; the end-of-sentence token optional) -> an OpenAI-style
    assistant message {"role", "content", "reasoning_content", "tool_calls"}. In thinking mode the text must
    hold `</think>` (reasoning before it); arguments come back as a JSON string of an object, string values
    JSON-quoted and the others as the model wrote them (they must be valid JSON)."""
    reasoning, rest = "", text
    if thinking:
        end = rest.find(END_THINK)
        calls_at = rest.find(CALLS_OPEN)
        if end < 0 or 0 <= calls_at < end:
            raise CompletionFormatError(f"thinking mode: no {END_THINK} before the answer in {text!r:.120}")
        reasoning, rest = rest[:end], rest[end + len(END_THINK):]
    eos = rest.find(EOS)
    calls_at = rest.find(CALLS_OPEN)
    tool_calls: list[dict[str, Any]] = []
    if calls_at >= 0 and (eos < 0 or calls_at < eos):
        content = rest[:calls_at]
        pos, tool_calls = _parse_calls(rest, calls_at + len(CALLS_OPEN))
        tail = rest[pos:]
        if tail not in ("", EOS):
            raise CompletionFormatError(f"text after {CALLS_CLOSE}: {tail!r:.80}")
    else:
        content = rest if eos < 0 else rest[:eos]
        if eos >= 0 and rest[eos + len(EOS):]:
            raise CompletionFormatError(f"text after {EOS}: {rest[eos + len(EOS):]!r:.80}")
    for part, label in ((reasoning, "reasoning"), (content, "content")):
        for marker in (BOS, EOS, THINK, END_THINK, DSML):
            if marker in part:
                raise CompletionFormatError(f"{label} holds {marker!r} where the format does not put it: "
                                            f"{part!r:.120}")
    return {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": tool_calls}


def find_tool_calls(completion: str, thinking: bool) -> tuple[str, list[dict[str, Any]]] | None:
    """(answer text before the calls, OpenAI-style tool calls) when a completion (decoded with its special
    tokens, so a DSML marker that is one special token is still there) holds DSML tool calls after its
    reasoning; None when it holds none (or, in thinking mode, never ended its reasoning). Malformed calls raise
    CompletionFormatError."""
    if thinking:
        _, found, completion = completion.partition(END_THINK)
        if not found:
            return None
    if DSML not in completion:
        return None
    msg = parse_completion(completion, thinking=False)
    return (msg["content"], msg["tool_calls"]) if msg["tool_calls"] else None


def _expect(text: str, pos: int, token: str) -> int:
    if not text.startswith(token, pos):
        raise CompletionFormatError(f"expected {token!r} at offset {pos}, found {text[pos:pos + 40]!r}")
    return pos + len(token)


def _parse_calls(text: str, pos: int) -> tuple[int, list[dict[str, Any]]]:
    """The invokes after `<DSML function_calls>` up to its closing tag; returns (offset after it, calls)."""
    pos = _expect(text, pos, ">\n")
    calls = []
    while not text.startswith(CALLS_CLOSE, pos):
        pos = _expect(text, pos, INVOKE_OPEN)
        head = _INVOKE_HEAD.match(text, pos)
        if head is None:
            raise CompletionFormatError(f"bad invoke header at offset {pos}: {text[pos:pos + 60]!r}")
        name, pos = head.group(1), head.end()
        args: dict[str, str] = {}
        while text.startswith(PARAM_OPEN, pos):
            m = _PARAM.match(text, pos + len(PARAM_OPEN))
            if m is None:
                raise CompletionFormatError(f"bad parameter at offset {pos}: {text[pos:pos + 80]!r}")
            key, is_str, value = m.groups()
            if key in args:
                raise CompletionFormatError(f"tool call {name!r}: parameter {key!r} given twice")
            if is_str == "false":
                try:
                    json.loads(value)
                except json.JSONDecodeError:
                    raise CompletionFormatError(f"tool call {name!r}: parameter {key!r} has string=\"false\" but "
                                                f"is not JSON: {value!r:.80}") from None
            args[key] = json.dumps(value, ensure_ascii=False) if is_str == "true" else value
            pos = m.end()
        if not args:  # a call without arguments has an empty line where they would be
            pos = _expect(text, pos, "\n")
        pos = _expect(text, pos, INVOKE_CLOSE + "\n")
        arguments = "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in args.items()) + "}"
        calls.append({"type": "function", "function": {"name": name, "arguments": arguments}})
    return pos + len(CALLS_CLOSE), calls
