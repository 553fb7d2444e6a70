"""Request bodies of the HTTP API as msgspec Structs: litestar validates them and the
OpenAPI schema at ``/schema/openapi.json`` is generated from them.

Static bounds (types, ranges that never change) live here, so a bad value is refused with
the field named before a handler runs. Limits that depend on the server's configuration
(``max_tokens``, ``max_steps``, prompt length) are checked by the handlers.

``AgentRunRequest`` refuses unknown fields (a typo should not be silently ignored);
``ChatCompletionRequest`` accepts and ignores fields it does not implement
(``user``, ``logprobs``...), as OpenAI clients send them freely.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

Speculation = Literal["auto", "on", "off"]
MaxTokens = Annotated[int, msgspec.Meta(ge=1, description="tokens to generate at most (server limit applies)")]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Seed = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]  # OpenAI's range
RepetitionPenalty = Annotated[
    float, msgspec.Meta(gt=0.0, le=2.0, description="vLLM's: seen tokens' logits divided (>0) or multiplied (<0)")
]
ShortText = Annotated[str, msgspec.Meta(min_length=1)]


class AgentRunRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /v1/agent/runs``: one question answered by the agent loop with citations."""

    question: Annotated[str, msgspec.Meta(min_length=1, description="the user's question")]
    stream: bool = False
    max_steps: Annotated[int, msgspec.Meta(ge=1, description="loop steps at most (server limit applies)")] | None = None
    tools: list[ShortText] | None = None  # names of registered tools the model may call; None: every one
    speculation: Speculation = "auto"
    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    seed: Seed | None = None
    max_tokens: MaxTokens | None = None
    k: Annotated[int, msgspec.Meta(ge=1, le=20, description="passages shown in the prompt")] = 5
    abstain_threshold: (
        Annotated[
            float,
            msgspec.Meta(
                ge=0.0,
                le=1.0,
                description="reply 'The documents do not say.' when the answerability probe's P(no) reaches this",
            ),
        ]
        | None
    ) = None
    # false: the irrelevance gate (agent/tool_gate.py) never holds the first step to text
    tool_gate: bool = True
    # "attribute": each answer sentence re-cites the shown passage closest in meaning (agent/attribution.py)
    citations: Literal["model", "attribute"] = "attribute"
    # the answer checked against the passages (agent/grounding/check.py): "mark" records
    # grounded or not, "abstain" replies 'The documents do not say.' when it is not
    grounding: Literal["off", "mark", "abstain"] = "mark"
    min_supported: (
        Annotated[float, msgspec.Meta(ge=0.0, le=1.0, description="share of claims the passages must support")] | None
    ) = None
    grounding_judge: bool = False  # the model also judges each claim the rules let through
    citation_min_similarity: (
        Annotated[float, msgspec.Meta(ge=0.0, le=1.0, description="cosine a sentence needs to cite a passage")] | None
    ) = None
    # The end user, as OpenAI's ``user``: the run's decoding may draft from that user's
    # earlier answers (agent runs and chat completions alike), and from no one else's.
    user: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str = "{}"  # a JSON document, as OpenAI sends it


class ToolCallItem(msgspec.Struct, kw_only=True):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")]
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(msgspec.Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaSpec(msgspec.Struct, kw_only=True):
    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class ChatCompletionRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/chat/completions``: the OpenAI request, plus ``speculation``."""

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    model: str | None = None  # accepted and ignored: the server serves the one model it loaded
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    # A vLLM extension of the OpenAI request. None: 1.0, except for a json_schema response
    # format with no penalty set (agent/openai_compat.py: STRUCTURED_REPETITION_PENALTY).
    repetition_penalty: RepetitionPenalty | None = None
    n: int = 1
    speculation: Speculation = "auto"
    # Most nodes of a draft tree (chain included; docs/design/trees.md); 0: chains only;
    # None: the server's policy.
    draft_tree_nodes: Annotated[int, msgspec.Meta(ge=0, le=64)] | None = None
    # OpenAI's end-user id. specrag also scopes drafting from earlier outputs by it: a
    # request that names a user may copy that user's earlier answers, and no one else's.
    user: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None


class ServerLimits(msgspec.Struct, frozen=True, kw_only=True):
    """The server's configurable bounds on a request (checked by the handlers)."""

    max_prompt_tokens: int
    max_tokens_limit: int = 2048
    max_steps_limit: int = 8
    default_max_tokens: int = 256
    max_stop_sequences: int = 8


class ErrorDetail(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: str
    message: str
    field: str | None = None  # the request field at fault, as a path: messages[0].role
    code: str | None = None  # e.g. context_length_exceeded


class ErrorResponse(msgspec.Struct, kw_only=True):
    """Every error the server returns (documented in the OpenAPI schema for each route)."""

    error: ErrorDetail


def user_tenant(user: str | None) -> str | None:
    """The drafting tenant (``GenerationRequest.tenant``) of an API request's ``user``:
    one per end user, shared by their agent runs and chat completions."""
    return f"user:{user}" if user is not None else None
