"""Schemathesis fuzzes every operation of ``/schema/openapi.json`` against the real app: no
input may produce a 5xx, and every refusal uses the error shape.

The app is built with tight limits (4 tokens, 2 steps, short prompts) so that the requests
the fuzzer gets accepted stay quick generations; the limits are part of what is fuzzed.
Both generation modes run: valid bodies (positive) and bodies that break the schema (negative).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from specrag.agent.runtime import Agent
from specrag.agent.server import create_app
from specrag.decoding.model import CausalLM


@pytest.fixture(scope="module")
def api_schema(smollm2: CausalLM) -> Iterator[Any]:
    # No index: the prompts stay short, so 20 examples per operation fit the suite's time budget
    # (retrieval is covered by the other server tests).
    agent = Agent(model=smollm2, index=None, concurrent=True)
    app = create_app(agent, api_key="", max_prompt_tokens=96, max_tokens_limit=4, max_steps_limit=2)
    yield schemathesis.openapi.from_asgi("/schema/openapi.json", app)
    agent.close()


# Driven through hypothesis directly rather than ``schemathesis.pytest.from_fixture``: its lazy
# loader sets ``item._nodeid``, which pytest 9.2 no longer has (schemathesis 4.32.5).
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_input_makes_the_server_fail(api_schema: Any, mode: GenerationMode) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) == 9

    for operation in operations:

        @given(case=operation.as_strategy(mode))
        @settings(
            max_examples=20,
            deadline=None,
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def check(case: Any) -> None:
            response = case.call(timeout=120)
            assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
            if response.status_code >= 400:
                error = response.json()["error"]
                assert isinstance(error["type"], str) and isinstance(error["message"], str)

        started = time.perf_counter()
        try:
            check()
        except Unsatisfiable:  # an operation without inputs has no negative cases
            assert mode == GenerationMode.NEGATIVE
        print(f"{mode.value} {operation.method.upper()} {operation.path}: {time.perf_counter() - started:.1f} s")
