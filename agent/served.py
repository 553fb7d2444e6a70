"""What the HTTP layer needs of an agent (``ServedAgent``), and the streaming helper it shares.

The server's routes get the agent, the request limits and the metrics through litestar's
dependency injection (``Provide``), typed by this protocol rather than by ``Agent`` itself,
so a test or a remote-engine agent can stand in for it.
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Iterator
from typing import Any, Protocol, TypeVar, runtime_checkable

import anyio.to_thread
from litestar.di import NamedDependency

from specrag.agent.api_models import ServerLimits
from specrag.agent.events import AgentEvent
from specrag.agent.metrics import ServerMetrics
from specrag.agent.run_state import RunOptions
from specrag.agent.trace import Tracer
from specrag.decoding.model import CausalLM
from specrag.tools import ToolRegistry

T = TypeVar("T")
_DONE = object()


@runtime_checkable  # litestar checks an injected value against its annotation
class ServedAgent(Protocol):
    model: CausalLM
    registry: ToolRegistry
    tracer: Tracer
    engine: Any

    def stream(self, question: str, options: RunOptions | None = None, **overrides: Any) -> Iterator[AgentEvent]: ...

    def trace(self, trace_id: str) -> dict[str, Any] | None: ...

    def generate(self, request: Any) -> Iterator[Any]: ...


# The routes' injected values, provided by create_app by name (litestar's NamedDependency).
AgentDep = NamedDependency[ServedAgent]
LimitsDep = NamedDependency[ServerLimits]
MetricsDep = NamedDependency[ServerMetrics]
StartedDep = NamedDependency[int]


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
