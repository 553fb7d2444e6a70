"""A custom tool next to the built-in document search, run through the agent.

    python examples/custom_tool.py                      # qwen2.5-coder-0.5b, the sample index
    python examples/custom_tool.py --model smollm2-135m --index DIR

Tools are typed Python functions: ``@tool`` reads the description and the per-argument
descriptions from the docstring and the JSON schema from the type hints. The agent offers
them to the model under a grammar, so any call it makes is valid JSON for one of them.
"""

from __future__ import annotations

import argparse
import json
from typing import Annotated, Literal

from pydantic import Field

from specrag.agent.runtime import Agent
from specrag.tools import tool


@tool(timeout_s=5)
def convert_temperature(
    value: float, unit: Annotated[Literal["celsius", "fahrenheit"], Field(description="unit of value")]
) -> str:
    """Convert a temperature between Celsius and Fahrenheit.

    Args:
        value: The temperature to convert.
        unit: The unit the value is in.
    """
    if unit == "celsius":
        return f"{value * 9 / 5 + 32:.1f} fahrenheit"
    return f"{(value - 32) * 5 / 9:.1f} celsius"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--index", default=None, help="an index folder (default: no retrieval)")
    parser.add_argument("--question", default="What is 21 degrees Celsius in Fahrenheit?")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    agent = Agent(tools=[convert_temperature], index=args.index, model=args.model, dtype=args.dtype)
    result = agent.run(args.question, max_tokens=args.max_tokens, max_steps=3)
    for step in result["steps"]:
        if step["kind"] == "tool_call":
            print("tool call:", json.dumps(step["tool_call"]), "->", step["tool_result"]["content"])
    print("answer:", result["answer"])
    print("trace:", result["trace_id"], [span["name"] for span in agent.trace(result["trace_id"])["spans"]])
    return result


if __name__ == "__main__":
    main()
