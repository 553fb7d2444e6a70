"""``/v1/traces``: recent runs (JSON and an HTML index) and one run's trace (JSON and waterfall)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio.to_thread
from litestar import Controller, MediaType, get
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath, FromQuery

from specrag.agent.errors import ApiError, documented, invalid
from specrag.agent.served import AgentDep, ServedAgent
from specrag.agent.trace_index import MAX_PAGE, STATUSES, TraceSummary, recent, render_index
from specrag.agent.trace_view import render_waterfall

LIST_ERRORS = documented(400, 401)
TRACE_ERRORS = documented(401, 404)


@dataclass(frozen=True)
class TraceQuery:
    """The list routes' filters and page, checked once for both the JSON and the HTML index."""

    status: str | None
    min_duration_ms: float
    limit: int
    offset: int


def trace_query(
    status: FromQuery[str | None] = None,
    min_duration_ms: FromQuery[float] = 0.0,
    limit: FromQuery[int] = 50,
    offset: FromQuery[int] = 0,
) -> TraceQuery:
    """The list routes' query, as a dependency: litestar documents and parses these parameters
    for each route that injects it, and a bad value is a 400 naming its field."""
    if status is not None and status not in STATUSES:
        raise invalid("status", f"status must be one of {', '.join(STATUSES)}, not {status!r}")
    if not 1 <= limit <= MAX_PAGE:
        raise invalid("limit", f"limit must be within 1..{MAX_PAGE}, not {limit}")
    if offset < 0 or min_duration_ms < 0:
        raise invalid("offset" if offset < 0 else "min_duration_ms", "must be at least 0")
    return TraceQuery(status, min_duration_ms, limit, offset)


# Per route rather than on the controller: only the two list routes take these parameters.
# Not named "query": litestar reserves that name for the raw query mapping.
LIST_QUERY = {"trace_query": Provide(trace_query, sync_to_thread=False)}
TraceQueryDep = NamedDependency[TraceQuery]


class TraceController(Controller):
    path = "/v1/traces"

    @get(
        "/",
        summary="Recent runs, newest first (filters, paged)",
        responses=LIST_ERRORS,
        dependencies=LIST_QUERY,
    )
    async def recent_runs(self, agent: AgentDep, trace_query: TraceQueryDep) -> dict[str, Any]:
        page, total = recent_traces(agent, trace_query)
        return {
            "object": "list",
            "data": [item.as_dict() for item in page],
            "total": total,
            "offset": trace_query.offset,
        }

    @get(
        "/view",
        summary="Recent runs as an HTML table linking each waterfall",
        media_type=MediaType.HTML,
        responses=LIST_ERRORS,
        dependencies=LIST_QUERY,
    )
    async def recent_runs_view(self, agent: AgentDep, trace_query: TraceQueryDep) -> str:
        page, total = recent_traces(agent, trace_query)
        return render_index(page, total)

    @get("/{trace_id:str}", summary="A run's span tree as JSON", responses=TRACE_ERRORS)
    async def trace(self, agent: AgentDep, trace_id: FromPath[str]) -> dict[str, Any]:
        return trace_or_404(agent, trace_id)

    @get(
        "/{trace_id:str}/view",
        summary="A run's trace as an HTML waterfall",
        media_type=MediaType.HTML,
        responses=TRACE_ERRORS,
    )
    async def trace_view(self, agent: AgentDep, trace_id: FromPath[str]) -> str:
        return await anyio.to_thread.run_sync(render_waterfall, trace_or_404(agent, trace_id))


def recent_traces(agent: ServedAgent, query: TraceQuery) -> tuple[list[TraceSummary], int]:
    store = agent.tracer.store
    kept = store.snapshot() if store is not None else []
    return recent(
        kept, status=query.status, min_duration_ms=query.min_duration_ms, limit=query.limit, offset=query.offset
    )


def trace_or_404(agent: ServedAgent, trace_id: str) -> dict[str, Any]:
    found = agent.trace(trace_id)
    if found is None:
        raise ApiError(404, f"no trace {trace_id!r} (unknown, or no longer kept)", field="trace_id")
    return found
