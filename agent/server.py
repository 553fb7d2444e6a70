"""The HTTP server: a litestar app over one agent (``docs``: "HTTP API").

    app = create_app(Agent(index=..., concurrent=True))   # then: uvicorn.run(app)

Routes, one controller each: ``POST /v1/agent/runs`` (the agent loop; SSE with ``stream``;
``agent/routes_runs.py``), ``POST /v1/chat/completions`` (OpenAI-compatible;
``agent/routes_chat.py``), ``/v1/traces`` (recent runs, ``/v1/traces/view`` as HTML, one
run's trace and its waterfall; ``agent/routes_traces.py``), and here ``GET /v1/models``,
``GET /metrics`` (``agent/metrics.py``), ``GET /healthz``; litestar's OpenAPI schema is at
``/schema/openapi.json`` (bodies are ``agent/api_models.py``).

The agent, the request limits and the metrics reach the routes as litestar dependencies
(``Provide``), typed by ``specrag.agent.served.ServedAgent``. Blocking work (tokenising, grammar
compiles, agent runs, generation) runs in worker threads, never on the event loop;
generation goes through the agent's engine worker, so concurrent requests advance
together and their number is bounded: a full worker is a 503 with ``Retry-After``. A
client that disconnects from a stream stops the iteration; closing the generator cancels
its sequence in the worker. Errors are ``agent/errors.py``'s JSON shape; with a key
(``SPECRAG_API_KEY`` or ``api_key``) every route but ``/healthz`` needs it as a bearer
token (``agent/server_auth.py``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from litestar import Litestar, Response, get
from litestar.di import Provide
from litestar.middleware import DefineMiddleware
from litestar.openapi import OpenAPIConfig

from specrag.agent.api_models import ServerLimits
from specrag.agent.errors import EXCEPTION_HANDLERS, GET_ERRORS
from specrag.agent.metrics import CONTENT_TYPE, MetricsMiddleware, ServerMetrics
from specrag.agent.routes_chat import ChatController
from specrag.agent.routes_runs import AgentRunController
from specrag.agent.routes_traces import TraceController
from specrag.agent.served import AgentDep, MetricsDep, ServedAgent, StartedDep


@get("/healthz", summary="Liveness (no auth)", sync_to_thread=True)  # may load a new index version
def healthz(agent: AgentDep) -> dict[str, Any]:
    return {"status": "ok", "model": agent.model.name, "index": _index_status(getattr(agent, "retriever", None))}


def _index_status(retriever: Any) -> dict[str, Any] | None:
    """The index version this process searches, after checking for a newer one (replicas
    sharing an index directory switch on their own; this is where one can watch them)."""
    if retriever is None or not hasattr(retriever, "refresh"):
        return None
    retriever.refresh()
    return {"version": retriever.index.version, "passages": len(retriever)}


@get("/v1/models", summary="The served model (OpenAI list shape)", responses=GET_ERRORS)
async def models(agent: AgentDep, started: StartedDep) -> dict[str, Any]:
    model = {"id": agent.model.name, "object": "model", "created": started, "owned_by": "specrag"}
    return {"object": "list", "data": [model]}


@get("/metrics", summary="Prometheus metrics", media_type=CONTENT_TYPE, responses=GET_ERRORS)
async def metrics_route(metrics: MetricsDep) -> Response[bytes]:
    return Response(metrics.render(), media_type=CONTENT_TYPE)


def create_app(
    agent: ServedAgent,
    *,
    api_key: str | None = None,
    max_body_bytes: int = 1_000_000,
    max_prompt_tokens: int | None = None,
    max_tokens_limit: int = 2048,
    max_steps_limit: int = 8,
    metrics: ServerMetrics | None = None,
) -> Litestar:
    """The app over ``agent`` (built with ``concurrent=True`` so requests interleave);
    ``metrics``: a registry the caller also reads (a Ray replica pushes it to the ingress)."""
    from specrag.agent.server_auth import BearerAuth

    key = api_key if api_key is not None else os.environ.get("SPECRAG_API_KEY") or None
    context = getattr(agent.model.config, "max_position_embeddings", None) or 4096
    limits = ServerLimits(
        max_prompt_tokens=max_prompt_tokens or int(context),
        max_tokens_limit=max_tokens_limit,
        max_steps_limit=max_steps_limit,
    )
    metrics = metrics or ServerMetrics(agent)
    started = int(time.time())
    dependencies = {
        "agent": Provide(lambda: agent, sync_to_thread=False),
        "limits": Provide(lambda: limits, sync_to_thread=False),
        "metrics": Provide(lambda: metrics, sync_to_thread=False),
        "started": Provide(lambda: started, sync_to_thread=False),
    }
    middleware = [DefineMiddleware(MetricsMiddleware, metrics=metrics)]
    if key:
        middleware.append(DefineMiddleware(BearerAuth, api_key=key))
    return Litestar(
        route_handlers=[healthz, models, metrics_route, AgentRunController, ChatController, TraceController],
        dependencies=dependencies,
        middleware=middleware,
        exception_handlers=EXCEPTION_HANDLERS,
        request_max_body_size=max_body_bytes,
        openapi_config=OpenAPIConfig(title="specrag", version="0.1.0", path="/schema"),
    )


def serve(agent: ServedAgent, host: str = "127.0.0.1", port: int = 8000, **options: Any) -> None:
    """Run the app under uvicorn until interrupted (``specrag serve``)."""
    import uvicorn

    uvicorn.run(create_app(agent, **options), host=host, port=port, log_level="info")
