"""The agent's prompt, laid out so that what changes least comes first.

The order is the prefix cache's (``decoding/prefix_cache.py``) best case: the system prompt
and the tool schemas (the same for every run of a server), then the earlier turns of the
conversation verbatim (a follow-up turn extends the cached conversation), then the new
user message with the retrieved passages before the question (the same passages give the
same tokens up to the question, so a repeated retrieval hits up to there). Tool schemas
are serialised with sorted keys and fixed separators and the passages keep the
retriever's deterministic order, so identical inputs give identical token ids: a
follow-up turn or a repeated retrieval re-prefills only what is new.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from specrag.tools.builtin import format_passage
from specrag.tools.formats import BARE_JSON, CallFormat

DEFAULT_SYSTEM = (
    "You are a precise assistant. Answer from the passages only and cite each passage you use as [P1], [P2]. "
    "If the passages do not contain the answer, say that it is not in the documents."
)
# Opt-in (Agent(system=CITING_SYSTEM), eval --system citing). Under DEFAULT_SYSTEM
# qwen2.5-coder-1.5b cited 8 times in 20 answers and 0.5b once in 71. With this prompt's
# example answer 1.5B put a [Pn] in 22 of 43 non-refusing answers over the 71 eval questions,
# but only 9 of the 18 scored citations supported their sentence; on 0.5B it cost
# groundedness (0.711 -> 0.597) and both models once answered with the example itself
# (docs/reports/groundedness_qwen1.5b, groundedness_qwen0.5b_citing). So it is not the default.
CITING_SYSTEM = (
    "You are a precise assistant. Answer from the passages only. After each sentence, cite the passage it comes "
    "from, like [P2]. If the passages do not contain the answer, say that it is not in the documents.\n\n"
    "Example answer: The pass statement does nothing when it is executed [P2]. It is useful as a placeholder "
    "where a statement is required syntactically [P2]."
)
SYSTEM_PROMPTS = {"default": DEFAULT_SYSTEM, "citing": CITING_SYSTEM}
# The default system prompt follows what a step offers. DEFAULT_SYSTEM told the model to say
# "not in the documents" even when a tool could answer (qwen2.5-coder-1.5b did, on a
# temperature question with a conversion tool offered).
TOOLS_SYSTEM = (
    "You are a helpful assistant. When a tool can compute or look up what the question asks, call it, "
    "then answer in plain text using its result. Answer directly when no tool fits the question."
)
PASSAGES_AND_TOOLS_SYSTEM = (
    "You are a precise assistant. Answer from the passages and from the results of the tools, and cite each "
    "passage you use as [P1], [P2]. When a tool can compute or look up what the question asks, call it, then "
    "answer in plain text using its result. If neither the passages nor a tool can answer, say that it is not "
    "in the documents."
)


# Asked, as a user turn after the tool results, when a step may only answer (the last step,
# or after the model repeated a call), as smolagents asks for a final answer at its step
# limit. Measured on qwen2.5-coder-0.5b (tool-use eval, dev half): held to text with no
# request, it wrote its call again in a code fence; told so inside the tool result, it
# copied the note as its answer.
ANSWER_REQUEST = "Using the tool results above, answer in plain text: {question}"


# Neither passages nor tools: a run without an index whose tools the irrelevance gate held back.
PLAIN_SYSTEM = "You are a helpful assistant. Answer the question directly and briefly."


def default_system(has_passages: bool, has_tools: bool) -> str:
    """The system prompt for what the run offers: passages, tools, both, or neither."""
    if has_tools:
        return PASSAGES_AND_TOOLS_SYSTEM if has_passages else TOOLS_SYSTEM
    return DEFAULT_SYSTEM if has_passages else PLAIN_SYSTEM


class PassageLike(Protocol):
    id: str
    source: str
    text: str


@dataclass(frozen=True)
class PromptParts:
    question: str
    system: str | None = None  # None: default_system() for what is offered
    tool_schemas: Sequence[dict[str, Any]] = ()
    passages: Sequence[PassageLike] = ()
    history: Sequence[dict[str, Any]] = field(default_factory=tuple)  # earlier turns, oldest first
    steps: Sequence[dict[str, Any]] = field(default_factory=tuple)  # this turn's tool calls and results
    call_format: CallFormat = BARE_JSON  # HERMES: the chat template renders the tools itself
    answer_request: bool = False  # end with ANSWER_REQUEST: the step may only answer
    tools_offered: bool = False  # the run offers tools, shown or not (an answer step shows none)

    @property
    def system_text(self) -> str:
        if self.system is not None:
            return self.system
        return default_system(bool(self.passages), bool(self.tool_schemas) or self.tools_offered)

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The schemas for ``apply_chat_template(tools=...)`` when the template renders them."""
        return list(self.tool_schemas) if self.call_format.native and self.tool_schemas else None


def passage_label(index: int) -> str:
    """The marker the model cites: [P1] for the first passage shown."""
    return f"P{index + 1}"


def system_message(parts: PromptParts) -> str:
    """The system prompt; with a template that knows nothing of tools, then how to call a
    tool and one line per tool (a native template renders the tools itself).

    Tools are shown as signatures, not raw JSON schemas: small models shown a schema tend to
    copy it back instead of answering. The grammar enforces the full schema anyway.
    """
    if not parts.tool_schemas or parts.call_format.native:
        return parts.system_text
    tools = "\n".join(tool_line(schema) for schema in parts.tool_schemas)
    syntax = parts.call_format.syntax
    call = f'{syntax.open}{{"name": "<tool>", "arguments": {{...}}}}{syntax.close}'
    how = (
        f"When you need a tool, reply with only a JSON object {call} and nothing else."
        if not syntax.open
        else f"When you need a tool, reply with only {call}, one per call, and nothing else."
    )
    return f"{parts.system_text}\n\n{how} Otherwise answer in plain text.\nTools:\n{tools}"


def tool_line(schema: dict[str, Any]) -> str:
    """``- name(arg: type = default, ...): description`` from an OpenAI-style function schema."""
    function = schema.get("function", schema)
    properties = function.get("parameters", {}).get("properties", {})
    required = set(function.get("parameters", {}).get("required", []))
    arguments = []
    for name, spec in properties.items():
        kind = spec.get("type") or ("|".join(map(str, spec["enum"])) if "enum" in spec else "value")
        default = "" if name in required or "default" not in spec else f" = {json.dumps(spec['default'])}"
        arguments.append(f"{name}: {kind}{default}")
    description = " ".join(str(function.get("description", "")).split())
    return f"- {function['name']}({', '.join(arguments)}): {description}".rstrip(": ")


def passages_message(passages: Sequence[PassageLike]) -> str:
    shown = "\n\n".join(
        format_passage(passage_label(index), passage.source, passage.text) for index, passage in enumerate(passages)
    )
    return f"Passages:\n{shown}"


def user_message(parts: PromptParts) -> str:
    if not parts.passages:
        return parts.question
    return f"{passages_message(parts.passages)}\n\nQuestion: {parts.question}"


def build_messages(parts: PromptParts) -> list[dict[str, Any]]:
    """Chat messages in stable-first order: system + tools, history, passages + question, then
    this turn's steps (each step's prompt extends the previous one, so it hits the cache),
    then the request for an answer when the step may no longer call tools."""
    return [
        {"role": "system", "content": system_message(parts)},
        *parts.history,
        {"role": "user", "content": user_message(parts)},
        *parts.steps,
        *(
            [{"role": "user", "content": ANSWER_REQUEST.format(question=parts.question)}]
            if parts.answer_request
            else []
        ),
    ]


def prompt_ids(tokenizer: Any, parts: PromptParts) -> list[int]:
    """The step's prompt: the messages through the chat template, tools rendered by it when native."""
    return encode_messages(tokenizer, build_messages(parts), tools=parts.template_tools)


def encode_messages(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """Token ids of the chat template with the generation prompt appended."""
    extra = {"tools": tools} if tools else {}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
