"""The request forwarding under Ray Serve, without Ray: the prefix each route is routed by, and
an ASGI app answering a forwarded request in process (status, headers, streamed chunks, the
app's own failure, and a consumer leaving early cancelling the app)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from litestar import Litestar, Request, Response, get, post
from litestar.response import Stream

from specrag.agent.asgi_forward import ForwardedRequest, ResponseStart, call_asgi, routing_prompt

STREAM_CLOSED: list[bool] = []


@post("/echo", status_code=201)
async def echo(request: Request) -> Response[dict[str, int]]:
    data = await request.json()
    return Response({"sum": sum(data.values())}, headers={"x-seen": "yes"}, status_code=201)


@get("/count")
async def count() -> Stream:
    async def numbers() -> AsyncIterator[str]:
        try:
            for n in range(1_000_000):
                yield f"{n}\n"
                await asyncio.sleep(0.001)
        finally:
            STREAM_CLOSED.append(True)

    return Stream(numbers(), media_type="text/plain")


@get("/fail")
async def fail() -> None:
    raise RuntimeError("planted")


APP = Litestar([echo, count, fail], debug=False)


def chat_body(**fields: object) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


def test_a_chat_routes_by_its_messages_text_in_order() -> None:
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    later = [*first, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    prompt = routing_prompt("POST", "/v1/chat/completions", chat_body(messages=first))
    assert prompt == "Hi"  # the system prompt, shared by most conversations, is left out
    assert routing_prompt("POST", "/v1/chat/completions/", chat_body(messages=later)) == "HiBye"  # answers too
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert routing_prompt("POST", "/v1/chat/completions", chat_body(messages=parts)) == "ab"


def test_a_named_user_prefixes_its_requests() -> None:
    run = json.dumps({"question": "Why?", "user": "ann"}).encode()
    assert routing_prompt("POST", "/v1/agent/runs", run) == "user:ann\nWhy?"
    chat = chat_body(messages=[{"role": "user", "content": "Hi"}], user="ann")
    assert routing_prompt("POST", "/v1/chat/completions", chat) == "user:ann\nHi"


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/traces/abc", b""),
        ("POST", "/v1/chat/completions", b"{not json"),
        ("POST", "/v1/chat/completions", b"[1, 2]"),
        ("POST", "/v1/chat/completions", chat_body(messages="hi")),
        ("POST", "/v1/agent/runs", b'{"question": 3}'),
        ("POST", "/metrics", b"{}"),
    ],
)
def test_requests_without_a_prompt_route_by_load(method: str, path: str, body: bytes) -> None:
    assert routing_prompt(method, path, body) == ""


async def collect(request: ForwardedRequest, limit: int | None = None) -> list[ResponseStart | bytes]:
    items: list[ResponseStart | bytes] = []
    stream = call_asgi(APP, request)
    try:
        async for item in stream:
            items.append(item)
            if limit is not None and len(items) >= limit:
                break
    finally:
        await stream.aclose()
    return items


def test_status_headers_and_body_come_back() -> None:
    headers = [(b"content-type", b"application/json")]
    request = ForwardedRequest("POST", "/echo", headers=headers, body=b'{"a": 2, "b": 3}')
    start, *body = asyncio.run(collect(request))
    assert isinstance(start, ResponseStart) and start.status == 201
    assert (b"x-seen", b"yes") in start.headers
    assert json.loads(b"".join(body)) == {"sum": 5}  # type: ignore[arg-type]


def test_the_apps_own_errors_are_its_responses() -> None:
    start, *_ = asyncio.run(collect(ForwardedRequest("GET", "/fail")))
    assert isinstance(start, ResponseStart) and start.status == 500
    missing, *_ = asyncio.run(collect(ForwardedRequest("GET", "/nowhere")))
    assert isinstance(missing, ResponseStart) and missing.status == 404


def test_leaving_a_stream_early_stops_the_app() -> None:
    STREAM_CLOSED.clear()
    items = asyncio.run(collect(ForwardedRequest("GET", "/count"), limit=4))
    assert isinstance(items[0], ResponseStart) and items[1:] == [b"0\n", b"1\n", b"2\n"]
    assert STREAM_CLOSED == [True]  # the generator was closed, not left running
