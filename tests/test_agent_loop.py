"""The agent loop: retrieval, tool calls and their failures, citations, traces; real model runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from specrag.agent.events import TokenEvent
from specrag.agent.loop import AgentLoop, RunOptions, ShownPassage, default_tools
from specrag.agent.results import resolve_citations
from specrag.agent.runtime import Agent
from specrag.agent.trace import Tracer, TraceStore, stages_cover_run
from specrag.decoding.model import CausalLM
from specrag.retrieval import Retriever
from specrag.tools import ToolRegistry, search_documents_tool
from tests.agent_helpers import Scripted, add, call, explode, slow_lookup
from tests.retrieval_helpers import sample_index, shared_embedder


@pytest.fixture(scope="module")
def retriever(tmp_path_factory: pytest.TempPathFactory) -> Retriever:
    root, _ = sample_index(tmp_path_factory.getbasetemp())
    return Retriever.open(root, shared_embedder())


def scripted_loop(smollm2: CausalLM, replies: list[str], retriever: Retriever | None = None) -> tuple:
    script = Scripted(smollm2.tokenizer, replies)
    registry = ToolRegistry([slow_lookup, explode, add])
    loop = AgentLoop(
        smollm2.tokenizer,
        script,
        registry,
        lambda reg, names, call_format: None,
        retriever,
        tracer=Tracer(store=TraceStore()),
    )
    return loop, script


def test_a_tool_call_runs_and_its_result_reaches_the_next_prompt(smollm2: CausalLM) -> None:
    loop, script = scripted_loop(smollm2, [call("add", a=2, b=3), "The sum is 5."])
    events = list(loop.events("What is 2 + 3?"))
    kinds = [event.kind for event in events]
    assert kinds[0] == "tool_call" and "tool_result" in kinds and kinds[-1] == "final"
    result = events[-1].data()
    assert result["answer"] == "The sum is 5."
    assert result["steps"][0]["tool_result"] == {"name": "add", "ok": True, "content": "5", "error": None}
    second_prompt = smollm2.tokenizer.decode(script.requests[1].prompt_tokens)
    assert '{"name": "add"' in second_prompt and "5" in second_prompt
    assert "".join(e.text for e in events if isinstance(e, TokenEvent)) == "The sum is 5."


@pytest.mark.parametrize(
    ("reply", "error_type"),
    [
        (call("explode", reason="boom"), "exception"),
        (call("slow_lookup", key="k"), "timeout"),
        (call("add", a="two", b=3), "invalid_arguments"),
    ],
)
def test_tool_failures_are_observations_and_the_run_goes_on(smollm2: CausalLM, reply: str, error_type: str) -> None:
    loop, script = scripted_loop(smollm2, [reply, "Sorry, that failed."])
    result = loop.run("Try it.")
    failed = result["steps"][0]["tool_result"]
    assert not failed["ok"] and failed["error"]["type"] == error_type
    assert result["answer"] == "Sorry, that failed."
    assert failed["content"] in smollm2.tokenizer.decode(script.requests[1].prompt_tokens)
    trace = loop.tracer.store.get(result["trace_id"])
    tool_span = next(span for span in trace["spans"] if span["name"].startswith("execute_tool"))
    assert tool_span["status"] == "error"


def test_the_last_step_has_no_tools_so_a_run_always_answers(smollm2: CausalLM) -> None:
    loop, _script = scripted_loop(smollm2, [call("add", a=1, b=1), call("add", a=2, b=2)])
    result = loop.run("Loop forever.", RunOptions(max_steps=2))
    assert [step["kind"] for step in result["steps"]] == ["tool_call", "answer"]
    assert result["answer"].startswith("{")  # plain text now: no tool is offered at the last step


def test_retrieval_shows_k_passages_and_feeds_more_to_prompt_lookup(smollm2: CausalLM, retriever: Retriever) -> None:
    loop, script = scripted_loop(smollm2, ["It wraps a block [P1], see also [P9]."], retriever)
    result = loop.run("What does the with statement do?", RunOptions(k=3, lookup_k=6, citations="model"))
    assert [passage["label"] for passage in result["passages"]] == ["P1", "P2", "P3"]
    names = script.requests[0].lookup_source_names
    assert len(set(names)) == 6 and len(names) == len(script.requests[0].lookup_sources)  # reflowed variants too
    assert [c["label"] for c in result["citations"]] == ["P1"] and result["dropped_citations"] == 1
    prompt = smollm2.tokenizer.decode(script.requests[0].prompt_tokens)
    assert all(passage["text"][:40] in prompt for passage in result["passages"])


def test_search_documents_passages_become_citable(smollm2: CausalLM, retriever: Retriever) -> None:
    loop, _script = scripted_loop(
        smollm2, [call("search_documents", query="lambda expressions", k=2), "Lambdas [P4]."], retriever
    )
    loop.registry.register(search_documents_tool(retriever))
    result = loop.run("Tell me about lambdas.", RunOptions(k=3, lookup_k=3, tools=["search_documents"]))
    labels = [passage["label"] for passage in result["passages"]]
    assert labels[:3] == ["P1", "P2", "P3"] and "P4" in labels
    assert result["citations"][0]["label"] == "P4"
    assert "[P4]" in result["steps"][0]["tool_result"]["content"]


def test_the_built_in_search_is_offered_only_when_a_run_names_it() -> None:
    assert default_tools(["search_documents", "add", "explode"]) == ["add", "explode"]


def test_citations_resolve_in_order_and_drop_unknown_ones() -> None:
    shown = [ShownPassage("P1", "a#0", "a", "x"), ShownPassage("P2", "b#1", "b", "y")]
    citations, dropped = resolve_citations("B [P2], A [P1], again [P2], bogus [P7].", shown)
    assert [c["passage_id"] for c in citations] == ["b#1", "a#0"] and dropped == 1


@pytest.mark.slow
def test_agent_runs_end_to_end_and_speculation_does_not_change_the_answer(
    smollm2: CausalLM, retriever: Retriever, tmp_path: Path
) -> None:
    agent = Agent(tools=[add], index=retriever, model=smollm2)
    on = agent.run("What does the pass statement do?", max_tokens=48, speculation="on", k=2)
    off = agent.run("What does the pass statement do?", max_tokens=48, speculation="off", k=2)
    assert on["answer"] == off["answer"]
    assert on["speculation"]["ran"] and not off["speculation"]["ran"]
    assert off["usage"]["cached_prompt_tokens"] > 0  # the second run reused the first's prompt
    trace = agent.trace(on["trace_id"])
    names = [span["name"] for span in trace["spans"]]
    assert names[0] == "invoke_agent specrag"
    assert any(name.startswith("retrieval") for name in names) and "prompt_build" in names
    assert any(name.startswith("chat") for name in names) and "prefill" in names
    assert stages_cover_run(trace)
