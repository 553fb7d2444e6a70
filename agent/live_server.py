"""A real uvicorn server for an app on a free local port, in a thread of this process.

``with LiveServer(create_app(agent)) as url: ...``: the HTTP tests and ``specrag bench
serve`` talk to the app over real sockets, as any client would.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn


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
