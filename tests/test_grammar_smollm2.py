"""Constrained decoding on the real smollm2 pack: exact under speculation, always valid.

Twelve JSON schemas of varied shape plus two tool-call grammars; each case is generated
four ways (greedy and sampled, speculation off and on): 56 generations, every one of
which must finish and validate. Strings and arrays are bounded so that every document
ends well inside ``max_tokens``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import jsonschema
import pytest
from pydantic import Field

from specrag.decoding.engine import Engine
from specrag.decoding.model import CausalLM
from specrag.decoding.request import GenerationRequest
from specrag.decoding.sampling import SamplingParams
from specrag.tools import ToolRegistry, parse_tool_call, tool, validate_call

pytestmark = pytest.mark.slow

INT = {"type": "integer"}
SCHEMAS: dict[str, tuple[str, dict[str, Any]]] = {
    "person": (
        "Describe a famous scientist.",
        {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 20}, "age": {**INT, "minimum": 0, "maximum": 120}},
            "required": ["name", "age"],
        },
    ),
    "nested_object": (
        "Create a user account.",
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "id": {**INT, "minimum": 1, "maximum": 999},
                        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
                    },
                    "required": ["id", "email"],
                },
                "active": {"type": "boolean"},
            },
            "required": ["user", "active"],
        },
    ),
    "int_array": (
        "List a few prime numbers.",
        {"type": "array", "items": {**INT, "minimum": 0, "maximum": 100}, "minItems": 1, "maxItems": 5},
    ),
    "enums": (
        "Pick a colour for a kitchen.",
        {
            "type": "object",
            "properties": {"color": {"enum": ["red", "green", "blue"]}, "shade": {"enum": ["light", "dark"]}},
            "required": ["color", "shade"],
        },
    ),
    "bounded_numbers": (
        "Report the weather in Paris.",
        {
            "type": "object",
            "properties": {
                "temperature": {"type": "number", "minimum": -50, "maximum": 60},
                "humidity": {**INT, "minimum": 0, "maximum": 100},
            },
            "required": ["temperature", "humidity"],
        },
    ),
    "optional_fields": (
        "Describe a book.",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 30},
                "subtitle": {"type": "string", "maxLength": 20},
                "pages": {**INT, "minimum": 1, "maximum": 2000},
            },
            "required": ["title"],
        },
    ),
    "string_pattern": (
        "Give a flight code.",
        {
            "type": "object",
            "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
            "required": ["code"],
        },
    ),
    "object_array": (
        "Write a shopping order.",
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string", "maxLength": 8},
                            "qty": {**INT, "minimum": 1, "maximum": 9},
                        },
                        "required": ["sku", "qty"],
                    },
                }
            },
            "required": ["items"],
        },
    ),
    "nested_arrays": (
        "Write a small matrix.",
        {
            "type": "object",
            "properties": {
                "matrix": {
                    "type": "array",
                    "maxItems": 2,
                    "items": {"type": "array", "maxItems": 3, "items": {**INT, "minimum": 0, "maximum": 9}},
                }
            },
            "required": ["matrix"],
        },
    ),
    "flags": (
        "Configure a logger.",
        {
            "type": "object",
            "properties": {
                "debug": {"type": "boolean"},
                "verbose": {"type": "boolean"},
                "level": {"enum": ["info", "warn", "error"]},
            },
            "required": ["debug", "verbose", "level"],
        },
    ),
    "any_of": (
        "Give a value.",
        {
            "type": "object",
            "properties": {
                "value": {"anyOf": [{**INT, "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 5}]}
            },
            "required": ["value"],
        },
    ),
    "dated_event": (
        "Name an event and its date.",
        {
            "type": "object",
            "properties": {
                "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                "event": {"type": "string", "maxLength": 24},
            },
            "required": ["date", "event"],
        },
    ),
}


@tool
def get_weather(city: Annotated[str, Field(max_length=20)], unit: Literal["celsius", "fahrenheit"] = "celsius") -> str:
    """Get the current weather in a city.

    Args:
        city: The city name.
        unit: Temperature unit.
    """
    return "sunny"


@tool
def convert(amount: Annotated[int, Field(ge=0, le=10000)], currency: Literal["EUR", "USD", "GBP"]) -> str:
    """Convert an amount of money to euros.

    Args:
        amount: How much.
        currency: The currency of the amount.
    """
    return "1"


TOOLS = ToolRegistry([get_weather, convert])
TOOL_CASES = {
    "tool_call_required": ("What is the weather in Oslo?", False),
    "tool_call_or_text": ("How many euros are 40 dollars?", True),
}
CASES = [*SCHEMAS, *TOOL_CASES]


def _prompt(model: CausalLM, case: str) -> list[int]:
    if case in SCHEMAS:
        question, schema = SCHEMAS[case]
        system = f"Reply with only a JSON value valid under this JSON schema:\n{json.dumps(schema)}"
    else:
        question = TOOL_CASES[case][0]
        schemas = json.dumps(TOOLS.openai_schemas())
        system = f'You can call these tools by replying {{"name": ..., "arguments": {{...}}}}:\n{schemas}'
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def _grammar(model: CausalLM, case: str):
    if case in SCHEMAS:
        return model.grammar_compiler.json_schema(SCHEMAS[case][1])
    return TOOLS.grammar(model.grammar_compiler, allow_text=TOOL_CASES[case][1])


def _check_valid(model: CausalLM, case: str, tokens: list[int]) -> None:
    text = model.tokenizer.decode(tokens, skip_special_tokens=True)
    if case in SCHEMAS:
        jsonschema.validate(json.loads(text), SCHEMAS[case][1])
        return
    call = parse_tool_call(text)
    if call is None:
        assert TOOL_CASES[case][1], f"{case}: a final answer where a call was required: {text!r}"
        return
    validate_call(TOOLS, call.name, call.arguments)


@pytest.fixture(scope="module")
def engine(smollm2: CausalLM) -> Engine:
    return Engine(smollm2)


def _generate(engine: Engine, case: str, **options: Any) -> tuple[list[int], Any]:
    model = engine.target
    request = GenerationRequest(_prompt(model, case), max_tokens=160, grammar=_grammar(model, case), **options)
    tokens: list[int] = []
    stats = None
    for event in engine.generate(request):
        tokens += event.token_ids
        stats = event.stats or stats
    return tokens, stats


@pytest.mark.parametrize("case", CASES)
def test_constrained_outputs_are_exact_and_valid(engine: Engine, case: str) -> None:
    model = engine.target
    spec_mode = "auto" if CASES.index(case) % 2 else "on"
    plain, plain_stats = _generate(engine, case, speculation="off")
    fast, stats = _generate(engine, case, speculation=spec_mode)
    assert fast == plain, f"{case}: constrained speculative output differs from constrained plain"
    for tokens, run_stats in ((plain, plain_stats), (fast, stats)):
        assert run_stats.finish_reason == "stop", f"{case}: {run_stats.finish_reason}"
        _check_valid(model, case, tokens)
    for speculation in ("off", "on"):
        sampled, sampled_stats = _generate(
            engine, case, speculation=speculation, sampling=SamplingParams(temperature=0.8, seed=CASES.index(case))
        )
        assert sampled_stats.finish_reason == "stop", f"{case}, sampled, {speculation}"
        _check_valid(model, case, sampled)
