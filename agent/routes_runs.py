"""``POST /v1/agent/runs``: the agent loop over HTTP, as JSON or Server-Sent Events.

A stream pulls its first event before the response starts, so an overloaded (503 with
``Retry-After``) or too-large (400) request still gets a proper status; the loop reports
its own failures as ``error`` events, which become a 500 (JSON) or an ``error`` event (SSE).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import anyio.to_thread
from litestar import Controller, Response, post
from litestar.params import JSONBody
from litestar.response import ServerSentEvent, ServerSentEventMessage

from specrag.agent.api_models import AgentRunRequest, ServerLimits, user_tenant
from specrag.agent.errors import POST_ERRORS, ApiError, invalid, logger
from specrag.agent.events import AgentEvent, ErrorEvent, FinalEvent, TokenEvent
from specrag.agent.loop import default_tools
from specrag.agent.metrics import ServerMetrics
from specrag.agent.remote import RemoteEngineError, RemoteOptionUnsupported
from specrag.agent.run_state import RunOptions
from specrag.agent.served import AgentDep, LimitsDep, MetricsDep, ServedAgent, iterate_in_thread
from specrag.agent.worker import QueueFull, WorkerStopped
from specrag.decoding.kv_manager import RequestTooLarge

# Failures of a run that are the caller's to act on, as the exceptions the loop's error
# event carries: busy (503, retry later) or a prompt + max_tokens the KV pool could never hold (400).
OVERLOADED = (QueueFull, WorkerStopped)


def overloaded(message: str) -> ApiError:
    return ApiError(503, message, type="overloaded_error", headers={"Retry-After": "1"})


def upstream_failed(error: RemoteEngineError) -> ApiError:
    """The engine behind ``--engine-url`` failed or could not be reached: a 502."""
    return ApiError(502, f"the generation engine failed: {error}", type="upstream_error")


class AgentRunController(Controller):
    path = "/v1/agent/runs"

    @post(
        "/",
        status_code=200,
        summary="Answer a question with the agent loop (SSE with stream)",
        responses=POST_ERRORS,
    )
    async def run(
        self, agent: AgentDep, limits: LimitsDep, metrics: MetricsDep, data: JSONBody[AgentRunRequest]
    ) -> Response[Any]:
        received = time.perf_counter()
        options = await anyio.to_thread.run_sync(run_options, agent, data, limits)
        events = iterate_in_thread(agent.stream(data.question, options))
        first = await anext(events)
        refusal = _refusal(first)
        if refusal is not None:
            await events.aclose()
            raise refusal
        if not data.stream:
            async with aclosing(events):
                return Response(await _collect_run(agent, metrics, first, events, received))
        return ServerSentEvent(_run_sse(agent, metrics, first, events, received))


def run_options(agent: ServedAgent, body: AgentRunRequest, limits: ServerLimits) -> RunOptions:
    """A request's RunOptions, after the server's limits (each refusal names its field)."""
    max_tokens = body.max_tokens or min(limits.default_max_tokens, limits.max_tokens_limit)
    if max_tokens > limits.max_tokens_limit:
        raise invalid("max_tokens", f"max_tokens must be at most {limits.max_tokens_limit}")
    max_steps = body.max_steps or min(4, limits.max_steps_limit)
    if max_steps > limits.max_steps_limit:
        raise invalid("max_steps", f"max_steps must be at most {limits.max_steps_limit}")
    known = agent.registry.names
    tools = default_tools(known) if body.tools is None else body.tools
    for name in tools:
        if name not in known:
            raise invalid("tools", f"unknown tool {name!r}; known tools: {', '.join(known) or '(none)'}")
    tokenizer = agent.model.tokenizer  # None over a remote engine: the engine checks its context
    question_tokens = len(tokenizer(body.question, add_special_tokens=False)["input_ids"]) if tokenizer else 0
    if question_tokens > limits.max_prompt_tokens:
        raise invalid(
            "question",
            f"the question has {question_tokens} tokens; the limit is {limits.max_prompt_tokens}",
            code="context_length_exceeded",
        )
    fields: dict[str, Any] = {
        "max_steps": max_steps,
        "max_tokens": max_tokens,
        "k": body.k,
        "lookup_k": max(10, body.k),
        "speculation": body.speculation,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "tools": list(tools),
        "abstain_threshold": body.abstain_threshold,
        "citations": body.citations,
        "grounding": body.grounding,
        "grounding_judge": body.grounding_judge,
        "tenant": user_tenant(body.user),
    }
    if body.min_supported is not None:
        fields["min_supported"] = body.min_supported
    if body.citation_min_similarity is not None:
        fields["citation_min_similarity"] = body.citation_min_similarity
    if not body.tool_gate:
        fields |= {"min_tool_similarity": None, "min_call_probability": None}
    return RunOptions(**fields)


def _observe_event(
    metrics: ServerMetrics, agent: ServedAgent, event: AgentEvent, seen_token: bool, received: float
) -> bool:
    if isinstance(event, TokenEvent) and not seen_token:
        metrics.ttft.labels("agent").observe(time.perf_counter() - received)
        seen_token = True
    if isinstance(event, FinalEvent):
        metrics.observe_run(event.result, agent.trace(event.result["trace_id"]))
    return seen_token


async def _collect_run(
    agent: ServedAgent,
    metrics: ServerMetrics,
    first: AgentEvent,
    events: AsyncIterator[AgentEvent],
    received: float,
) -> dict[str, Any]:
    seen_token = False
    event = first
    while True:
        seen_token = _observe_event(metrics, agent, event, seen_token, received)
        if isinstance(event, FinalEvent):
            return event.result
        if isinstance(event, ErrorEvent):
            refusal = _refusal(event)
            if refusal is not None:
                raise refusal
            logger.error("agent run failed: %s: %s", event.type, event.message)
            raise ApiError(500, "internal error", type="internal_error")
        event = await anext(events)


def _refusal(event: AgentEvent) -> ApiError | None:
    """The 503 or 400 for an error event whose exception is the caller's to act on, else None."""
    exception = event.exception if isinstance(event, ErrorEvent) else None
    if isinstance(exception, RequestTooLarge):
        return invalid("max_tokens", str(exception), code="context_length_exceeded")
    if isinstance(exception, OVERLOADED):
        return overloaded(str(exception))
    if isinstance(exception, RemoteOptionUnsupported):
        return invalid(exception.field, str(exception))
    if isinstance(exception, RemoteEngineError):
        return upstream_failed(exception)
    return None


async def _run_sse(
    agent: ServedAgent,
    metrics: ServerMetrics,
    first: AgentEvent,
    events: AsyncIterator[AgentEvent],
    received: float,
) -> AsyncIterator[ServerSentEventMessage]:
    """One SSE event per loop event (the loop reports its own failures as ``error`` events)."""
    seen_token = False
    async with aclosing(events):
        event: AgentEvent | None = first
        try:
            while event is not None:
                seen_token = _observe_event(metrics, agent, event, seen_token, received)
                yield ServerSentEventMessage(data=json.dumps(event.data()), event=event.kind)
                event = await anext(events, None)
        except Exception:  # the status is sent already: report it in the stream
            logger.exception("agent run stream failed")
            yield ServerSentEventMessage(
                data=json.dumps({"type": "internal_error", "message": "internal error"}), event="error"
            )
