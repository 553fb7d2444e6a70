"""The ``@tool`` decorator, the ``Tool`` it returns and the ``ToolRegistry`` that holds them."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

from pydantic import BaseModel

from specrag.decoding.grammar_compile import BARE_CALLS, CallSyntax
from specrag.tools.schema import arguments_model, describe, parameters_schema

if TYPE_CHECKING:
    from specrag.decoding.grammar import Grammar
    from specrag.decoding.grammar_compile import GrammarCompiler

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MAX_RESULT_CHARS = 4000


@dataclass(frozen=True)
class Tool:
    """A typed function the agent can call. Calling the Tool calls the function itself."""

    name: str
    description: str
    function: Callable[..., Any]
    arguments: type[BaseModel]
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_result_chars: int = DEFAULT_MAX_RESULT_CHARS
    parameters: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "parameters", parameters_schema(self.arguments))

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.function)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)

    def openai_schema(self) -> dict[str, Any]:
        """The OpenAI ``tools`` entry: ``{"type": "function", "function": {...}}``."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@overload
def tool(function: Callable[..., Any], /) -> Tool: ...
@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_result_chars: int = DEFAULT_MAX_RESULT_CHARS,
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    function: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_result_chars: int = DEFAULT_MAX_RESULT_CHARS,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Turn a typed function (sync or async) into a Tool; usable bare or with options."""

    def make(function: Callable[..., Any]) -> Tool:
        tool_name = name or function.__name__
        if not tool_name.isidentifier():
            raise ValueError(f"tool name {tool_name!r} must be an identifier")
        if timeout_s <= 0 or max_result_chars <= 0:
            raise ValueError(f"tool {tool_name!r}: timeout_s and max_result_chars must be positive")
        doc_description, argument_descriptions = describe(function)
        return Tool(
            name=tool_name,
            description=description if description is not None else doc_description,
            function=function,
            arguments=arguments_model(function, tool_name, argument_descriptions),
            timeout_s=timeout_s,
            max_result_chars=max_result_chars,
        )

    return make(function) if function is not None else make


class UnknownToolError(LookupError):
    def __init__(self, name: str, known: Iterable[str]) -> None:
        super().__init__(f"unknown tool {name!r}; known tools: {', '.join(sorted(known)) or '(none)'}")
        self.name = name


class ToolRegistry:
    """Tools by name. A registry compiles to one grammar: a call to one of its tools,
    or (with ``allow_text``) a free-text final answer."""

    def __init__(self, tools: Iterable[Tool | Callable[..., Any]] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for item in tools:
            self.register(item)

    def register(self, item: Tool | Callable[..., Any]) -> Tool:
        registered = item if isinstance(item, Tool) else tool(item)
        if registered.name in self._tools:
            raise ValueError(f"a tool named {registered.name!r} is registered already")
        self._tools[registered.name] = registered
        return registered

    def get(self, name: str) -> Tool:
        if name not in self._tools:
            raise UnknownToolError(name, self._tools)
        return self._tools[name]

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def openai_schemas(self) -> list[dict[str, Any]]:
        return [registered.openai_schema() for registered in self]

    def grammar(
        self,
        compiler: GrammarCompiler,
        *,
        allow_text: bool = True,
        only: str | None = None,
        syntax: CallSyntax = BARE_CALLS,
    ) -> Grammar:
        """The tool-choice grammar (compiled once per tool set, cached by the compiler).

        ``only`` restricts the call to one tool (OpenAI's ``tool_choice`` naming a function).
        """
        chosen = [self.get(only)] if only is not None else list(self)
        if not chosen:
            raise ValueError("the registry has no tools to build a grammar from")
        specs = [(item.name, item.parameters) for item in chosen]
        return compiler.tool_calls(specs, allow_text=allow_text, syntax=syntax)
