"""The loop's rules about calls and answers: which calls are new, and whether an answer
uses the tool results it was given. Pure functions over calls, results and text."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from specrag.decoding.schema_merge import canonical_json
from specrag.tools import ToolCall, ToolResult

SEARCH_TOOL = "search_documents"


def uses_results(answer: str, results: Iterable[ToolResult]) -> bool:
    """Whether the answer takes anything from the tool results that succeeded: one of their
    numbers, else one of their words of four letters or more. qwen2.5-coder-1.5b, given a calculator's
    37200, answered with a tool's description ("The latest price of a stock."); asked again
    for a text answer it used the result (tool-use eval, dev half)."""
    numbers, words = set(), set()
    for result in results:
        if not result.ok:  # "the tool failed" is an answer that uses a failure
            continue
        numbers.update(_numbers(result.content))
        words.update(_words(result.content))
    if numbers:  # a rounded figure counts: 4828.03 m answered as 4828 metres
        return any(abs(said - found) <= 0.005 * found + 0.01 for said in _numbers(answer) for found in numbers)
    return not words or bool(words & _words(answer))


def grounding_sources(question: str, executed: Mapping[str, ToolResult]) -> list[str]:
    """Where a changed call's values may come from: the question, the earlier calls and
    the results that succeeded. An error message is no value to pass on: asked for ZZZZ's
    price, qwen2.5-coder-0.5b called the tool again with the error "unknown ticker symbol
    'ZZZZZ'" as the symbol (tool-use eval, dev half)."""
    return [question, *executed, *(result.content for result in executed.values() if result.ok)]


def grounded(call: ToolCall, sources: Iterable[str]) -> bool:
    """Whether every argument value of ``call`` is written in ``sources`` (the question,
    earlier calls, their results): strings case-insensitively, numbers as numbers. A call
    the loop makes the model write instead of a repeat (``agent/repeat_deviation.py``) must
    pass: asked to change a repeated call, qwen2.5-coder-1.5b also wrote
    ``convert_temperature(25, "celsius")`` for "What is the capital of Kenya?"."""
    texts = [text.lower() for text in sources]
    numbers = set().union(*(_numbers(text) for text in texts))
    for value in _leaves(call.arguments):
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int | float):
            if not any(abs(abs(value) - found) <= 1e-9 * max(1.0, found) for found in numbers):  # unsigned
                return False
        elif not any(str(value).lower() in text for text in texts):
            return False
    return True


def _leaves(value: object) -> Iterable[object]:
    if isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def _numbers(text: str) -> set[float]:
    return {float(found.replace(",", "")) for found in re.findall(r"\d[\d,]*(?:\.\d+)?", text)}


def _words(text: str) -> set[str]:
    return {word.lower() for word in re.findall(r"[^\W\d_]{4,}", text)}


def first_time(calls: Sequence[ToolCall], executed: Mapping[str, ToolResult]) -> list[bool]:
    """Per call: not made earlier in the run, nor earlier in the same turn."""
    seen = set(executed)
    fresh = []
    for call in calls:
        key = canonical_call(call)
        fresh.append(key not in seen)
        seen.add(key)
    return fresh


def made_before(call: ToolCall, executed: Mapping[str, ToolResult], loosely: bool = False) -> bool:
    """Whether ``call`` is among the ``executed`` ones (keyed by ``canonical_call``);
    ``loosely``: also when it differs from one only in the case or the outer spaces of
    its strings (``" Kenya"``, ``"kenya"`` for ``"Kenya"``)."""
    if canonical_call(call) in executed:
        return True
    if not loosely:
        return False
    key = _loose(json.loads(canonical_call(call)))
    return any(_loose(json.loads(made)) == key for made in executed)


def _loose(value: Any) -> Any:
    if isinstance(value, str):
        return value.strip().casefold()
    if isinstance(value, dict):
        return {key: _loose(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_loose(item) for item in value]
    return value


def canonical_call(call: ToolCall) -> str:
    """Two calls are the same call when name and arguments are equal as JSON."""
    return canonical_json({"name": call.name, "arguments": call.arguments})


def default_tools(registered: Sequence[str]) -> list[str]:
    """The tools a run offers unless it names its own: every registered one but the built-in
    search. The question's retrieval has already run; offered a second search by default,
    the small models here (qwen2.5-coder-0.5b, smollm2) called it with placeholder queries
    instead of answering. A run that names ``search_documents`` in ``tools`` gets it."""
    return [name for name in registered if name != SEARCH_TOOL]
