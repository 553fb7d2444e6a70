"""``POST /v1/chat/completions``: OpenAI's chat API over the engine worker.

``plan_chat`` turns a request into token ids and a ``GenerationRequest`` (or an ``ApiError``
naming the field): the model's chat template over the messages, with the tool schemas
rendered into the system message exactly as the agent's prompt does (``agent/prompt.py``)
and earlier assistant tool calls written back in the project's call format
``{"name": ..., "arguments": {...}}`` (``tools/calls.py``). The output is constrained by a
grammar: tools with ``tool_choice`` auto (a call or text), required (a call), a named
function (a call to it), none (no tools); ``response_format`` json_object / json_schema.
Tools and a JSON ``response_format`` together are refused: one grammar cannot be both.
A response that claims completion (``finish_reason`` stop or tool_calls) is validated
against the caller's schema before it is returned (``tools/schema_check.py``): a failure
is a bug on the constrained path, answered 500 (or an ``error`` event in a stream) and
logged with the schema and the text, never returned as a valid answer.

``ChatRun`` runs the request through ``agent.generate`` (the worker) and yields text pieces.
Stop strings (``stop``) are matched in the decoded text, which is exact whatever the
tokenization: the text is cut before the first match, text that could still become a stop
string is held back from the stream, and the sequence is cancelled at once. Each stop is
also given to the engine as token ids (as written alone and after a space), so that the
common case ends inside the engine with its full statistics; when only the text matched,
``usage`` counts the tokens received and ``cached_tokens`` is 0 (the engine's stats of a
cancelled sequence are not reported).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from specrag.agent.api_models import ChatCompletionRequest, ServerLimits, ToolDefinition, user_tenant
from specrag.agent.errors import ApiError, invalid, logger
from specrag.agent.metrics import ServerMetrics
from specrag.agent.prompt import PromptParts, encode_messages, system_message
from specrag.agent.results import speculation_summary
from specrag.agent.stream import IncrementalDecoder
from specrag.decoding.grammar import Grammar
from specrag.decoding.grammar_compile import UnsupportedSchemaError, enforceable_schema
from specrag.decoding.penalties import Penalties, PenaltyProcessor
from specrag.decoding.request import GenerationRequest
from specrag.decoding.sampling import SamplingParams
from specrag.decoding.stats import GenerationStats
from specrag.tools import ToolCall
from specrag.tools.formats import BARE_JSON, CallFormat
from specrag.tools.schema_check import SchemaViolation, validate_json_text, validate_value

DEFAULT_TOOL_SYSTEM = "You are a helpful assistant."
_CALL_OPENINGS = "{<`"  # the first character of a bare, tagged or fenced call
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass
class ChatPlan:
    body: ChatCompletionRequest
    prompt: list[int]
    request: GenerationRequest
    tool_names: list[str]  # tools the output may call (empty: plain text or JSON)
    stops: list[str]
    response_schema: dict[str, Any] | None = None  # what a finished text answer must validate against
    tool_parameters: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> parameters schema
    call_format: CallFormat = BARE_JSON  # how the model writes calls (its chat template's format)
    completion_id: str = field(default_factory=lambda: f"chatcmpl-{secrets.token_hex(12)}")
    created: int = field(default_factory=lambda: int(time.time()))


def plan_chat(agent: Any, body: ChatCompletionRequest, limits: ServerLimits) -> ChatPlan:
    """Validate the request against the server's limits and build its prompt and grammar."""
    if body.n != 1:
        raise invalid("n", "only n=1 is supported")
    max_tokens_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = (
        body.max_completion_tokens or body.max_tokens or min(limits.default_max_tokens, limits.max_tokens_limit)
    )
    if max_tokens > limits.max_tokens_limit:
        raise invalid(max_tokens_field, f"{max_tokens_field} must be at most {limits.max_tokens_limit}")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    stops = [stop for stop in stops if stop]
    if len(stops) > limits.max_stop_sequences:
        raise invalid("stop", f"at most {limits.max_stop_sequences} stop sequences")
    tools = _active_tools(body)
    tool_schemas = [_openai_tool(tool) for tool in tools]
    call_format = getattr(agent, "call_format", BARE_JSON)
    grammar, tool_names = _grammar(agent.model.grammar_compiler, body, tools, call_format)
    tokenizer = agent.model.tokenizer
    try:
        messages = chat_messages(body, tool_schemas, call_format)
        template_tools = tool_schemas if call_format.native and tool_schemas else None
        prompt = encode_messages(tokenizer, messages, tools=template_tools)
    except ApiError:
        raise
    except Exception as error:  # a template that refuses the conversation, text that cannot be encoded
        raise invalid("messages", f"the messages cannot be rendered by the chat template: {error}") from None
    if len(prompt) > limits.max_prompt_tokens:
        raise invalid(
            "messages",
            f"the prompt has {len(prompt)} tokens; the limit is {limits.max_prompt_tokens}",
            code="context_length_exceeded",
        )
    request = GenerationRequest(
        prompt,
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=body.temperature, top_p=body.top_p, seed=body.seed),
        speculation=body.speculation,
        stop_sequences=_stop_token_sequences(tokenizer, stops),
        logits_processors=_penalty_processors(body, len(prompt)),
        grammar=grammar,
        tenant=user_tenant(body.user),
        tree_nodes=body.draft_tree_nodes,
    )
    kv = getattr(getattr(agent, "engine", None), "kv", None)
    try:
        if kv is not None:
            kv.check_fits(request)  # a request the KV pool could never hold waits forever otherwise
    except ValueError as error:
        raise invalid("max_tokens", str(error), code="context_length_exceeded") from None
    parameters = {tool.function.name: tool.function.parameters or EMPTY_PARAMETERS for tool in tools}
    response_schema = _response_schema(body, tools)
    return ChatPlan(body, prompt, request, tool_names, stops, response_schema, parameters, call_format)


# The repetition penalty of a json_schema request that sets no penalty. Greedy decoding
# under a schema grammar loops on small models: qwen2.5-coder-0.5b on 120 SchemaStore
# schemas ended 31 of the 108 it could compile at max_tokens 512, every one a degenerate
# repeat ("image", "video", ... or .gz.gz.gz), and 1.1 cut that to 8 (valid 71% -> 93% of the
# compiled; `python -m specrag.evals.studies.schema_corpus`, docs/constrained-decoding.md). A vLLM-based batch API
# (Sutro) sets a repetition penalty for json-schema requests by default for the same reason. Any penalty
# field in the request, 1.0 included, is used as given.
STRUCTURED_REPETITION_PENALTY = 1.1


def repetition_penalty_for(body: ChatCompletionRequest) -> float:
    """The request's repetition_penalty, or the structured-output default where it set none."""
    if body.repetition_penalty is not None:
        return body.repetition_penalty
    response_format = body.response_format
    structured = response_format is not None and response_format.type == "json_schema" and not body.tools
    unpenalised = body.frequency_penalty == 0.0 and body.presence_penalty == 0.0
    return STRUCTURED_REPETITION_PENALTY if structured and unpenalised else 1.0


def _penalty_processors(body: ChatCompletionRequest, prompt_length: int) -> list[PenaltyProcessor]:
    penalties = Penalties(body.frequency_penalty, body.presence_penalty, repetition_penalty_for(body))
    return [PenaltyProcessor(penalties, prompt_length)] if penalties.active else []


def _response_schema(body: ChatCompletionRequest, tools: list[ToolDefinition]) -> dict[str, Any] | None:
    response_format = body.response_format
    if tools or response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"type": "object"}
    assert response_format.json_schema is not None and response_format.json_schema.schema is not None
    return response_format.json_schema.schema


def _active_tools(body: ChatCompletionRequest) -> list[ToolDefinition]:
    tools = body.tools or []
    names = [tool.function.name for tool in tools]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise invalid(f"tools[{index}].function.name", f"tool {name!r} is defined twice")
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return []
    if not tools:
        raise invalid("tool_choice", "tool_choice needs tools")
    if not isinstance(choice, str) and choice.function.name not in names:
        raise invalid("tool_choice", f"unknown tool {choice.function.name!r}; known tools: {', '.join(names)}")
    if body.response_format is not None and body.response_format.type != "text":
        raise invalid("response_format", "response_format cannot be combined with tools (use tool_choice none)")
    for index, tool in enumerate(tools):
        try:
            enforceable_schema(tool.function.parameters or EMPTY_PARAMETERS)
        except UnsupportedSchemaError as error:
            raise invalid(f"tools[{index}].function.parameters", str(error)) from None
        except (TypeError, AttributeError, ValueError):
            raise invalid(f"tools[{index}].function.parameters", "not a valid JSON schema") from None
    return tools


def _openai_tool(tool: ToolDefinition) -> dict[str, Any]:
    function = tool.function
    parameters = function.parameters or EMPTY_PARAMETERS
    return {
        "type": "function",
        "function": {"name": function.name, "description": function.description, "parameters": parameters},
    }


def _grammar(
    compiler: Any, body: ChatCompletionRequest, tools: list[ToolDefinition], call_format: CallFormat
) -> tuple[Grammar | None, list[str]]:
    if tools:
        choice = body.tool_choice
        chosen = [
            tool for tool in tools if isinstance(choice, str | None) or tool.function.name == choice.function.name
        ]
        specs = [(tool.function.name, tool.function.parameters or EMPTY_PARAMETERS) for tool in chosen]
        try:
            grammar = compiler.tool_calls(specs, allow_text=choice in (None, "auto"), syntax=call_format.syntax)
        except (UnsupportedSchemaError, TypeError, AttributeError, ValueError) as error:
            raise invalid("tools", f"the tool schemas cannot be compiled: {error}") from None
        return grammar, [name for name, _ in specs]
    response_format = body.response_format
    if response_format is None or response_format.type == "text":
        return None, []
    if response_format.type == "json_object":
        return compiler.json_object(), []
    spec = response_format.json_schema
    if spec is None or spec.schema is None:
        raise invalid("response_format.json_schema.schema", "json_schema needs a schema")
    try:
        return compiler.json_schema(spec.schema), []
    except UnsupportedSchemaError as error:
        raise invalid("response_format.json_schema.schema", str(error)) from None
    except (TypeError, AttributeError, ValueError) as error:  # not a JSON schema at all
        raise invalid("response_format.json_schema.schema", f"not a valid JSON schema: {error}") from None


def chat_messages(
    body: ChatCompletionRequest, tool_schemas: Sequence[dict[str, Any]], call_format: CallFormat = BARE_JSON
) -> list[dict[str, Any]]:
    """The conversation as chat-template messages. Native format: earlier calls stay in
    ``tool_calls`` and the template renders them and the tools; otherwise calls are written
    back as the model's JSON and the tools are described in the system message."""
    messages: list[dict[str, Any]] = []
    for index, message in enumerate(body.messages):
        role = "system" if message.role == "developer" else message.role
        content = _text(message.content, f"messages[{index}].content")
        if role == "assistant" and message.tool_calls:
            calls = [
                ToolCall(call.function.name, _arguments(call.function.arguments, index, j))
                for j, call in enumerate(message.tool_calls)
            ]
            if call_format.native:
                messages.append({**call_format.assistant_message(content, calls), "content": content})
                continue
            content = "\n".join(
                [content, *(call_format.render_call(call) for call in calls)]
                if content
                else [call_format.render_call(call) for call in calls]
            )
        messages.append({"role": role, "content": content})
    if tool_schemas and not call_format.native:
        if messages[0]["role"] == "system":
            messages[0]["content"] = system_message(
                PromptParts("", messages[0]["content"], tool_schemas, call_format=call_format)
            )
        else:
            parts = PromptParts("", DEFAULT_TOOL_SYSTEM, tool_schemas, call_format=call_format)
            messages.insert(0, {"role": "system", "content": system_message(parts)})
    elif tool_schemas and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": DEFAULT_TOOL_SYSTEM})
    return messages


def _text(content: Any, field_name: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for index, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise invalid(f"{field_name}[{index}]", f"content parts of type {part.type!r} are not supported")
        parts.append(part.text)
    return "".join(parts)


def _arguments(arguments: str, message: int, call: int) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError as error:
        raise invalid(f"messages[{message}].tool_calls[{call}].function.arguments", f"not JSON: {error.msg}") from None


def _stop_token_sequences(tokenizer: Any, stops: Sequence[str]) -> list[list[int]]:
    sequences: list[list[int]] = []
    for stop in stops:
        for spelling in (stop, f" {stop}"):
            ids = list(tokenizer.encode(spelling, add_special_tokens=False))
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


class StopMatcher:
    """Finds the first stop string in a growing text; says how much text is safe to emit."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.hold = max((len(stop) for stop in self.stops), default=1) - 1

    def find(self, text: str, start: int) -> int | None:
        hits = [index for stop in self.stops if (index := text.find(stop, max(0, start - self.hold))) >= 0]
        return min(hits) if hits else None


class ChatRun:
    """One chat generation through the worker: text pieces out, stop strings cut, usage kept."""

    def __init__(self, agent: Any, plan: ChatPlan, metrics: ServerMetrics, received_s: float) -> None:
        self.agent = agent
        self.plan = plan
        self.metrics = metrics
        self.received_s = received_s
        self.text = ""
        self.finish_reason = "stop"
        self.completion_tokens = 0
        self.stats: GenerationStats | None = None

    def pieces(self) -> Iterator[str]:
        """One (possibly empty) piece per engine event; the first arrives after prefill.

        Leaving early (a disconnected client) closes the worker's iterator, which cancels
        the sequence and frees its KV.
        """
        decoder = IncrementalDecoder(self.agent.model.tokenizer)
        matcher = StopMatcher(self.plan.stops)
        emitted = 0
        submitted_ns = time.monotonic_ns()
        last_s: float | None = None
        events = self.agent.generate(self.plan.request)
        try:
            for event in events:
                now = time.perf_counter()
                if last_s is None:
                    self.metrics.ttft.labels("chat").observe(now - self.received_s)
                    if event.cycle is not None:
                        self.metrics.queue_time.observe(max(0, event.cycle.start_ns - submitted_ns) / 1e9)
                elif event.token_ids:
                    for _ in event.token_ids:
                        self.metrics.itl.observe((now - last_s) / len(event.token_ids))
                last_s = now
                self.completion_tokens += len(event.token_ids)
                decoder.push(event.token_ids)
                text = decoder.finish() if event.finished else decoder.text
                cut = matcher.find(text, emitted) if self.plan.stops else None
                if cut is not None:
                    self.text, self.finish_reason, self.stats = text[:cut], "stop", event.stats
                    yield text[emitted:cut]
                    return
                safe = len(text) if event.finished else max(emitted, len(text) - matcher.hold)
                piece, emitted = text[emitted:safe], safe
                if event.finished:
                    self.text, self.stats = text, event.stats
                    self.finish_reason = "length" if event.finish_reason == "length" else "stop"
                yield piece
        finally:
            events.close()
            if self.stats is not None:
                self.metrics.observe_stats(self.stats)

    def message(self) -> tuple[dict[str, Any], str]:
        """The assistant message and finish reason, once the pieces are exhausted; an answer
        that claims completion is validated against its schema first."""
        calls = self._calls()
        if calls:
            for call in calls:
                parameters = self.plan.tool_parameters[call.name]
                self._validated(lambda call=call, parameters=parameters: validate_value(call.arguments, parameters))
            tool_calls = [
                {
                    "id": f"call_{secrets.token_hex(12)}",
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
                }
                for call in calls
            ]
            return {"role": "assistant", "content": None, "tool_calls": tool_calls}, "tool_calls"
        schema = self.plan.response_schema
        if schema is not None and self.finish_reason == "stop":
            self._validated(lambda: validate_json_text(self.text, schema))
        return {"role": "assistant", "content": self.text}, self.finish_reason

    def _calls(self) -> list[ToolCall]:
        if not self.plan.tool_names:
            return []
        try:
            calls = self.plan.call_format.parse(self.text) or []
        except ValueError:
            return []  # cut short by max_tokens or a stop: it stays text
        return calls if all(call.name in self.plan.tool_names for call in calls) else []

    def _validated(self, check: Any) -> None:
        try:
            check()
        except SchemaViolation as violation:
            logger.error(
                "BUG: a constrained answer failed validation against its schema: %s\nschema: %s\nanswer: %r",
                violation,
                json.dumps(self.plan.response_schema or self.plan.tool_parameters),
                self.text,
            )
            raise ApiError(
                500, f"the answer failed validation against its schema: {violation}", type="internal_error"
            ) from None

    def usage(self) -> dict[str, Any]:
        prompt_tokens = len(self.plan.prompt)
        completion = self.stats.output_tokens if self.stats is not None else self.completion_tokens
        cached = self.stats.cached_prompt_tokens if self.stats is not None else 0
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _envelope(self, kind: str) -> dict[str, Any]:
        return {
            "id": self.plan.completion_id,
            "object": kind,
            "created": self.plan.created,
            "model": self.agent.model.name,
            "system_fingerprint": None,
        }

    def completion(self) -> dict[str, Any]:
        """Run to the end; the ``chat.completion`` object (plus the ``speculation`` extension)."""
        for _ in self.pieces():
            pass
        message, finish_reason = self.message()
        return {
            **self._envelope("chat.completion"),
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
            "usage": self.usage(),
            "speculation": speculation_summary([self.stats]) if self.stats is not None else None,
        }

    def chunks(self) -> Iterator[dict[str, Any]]:
        """``chat.completion.chunk`` objects; the first is yielded after the first engine event.

        With tools, text is streamed once it is known not to be a call (it does not open a
        JSON object, a tag or a fence); calls are sent whole in one ``tool_calls`` delta.
        """
        deciding = bool(self.plan.tool_names)
        held = ""
        first = True
        for piece in self.pieces():
            if first:
                yield self._chunk({"role": "assistant", "content": ""})
                first = False
            text = piece
            if deciding:
                held += piece
                if not held.strip() or held.lstrip()[0] in _CALL_OPENINGS:
                    continue
                deciding, text, held = False, held, ""
            if text:
                yield self._chunk({"content": text})
        message, finish_reason = self.message()
        if message.get("tool_calls"):
            calls = [{"index": index, **call} for index, call in enumerate(message["tool_calls"])]
            yield self._chunk({"tool_calls": calls})
        elif held:
            yield self._chunk({"content": held})
        yield self._chunk({}, finish_reason)
        if self.plan.body.stream_options is not None and self.plan.body.stream_options.include_usage:
            yield {**self._envelope("chat.completion.chunk"), "choices": [], "usage": self.usage()}

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return {**self._envelope("chat.completion.chunk"), "choices": [choice]}
