"""Tool use in `mtp-chat`: OpenAI-style tool schemas from a JSON file, the model's DSML tool calls read back from
its reply (`mtp.text.dsml`), and the results the person types, one per call, in the order of the calls.

    /tools FILE     load tool schemas: a JSON list of {"type": "function", "function": {"name": ..., ...}}
                    (or an object with such a list under "tools"); /tools shows them, /tools off drops them
    /result TEXT    the result of the next pending call; after the last one the model goes on by itself
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..text.dsml import find_tool_calls, tools_block
from ..text.tokenizer import Tokenizer

TOOLS_HELP = """\
  /tools FILE                  load tool schemas (JSON list of OpenAI-style tools); /tools off drops them
  /result TEXT                 result of the model's next pending tool call (one per call, in order);
                               after the last one the reply continues"""


def load_tools(path: str | Path) -> list[dict[str, Any]]:
    """Tool schemas from a JSON file, checked as the prompt builder will use them."""
    file = Path(path).expanduser()
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"{file}: cannot read: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    tools = data.get("tools") if isinstance(data, dict) else data
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"{file}: expected a non-empty JSON list of tools (or {{\"tools\": [...]}})")
    tools_block(tools, str(file))  # the format's own checks, with the file named
    for j, tool in enumerate(tools):
        name = tool["function"].get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{file}: tools[{j}].function.name must be a non-empty str, got {name!r}")
    return tools


def tool_names(tools: Sequence[dict[str, Any]]) -> str:
    return ", ".join(t["function"]["name"] for t in tools)


def read_tool_calls(tok: Tokenizer, reply_ids: Sequence[int], thinking: bool) -> tuple[str, list[dict]] | None:
    """`mtp.text.dsml.find_tool_calls` of a reply's ids, decoded with their special tokens."""
    return find_tool_calls(tok.decode(reply_ids, skip_special_tokens=False), thinking)


def describe_calls(calls: Sequence[dict[str, Any]]) -> str:
    lines = [f"  {i}) {c['function']['name']}({c['function']['arguments']})" for i, c in enumerate(calls, 1)]
    return "tool calls:\n" + "\n".join(lines) + "\nanswer with /result TEXT, one per call in this order"
