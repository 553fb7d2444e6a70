"""The HTTP server over the real agent (smollm2 + the sample index, engine behind the worker):
agent runs as JSON and as SSE, traces, models, metrics, auth, speculation parity, and tool
failures inside a stream."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from specrag.agent.events import AgentEvent, ErrorEvent, TokenEvent
from specrag.agent.loop import AgentLoop
from specrag.agent.runtime import Agent
from specrag.agent.server import create_app
from specrag.decoding.model import CausalLM
from tests.agent_helpers import Scripted, call, explode, slow_lookup
from tests.server_helpers import assert_error, sample_agent

QUESTION = "What does the pass statement do?"
QUOTE = "Repeat this sentence exactly: the pass statement is a null operation and nothing happens when it runs."


@pytest.fixture(scope="module")
def agent(smollm2: CausalLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    agent = sample_agent(smollm2, tmp_path_factory.getbasetemp())
    yield agent
    agent.close()


@pytest.fixture(scope="module")
def client(agent: Agent) -> Iterator[TestClient[Any]]:
    with TestClient(create_app(agent, api_key="", max_tokens_limit=64, max_steps_limit=4)) as client:
        yield client


def sse_events(text: str) -> list[tuple[str, Any]]:
    """(event, data) pairs of an SSE body; ``data`` parsed as JSON."""
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        name = next((line[len("event: ") :] for line in lines if line.startswith("event: ")), "message")
        data = "\n".join(line[len("data: ") :] for line in lines if line.startswith("data: "))
        events.append((name, json.loads(data)))
    return events


def run_body(**overrides: Any) -> dict[str, Any]:
    return {"question": QUESTION, "max_tokens": 12, "k": 2, "tools": [], "temperature": 0.0, **overrides}


def test_an_agent_run_answers_with_citations_usage_and_a_trace(client: TestClient[Any]) -> None:
    response = client.post("/v1/agent/runs", json=run_body())
    assert response.status_code == 200, response.text
    result = response.json()
    assert {"run_id", "answer", "citations", "steps", "usage", "speculation", "trace_id"} <= set(result)
    assert result["answer"] and result["usage"]["completion_tokens"] > 0
    assert any(passage["source"] == "pydoc/pass" for passage in result["passages"])

    trace = client.get(f"/v1/traces/{result['trace_id']}")
    assert trace.status_code == 200
    names = [span["name"] for span in trace.json()["spans"]]
    assert names[0] == "invoke_agent specrag" and any(name.startswith("chat ") for name in names)
    view = client.get(f"/v1/traces/{result['trace_id']}/view")
    assert view.status_code == 200 and view.headers["content-type"].startswith("text/html")
    assert "invoke_agent specrag" in view.text
    assert_error(client.get("/v1/traces/0123456789abcdef"), 404, "trace_id")
    assert_error(client.get("/v1/traces/0123456789abcdef/view"), 404, "trace_id")


def test_recent_runs_are_listed_newest_first_filtered_and_paged(client: TestClient[Any], agent: Agent) -> None:
    first = client.post("/v1/agent/runs", json=run_body()).json()["trace_id"]
    second = client.post("/v1/agent/runs", json=run_body(question="What does del do?")).json()["trace_id"]
    failed = agent.tracer.start_trace(attributes={"gen_ai.operation.name": "invoke_agent"})
    failed.root.record_exception(RuntimeError("the index went away"))
    failed.finish()

    listed = client.get("/v1/traces", params={"limit": 200}).json()
    ids = [item["trace_id"] for item in listed["data"]]
    assert ids[:3] == [failed.trace_id, second, first] and listed["total"] == len(ids)
    newest_run = listed["data"][1]
    assert newest_run["status"] == "ok" and newest_run["model"] == "smollm2-135m"
    assert newest_run["operation"] == "invoke_agent" and newest_run["output_tokens"] > 0
    assert newest_run["input_tokens"] > newest_run["output_tokens"] and newest_run["duration_ms"] > 0
    errors = client.get("/v1/traces", params={"status": "error"}).json()["data"]
    assert errors[0]["trace_id"] == failed.trace_id and "the index went away" in errors[0]["error"]
    assert all(item["status"] == "error" for item in errors)
    page = client.get("/v1/traces", params={"limit": 1, "offset": 1}).json()
    assert [item["trace_id"] for item in page["data"]] == [second]
    assert client.get("/v1/traces", params={"min_duration_ms": 1e9}).json() == {
        "object": "list",
        "data": [],
        "total": 0,
        "offset": 0,
    }
    html = client.get("/v1/traces/view")
    assert html.status_code == 200 and html.headers["content-type"].startswith("text/html")
    assert f'href="/v1/traces/{second}/view"' in html.text
    assert_error(client.get("/v1/traces", params={"status": "crashed"}), 400, "status")
    assert_error(client.get("/v1/traces", params={"limit": 0}), 400, "limit")
    assert_error(client.get("/v1/traces", params={"offset": -1}), 400, "offset")


def test_a_run_with_an_abstain_threshold_of_zero_abstains_without_generating(client: TestClient[Any]) -> None:
    response = client.post("/v1/agent/runs", json=run_body(abstain_threshold=0.0))
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["answer"] == "The documents do not say." and result["answerability"]["abstained"]
    assert result["usage"]["completion_tokens"] == 0 and result["steps"][0]["kind"] == "abstain"


def test_a_run_with_attributed_citations_keeps_the_model_text(client: TestClient[Any]) -> None:
    plain = client.post("/v1/agent/runs", json=run_body(citations="model")).json()
    response = client.post("/v1/agent/runs", json=run_body(citations="attribute", citation_min_similarity=0.0))
    assert response.status_code == 200, response.text
    result = response.json()
    attribution = result["attribution"]
    assert plain["attribution"] is None and attribution["model_answer"] == plain["answer"]  # greedy: same text
    assert attribution["min_similarity"] == 0.0
    labels = [sentence["label"] for sentence in attribution["sentences"]]
    # at threshold 0 every claim cites, and the result's citations are exactly those passages
    assert labels and None not in labels
    assert sorted({c["label"] for c in result["citations"]}) == sorted(set(labels))
    assert re.sub(r"\s*\[P\d+\]", "", result["answer"]) == re.sub(r"\s*\[P\d+\]", "", plain["answer"]).strip()


def test_a_streamed_run_sends_token_events_then_the_final_result(client: TestClient[Any]) -> None:
    response = client.post("/v1/agent/runs", json=run_body(stream=True))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    names = [name for name, _ in events]
    assert names[-1] == "final" and names.count("final") == 1 and "token" in names
    assert set(names) <= {"token", "tool_call", "tool_result", "final", "error"}
    final = events[-1][1]
    streamed = "".join(data["text"] for name, data in events if name == "token")
    # the stream is the model's text; the final answer's citations were chosen again after it
    assert streamed.strip() == final["attribution"]["model_answer"]
    # the same run without streaming gives the same answer (temperature 0)
    assert client.post("/v1/agent/runs", json=run_body()).json()["answer"] == final["answer"]


def test_speculation_on_and_off_give_identical_answers(client: TestClient[Any]) -> None:
    on = client.post("/v1/agent/runs", json=run_body(question=QUOTE, max_tokens=20, speculation="on")).json()
    off = client.post("/v1/agent/runs", json=run_body(question=QUOTE, max_tokens=20, speculation="off")).json()
    assert on["answer"] == off["answer"]
    assert on["speculation"]["ran"] and not off["speculation"]["ran"]

    chat = {"messages": [{"role": "user", "content": QUOTE}], "max_tokens": 20, "temperature": 0}
    chat_on = client.post("/v1/chat/completions", json={**chat, "speculation": "on"}).json()
    chat_off = client.post("/v1/chat/completions", json={**chat, "speculation": "off"}).json()
    assert chat_on["choices"][0]["message"]["content"] == chat_off["choices"][0]["message"]["content"]
    assert chat_on["speculation"]["drafted_tokens"] > 0 and chat_off["speculation"]["drafted_tokens"] == 0


VERSIONS = (
    "v1: the loader opens the file, reads the header and checks the magic number. "
    "v2: the loader opens the file, reads the index and checks the version field. "
    "v3: the loader opens the file, reads the footer and checks the checksum. "
    "Repeat v2 word for word."
)


def test_a_chat_completion_asks_for_draft_trees_and_gets_the_same_answer(client: TestClient[Any]) -> None:
    chat = {"messages": [{"role": "user", "content": VERSIONS}], "max_tokens": 24, "temperature": 0}
    chains = client.post("/v1/chat/completions", json={**chat, "speculation": "on", "draft_tree_nodes": 0}).json()
    trees = client.post("/v1/chat/completions", json={**chat, "speculation": "on", "draft_tree_nodes": 16}).json()
    assert trees["choices"][0]["message"]["content"] == chains["choices"][0]["message"]["content"]
    assert chains["speculation"]["tree_cycles"] == 0 and trees["speculation"]["tree_cycles"] > 0
    assert_error(client.post("/v1/chat/completions", json={**chat, "draft_tree_nodes": 65}), 400, "draft_tree_nodes")


def test_an_agent_run_naming_a_user_keeps_its_answer_for_that_user_only(client: TestClient[Any], agent: Agent) -> None:
    history = agent.engine.history
    before = history.tokens_held("user:carol")
    plain = client.post("/v1/agent/runs", json=run_body(question=QUOTE)).json()
    named = client.post("/v1/agent/runs", json=run_body(question=QUOTE, user="carol")).json()
    assert named["answer"] == plain["answer"]  # greedy: drafting from history changes no token
    assert history.tokens_held("user:carol") > before and history.tokens_held("user:dave") == 0
    assert_error(client.post("/v1/agent/runs", json=run_body(user="")), 400, "user")


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_count_requests_and_speculation(client: TestClient[Any]) -> None:
    body = {"messages": [{"role": "user", "content": QUOTE}], "max_tokens": 16, "temperature": 0, "speculation": "on"}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = metric_samples(response.text)
    route = (("method", "POST"), ("route", "/v1/chat/completions"), ("status", "200"))
    assert samples[("specrag:http_requests_total", route)] >= 1
    assert samples[("specrag:spec_decode_num_drafts_total", ())] > 0
    assert samples[("specrag:spec_decode_num_draft_tokens_total", ())] > 0
    accepted = samples[("specrag:spec_decode_num_accepted_tokens_total", ())]
    per_position = sum(v for (name, _), v in samples.items() if name.endswith("accepted_tokens_per_pos_total"))
    assert accepted == per_position
    assert samples[("specrag:prefix_cache_queries_total", ())] > 0
    assert ("specrag:time_to_first_token_seconds_count", (("endpoint", "chat"),)) in samples
    assert samples[("specrag:request_queue_time_seconds_count", ())] >= 1
    assert samples[("specrag:inter_token_latency_seconds_count", ())] >= 1
    assert samples[("specrag:num_requests_running", ())] == samples[("specrag:num_requests_waiting", ())] == 0
    assert samples[("specrag:kv_cache_usage_perc", ())] == 0  # every finished request gave its blocks back


def test_models_health_and_openapi(client: TestClient[Any]) -> None:
    assert client.get("/healthz").json()["status"] == "ok"
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "smollm2-135m"
    schema = client.get("/schema/openapi.json").json()
    run = schema["paths"]["/v1/agent/runs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert run["$ref"].endswith("AgentRunRequest")
    properties = schema["components"]["schemas"]["AgentRunRequest"]["properties"]
    assert {"question", "stream", "max_steps", "tools", "speculation", "max_tokens"} <= set(properties)
    assert "/v1/chat/completions" in schema["paths"]


def test_an_api_key_guards_every_route_but_healthz(agent: Agent, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECRAG_API_KEY", "s3cret")
    with TestClient(create_app(agent)) as client:
        assert client.get("/healthz").status_code == 200
        for path in ("/v1/models", "/metrics", "/schema/openapi.json", "/v1/traces/abc"):
            error = assert_error(client.get(path), 401)
            assert error["type"] == "authentication_error"
        assert_error(client.post("/v1/agent/runs", json=run_body()), 401)
        assert_error(client.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(client.get("/v1/models", headers={"Authorization": "Basic s3cret"}), 401)
        assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert client.get("/schema/openapi.json", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    with TestClient(create_app(agent, api_key="other")) as client:  # the argument wins over the environment
        assert client.get("/v1/models", headers={"Authorization": "Bearer other"}).status_code == 200


# -- tool failures inside a stream (the model's replies scripted; everything else real) -------


def test_tool_errors_and_timeouts_are_stream_events_and_the_server_keeps_serving(smollm2: CausalLM) -> None:
    agent = Agent(tools=[explode, slow_lookup], index=None, model=smollm2, concurrent=True)
    replies = [call("explode", reason="boom"), call("slow_lookup", key="k"), "Both tools failed."]
    agent.loop = AgentLoop(
        smollm2.tokenizer, Scripted(smollm2.tokenizer, replies), agent.registry, agent.grammar_for,
        tracer=agent.tracer,
    )  # fmt: skip
    try:
        with TestClient(create_app(agent)) as client:
            body = {"question": "Try the tools.", "stream": True, "max_steps": 3, "tools": ["explode", "slow_lookup"]}
            response = client.post("/v1/agent/runs", json=body)
            assert response.status_code == 200
            events = sse_events(response.text)
            results = [data for name, data in events if name == "tool_result"]
            assert [name for name, _ in events if name != "token"] == [
                "tool_call", "tool_result", "tool_call", "tool_result", "final",
            ]  # fmt: skip
            assert [result["error"]["type"] for result in results] == ["exception", "timeout"]
            assert not any(result["ok"] for result in results)
            assert events[-1][1]["answer"] == "Both tools failed."
            # still serving: health, and a real generation through the engine worker
            assert client.get("/healthz").status_code == 200
            chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
            assert client.post("/v1/chat/completions", json=chat).json()["usage"]["completion_tokens"] == 4
    finally:
        agent.close()


def test_an_unexpected_failure_is_a_500_without_a_stack_trace(agent: Agent, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: object, **__: object) -> Iterator[dict[str, Any]]:
        raise RuntimeError("secret internals /path/to/file.py")

    monkeypatch.setattr(agent, "stream", broken)
    with TestClient(create_app(agent)) as client:
        error = assert_error(client.post("/v1/agent/runs", json=run_body()), 500)
        assert error == {"type": "internal_error", "message": "internal error"}
        assert client.get("/healthz").status_code == 200


def test_an_agent_error_event_is_a_500_or_an_error_event_in_the_stream(
    agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(*_: object, **__: object) -> Iterator[AgentEvent]:
        yield TokenEvent(0, "Hal")
        yield ErrorEvent(RuntimeError("engine failed"))

    monkeypatch.setattr(agent, "stream", failing)
    with TestClient(create_app(agent)) as client:
        assert_error(client.post("/v1/agent/runs", json=run_body()), 500)
        events = sse_events(client.post("/v1/agent/runs", json=run_body(stream=True)).text)
        assert [name for name, _ in events] == ["token", "error"]
