"""DeepSeek-V3.2 chat prompt format (no Jinja template ships with the model; facts section 6).

    BOS + system text + for each user turn: <｜User｜>content<｜Assistant｜>M
        where M = <think> after the last user turn in thinking mode, else </think>
    + for each assistant turn: content<｜end▁of▁sentence｜>

An assistant turn after the last user turn in thinking mode is the one being written, so it keeps its
reasoning: `reasoning</think>content<｜end▁of▁sentence｜>`; earlier assistant turns keep only their answer.
This follows DeepSeek's reference `encoding_dsv32.py`, including its one surprise: every user message
is followed by the `<｜Assistant｜>` marker, so two user messages in a row read
`<｜User｜>a<｜Assistant｜></think><｜User｜>b<｜Assistant｜>...`. An assistant message that does not follow a
user message gets its own `<｜Assistant｜></think>` opener so its role stays visible.

The marker after the final user message is the generation prompt; `add_generation_prompt=False` leaves
it out (for scoring a prefix). Ids are built piece by piece with special ids inserted directly, so the
result never depends on how the BPE would split a special-token string.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mtp.tokenizer import ASSISTANT, BOS, END_THINK, EOS, THINK, USER, Tokenizer

ROLES = ("system", "user", "assistant")

Messages = Sequence[Mapping[str, Any]]
Piece = tuple[str, bool]  # (text, is_special_token)


def _validate(messages: Messages) -> None:
    if len(messages) == 0:
        raise ValueError("messages is empty; expected at least one message")
    started_at = None  # index of the first non-system message
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            got = type(msg).__name__
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {got}")
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}]: unknown role {role!r}, expected one of {ROLES}")
        if not isinstance(msg.get("content"), str):
            got = type(msg.get("content")).__name__
            raise ValueError(f"messages[{i}] ({role}): content must be a str, got {got}")
        reasoning = msg.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            got = type(reasoning).__name__
            raise ValueError(f"messages[{i}] ({role}): reasoning_content must be a str or None, got {got}")
        if role == "system" and started_at is not None:
            raise ValueError(
                f"messages[{i}]: system message after the conversation started at messages[{started_at}]; "
                "system messages must come first"
            )
        if role != "system" and started_at is None:
            started_at = i


def chat_pieces(messages: Messages, thinking: bool, add_generation_prompt: bool = True) -> list[Piece]:
    """The prompt as (text, is_special) pieces: the single source for both `render_chat` and `encode_chat`."""
    _validate(messages)
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    pieces: list[Piece] = [(BOS, True)]
    system = "".join(m["content"] for m in messages if m["role"] == "system")
    if system:
        pieces.append((system, False))
    for i, msg in enumerate(messages):
        role, content = msg["role"], msg["content"]
        if role == "user":
            pieces += [(USER, True), (content, False)]
            if i < len(messages) - 1 or add_generation_prompt:
                opens_thinking = thinking and i == last_user
                pieces += [(ASSISTANT, True), (THINK if opens_thinking else END_THINK, True)]
        elif role == "assistant":
            if i == 0 or messages[i - 1]["role"] != "user":
                pieces += [(ASSISTANT, True), (END_THINK, True)]
            elif thinking and i > last_user:
                pieces += [(msg.get("reasoning_content") or "", False), (END_THINK, True)]
            pieces += [(content, False), (EOS, True)]
    return [(text, special) for text, special in pieces if text]


def render_chat(messages: Messages, thinking: bool, add_generation_prompt: bool = True) -> str:
    """The prompt as one string (for logs and for comparing with DeepSeek's reference encoder)."""
    return "".join(text for text, _ in chat_pieces(messages, thinking, add_generation_prompt))


def encode_chat(
    messages: Messages, tokenizer: Tokenizer, thinking: bool, add_generation_prompt: bool = True
) -> list[int]:
    """The prompt as token ids: plain text encoded piece by piece, special tokens inserted by id."""
    special_ids = {
        BOS: tokenizer.bos_id,
        EOS: tokenizer.eos_id,
        USER: tokenizer.user_id,
        ASSISTANT: tokenizer.assistant_id,
        THINK: tokenizer.think_id,
        END_THINK: tokenizer.end_think_id,
    }
    ids: list[int] = []
    for text, special in chat_pieces(messages, thinking, add_generation_prompt):
        if special:
            ids.append(special_ids[text])
        else:
            ids += tokenizer.encode(text)
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
