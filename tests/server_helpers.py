"""Shared pieces of the HTTP server tests: agents over the real smollm2 pack, the error-shape
check, and a real uvicorn server on a free local port."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from specrag.agent.live_server import LiveServer, wait_until
from specrag.agent.runtime import Agent
from specrag.decoding.model import CausalLM
from specrag.retrieval import Retriever
from tests.retrieval_helpers import sample_index, shared_embedder


def sample_agent(model: CausalLM, base: Path, **options: Any) -> Agent:
    """The real agent over the sample index, its engine behind the worker (as ``serve`` builds it)."""
    root, _ = sample_index(base)
    return Agent(model=model, index=Retriever.open(root, shared_embedder()), concurrent=True, **options)


@contextlib.contextmanager
def sample_server(model: CausalLM, base: Path, api_key: str = "") -> Iterator[str]:
    """A real uvicorn server of ``sample_agent``'s app; yields its URL, closes the agent after."""
    from specrag.agent.server import create_app

    agent = sample_agent(model, base)
    try:
        with LiveServer(create_app(agent, api_key=api_key)) as url:
            yield url
    finally:
        agent.close()


def assert_error(response: httpx.Response | Any, status: int, field: str | None = None) -> dict[str, Any]:
    """The response is the JSON error shape with ``status``, naming ``field`` (a prefix is enough)."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error["type"], str) and isinstance(error["message"], str)
    assert "Traceback" not in response.text and 'File "' not in response.text
    if field is not None:
        assert str(error.get("field", "")).startswith(field), error
    return error


__all__ = ["LiveServer", "assert_error", "sample_agent", "sample_server", "wait_until"]
