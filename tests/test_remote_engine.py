"""The agent over a remote OpenAI-compatible engine (``agent/remote.py``).

A second, real ``specrag`` server (smollm2 over the sample index) is the remote: retrieval,
citations, the groundedness check and the trace stay in this process, generation goes
there. A scripted engine (a test double of the engine, in a test of the loop) makes the
tool path deterministic: its ``tool_calls`` run here and their results go back with the
call's id. The stream assembly and the message conversion are checked as pure functions.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from litestar import Litestar, Request, post
from litestar.response import ServerSentEvent

from specrag.agent.remote import RemoteAgent, RemoteReply, _absorb, openai_messages
from specrag.agent.run_state import RunOptions
from specrag.agent.server import create_app
from specrag.decoding.model import CausalLM
from specrag.evals.bench.ray_routing import free_port
from specrag.tools import tool
from tests.retrieval_helpers import sample_index
from tests.server_helpers import LiveServer, assert_error, sample_server

MODEL = "smollm2-135m"


USAGE_DETAILS = {"cached_tokens": 4}


def test_a_streamed_reply_is_assembled_from_its_deltas() -> None:
    reply, fragments = RemoteReply(), {}
    chunks = [
        {"choices": [{"delta": {"content": "Let me"}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": "add", "arguments": '{"a": '}}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "2}"}}]}}]},
        {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]},
        {
            "choices": [],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}},
        },
    ]
    texts = [_absorb(reply, fragments, chunk) for chunk in chunks]
    assert texts == ["Let me", "", "", "", ""] and reply.text == "Let me"
    assert fragments == {0: {"name": "add", "arguments": '{"a": 2}'}}
    assert (reply.finish_reason, reply.prompt_tokens, reply.completion_tokens, reply.cached_tokens) == (
        "tool_calls",
        7,
        3,
        4,
    )


def test_the_conversation_goes_out_in_openai_shape() -> None:
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2}}}
    messages = [
        {"role": "user", "content": "2+?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "4"},
    ]
    converted = openai_messages(messages)
    made = converted[1]["tool_calls"][0]
    assert converted[1]["content"] is None and made["function"] == {"name": "add", "arguments": '{"a": 2}'}
    assert converted[2] == {"role": "tool", "tool_call_id": made["id"], "content": "4"}


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class ScriptedEngine:
    """An OpenAI-compatible engine that calls ``add`` once, then answers with its result."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def app(self) -> Litestar:
        @post("/v1/chat/completions", status_code=200)
        async def complete(request: Request) -> ServerSentEvent:
            body = await request.json()
            self.bodies.append(body)
            return ServerSentEvent(self.chunks(body))

        return Litestar([complete])

    def chunks(self, body: dict[str, Any]) -> Iterator[str]:
        results = [message for message in body["messages"] if message["role"] == "tool"]
        if body.get("tools") and not results:
            call = {
                "index": 0,
                "id": "c1",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
            }
            yield json.dumps(
                {"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": "tool_calls"}]}
            )
        else:
            yield json.dumps({"choices": [{"index": 0, "delta": {"content": "It is 5."}, "finish_reason": "stop"}]})
        yield json.dumps({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 4}})
        yield "[DONE]"


def test_the_engines_tool_calls_run_here_and_their_results_go_back() -> None:
    engine = ScriptedEngine()
    with LiveServer(engine.app()) as url:
        agent = RemoteAgent(url, "scripted", tools=[add], index=None)
        result = agent.run("What is 2 plus 3?", RunOptions(min_tool_similarity=None, max_tokens=16))
        agent.close()
    assert result["answer"] == "It is 5."
    (call,) = [step for step in result["steps"] if step["kind"] == "tool_call"]
    assert call["tool_call"] == {"name": "add", "arguments": {"a": 2, "b": 3}} and call["tool_result"]["content"] == "5"
    assert [tool["function"]["name"] for tool in engine.bodies[0]["tools"]] == ["add"]
    sent_call = engine.bodies[1]["messages"][-2]["tool_calls"][0]
    assert engine.bodies[1]["messages"][-1] == {"role": "tool", "tool_call_id": sent_call["id"], "content": "5"}
    trace = agent.trace(result["trace_id"])
    assert trace is not None
    chats = [span for span in trace["spans"] if span["name"] == "chat scripted"]
    assert len(chats) == 2 and all(span["attributes"]["gen_ai.usage.input_tokens"] == 11 for span in chats)
    assert result["usage"]["prompt_tokens"] == 22 and result["usage"]["completion_tokens"] == 8


@pytest.fixture(scope="module")
def remote(smollm2: CausalLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real specrag server: the engine behind --engine-url."""
    with sample_server(smollm2, tmp_path_factory.getbasetemp(), api_key="engine-key") as url:
        yield url


@pytest.fixture(scope="module")
def remote_agent(remote: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteAgent]:
    root: Path = sample_index(tmp_path_factory.getbasetemp())[0]
    agent = RemoteAgent(remote, MODEL, index=str(root), api_key="engine-key")
    yield agent
    agent.close()


@pytest.mark.slow
def test_retrieval_citations_grounding_and_trace_stay_here(remote_agent: RemoteAgent) -> None:
    result = remote_agent.run("What does the with statement do?", max_tokens=24, temperature=0.0)
    assert result["answer"] and result["passages"] and result["grounding"] is not None
    assert any(passage["source"] == "pydoc/with" for passage in result["passages"])
    trace = remote_agent.trace(result["trace_id"])
    assert trace is not None
    names = [span["name"] for span in trace["spans"]]
    assert any(name.startswith("retrieval ") for name in names) and f"chat {MODEL}" in names
    chat = next(span for span in trace["spans"] if span["name"] == f"chat {MODEL}")
    assert chat["attributes"]["gen_ai.usage.input_tokens"] > 0 and chat["attributes"]["server.address"]
    assert result["usage"]["completion_tokens"] > 0


@pytest.mark.slow
def test_the_agent_endpoint_over_a_remote_engine(remote_agent: RemoteAgent) -> None:
    with LiveServer(create_app(remote_agent, api_key="")) as url:
        body = {"question": "What does the pass statement do?", "max_tokens": 16}
        response = httpx.post(f"{url}/v1/agent/runs", json=body, timeout=300)
        assert response.status_code == 200, response.text
        assert response.json()["answer"]
        refused = httpx.post(f"{url}/v1/agent/runs", json=body | {"abstain_threshold": 0.5}, timeout=60)
        assert_error(refused, 400, "abstain_threshold")


def test_chat_completions_are_relayed_to_the_engine(remote_agent: RemoteAgent, remote: str) -> None:
    """The engine's answer as it came: JSON, a stream (the official client), its own 400."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}]}
    chat |= {"max_tokens": 8, "temperature": 0}
    direct = httpx.post(
        f"{remote}/v1/chat/completions", json=chat, headers={"Authorization": "Bearer engine-key"}, timeout=120
    )
    expected = direct.json()["choices"][0]["message"]["content"]
    with LiveServer(create_app(remote_agent, api_key="")) as url:
        relayed = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=120)
        assert relayed.status_code == 200 and relayed.json()["choices"][0]["message"]["content"] == expected
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        stream = client.chat.completions.create(
            model=MODEL, messages=chat["messages"], max_tokens=8, temperature=0, stream=True
        )
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == expected
        refused = httpx.post(f"{url}/v1/chat/completions", json=chat | {"max_tokens": -1}, timeout=60)
        assert_error(refused, 400, "max_tokens")  # the engine's own refusal


def test_an_engine_that_fails_is_a_502(tmp_path: Path) -> None:
    with LiveServer(Litestar([])) as url:  # answers 404 to everything
        agent = RemoteAgent(url, "missing", index=None)
        with LiveServer(create_app(agent, api_key="")) as server:
            response = httpx.post(f"{server}/v1/agent/runs", json={"question": "Hi?", "max_tokens": 4}, timeout=60)
        agent.close()
    assert_error(response, 502)
    assert "404" in response.json()["error"]["message"]
    unreachable = RemoteAgent(f"http://127.0.0.1:{free_port()}", "missing", index=None)  # nothing listens there
    with LiveServer(create_app(unreachable, api_key="")) as server:
        chat = {"model": "missing", "messages": [{"role": "user", "content": "hi"}]}
        assert_error(httpx.post(f"{server}/v1/chat/completions", json=chat, timeout=60), 502)
    unreachable.close()


@pytest.mark.slow
def test_the_groundedness_eval_runs_over_a_remote_engine(
    remote: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from specrag.evals.groundedness.run import main

    root = sample_index(tmp_path_factory.getbasetemp())[0]
    monkeypatch.setenv("SPECRAG_ENGINE_API_KEY", "engine-key")
    argv = ["--out", str(tmp_path / "report"), "--engine-url", remote, "--model", MODEL, "--index", str(root)]
    assert main([*argv, "--limit", "2", "--max-tokens", "24", "--no-progress"]) == 0
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["config"]["engine_url"] == remote
    assert len(report["records"]) == 2 and all(record["answer"] for record in report["records"])
