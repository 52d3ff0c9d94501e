"""DeepSeek-V3.2 chat prompt format: OpenAI-style messages -> the exact string of DeepSeek's reference encoder
(`encoding_dsv32.py`, published with the model; no Jinja template ships), and its token ids.

    BOS, then each message in order:
    system      content, then "\\n\\n" + tools block if it has `tools`, "\\n\\n" + response format if it has
                `response_format` (mtp.text.dsml); no role marker, so a system message mid-conversation is text in place
    user        <｜User｜>content<｜Assistant｜>M
    developer   <｜User｜>[\\n\\n tools][\\n\\n response format]\\n\\n# The user's message is: content
                (no line break), then <｜Assistant｜>M as after a user message
    assistant   [reasoning</think>]content[\\n\\n DSML tool calls]<｜end▁of▁sentence｜>
    tool        its result inside a <function_results> block; the block closes after as many results as the
                assistant before made calls, followed by "\\n\\n" + M
    M = <think> after the last user/developer message in thinking mode (and after tool results that follow it),
        </think> everywhere else.

An assistant message after the last user/developer message in thinking mode keeps its reasoning (it is part of
the reply being written: a tool-calling turn, its results, then more reasoning) and must have reasoning or tool
calls; earlier assistant turns keep only their answer. Assistant messages get no role marker of their own: the
`<｜Assistant｜>` that follows every user message opens them, so an assistant turn that does not follow a user
message (the first message, one after another) is written straight after the previous text. `content: None`
is "" for system and assistant messages. `reasoning` is read as well as `reasoning_content`, as the reference does.

`tools=` (OpenAI's request-level list) is placed as vLLM's DeepSeek-V3.2 front end places it: a system message
holding only the tools, before all others. Tools on a system or developer message are rendered where they are.

Departures from the reference, each refusing garbage the reference would turn into a prompt: an empty
conversation; user, developer or tool content that is not a string (the reference writes Python's str() of it,
e.g. "None"); a tool result as the first message (the reference then pairs it with the last message's calls);
`tools` / `response_format` / `tool_calls` on a message whose role does not render them (the reference ignores
them). One acceptance beyond it: in thinking mode a developer message before the last user message renders in
place (the reference's default `drop_thinking=True` fails on it with an index error; with `drop_thinking=False`
it renders the same string as here).

`label_assistant_turns=True` keeps this project's earlier format, where an assistant message that follows no
user/developer/tool message gets its own `<｜Assistant｜></think>` opener (and no reasoning), so its role stays
visible; DeepSeek's reference does not do this. `add_generation_prompt=False` leaves out what opens the reply
after the final message (`<｜Assistant｜>M` after a user message, `\\n\\nM` after tool results), for scoring a
prefix. Ids are built piece by piece with the role tokens inserted by id and each run of text encoded whole, so
they equal encoding the rendered string with the real tokenizer whatever its BPE does with special-token text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from . import dsml
from .tokenizer import ASSISTANT, BOS, END_THINK, EOS, THINK, USER, Tokenizer

ROLES = ("system", "user", "developer", "assistant", "tool")
_RENDERS = {"tools": ("system", "developer"), "response_format": ("system", "developer"), "tool_calls": ("assistant",)}

Messages = Sequence[Mapping[str, Any]]
Piece = tuple[str, bool]  # (text, is_special_token)


def _reasoning(msg: Mapping[str, Any]) -> str | None:
    return msg.get("reasoning") or msg.get("reasoning_content")


def _check(i: int, msg: Any) -> None:
    """Types of one message, by the rules of its role."""
    if not isinstance(msg, Mapping):
        raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(msg).__name__}")
    role = msg.get("role")
    if role not in ROLES:
        raise ValueError(f"messages[{i}]: unknown role {role!r}, expected one of {ROLES}")
    content = msg.get("content")
    if role in ("system", "assistant"):
        ok = content is None or isinstance(content, str)
        expected = "a str or None"
    elif role == "developer":
        ok, expected = isinstance(content, str) and content != "", "a non-empty str"
    else:
        ok, expected = isinstance(content, str), "a str"
    if not ok:
        raise ValueError(f"messages[{i}] ({role}): content must be {expected}, got {type(content).__name__}")
    for key in ("reasoning_content", "reasoning"):
        value = msg.get(key)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"messages[{i}] ({role}): {key} must be a str or None, got {type(value).__name__}")
    for key, roles in _RENDERS.items():
        if msg.get(key) and role not in roles:
            raise ValueError(f"messages[{i}] ({role}): {key} belongs on a {' or '.join(roles)} message; "
                             f"a {role} message would drop it")


def _tool_group(messages: Messages, i: int) -> tuple[int, int]:
    """(1-based order of tool result i among the results after its assistant message, calls that message made)."""
    j = i - 1
    while j >= 0 and messages[j]["role"] == "tool":
        j -= 1
    calls = messages[j].get("tool_calls") if j >= 0 and messages[j]["role"] == "assistant" else None
    if not calls:
        raise ValueError(f"messages[{i}] (tool): a tool result must follow an assistant message with tool_calls "
                         f"(and the results of its other calls)")
    order = i - j
    if order > len(calls):
        raise ValueError(f"messages[{i}] (tool): result {order} after messages[{j}], which made only "
                         f"{len(calls)} tool call(s)")
    return order, len(calls)


def chat_pieces(messages: Messages, thinking: bool, add_generation_prompt: bool = True, *,
                tools: Sequence[Mapping[str, Any]] | None = None, label_assistant_turns: bool = False,
                ) -> list[Piece]:
    """The prompt as (text, is_special) pieces: the single source for both `render_chat` and `encode_chat`."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError("messages is empty; expected at least one message")
    for i, msg in enumerate(messages):
        _check(i, msg)
    last = len(messages) - 1
    last_user = max((i for i, m in enumerate(messages) if m["role"] in ("user", "developer")), default=-1)
    pieces: list[Piece] = [(BOS, True)]
    if tools:  # a system message of its own, holding only the tools
        pieces.append(("\n\n" + dsml.tools_block(tools, "tools"), False))

    def text(s: str) -> None:
        pieces.append((s, False))

    def opens_reply(i: int, prefix: str) -> None:
        if i < last or add_generation_prompt:
            text(prefix)
            pieces.append((THINK if thinking and i >= last_user else END_THINK, True))

    for i, msg in enumerate(messages):
        role, where = msg["role"], f"messages[{i}] ({msg['role']})"
        if role in ("system", "developer"):
            extra = ""
            if msg.get("tools"):
                extra += "\n\n" + dsml.tools_block(msg["tools"], where)
            if msg.get("response_format"):
                extra += "\n\n" + dsml.response_format_block(msg["response_format"], where)
            if role == "system":
                text((msg.get("content") or "") + extra)
                continue
            pieces.append((USER, True))
            text(f"{extra}\n\n# The user's message is: {msg['content']}")
            if i < last or add_generation_prompt:
                pieces += [(ASSISTANT, True), (THINK if thinking and i == last_user else END_THINK, True)]
        elif role == "user":
            pieces.append((USER, True))
            text(msg["content"])
            if i < last or add_generation_prompt:
                pieces += [(ASSISTANT, True), (THINK if thinking and i == last_user else END_THINK, True)]
        elif role == "tool":
            if i == 0:
                raise ValueError(f"{where}: a tool result cannot be the first message; it must follow an "
                                 "assistant message with tool_calls")
            order, n_calls = _tool_group(messages, i)
            text(dsml.tool_result_text(msg["content"], first=order == 1, last=order == n_calls))
            if order == n_calls:
                opens_reply(i, "\n\n")
        else:  # assistant
            calls = dsml.tool_calls_text(msg["tool_calls"], where) if msg.get("tool_calls") else ""
            follows_turn = i > 0 and messages[i - 1]["role"] in ("user", "developer", "tool")
            if label_assistant_turns and not follows_turn:
                pieces += [(ASSISTANT, True), (END_THINK, True)]
            elif thinking and i > last_user:
                reasoning = _reasoning(msg)
                if not reasoning and not calls:
                    raise ValueError(f"{where}: in thinking mode an assistant message after the last user message "
                                     "needs reasoning_content or tool_calls (it is part of the reply being written)")
                text(reasoning or "")
                pieces.append((END_THINK, True))
            text((msg.get("content") or "") + calls)
            pieces.append((EOS, True))
    return _merge([(t, special) for t, special in pieces if t])


def _merge(pieces: list[Piece]) -> list[Piece]:
    """Adjacent text pieces joined, so each run of text is tokenized whole (as the rendered string would be)."""
    out: list[Piece] = []
    for t, special in pieces:
        if out and not special and not out[-1][1]:
            out[-1] = (out[-1][0] + t, False)
        else:
            out.append((t, special))
    return out


def render_chat(messages: Messages, thinking: bool, add_generation_prompt: bool = True, *,
                tools: Sequence[Mapping[str, Any]] | None = None, label_assistant_turns: bool = False) -> str:
    """The prompt as one string (DeepSeek's reference encoder gives the same string; see the module doc)."""
    return "".join(t for t, _ in chat_pieces(messages, thinking, add_generation_prompt, tools=tools,
                                             label_assistant_turns=label_assistant_turns))


def encode_chat(messages: Messages, tokenizer: Tokenizer, thinking: bool, add_generation_prompt: bool = True, *,
                tools: Sequence[Mapping[str, Any]] | None = None, label_assistant_turns: bool = False) -> list[int]:
    """The prompt as token ids: role tokens inserted by id, each run of text encoded whole."""
    special_ids = {
        BOS: tokenizer.bos_id,
        EOS: tokenizer.eos_id,
        USER: tokenizer.user_id,
        ASSISTANT: tokenizer.assistant_id,
        THINK: tokenizer.think_id,
        END_THINK: tokenizer.end_think_id,
    }
    ids: list[int] = []
    for t, special in chat_pieces(messages, thinking, add_generation_prompt, tools=tools,
                                  label_assistant_turns=label_assistant_turns):
        if special:
            ids.append(special_ids[t])
        else:
            ids += tokenizer.encode(t)
    return ids


def initial_think_state(prompt_ids: Sequence[int], think_id: int, end_think_id: int) -> bool:
    """Whether generation starts inside a thinking span: the later of `<think>`/`</think>` is `<think>`.

    The relaxed verifier accepts looser drafts only inside reasoning, so it needs this state for the
    first generated token; it tracks later transitions itself.
    """
    for token_id in reversed(prompt_ids):
        if token_id == think_id:
            return True
        if token_id == end_think_id:
            return False
    return False
