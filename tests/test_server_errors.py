"""Bad input to the HTTP server: each case gets the right status and the JSON error shape
naming the field at fault, and never a stack trace."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from litestar.testing import TestClient

from specrag.agent.runtime import Agent
from specrag.agent.server import create_app
from specrag.decoding.model import CausalLM
from tests.server_helpers import assert_error, sample_agent

RUNS, CHAT = "/v1/agent/runs", "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Hello"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def client(smollm2: CausalLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient[Any]]:
    agent: Agent = sample_agent(smollm2, tmp_path_factory.getbasetemp())
    app = create_app(agent, api_key="", max_body_bytes=4000, max_prompt_tokens=64, max_tokens_limit=32)
    try:
        with TestClient(app) as client:
            yield client
    finally:
        agent.close()


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": HELLO, "max_tokens": 4, **fields}


@pytest.mark.parametrize(
    ("path", "body", "status", "field"),
    [
        # agent runs
        (RUNS, {}, 400, "question"),
        (RUNS, {"question": 42}, 400, "question"),
        (RUNS, {"question": ""}, 400, "question"),
        (RUNS, {"question": "q", "max_tokens": "x"}, 400, "max_tokens"),
        (RUNS, {"question": "q", "max_tokens": 0}, 400, "max_tokens"),
        (RUNS, {"question": "q", "max_tokens": 33}, 400, "max_tokens"),
        (RUNS, {"question": "q", "max_steps": 9}, 400, "max_steps"),
        (RUNS, {"question": "q", "temperature": -1}, 400, "temperature"),
        (RUNS, {"question": "q", "speculation": "sometimes"}, 400, "speculation"),
        (RUNS, {"question": "q", "abstain_threshold": 1.5}, 400, "abstain_threshold"),
        (RUNS, {"question": "q", "citations": "post-hoc"}, 400, "citations"),
        (RUNS, {"question": "q", "citation_min_similarity": -0.1}, 400, "citation_min_similarity"),
        (RUNS, {"question": "q", "tools": ["no_such_tool"]}, 400, "tools"),
        (RUNS, {"question": "q", "tool_gate": "off"}, 400, "tool_gate"),
        (RUNS, {"question": "q", "surprise": 1}, 400, "surprise"),
        (RUNS, {"question": "word " * 200}, 400, "question"),
        (RUNS, [1, 2], 400, "body"),
        # chat completions
        (CHAT, {}, 400, "messages"),
        (CHAT, {"messages": "hi"}, 400, "messages"),
        (CHAT, {"messages": []}, 400, "messages"),
        (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
        (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
        (CHAT, chat(max_tokens="x"), 400, "max_tokens"),
        (CHAT, chat(max_tokens=1000), 400, "max_tokens"),
        (CHAT, chat(max_completion_tokens=1000), 400, "max_completion_tokens"),
        (CHAT, chat(n=2), 400, "n"),
        (CHAT, chat(top_p=0), 400, "top_p"),
        (CHAT, chat(stop=["a"] * 9), 400, "stop"),
        (CHAT, chat(tool_choice="required"), 400, "tool_choice"),
        (
            CHAT,
            chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
            400,
            "tool_choice",
        ),
        (CHAT, chat(tools=[WEATHER, WEATHER]), 400, "tools[1]"),
        (CHAT, chat(tools=[{"type": "function", "function": {"name": "bad name!"}}]), 400, "tools"),
        (
            CHAT,
            chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"not": {"type": "string"}}}}]),
            400,
            "tools[0].function.parameters",
        ),
        (CHAT, chat(response_format={"type": "xml"}), 400, "response_format"),
        (CHAT, chat(response_format={"type": "json_schema"}), 400, "response_format"),
        (
            CHAT,
            chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}),
            400,
            "response_format",
        ),
        (
            CHAT,
            chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
            400,
            "response_format",
        ),
        (
            CHAT,
            chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": 5}}}),
            400,
            "response_format",
        ),
        (CHAT, chat(tools=[WEATHER], response_format={"type": "json_object"}), 400, "response_format"),
        (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400, "messages[0].content"),
        (
            CHAT,
            chat(
                messages=[
                    *HELLO,
                    {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{"}}]},
                ]
            ),
            400,
            "messages[1].tool_calls[0].function.arguments",
        ),
        (CHAT, chat(messages=[{"role": "user", "content": "word " * 200}]), 400, "messages"),
    ],
)
def test_bad_input_is_refused_naming_the_field(
    client: TestClient[Any], path: str, body: Any, status: int, field: str
) -> None:
    assert_error(client.post(path, json=body), status, field)


def test_too_many_prompt_tokens_is_context_length_exceeded(client: TestClient[Any]) -> None:
    error = assert_error(client.post(CHAT, json=chat(messages=[{"role": "user", "content": "word " * 200}])), 400)
    assert error["code"] == "context_length_exceeded" and error["field"] == "messages"
    error = assert_error(client.post(RUNS, json={"question": "word " * 200}), 400, "question")
    assert error["code"] == "context_length_exceeded"


@pytest.mark.parametrize("path", [RUNS, CHAT])
def test_malformed_json_and_oversize_bodies(client: TestClient[Any], path: str) -> None:
    headers = {"content-type": "application/json"}
    assert_error(client.post(path, content=b'{"question": ', headers=headers), 400, "body")
    assert_error(client.post(path, content=b"not json at all", headers=headers), 400, "body")
    oversize = b'{"question": "' + b"x" * 5000 + b'"}'
    error = assert_error(client.post(path, content=oversize, headers=headers), 413, "body")
    assert error["type"] == "request_too_large"


def test_unknown_routes_and_methods_use_the_error_shape(client: TestClient[Any]) -> None:
    assert assert_error(client.get("/v1/nothing-here"), 404)["type"] == "not_found_error"
    assert_error(client.get(RUNS), 405)
    assert_error(client.delete("/v1/models"), 405)


def test_the_server_still_answers_after_bad_requests(client: TestClient[Any]) -> None:
    response = client.post(CHAT, json=chat(temperature=0))
    assert response.status_code == 200
    assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_a_request_the_kv_pool_could_never_hold_is_context_length_exceeded(
    smollm2: CausalLM, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from specrag.decoding.kv_pool import KVPool
    from specrag.decoding.prefix_cache import PrefixCache

    agent = sample_agent(smollm2, tmp_path_factory.getbasetemp(), prefix_cache=PrefixCache(KVPool(num_blocks=4)))
    try:
        with TestClient(create_app(agent, api_key="")) as client:
            error = assert_error(client.post(CHAT, json=chat(max_tokens=200)), 400, "max_tokens")
            assert error["code"] == "context_length_exceeded" and "KV blocks" in error["message"]
            assert client.post(CHAT, json=chat(max_tokens=4)).status_code == 200
            error = assert_error(client.post(RUNS, json={"question": "What is 2+2?", "max_tokens": 32}), 400)
            assert error["code"] == "context_length_exceeded" and "KV blocks" in error["message"]
    finally:
        agent.close()
