"""One HTTP request carried to another process and answered there by the same ASGI app.

Under Ray Serve (``agent/ray_serve.py``) the ingress reads a request once, names the text its
prompt will start with (``routing_prompt``) so that Ray's prefix-aware router can send it to
the replica holding that prefix, and hands the replica a ``ForwardedRequest``. The replica
answers it with the very litestar app ``specrag serve`` runs (``call_asgi``): routes, auth,
errors, limits and streaming are the single-process ones, not a copy. What travels back is
a ``ResponseStart`` and then the body's chunks, as they are sent (SSE streams stay streams).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

Message = MutableMapping[str, Any]
ASGIApp = Callable[[Message, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

# The request fields whose text a generation's prompt starts with, per route. Ray's
# PrefixCacheAffinityRouter reads a ``prompt`` attribute; see ``routing_prompt``.
CHAT_PATH = "/v1/chat/completions"
RUNS_PATH = "/v1/agent/runs"


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request, read whole, with the text Ray's prefix router matches on."""

    method: str
    path: str
    query_string: bytes = b""
    headers: Headers = field(default_factory=list)
    body: bytes = b""
    prompt: str = ""  # empty: nothing to route by, the router balances load alone


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: Headers


def routing_prompt(method: str, path: str, body: bytes) -> str:
    """The text a request's prompt starts with, or "" where it has none.

    A chat's user messages in order, so a conversation's next turn extends its last one; an
    agent run's question. Both are preceded by the OpenAI ``user`` when one is named: a user's
    requests then share a prefix, and land where that user's earlier answers (the drafting
    history, issue 21) and cached blocks are. The router's tree holds only the text it routed,
    never the answers, so the assistant's messages (and tool results) that a client sends
    back would only dilute the match and push a conversation's third turn elsewhere; and one
    system prompt is usually shared by every conversation (each replica caches it after its
    first request), so it would only make unrelated conversations look alike. A body that
    does not parse routes by load; the replica answers it with the usual 4xx.
    """
    if method != "POST" or path.rstrip("/") not in (CHAT_PATH, RUNS_PATH):
        return ""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(data, dict):
        return ""
    user = data.get("user")
    head = f"user:{user}\n" if isinstance(user, str) and user else ""
    if path.rstrip("/") == RUNS_PATH:
        question = data.get("question")
        return head + question if isinstance(question, str) else ""
    messages = data.get("messages")
    if not isinstance(messages, list):
        return ""
    return head + "".join(_message_text(message) for message in messages if _role(message) == "user")


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, dict) else None


def _message_text(message: Any) -> str:
    """The message's text alone, as Ray's router normalises messages."""
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


async def call_asgi(app: ASGIApp, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
    """Run ``app`` on ``request`` in this process: a ``ResponseStart``, then body chunks.

    Leaving early (the client went away, or the caller was cancelled) tells the app the
    client disconnected and cancels it, as uvicorn does, so a stream's generation stops.
    """
    sent: asyncio.Queue[Message] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    task = asyncio.create_task(app(_scope(request), receive, send))
    try:
        while True:
            message = await _next_message(sent, task)
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], [(bytes(k), bytes(v)) for k, v in message.get("headers", [])])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        disconnected.set()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _next_message(sent: asyncio.Queue[Message], task: asyncio.Task[None]) -> Message:
    """The app's next message; its exception if it fails, or an error if it ends without one."""
    if not sent.empty():
        return sent.get_nowait()
    getter = asyncio.ensure_future(sent.get())
    done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
    if getter in done:
        return getter.result()
    getter.cancel()
    task.result()  # raises the app's own exception
    if not sent.empty():
        return sent.get_nowait()
    raise RuntimeError("the app returned without completing its response")


def _scope(request: ForwardedRequest) -> Message:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query_string,
        "root_path": "",
        "headers": request.headers,
        "client": ("127.0.0.1", 0),
        "server": ("specrag", 80),
        "state": {},
    }
