"""Shared pieces of the agent-loop and server tests: tools that fail on purpose, and a
scripted stand-in for generation (smollm2 cannot be relied on to call a tool; these tests
are about what the loop and the server do with a call, so only the replies are scripted)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from specrag.decoding.request import GenerationEvent, GenerationRequest
from specrag.decoding.stats import CycleInfo, GenerationStats
from specrag.tools import tool


@tool(timeout_s=0.3)
def slow_lookup(key: str) -> str:
    """Look a key up slowly.

    Args:
        key: The key.
    """
    time.sleep(3)
    return key


@tool
def explode(reason: str) -> str:
    """Fail on purpose.

    Args:
        reason: Why.
    """
    raise RuntimeError(reason)


@tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: First.
        b: Second.
    """
    return a + b


def call(name: str, **arguments: object) -> str:
    """A reply that is a tool call in the project's format."""
    return json.dumps({"name": name, "arguments": arguments})


class Scripted:
    """Replies with fixed texts, one per step, a token per event; records the requests."""

    def __init__(self, tokenizer: Any, replies: list[str]) -> None:
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.requests: list[GenerationRequest] = []

    def __call__(self, request: GenerationRequest) -> Iterator[GenerationEvent]:
        self.requests.append(request)
        tokens = self.tokenizer(self.replies.pop(0), add_special_tokens=False)["input_ids"]
        stats = GenerationStats(prompt_tokens=len(request.prompt_tokens), output_tokens=len(tokens))
        stats.target_calls = len(tokens)
        for index, token in enumerate(tokens):
            now = time.monotonic_ns()
            cycle = CycleInfo("prefill" if index == 0 else "plain", now, now + 1000, 0, 0, None, {})
            last = index == len(tokens) - 1
            yield GenerationEvent(0, [token], last, "stop" if last else None, stats if last else None, cycle)
