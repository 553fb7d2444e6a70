"""Running a tool call: validate, execute with a timeout, serialise, never raise.

Every failure (unknown tool, arguments that are not JSON or do not validate, the tool
raising, the tool running past its timeout) becomes a ``ToolResult`` with a structured
``ToolError`` that the agent sees as an observation and the caller sees in the run's
steps. Sync tools run in a worker thread so the event loop keeps serving; Python cannot
kill a thread, so a sync tool that times out keeps running in the background until it
returns, and its result is discarded.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Literal

import pydantic

from specrag.tools.registry import Tool, ToolRegistry, UnknownToolError

# Sync tools run here, not in the loop's default executor: ``asyncio.run`` joins that one
# on exit, which would make a caller wait for a timed-out tool after all.
_TOOL_THREADS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="specrag-tool")

ErrorType = Literal["unknown_tool", "invalid_arguments", "timeout", "exception"]


@dataclass(frozen=True)
class ToolError:
    type: ErrorType
    message: str
    field: str | None = None  # the offending argument, for invalid_arguments


@dataclass(frozen=True)
class ToolResult:
    name: str
    content: str  # what the agent reads: the result, or the error message
    error: ToolError | None = None
    seconds: float = 0.0
    truncated_chars: int = 0  # characters cut by the tool's max_result_chars

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def parse_arguments(arguments: Mapping[str, Any] | str) -> dict[str, Any]:
    """Arguments as a dict; a JSON string is decoded. Raises ValueError with the reason."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            raise ValueError(f"arguments are not valid JSON: {error}") from None
    if not isinstance(arguments, Mapping):
        raise ValueError(f"arguments must be a JSON object, got {type(arguments).__name__}")
    return dict(arguments)


def validate_call(
    registry: ToolRegistry, name: str, arguments: Mapping[str, Any] | str
) -> tuple[Tool, pydantic.BaseModel]:
    """Resolve and validate a call; raises UnknownToolError or InvalidArgumentsError."""
    tool = registry.get(name)
    try:
        return tool, tool.arguments.model_validate(parse_arguments(arguments))
    except ValueError as error:  # pydantic.ValidationError is a ValueError
        raise InvalidArgumentsError(name, error) from None


class InvalidArgumentsError(ValueError):
    def __init__(self, name: str, error: ValueError) -> None:
        self.field: str | None = None
        if isinstance(error, pydantic.ValidationError):
            first = error.errors()[0]
            self.field = ".".join(str(part) for part in first["loc"]) or None
            detail = "; ".join(
                f"{'.'.join(str(part) for part in item['loc']) or '(arguments)'}: {item['msg']}"
                for item in error.errors()
            )
        else:
            detail = str(error)
        super().__init__(f"invalid arguments for tool {name!r}: {detail}")


async def run_tool(registry: ToolRegistry, name: str, arguments: Mapping[str, Any] | str) -> ToolResult:
    """Validate and execute one call. Never raises for anything the call itself does."""
    start = time.perf_counter()
    try:
        tool, validated = validate_call(registry, name, arguments)
    except UnknownToolError as error:
        return ToolResult(name, str(error), ToolError("unknown_tool", str(error)))
    except InvalidArgumentsError as error:
        return ToolResult(name, str(error), ToolError("invalid_arguments", str(error), error.field))
    kwargs = {field: getattr(validated, field) for field in type(validated).model_fields}
    try:
        if tool.is_async:
            value = await asyncio.wait_for(tool.function(**kwargs), tool.timeout_s)
        else:
            # In a copy of the caller's context, as asyncio.to_thread does: an agent run's
            # bindings (``builtin.search_scope``) reach the tool in its worker thread.
            call = functools.partial(contextvars.copy_context().run, tool.function, **kwargs)
            running = asyncio.get_running_loop().run_in_executor(_TOOL_THREADS, call)
            value = await asyncio.wait_for(running, tool.timeout_s)
    except TimeoutError:
        message = f"tool {name!r} timed out after {tool.timeout_s:g} s"
        return ToolResult(name, message, ToolError("timeout", message), time.perf_counter() - start)
    except Exception as error:  # a tool's failure is an observation, not a crash
        message = f"tool {name!r} raised {type(error).__name__}: {error}"
        return ToolResult(name, message, ToolError("exception", message), time.perf_counter() - start)
    content, cut = _capped(serialise(value), tool.max_result_chars)
    return ToolResult(name, content, None, time.perf_counter() - start, cut)


def run_tool_sync(registry: ToolRegistry, name: str, arguments: Mapping[str, Any] | str) -> ToolResult:
    """``run_tool`` for callers without an event loop."""
    return asyncio.run(run_tool(registry, name, arguments))


def serialise(value: Any) -> str:
    """Text for the model: strings as they are, pydantic models and JSON-able values as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, pydantic.BaseModel):
        return value.model_dump_json()
    try:
        return json.dumps(value, ensure_ascii=False, default=_fallback)
    except (TypeError, ValueError):
        return str(value)


def _fallback(value: Any) -> Any:
    if isinstance(value, pydantic.BaseModel):
        return value.model_dump(mode="json")
    return str(value)


def _capped(text: str, max_chars: int) -> tuple[str, int]:
    if len(text) <= max_chars:
        return text, 0
    cut = len(text) - max_chars
    return f"{text[:max_chars]}\n[... {cut} more characters cut]", cut
