"""Tools: ``@tool`` functions, their schemas, a registry, and execution with timeouts."""

from specrag.tools.builtin import format_passage, search_documents_tool, search_scope
from specrag.tools.calls import ToolCall, parse_tool_call
from specrag.tools.execute import InvalidArgumentsError, ToolError, ToolResult, run_tool, run_tool_sync, validate_call
from specrag.tools.registry import Tool, ToolRegistry, UnknownToolError, tool
from specrag.tools.schema import ToolDefinitionError

__all__ = [
    "InvalidArgumentsError",
    "Tool",
    "ToolCall",
    "ToolDefinitionError",
    "ToolError",
    "ToolRegistry",
    "ToolResult",
    "UnknownToolError",
    "format_passage",
    "parse_tool_call",
    "run_tool",
    "run_tool_sync",
    "search_documents_tool",
    "search_scope",
    "tool",
    "validate_call",
]
