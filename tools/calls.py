"""Reading a tool call out of model output produced under the tool-choice grammar."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def parse_tool_call(text: str) -> ToolCall | None:
    """The call in ``text``, or None when the text is a final answer.

    Under the tool-choice grammar an output that opens a JSON object is a call; one that
    does not parse was cut short (``max_tokens`` or a stop sequence) and raises ValueError.
    """
    stripped = text.strip()
    if not stripped.startswith("{"):
        return None
    try:
        call = json.loads(stripped)
    except json.JSONDecodeError as error:
        raise ValueError(f"incomplete tool call ({error.msg} at character {error.pos})") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ValueError('a tool call must be {"name": ..., "arguments": {...}}')
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        raise ValueError("tool call arguments must be a JSON object")
    return ToolCall(call["name"], arguments)
