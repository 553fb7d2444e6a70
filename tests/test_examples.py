"""Every script in examples/ runs (on the smollm2 pack, so it takes seconds)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from specrag.tools import ToolRegistry, run_tool_sync

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_custom_tool_has_a_schema_and_runs() -> None:
    example = load("custom_tool")
    schema = example.convert_temperature.openai_schema()
    assert schema["function"]["parameters"]["properties"]["unit"]["enum"] == ["celsius", "fahrenheit"]
    result = run_tool_sync(
        ToolRegistry([example.convert_temperature]), "convert_temperature", {"value": 21, "unit": "celsius"}
    )
    assert (result.ok and result.content == '"69.8 fahrenheit"') or result.content == "69.8 fahrenheit"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_the_custom_tool_example_answers_correctly(dtype: str) -> None:
    """qwen2.5-coder-0.5b (the default model) calls the tool once and answers with its result."""
    result = load("custom_tool").main(["--dtype", dtype])
    calls = [step for step in result["steps"] if step["kind"] == "tool_call"]
    assert calls and calls[0]["tool_call"] == {
        "name": "convert_temperature",
        "arguments": {"value": 21, "unit": "celsius"},
    }
    assert "69.8" in result["answer"], result["answer"]
    assert not result["answer"].lstrip().startswith(("{", "<"))  # text, not call syntax
