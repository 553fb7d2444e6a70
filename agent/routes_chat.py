"""``POST /v1/chat/completions``: the OpenAI-compatible endpoint (planning and replies in
``agent/openai_compat.py``), as one JSON completion or OpenAI's ``data:`` stream."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import anyio.to_thread
from litestar import Controller, Request, Response, post
from litestar.params import JSONBody
from litestar.response import ServerSentEvent, Stream

from specrag.agent.api_models import ChatCompletionRequest
from specrag.agent.errors import POST_ERRORS, ApiError, error_body, logger
from specrag.agent.openai_compat import ChatRun, plan_chat
from specrag.agent.remote import RemoteEngineError
from specrag.agent.routes_runs import overloaded, upstream_failed
from specrag.agent.served import AgentDep, LimitsDep, MetricsDep, iterate_in_thread
from specrag.agent.worker import QueueFull, WorkerStopped


class ChatController(Controller):
    path = "/v1/chat/completions"

    @post("/", status_code=200, summary="OpenAI-compatible chat completion (SSE with stream)", responses=POST_ERRORS)
    async def complete(
        self,
        agent: AgentDep,
        limits: LimitsDep,
        metrics: MetricsDep,
        request: Request[Any, Any, Any],
        data: JSONBody[ChatCompletionRequest],
    ) -> Response[Any]:
        received = time.perf_counter()
        if agent.model.tokenizer is None:  # generation is the engine's behind --engine-url
            return await _relay(agent, await request.body())
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


async def _relay(agent: Any, body: bytes) -> Response[Any]:
    """The request as it came to the engine behind ``--engine-url``; its answer as it came
    (an engine's 4xx too: it judged the request); no answer at all is a 502."""
    try:
        status, media_type, chunks = await agent.engine.relay(body)
    except RemoteEngineError as error:
        raise upstream_failed(error) from None
    return Stream(chunks, status_code=status, media_type=media_type)


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
