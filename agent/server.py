"""The HTTP server: a litestar app over one ``Agent`` (DESIGN.md, "HTTP").

    app = create_app(Agent(index=..., concurrent=True))   # then: uvicorn.run(app)

Routes: ``POST /v1/agent/runs`` (the agent loop; SSE with ``stream``), ``POST /v1/chat/completions``
(OpenAI-compatible, ``agent/openai_compat.py``), ``GET /v1/models``, ``GET /v1/traces`` (recent
runs; ``/v1/traces/view`` as HTML), ``GET /v1/traces/{id}`` (+ ``/view``, the HTML waterfall),
``GET /metrics`` (``agent/metrics.py``), ``GET /healthz``, and litestar's OpenAPI schema at
``/schema/openapi.json`` (bodies are ``agent/api_models.py``).

Blocking work (tokenising, grammar compiles, agent runs, generation) runs in worker threads,
never on the event loop; generation itself goes through the agent's engine worker, so
concurrent requests advance together and their number is bounded: a full worker
(``QueueFull``) is a 503 with ``Retry-After``. A stream pulls its first event before the
response starts, so an overloaded or invalid request still gets a proper status. A client
that disconnects from a stream stops the iteration; closing the generator cancels its
sequence in the worker. Errors are ``agent/errors.py``'s JSON shape; auth (``SPECRAG_API_KEY``
or ``api_key``) is a bearer token compared in constant time on every route but ``/healthz``.
"""

from __future__ import annotations

import contextvars
import hmac
import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from typing import Any, TypeVar

import anyio.to_thread
from litestar import Litestar, MediaType, Response, get, post
from litestar.middleware import DefineMiddleware
from litestar.openapi import OpenAPIConfig, ResponseSpec
from litestar.params import FromPath, FromQuery, JSONBody
from litestar.response import ServerSentEvent, ServerSentEventMessage
from litestar.types import ASGIApp, Receive, Scope, Send

from agent.api_models import AgentRunRequest, ChatCompletionRequest, ErrorResponse, ServerLimits
from agent.errors import EXCEPTION_HANDLERS, ApiError, error_body, invalid, logger
from agent.loop import default_tools
from agent.metrics import CONTENT_TYPE, MetricsMiddleware, ServerMetrics
from agent.openai_compat import ChatRun, plan_chat
from agent.trace_index import MAX_PAGE, STATUSES, TraceSummary, recent, render_index
from agent.trace_view import render_waterfall
from agent.worker import QueueFull, WorkerStopped

T = TypeVar("T")
OPEN_PATHS = frozenset({"/healthz"})
OVERLOAD_ERRORS = frozenset({"QueueFull", "WorkerStopped"})  # agent error events that mean "retry later"
TOO_LARGE = "RequestTooLarge"  # an agent error event: a prompt + max_tokens the KV pool could never hold
_DONE = object()
_ERRORS = {
    400: "invalid request: the field at fault is named",
    401: "missing or wrong bearer key (when the server has one)",
    413: "request body too large",
    503: "too many requests in flight; retry after Retry-After seconds",
}
ERROR_RESPONSES = {status: ResponseSpec(ErrorResponse, description=text) for status, text in _ERRORS.items()}
GET_ERRORS = {status: ERROR_RESPONSES[status] for status in (401,)}
LIST_ERRORS = {status: ERROR_RESPONSES[status] for status in (400, 401)}
TRACE_ERRORS = {**GET_ERRORS, 404: ResponseSpec(ErrorResponse, description="unknown trace, or no longer kept")}


def overloaded(message: str) -> ApiError:
    return ApiError(503, message, type="overloaded_error", headers={"Retry-After": "1"})


async def iterate_in_thread(iterator: Iterator[T]) -> AsyncIterator[T]:
    """Each ``next`` in a worker thread, all in one ``contextvars.Context``.

    The agent loop opens trace spans (context variables) in one ``next`` and closes them in
    a later one; a fresh context per call would make the reset fail. Leaving early closes
    the iterator, which cancels its generation in the engine worker.
    """
    context = contextvars.copy_context()
    try:
        while True:
            item = await anyio.to_thread.run_sync(context.run, next, iterator, _DONE)
            if item is _DONE:
                return
            yield item  # type: ignore[misc]
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            context.run(close)


class AuthMiddleware:
    """``Authorization: Bearer <key>`` on every route but ``/healthz``; else 401 in the error shape."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and not self._authorised(scope):
            body = json.dumps(error_body("authentication_error", "a valid 'Authorization: Bearer' key is required"))
            headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": body.encode(), "more_body": False})
            return
        await self.app(scope, receive, send)

    def _authorised(self, scope: Scope) -> bool:
        header = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)


def create_app(
    agent: Any,
    *,
    api_key: str | None = None,
    max_body_bytes: int = 1_000_000,
    max_prompt_tokens: int | None = None,
    max_tokens_limit: int = 2048,
    max_steps_limit: int = 8,
) -> Litestar:
    """The app over ``agent`` (built with ``concurrent=True`` so requests interleave)."""
    key = api_key if api_key is not None else os.environ.get("SPECRAG_API_KEY") or None
    context = getattr(agent.model.config, "max_position_embeddings", None) or 4096
    limits = ServerLimits(
        max_prompt_tokens=max_prompt_tokens or int(context),
        max_tokens_limit=max_tokens_limit,
        max_steps_limit=max_steps_limit,
    )
    metrics = ServerMetrics(agent)
    started = int(time.time())

    @get("/healthz", summary="Liveness (no auth)")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "model": agent.model.name}

    @get("/v1/models", summary="The served model (OpenAI list shape)", responses=GET_ERRORS)
    async def models() -> dict[str, Any]:
        model = {"id": agent.model.name, "object": "model", "created": started, "owned_by": "specrag"}
        return {"object": "list", "data": [model]}

    @get("/v1/traces", summary="Recent runs, newest first (filters, paged)", responses=LIST_ERRORS)
    async def traces(
        status: FromQuery[str | None] = None,
        min_duration_ms: FromQuery[float] = 0.0,
        limit: FromQuery[int] = 50,
        offset: FromQuery[int] = 0,
    ) -> dict[str, Any]:
        page, total = _recent_traces(agent, status, min_duration_ms, limit, offset)
        return {"object": "list", "data": [item.as_dict() for item in page], "total": total, "offset": offset}

    @get("/v1/traces/view", summary="Recent runs as an HTML table linking each waterfall", media_type=MediaType.HTML)
    async def traces_view(
        status: FromQuery[str | None] = None,
        min_duration_ms: FromQuery[float] = 0.0,
        limit: FromQuery[int] = 50,
        offset: FromQuery[int] = 0,
    ) -> str:
        page, total = _recent_traces(agent, status, min_duration_ms, limit, offset)
        return render_index(page, total)

    @get("/v1/traces/{trace_id:str}", summary="A run's span tree as JSON", responses=TRACE_ERRORS)
    async def trace(trace_id: FromPath[str]) -> dict[str, Any]:
        return _trace_or_404(agent, trace_id)

    @get(
        "/v1/traces/{trace_id:str}/view",
        summary="A run's trace as an HTML waterfall",
        media_type=MediaType.HTML,
        responses=TRACE_ERRORS,
    )
    async def trace_view(trace_id: FromPath[str]) -> str:
        found = _trace_or_404(agent, trace_id)
        return await anyio.to_thread.run_sync(render_waterfall, found)

    @get("/metrics", summary="Prometheus metrics", media_type=CONTENT_TYPE, responses=GET_ERRORS)
    async def metrics_route() -> Response[bytes]:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @post(
        "/v1/agent/runs",
        status_code=200,
        summary="Answer a question with the agent loop (SSE with stream)",
        responses=ERROR_RESPONSES,
    )
    async def agent_runs(data: JSONBody[AgentRunRequest]) -> Response[Any]:
        received = time.perf_counter()
        options = await anyio.to_thread.run_sync(_run_options, agent, data, limits)
        events = iterate_in_thread(agent.stream(data.question, **options))
        first = await anext(events)
        if first["event"] == "error" and first["data"].get("type") in {*OVERLOAD_ERRORS, TOO_LARGE}:
            await events.aclose()
            raise _refusal(first["data"])
        if not data.stream:
            async with aclosing(events):
                return Response(await _collect_run(agent, metrics, first, events, received))
        return ServerSentEvent(_run_sse(agent, metrics, first, events, received))

    @post(
        "/v1/chat/completions",
        status_code=200,
        summary="OpenAI-compatible chat completion (SSE with stream)",
        responses=ERROR_RESPONSES,
    )
    async def chat_completions(data: JSONBody[ChatCompletionRequest]) -> Response[Any]:
        received = time.perf_counter()
        plan = await anyio.to_thread.run_sync(plan_chat, agent, data, limits)
        run = ChatRun(agent, plan, metrics, received)
        try:
            if not data.stream:
                return Response(await anyio.to_thread.run_sync(run.completion))
            chunks = iterate_in_thread(run.chunks())
            first = await anext(chunks)
        except (QueueFull, WorkerStopped) as error:
            raise overloaded(str(error)) from None
        return ServerSentEvent(_chat_sse(first, chunks))

    middleware = [DefineMiddleware(MetricsMiddleware, metrics=metrics)]
    if key:
        middleware.append(DefineMiddleware(AuthMiddleware, api_key=key))
    trace_routes = [traces, traces_view, trace, trace_view]
    return Litestar(
        route_handlers=[healthz, models, *trace_routes, metrics_route, agent_runs, chat_completions],
        middleware=middleware,
        exception_handlers=EXCEPTION_HANDLERS,
        request_max_body_size=max_body_bytes,
        openapi_config=OpenAPIConfig(title="specrag", version="0.1.0", path="/schema"),
    )


def _recent_traces(
    agent: Any, status: str | None, min_duration_ms: float, limit: int, offset: int
) -> tuple[list[TraceSummary], int]:
    if status is not None and status not in STATUSES:
        raise invalid("status", f"status must be one of {', '.join(STATUSES)}, not {status!r}")
    if not 1 <= limit <= MAX_PAGE:
        raise invalid("limit", f"limit must be within 1..{MAX_PAGE}, not {limit}")
    if offset < 0 or min_duration_ms < 0:
        raise invalid("offset" if offset < 0 else "min_duration_ms", "must be at least 0")
    store = agent.tracer.store
    kept = store.snapshot() if store is not None else []
    return recent(kept, status=status, min_duration_ms=min_duration_ms, limit=limit, offset=offset)


def _trace_or_404(agent: Any, trace_id: str) -> dict[str, Any]:
    found = agent.trace(trace_id)
    if found is None:
        raise ApiError(404, f"no trace {trace_id!r} (unknown, or no longer kept)", field="trace_id")
    return found


def _run_options(agent: Any, body: AgentRunRequest, limits: ServerLimits) -> dict[str, Any]:
    """RunOptions fields for a request, after the server's limits (each refusal names its field)."""
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
    question_tokens = len(agent.model.tokenizer(body.question, add_special_tokens=False)["input_ids"])
    if question_tokens > limits.max_prompt_tokens:
        raise invalid(
            "question",
            f"the question has {question_tokens} tokens; the limit is {limits.max_prompt_tokens}",
            code="context_length_exceeded",
        )
    return (
        {
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
        }
        | ({} if body.min_supported is None else {"min_supported": body.min_supported})
        | ({} if body.citation_min_similarity is None else {"citation_min_similarity": body.citation_min_similarity})
        | ({} if body.tool_gate else {"min_tool_similarity": None, "min_call_probability": None})
    )


def _observe_event(
    metrics: ServerMetrics, agent: Any, event: dict[str, Any], seen_token: bool, received: float
) -> bool:
    if event["event"] == "token" and not seen_token:
        metrics.ttft.labels("agent").observe(time.perf_counter() - received)
        seen_token = True
    if event["event"] == "final":
        metrics.observe_run(event["data"], agent.trace(event["data"]["trace_id"]))
    return seen_token


async def _collect_run(
    agent: Any, metrics: ServerMetrics, first: dict[str, Any], events: AsyncIterator[dict[str, Any]], received: float
) -> dict[str, Any]:
    seen_token = False
    event = first
    while True:
        seen_token = _observe_event(metrics, agent, event, seen_token, received)
        if event["event"] == "final":
            return event["data"]
        if event["event"] == "error":
            error = event["data"]
            if error.get("type") in {*OVERLOAD_ERRORS, TOO_LARGE}:
                raise _refusal(error)
            logger.error("agent run failed: %s: %s", error.get("type"), error.get("message"))
            raise ApiError(500, "internal error", type="internal_error")
        event = await anext(events)


def _refusal(error: dict[str, Any]) -> ApiError:
    """An agent error event that is the caller's to act on: busy (503) or too large (400)."""
    message = str(error.get("message", "the server is busy"))
    if error.get("type") == TOO_LARGE:
        return invalid("max_tokens", message, code="context_length_exceeded")
    return overloaded(message)


async def _run_sse(
    agent: Any, metrics: ServerMetrics, first: dict[str, Any], events: AsyncIterator[dict[str, Any]], received: float
) -> AsyncIterator[ServerSentEventMessage]:
    """One SSE event per loop event (the loop reports its own failures as ``error`` events)."""
    seen_token = False
    async with aclosing(events):
        event: dict[str, Any] | None = first
        try:
            while event is not None:
                seen_token = _observe_event(metrics, agent, event, seen_token, received)
                yield ServerSentEventMessage(data=json.dumps(event["data"]), event=event["event"])
                event = await anext(events, None)
        except Exception:  # the status is sent already: report it in the stream
            logger.exception("agent run stream failed")
            yield ServerSentEventMessage(
                data=json.dumps({"type": "internal_error", "message": "internal error"}), event="error"
            )


async def _chat_sse(first: dict[str, Any], chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """OpenAI's stream: ``data: {chunk}`` events, then ``data: [DONE]``; a failure mid-stream
    (the status is already sent) becomes an ``{"error": ...}`` event, as OpenAI sends one."""
    async with aclosing(chunks):
        try:
            yield json.dumps(first)
            async for chunk in chunks:
                yield json.dumps(chunk)
        except (QueueFull, WorkerStopped) as error:
            yield json.dumps(error_body("overloaded_error", str(error)))
        except ApiError as error:  # e.g. an answer that failed its schema (logged where raised)
            yield json.dumps(error_body(error.type, error.message))
        except Exception:
            logger.exception("chat completion stream failed")
            yield json.dumps(error_body("internal_error", "internal error"))
    yield "[DONE]"


def serve(agent: Any, host: str = "127.0.0.1", port: int = 8000, **options: Any) -> None:
    """Run the app under uvicorn until interrupted (``specrag serve``)."""
    import uvicorn

    uvicorn.run(create_app(agent, **options), host=host, port=port, log_level="info")
