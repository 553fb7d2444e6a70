"""Shared pieces of the HTTP server tests: agents over the real smollm2 pack, the error-shape
check, and a real uvicorn server on a free local port."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from agent.runtime import Agent
from decoding.model import CausalLM
from retrieval import Retriever
from tests.retrieval_helpers import sample_index, shared_embedder


def sample_agent(model: CausalLM, base: Path, **options: Any) -> Agent:
    """The real agent over the sample index, its engine behind the worker (as ``serve`` builds it)."""
    root, _ = sample_index(base)
    return Agent(model=model, index=Retriever.open(root, shared_embedder()), concurrent=True, **options)


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


def wait_until(condition: Callable[[], bool], timeout: float = 30.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


class LiveServer:
    """uvicorn serving ``app`` on 127.0.0.1 in a thread; ``with LiveServer(app) as url: ...``."""

    def __init__(self, app: Any) -> None:
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> str:
        self.thread.start()
        if not wait_until(lambda: self.server.started, timeout=30):
            raise RuntimeError("uvicorn did not start")
        return self.url

    def __exit__(self, *_: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.socket.close()
