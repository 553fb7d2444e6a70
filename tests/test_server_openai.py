"""A real uvicorn server on 127.0.0.1, driven by the official ``openai`` client and by httpx:
completions, streaming, tool calls, structured output, stop strings, overload (503),
client disconnects and a bounded load test."""

from __future__ import annotations

import concurrent.futures
import gc
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import psutil
import pytest

from specrag.agent.runtime import Agent
from specrag.agent.server import create_app
from specrag.decoding.model import CausalLM
from tests.server_helpers import LiveServer, assert_error, sample_agent, wait_until

KEY = "test-key"
MODEL = "smollm2-135m"
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER_PARAMETERS},
}
CAPITAL_SCHEMA = {
    "type": "object",
    "properties": {"capital": {"type": "string", "enum": ["Paris", "Rome", "Madrid"]}, "sure": {"type": "boolean"}},
    "required": ["capital", "sure"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def agent(smollm2: CausalLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    agent = sample_agent(smollm2, tmp_path_factory.getbasetemp())
    yield agent
    agent.close()


@pytest.fixture(scope="module")
def server(agent: Agent) -> Iterator[str]:
    with LiveServer(create_app(agent, api_key=KEY, max_tokens_limit=512)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


def ask(client: openai.OpenAI, content: str, **options: Any) -> Any:
    options = {"max_tokens": 12, "temperature": 0, **options}
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **options)


def test_a_plain_completion(client: openai.OpenAI) -> None:
    completion = ask(client, "What is the capital of France?")
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert completion.usage.completion_tokens > 0
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
    assert completion.model == MODEL
    assert [model.id for model in client.models.list()] == [MODEL]


def test_streamed_deltas_add_up_to_the_unstreamed_text(client: openai.OpenAI) -> None:
    question = "Name three colours."
    whole = ask(client, question).choices[0].message.content
    stream = ask(client, question, stream=True, stream_options={"include_usage": True})
    deltas, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            deltas.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(deltas) == whole
    assert finish in ("stop", "length") and usage is not None and usage.completion_tokens > 0


def test_a_required_tool_call_has_valid_arguments(client: openai.OpenAI) -> None:
    question = "What is the weather in Tokyo?"
    completion = ask(client, question, max_tokens=32, tools=[WEATHER_TOOL], tool_choice="required")
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER_PARAMETERS)

    named = {"type": "function", "function": {"name": "get_weather"}}
    streamed = ask(client, question, max_tokens=32, tools=[WEATHER_TOOL], tool_choice=named, stream=True)
    calls = [call for chunk in streamed for choice in chunk.choices for call in choice.delta.tool_calls or []]
    assert [c.function.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER_PARAMETERS)

    # the call and its result go back in as history; tool_choice none gets a text answer
    history = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "clear"}'},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=12, temperature=0
    )
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_structured_output_follows_the_json_schema(client: openai.OpenAI) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "capital", "schema": CAPITAL_SCHEMA}}
    completion = ask(client, "What is the capital of France?", max_tokens=32, response_format=response_format)
    jsonschema.validate(json.loads(completion.choices[0].message.content), CAPITAL_SCHEMA)
    as_object = ask(client, "Describe Paris in JSON.", max_tokens=32, response_format={"type": "json_object"})
    if as_object.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(as_object.choices[0].message.content), dict)


def test_stop_strings_cut_the_text_streamed_or_not(client: openai.OpenAI) -> None:
    question = "Count from one to ten in words."
    full = ask(client, question, max_tokens=24).choices[0].message.content
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    expected = full[: full.index(stop)]
    cut = ask(client, question, max_tokens=24, stop=[stop, "zzzz"]).choices[0]
    assert cut.message.content == expected and cut.finish_reason == "stop"
    streamed = ask(client, question, max_tokens=24, stop=stop, stream=True)
    assert "".join(choice.delta.content or "" for chunk in streamed for choice in chunk.choices) == expected


def test_the_openai_client_sees_auth_and_validation_errors(server: str, client: openai.OpenAI) -> None:
    with pytest.raises(openai.AuthenticationError):
        ask(openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0), "Hi")
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, "Hi", n=2)
    assert caught.value.body["field"] == "n"
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, "Hi", frequency_penalty=2.5)
    assert caught.value.body["field"] == "frequency_penalty"
    assert httpx.get(f"{server}/healthz").status_code == 200


def test_overload_is_503_and_a_disconnect_cancels_the_generation(smollm2: CausalLM) -> None:
    """One slot: a streaming request holds it; others get 503 + Retry-After; when the client
    goes away mid-stream the sequence is cancelled and the slot is free again."""
    agent = Agent(model=smollm2, index=None, concurrent=True, max_in_flight=1)
    headers = {"Authorization": f"Bearer {KEY}"}
    long_chat = {
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
        "max_tokens": 400, "temperature": 0, "stream": True, "speculation": "off",
    }  # fmt: skip
    small = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    try:
        with LiveServer(create_app(agent, api_key=KEY, max_tokens_limit=512)) as url, httpx.Client(timeout=60) as http:
            for path, body in (
                ("/v1/chat/completions", long_chat),
                ("/v1/agent/runs", {"question": "Tell a long story.", "stream": True, "max_tokens": 400}),
            ):
                with http.stream("POST", url + path, json=body, headers=headers) as stream:
                    assert stream.status_code == 200
                    received = []
                    for line in stream.iter_lines():
                        received += [line] if line.startswith("data:") else []
                        if len(received) == 3:
                            break
                    assert len(received) == 3 and agent.worker.in_flight == 1
                    busy = http.post(url + "/v1/chat/completions", json=small, headers=headers)
                    assert assert_error(busy, 503)["type"] == "overloaded_error"
                    assert busy.headers["retry-after"] == "1"
                    busy_run = http.post(
                        url + "/v1/agent/runs", json={"question": "Hi", "max_tokens": 2}, headers=headers
                    )
                    assert_error(busy_run, 503)
                # the client closed the connection mid-stream
                assert wait_until(lambda: agent.worker.in_flight == 0 and not agent.engine.has_unfinished(), 30)
            done = http.post(url + "/v1/chat/completions", json=small, headers=headers)
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] <= 2
    finally:
        agent.close()


def test_bounded_load_completes_without_server_errors_or_leaks(server: str, agent: Agent) -> None:
    """8 concurrent clients x 2 requests (chat, streamed chat, agent runs), after a warm-up round
    of one request each (thread pools, allocator arenas); memory is compared across the measured
    round, net of the prefix cache, which keeps KV blocks on purpose up to its budget."""
    clients = 8
    headers = {"Authorization": f"Bearer {KEY}"}
    process = psutil.Process()
    cache = agent.engine.prefix_cache

    def one_client(index: int, requests_each: int = 2) -> list[httpx.Response]:
        out = []
        with httpx.Client(base_url=server, headers=headers, timeout=180) as http:
            for turn in range(requests_each):
                if (index + turn) % 3 == 0:
                    body = {"question": f"What does the {('pass', 'with', 'del')[index % 3]} statement do?"}
                    out.append(http.post("/v1/agent/runs", json={**body, "max_tokens": 8, "k": 1, "tools": []}))
                else:
                    content = f"Say a word about the number {index * 10 + turn}."
                    chat = {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0}
                    out.append(http.post("/v1/chat/completions", json={**chat, "stream": turn == 1}))
        return out

    def load_round(requests_each: int) -> tuple[list[httpx.Response], float]:
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            batches = pool.map(one_client, range(clients), [requests_each] * clients)
            responses = [response for batch in batches for response in batch]
        assert wait_until(lambda: agent.worker.in_flight == 0 and not agent.engine.has_unfinished(), 30)
        gc.collect()
        return responses, time.perf_counter() - started

    load_round(1)
    rss, cached = process.memory_info().rss, cache.used_bytes
    responses, elapsed = load_round(2)
    statuses = [response.status_code for response in responses]
    assert statuses == [200] * len(responses), statuses  # 32 worker slots: no request is turned away
    for response in responses:
        if response.headers["content-type"].startswith("text/event-stream"):
            assert response.text.rstrip().endswith("data: [DONE]")
        elif "answer" in response.json():
            assert isinstance(response.json()["answer"], str) and response.json()["trace_id"]
        else:
            assert response.json()["choices"][0]["message"]["content"] is not None
    grown_mb = (process.memory_info().rss - rss) / 2**20
    cache_mb = (cache.used_bytes - cached) / 2**20
    print(f"load: {len(responses)} requests, {clients} clients, {elapsed:.1f} s; RSS {grown_mb:+.0f} MB "
          f"of which prefix cache {cache_mb:+.0f} MB")  # fmt: skip
    assert grown_mb - cache_mb < 300


def test_penalties_reach_the_decoder(client: openai.OpenAI) -> None:
    question = "Write a short poem about the sea."
    plain = ask(client, question, max_tokens=32).choices[0].message.content
    for options in ({"frequency_penalty": 2.0}, {"extra_body": {"repetition_penalty": 2.0}}):
        penalised = ask(client, question, max_tokens=32, **options).choices[0].message.content
        assert penalised != plain, options


def test_a_user_drafts_from_their_own_earlier_answers_only(client: openai.OpenAI, agent: Agent) -> None:
    question = "Name the planets of the solar system."
    history = agent.engine.history
    anonymous = ask(client, question, max_tokens=24).choices[0].message.content
    assert history.tokens_held() == 0  # no user named: nothing is kept
    first = ask(client, question, max_tokens=24, user="alice").choices[0].message.content
    held = history.tokens_held("user:alice")
    assert held > 0 and history.tokens_held("user:bob") == 0
    again = ask(client, question, max_tokens=24, user="alice").choices[0].message.content
    assert first == again == anonymous  # greedy: drafting from history changes no token
    assert history.tokens_held("user:alice") == 2 * held
