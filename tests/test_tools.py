"""Tools: schemas from type hints and docstrings, validation, execution with timeouts."""

from __future__ import annotations

import asyncio
import json
import time
from enum import Enum
from typing import Annotated, Literal

import pytest
import xgrammar as xgr
from pydantic import BaseModel, Field

from specrag.decoding.grammar_compile import GrammarCompiler
from specrag.tools import (
    ToolDefinitionError,
    ToolRegistry,
    UnknownToolError,
    parse_tool_call,
    run_tool_sync,
    search_documents_tool,
    search_scope,
    tool,
)
from tests.test_grammar import EOS, VOCAB


class Unit(Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


class Place(BaseModel):
    city: str
    country: str = "FR"


def google(city: str, days: int = 1) -> str:
    """Forecast the weather.

    Args:
        city: The city to forecast.
        days: How many days ahead.
    """
    return f"{city}:{days}"


def numpy_style(city: str, days: int = 1) -> str:
    """Forecast the weather.

    Parameters
    ----------
    city : str
        The city to forecast.
    days : int
        How many days ahead.
    """
    return city


def rest_style(city: str, days: int = 1) -> str:
    """Forecast the weather.

    :param city: The city to forecast.
    :param days: How many days ahead.
    """
    return city


@pytest.mark.parametrize("function", [google, numpy_style, rest_style], ids=lambda f: f.__name__)
def test_descriptions_come_from_every_docstring_style(function) -> None:
    made = tool(function)
    assert made.description == "Forecast the weather."
    properties = made.parameters["properties"]
    assert properties["city"]["description"] == "The city to forecast."
    assert properties["days"]["description"] == "How many days ahead."
    assert made.parameters["required"] == ["city"]
    assert properties["days"]["default"] == 1


def test_schema_shapes_from_type_hints() -> None:
    @tool
    def plan(
        place: Place,
        unit: Unit = Unit.CELSIUS,
        mode: Literal["brief", "full"] = "brief",
        days: Annotated[int, Field(ge=1, le=7)] = 1,
        tags: list[str] | None = None,
        note: str | None = None,
    ) -> str:
        """Plan a trip."""
        return ""

    schema = plan.parameters
    props = schema["properties"]
    assert schema["additionalProperties"] is False
    assert props["place"] == {"$ref": "#/$defs/Place"}
    assert schema["$defs"]["Place"]["required"] == ["city"]
    assert schema["$defs"]["Unit"]["enum"] == ["celsius", "fahrenheit"]
    assert props["mode"]["enum"] == ["brief", "full"]
    assert (props["days"]["minimum"], props["days"]["maximum"]) == (1, 7)
    assert {"type": "null"} in props["tags"]["anyOf"] and props["tags"]["default"] is None
    assert props["note"]["anyOf"] == [{"type": "string"}, {"type": "null"}]
    assert "title" not in schema and "title" not in props["place"]


def test_a_field_called_title_survives_title_stripping() -> None:
    @tool
    def publish(title: str) -> str:
        """Publish."""
        return title

    assert "title" in publish.parameters["properties"]


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("def f(x): return x", "needs a type hint"),
        ("def f(*args: int): return 1", r"\*args is not supported"),
        ("def f(x: int, /): return x", "passable by keyword"),
    ],
)
def test_functions_that_cannot_be_tools_are_refused(source: str, message: str) -> None:
    namespace: dict = {}
    exec(source, namespace)
    with pytest.raises(ToolDefinitionError, match=message):
        tool(namespace["f"])


def test_options_and_calling_the_tool_calls_the_function() -> None:
    made = tool(name="forecast", description="Custom.", timeout_s=2)(google)
    assert (made.name, made.description, made.timeout_s) == ("forecast", "Custom.", 2)
    assert made("Oslo", 3) == "Oslo:3"
    assert made.openai_schema()["function"]["name"] == "forecast"


# -- execution -------------------------------------------------------------------------------


@tool(timeout_s=0.3)
def sleepy(seconds: float) -> str:
    """Sleep."""
    time.sleep(seconds)
    return "awake"


@tool(timeout_s=0.3)
async def sleepy_async(seconds: float) -> str:
    """Sleep without blocking."""
    await asyncio.sleep(seconds)
    return "awake"


@tool
def broken(x: int) -> int:
    """Always fails."""
    raise RuntimeError(f"cannot handle {x}")


@tool(max_result_chars=100)
def huge(n: int) -> str:
    """A long result."""
    return "x" * n


@tool
def structured(place: Place, unit: Unit = Unit.CELSIUS) -> dict:
    """Returns JSON-able data built from validated arguments."""
    return {"city": place.city, "unit": unit.value}


REGISTRY = ToolRegistry([sleepy, sleepy_async, broken, huge, structured, google])


def test_sync_and_async_tools_run() -> None:
    assert run_tool_sync(REGISTRY, "sleepy", {"seconds": 0}).content == "awake"
    assert run_tool_sync(REGISTRY, "sleepy_async", '{"seconds": 0}').content == "awake"
    result = run_tool_sync(REGISTRY, "structured", {"place": {"city": "Oslo"}, "unit": "fahrenheit"})
    assert result.ok and json.loads(result.content) == {"city": "Oslo", "unit": "fahrenheit"}


@pytest.mark.parametrize("name", ["sleepy", "sleepy_async"])
def test_a_tool_past_its_timeout_becomes_a_timeout_error(name: str) -> None:
    start = time.perf_counter()
    result = run_tool_sync(REGISTRY, name, {"seconds": 2})
    assert result.error is not None and result.error.type == "timeout"
    assert "timed out after 0.3 s" in result.content
    assert time.perf_counter() - start < 1.5


def test_an_exception_becomes_a_structured_error() -> None:
    result = run_tool_sync(REGISTRY, "broken", {"x": 7})
    assert not result.ok and result.error.type == "exception"
    assert result.content == "tool 'broken' raised RuntimeError: cannot handle 7"


def test_a_huge_result_is_capped() -> None:
    result = run_tool_sync(REGISTRY, "huge", {"n": 5000})
    assert result.ok and result.truncated_chars == 4900
    assert result.content.startswith("x" * 100) and "4900 more characters cut" in result.content


@pytest.mark.parametrize(
    ("name", "arguments", "error_type", "field", "fragment"),
    [
        ("nope", {}, "unknown_tool", None, "unknown tool 'nope'; known tools: broken"),
        ("broken", {"x": "seven"}, "invalid_arguments", "x", "x: Input should be a valid integer"),
        ("broken", {}, "invalid_arguments", "x", "x: Field required"),
        ("broken", {"x": 1, "y": 2}, "invalid_arguments", "y", "y: Extra inputs are not permitted"),
        ("broken", "{not json", "invalid_arguments", None, "arguments are not valid JSON"),
        ("broken", "[1]", "invalid_arguments", None, "must be a JSON object"),
        ("structured", {"place": {}}, "invalid_arguments", "place.city", "place.city: Field required"),
    ],
)
def test_bad_calls_from_outside_get_clear_errors(name, arguments, error_type, field, fragment) -> None:
    result = run_tool_sync(REGISTRY, name, arguments)
    assert result.error is not None and result.error.type == error_type
    assert result.error.field == field
    assert fragment in result.content


def test_registry_rejects_duplicates_and_names_unknown_tools() -> None:
    registry = ToolRegistry([google])
    with pytest.raises(ValueError, match="registered already"):
        registry.register(google)
    with pytest.raises(UnknownToolError, match="known tools: google"):
        registry.get("missing")


# -- calls under the grammar -----------------------------------------------------------------


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(xgr.TokenizerInfo(VOCAB, vocab_size=len(VOCAB), stop_token_ids=[EOS]))


def _accepts(grammar, text: str) -> bool:
    matcher = xgr.GrammarMatcher(grammar.compiled)
    return matcher.accept_string(text) and matcher.is_completed()


def test_registry_grammar_admits_valid_calls_only(compiler: GrammarCompiler) -> None:
    grammar = REGISTRY.grammar(compiler)
    assert _accepts(grammar, '{"name": "structured", "arguments": {"place": {"city": "oslo"}, "unit": "celsius"}}')
    assert _accepts(grammar, '{"name": "broken", "arguments": {"x": 3}}')
    assert _accepts(grammar, "no tool needed.")
    assert not _accepts(grammar, '{"name": "nope", "arguments": {}}')
    assert not _accepts(grammar, '{"name": "broken", "arguments": {"x": "3"}}')
    assert not _accepts(grammar, '{"name": "structured", "arguments": {"place": {}}}')
    only = REGISTRY.grammar(compiler, allow_text=False, only="broken")
    assert not _accepts(only, "no tool needed.")
    assert not _accepts(only, '{"name": "huge", "arguments": {"n": 3}}')
    assert REGISTRY.grammar(compiler) is grammar  # compiled once per tool set


def test_tool_call_parsing() -> None:
    call = parse_tool_call(' {"name": "broken", "arguments": {"x": 3}}')
    assert call is not None and (call.name, call.arguments) == ("broken", {"x": 3})
    assert parse_tool_call("The answer is 3.") is None
    with pytest.raises(ValueError, match="incomplete tool call"):
        parse_tool_call('{"name": "broken", "argu')


class _Hit:
    def __init__(self, index: int) -> None:
        self.id, self.source, self.text = f"doc#{index}", "doc.md", f"passage {index}"


class _Searcher:
    def search(self, query: str, k: int) -> list[_Hit]:
        return [_Hit(index) for index in range(k)]


def test_search_documents_tool_over_a_searcher() -> None:
    registry = ToolRegistry([search_documents_tool(_Searcher())])
    result = run_tool_sync(registry, "search_documents", {"query": "loops", "k": 2})
    assert result.content == "[doc#0] (doc.md)\npassage 0\n\n[doc#1] (doc.md)\npassage 1"
    assert run_tool_sync(registry, "search_documents", {"query": "x", "k": 99}).error.field == "k"


class _LabelledHit(_Hit):
    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.label, self.source = f"P{index + 7}", "run.md"


class _RunSearcher:
    def search(self, query: str, k: int) -> list[_Hit]:
        return [_LabelledHit(index) for index in range(k)]


def test_a_search_scope_serves_the_tool_from_the_runs_searcher_even_in_its_worker_thread() -> None:
    """The agent loop binds its run's retrieval this way: one implementation of the tool."""
    registry = ToolRegistry([search_documents_tool(_Searcher())])
    with search_scope(_RunSearcher()):
        scoped = run_tool_sync(registry, "search_documents", {"query": "loops", "k": 1})
    assert scoped.content == "[P7] (run.md)\npassage 0"
    outside = run_tool_sync(registry, "search_documents", {"query": "loops", "k": 1})
    assert outside.content == "[doc#0] (doc.md)\npassage 0"


def test_a_search_with_no_hits_says_so() -> None:
    class _Empty:
        def search(self, query: str, k: int) -> list[_Hit]:
            return []

    registry = ToolRegistry([search_documents_tool(_Empty())])
    assert run_tool_sync(registry, "search_documents", {"query": "x"}).content == "No passages found."
