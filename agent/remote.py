"""The agent over a remote engine: any OpenAI-compatible chat completions endpoint.

    specrag serve --engine-url http://gpu-box:8000 --model Qwen/Qwen2.5-Coder-1.5B-Instruct

vLLM, SGLang or another ``specrag serve`` generates; this process keeps everything else of
the agent: retrieval over its index, the tools (offered as OpenAI ``tools``; the engine's
``tool_calls`` run here), citations and their attribution, the groundedness check, the
trace (a ``chat {model}`` span per remote call with the usage it reported) and the evals.
The loop is ``AgentLoop`` itself; only the step's generation changes (``RemoteAgentLoop``).

``POST /v1/chat/completions`` is relayed to the engine as it came (``RemoteEngine.relay``):
the agent, retrieval and traces are the agent endpoint's; plain chat is the engine's own.
What needs the model's own logits cannot cross HTTP and is refused with a 400 naming the
option: the answerability probe (``abstain_threshold``), the model as grounding judge
(``grounding_judge``). The repeat deviation (``agent/repeat_deviation.py``) is skipped: a
step whose calls were all made before is asked again, text only, as when no deviation is
found. The irrelevance gate keeps its embedding half (its call-probability half is a logit).
Speculation, prompt lookup and the prefix cache are the engine's business there.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from specrag.agent.events import AgentEvent, ErrorEvent, TokenEvent
from specrag.agent.loop import AgentLoop, Generated
from specrag.agent.prompt import build_messages
from specrag.agent.results import record_chat
from specrag.agent.run_state import RunOptions, RunState
from specrag.agent.runtime import AgentRuns, open_index
from specrag.decoding.stats import GenerationStats
from specrag.tools import ToolCall
from specrag.tools.formats import HERMES


class RemoteEngineError(RuntimeError):
    """The engine answered with an error, or not at all (its status and message, if any)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class RemoteOptionUnsupported(ValueError):
    """An option that needs the model's logits, which a remote engine does not send."""

    def __init__(self, option: str) -> None:
        super().__init__(f"{option} needs the model's own logits; this server generates through --engine-url")
        self.field = option


@dataclass
class RemoteReply:
    """One chat completion, assembled from its stream."""

    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


class RemoteEngine:
    """POST ``{url}/v1/chat/completions`` with ``stream: true``; text deltas, then the reply."""

    def __init__(self, url: str, model: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = timeout
        self._client = httpx.Client(base_url=self.url, headers=self._headers, timeout=timeout)

    def chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]], **sampling: Any
    ) -> Iterator[str | RemoteReply]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": list(messages),
            "stream": True,
            "stream_options": {"include_usage": True},
            **{key: value for key, value in sampling.items() if value is not None},
        }
        if tools:
            body |= {"tools": list(tools), "tool_choice": "auto"}
        reply = RemoteReply()
        fragments: dict[int, dict[str, str]] = {}
        try:
            with self._client.stream("POST", "/v1/chat/completions", json=body) as response:
                if not response.is_success:
                    status = response.status_code
                    raise RemoteEngineError(f"HTTP {status}: {_error_text(response.read())}", status)
                for data in _events(response.iter_lines()):
                    text = _absorb(reply, fragments, data)
                    if text:
                        yield text
        except httpx.HTTPError as error:
            raise RemoteEngineError(f"{self.url}: {error}") from error
        reply.calls = [_call(fragment) for _, fragment in sorted(fragments.items())]
        yield reply

    async def relay(self, body: bytes) -> tuple[int, str, AsyncIterator[bytes]]:
        """A client's chat completion sent on as it came: the engine's status, content type
        and body (a stream's events as they arrive), as an OpenAI-compatible gateway does."""
        client = httpx.AsyncClient(base_url=self.url, headers=self._headers, timeout=self._timeout)
        request = client.build_request("POST", "/v1/chat/completions", content=body)
        request.headers["content-type"] = "application/json"
        try:
            response = await client.send(request, stream=True)
        except httpx.HTTPError as error:
            await client.aclose()
            raise RemoteEngineError(f"{self.url}: {error}") from error

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()
                await client.aclose()

        return response.status_code, response.headers.get("content-type", "application/json"), chunks()

    def close(self) -> None:
        self._client.close()


def _events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            return
        data = json.loads(payload)
        if isinstance(data, dict) and "error" in data:  # an error reported mid-stream
            raise RemoteEngineError(_error_text(payload.encode()))
        yield data


def _absorb(reply: RemoteReply, fragments: dict[int, dict[str, str]], data: dict[str, Any]) -> str:
    """One chunk into ``reply``; its text delta, if any."""
    usage = data.get("usage") or {}
    if usage:
        reply.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        reply.completion_tokens = int(usage.get("completion_tokens") or 0)
        reply.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    text = ""
    for choice in data.get("choices") or []:
        delta = choice.get("delta") or {}
        text += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            fragment = fragments.setdefault(int(call.get("index", len(fragments))), {"name": "", "arguments": ""})
            function = call.get("function") or {}
            fragment["name"] += function.get("name") or ""
            fragment["arguments"] += function.get("arguments") or ""
        reply.finish_reason = choice.get("finish_reason") or reply.finish_reason
    reply.text += text
    return text


def _call(fragment: dict[str, str]) -> ToolCall:
    try:
        arguments = json.loads(fragment["arguments"] or "{}")
    except ValueError as error:
        raise RemoteEngineError(f"the engine's call to {fragment['name']!r} has arguments that are not JSON") from error
    return ToolCall(fragment["name"], arguments if isinstance(arguments, dict) else {})


def _error_text(body: bytes) -> str:
    """The engine's error message (OpenAI's ``{"error": {"message": ...}}``), else its body."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return body.decode(errors="replace")[:500]


def openai_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The loop's conversation in OpenAI's shape: calls with ids and JSON-string arguments,
    each ``tool`` result answering the call it follows."""
    converted: list[dict[str, Any]] = []
    pending: list[str] = []
    for message in messages:
        if message.get("role") == "assistant" and message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                call_id = f"call_{len(converted)}_{len(calls)}"
                function = call["function"]
                arguments = function["arguments"]
                text = arguments if isinstance(arguments, str) else json.dumps(arguments)
                calls.append(
                    {"id": call_id, "type": "function", "function": {"name": function["name"], "arguments": text}}
                )
            pending = [call["id"] for call in calls]
            converted.append({"role": "assistant", "content": message.get("content") or None, "tool_calls": calls})
        elif message.get("role") == "tool":
            converted.append({"role": "tool", "tool_call_id": pending.pop(0) if pending else "", **message})
        else:
            converted.append(dict(message))
    return converted


class RemoteAgentLoop(AgentLoop):
    """``AgentLoop`` whose steps are chat completions of a remote engine."""

    def __init__(self, engine: RemoteEngine, registry: Any, retriever: Any = None, **options: Any) -> None:
        super().__init__(None, _no_local_generation, registry, _no_grammar, retriever, call_format=HERMES, **options)
        self.engine = engine

    def events(self, question: str, options: RunOptions | None = None) -> Iterator[AgentEvent]:
        options = options or RunOptions()
        unsupported = _unsupported(options)
        if unsupported is not None:  # an error event, as the loop reports its failures: a 400 over HTTP
            yield ErrorEvent(RemoteOptionUnsupported(unsupported))
            return
        yield from super().events(question, options)

    def _deviate(self, run: RunState, step: int, tool_names: list[str], generated: Generated) -> Any:
        return None
        yield  # a generator, as AgentLoop._deviate

    def _generate_step(self, run: RunState, step: int, tool_names: list[str], ban: Any = None) -> Any:
        with run.trace.span("prompt_build") as span:
            parts = replace(self._parts(run, tool_names), answer_request=bool(run.executed) and not tool_names)
            messages = openai_messages(build_messages(parts))
            tools = [self.registry.get(name).openai_schema() for name in tool_names]
            span.set_attribute("messages", len(messages))
        options = run.options
        hold = (bool(tool_names) and bool(run.executed)) or options.grounding == "abstain"
        attributes = {"gen_ai.request.model": self.engine.model, "server.address": self.engine.url}
        with run.trace.span(f"chat {self.engine.model}", attributes) as chat:
            started = time.perf_counter()
            reply = RemoteReply()
            sampling = {"max_tokens": options.max_tokens, "temperature": options.temperature, "top_p": options.top_p}
            for item in self.engine.chat(messages, tools, seed=options.seed, **sampling):
                if isinstance(item, RemoteReply):
                    reply = item
                elif not hold:
                    yield TokenEvent(step, item)
            stats = GenerationStats(
                prompt_tokens=reply.prompt_tokens,
                cached_prompt_tokens=reply.cached_tokens,
                output_tokens=reply.completion_tokens,
                target_calls=1,
                finish_reason=reply.finish_reason,
                decode_s=time.perf_counter() - started,
            )
            record_chat(run.trace, chat, [], stats)
        run.stats.append(stats)
        text = reply.text
        if reply.calls:  # the loop reads calls from text, in the format it writes them back
            text = HERMES.syntax.separator.join(HERMES.render_call(call) for call in reply.calls)
        return Generated(text, stats, [], reply.prompt_tokens, None, None)


def _unsupported(options: RunOptions) -> str | None:
    if options.abstain_threshold is not None or options.measure_answerability:
        return "abstain_threshold"
    if options.grounding_judge:
        return "grounding_judge"
    return None


def _no_local_generation(request: Any) -> Iterator[Any]:
    raise RemoteOptionUnsupported("a local generation")


def _no_grammar(*_: Any) -> None:
    return None  # the engine constrains its own tool calls


@dataclass(frozen=True)
class RemoteModel:
    """What the HTTP layer asks of ``agent.model`` when the model is elsewhere."""

    name: str
    tokenizer: None = None
    config: Any = None


class RemoteAgent(AgentRuns):
    """``Agent``'s API (``run``, ``stream``, ``trace``) over a remote engine; ``api_key``
    defaults to ``$SPECRAG_ENGINE_API_KEY``.

    agent = RemoteAgent("http://gpu-box:8000", "Qwen/Qwen2.5-Coder-1.5B-Instruct", tools=[...], index=...)
    """

    def __init__(
        self,
        engine_url: str,
        model: str,
        tools: Sequence[Any] = (),
        index: Any = None,
        *,
        api_key: str | None = None,
        system: str | None = None,
        tracer: Any = None,
        search_tool: bool = True,
    ) -> None:
        from specrag.agent.tool_gate import ToolRelevance
        from specrag.agent.trace import Tracer, TraceStore
        from specrag.agent.trace_otel import export_from_env
        from specrag.retrieval.embed import Embedder
        from specrag.tools import ToolRegistry, search_documents_tool

        self.model = RemoteModel(model)
        key = api_key if api_key is not None else os.environ.get("SPECRAG_ENGINE_API_KEY") or None
        self.engine = RemoteEngine(engine_url, model, api_key=key)
        self.retriever = open_index(index)
        self.registry = ToolRegistry(tools)
        if self.retriever is not None and search_tool and "search_documents" not in self.registry:
            self.registry.register(search_documents_tool(self.retriever))
        self.tracer = tracer or Tracer(store=TraceStore(export=export_from_env()))
        self.worker = None
        embedder = self.retriever.embedder if self.retriever is not None else Embedder()
        self.loop = RemoteAgentLoop(
            self.engine,
            self.registry,
            self.retriever,
            model_name=model,
            system=system,
            tracer=self.tracer,
            relevance=ToolRelevance(embedder),
        )

    def generate(self, request: Any) -> Iterator[Any]:
        raise RemoteOptionUnsupported("token-level generation")

    def close(self) -> None:
        self.engine.close()
