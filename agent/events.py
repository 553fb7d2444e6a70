"""What an agent run streams: typed events, one class per kind.

``Agent.stream`` yields them; the HTTP API sends each as a server-sent event named by
``kind`` whose data is ``data()`` (the wire format, unchanged from the dicts these replace).
A failure travels as an ``ErrorEvent`` carrying the exception itself, so the server tells
a busy worker or a too-large request from a failure by type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class TokenEvent:
    """Answer text as it is written (a step's text, in pieces)."""

    kind: ClassVar[str] = "token"
    step: int
    text: str

    def data(self) -> dict[str, Any]:
        return {"step": self.step, "text": self.text}


@dataclass(frozen=True)
class ToolCallEvent:
    """A tool call the model made, about to run."""

    kind: ClassVar[str] = "tool_call"
    step: int
    name: str
    arguments: dict[str, Any]

    def data(self) -> dict[str, Any]:
        return {"step": self.step, "name": self.name, "arguments": self.arguments}


@dataclass(frozen=True)
class ToolResultEvent:
    """A tool's result (``specrag.agent.results.tool_result_dict``: name, content, ok, error, ...)."""

    kind: ClassVar[str] = "tool_result"
    step: int
    result: dict[str, Any]

    def data(self) -> dict[str, Any]:
        return {"step": self.step, **self.result}


@dataclass(frozen=True)
class FinalEvent:
    """The run's result, the body ``POST /v1/agent/runs`` answers with."""

    kind: ClassVar[str] = "final"
    result: dict[str, Any]

    def data(self) -> dict[str, Any]:
        return self.result


@dataclass(frozen=True)
class ErrorEvent:
    """The run failed; clients see the exception's type name and message."""

    kind: ClassVar[str] = "error"
    exception: Exception = field(repr=False)

    @property
    def type(self) -> str:
        return type(self.exception).__name__

    @property
    def message(self) -> str:
        return str(self.exception)

    def data(self) -> dict[str, Any]:
        return {"type": self.type, "message": self.message}


AgentEvent = TokenEvent | ToolCallEvent | ToolResultEvent | FinalEvent | ErrorEvent
