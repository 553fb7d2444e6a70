"""How a model is shown tools and writes calls: its chat template's own format, or a fallback.

``HERMES``: the format Qwen's (and Hermes') chat templates render with
``apply_chat_template(messages, tools=...)``: the tool schemas inside ``<tools>`` in the
system message, each call as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
(several in one turn, one per line), the assistant turn carried in ``tool_calls`` and each
result as a ``tool`` message. That is the format those models were trained on, and the one
vLLM's ``hermes`` parser serves. ``BARE_JSON``: for templates that know nothing of tools
(smollm2), one call as the bare JSON object, described in the system prompt. A format is
text only: the grammar for it comes from ``GrammarCompiler.tool_calls(..., syntax=...)``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specrag.decoding.grammar_compile import BARE_CALLS, CallSyntax
from specrag.tools.calls import ToolCall, parse_tool_call

MAX_PARALLEL_CALLS = 4  # calls a tagged format may write in one turn


@dataclass(frozen=True)
class CallFormat:
    name: str
    syntax: CallSyntax
    native: bool  # the chat template renders tools, calls and results itself

    def parse(self, text: str) -> list[ToolCall] | None:
        """The calls in ``text``, or None when it is a text answer. ValueError when it
        started a call that never finished (cut by max_tokens or a stop)."""
        stripped = text.strip()
        if self.syntax.lenient and stripped.startswith("```"):  # a fenced call (CallSyntax)
            if '"arguments' not in stripped:
                # The grammar's text branch admits any fence without that key (qwen2.5-coder-1.5b
                # wrote a function's JSON schema as its answer); only its call branch has it.
                return None
            stripped = stripped.removeprefix("```json").removeprefix("```").removesuffix("```").strip()
            if not stripped.startswith("{"):
                raise ValueError("a fenced tool call must hold a JSON object")
        if not self.syntax.open or stripped.startswith("{"):  # a bare call is read in either format
            call = parse_tool_call(stripped)
            return None if call is None else [call]
        if not stripped.startswith(self.syntax.open.strip()):
            return None
        calls = []
        for body in _blocks(stripped, self.syntax):
            call = parse_tool_call(body)
            if call is None:
                raise ValueError("a tool call must be a JSON object")
            calls.append(call)
        return calls

    def assistant_message(self, text: str, calls: Sequence[ToolCall]) -> dict[str, Any]:
        """The assistant turn that made ``calls``, as the chat template wants it back."""
        if not self.native:
            return {"role": "assistant", "content": text.strip()}
        tool_calls = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return {"role": "assistant", "content": "", "tool_calls": tool_calls}

    def render_call(self, call: ToolCall) -> str:
        """One call as the model writes it (OpenAI-compatible history, docs)."""
        body = json.dumps({"name": call.name, "arguments": call.arguments})
        return f"{self.syntax.open}{body}{self.syntax.close}"


HERMES = CallFormat("hermes", CallSyntax("<tool_call>\n", "\n</tool_call>", "\n", MAX_PARALLEL_CALLS), native=True)
BARE_JSON = CallFormat("bare_json", BARE_CALLS, native=False)
# Hermes' tags for a template that knows nothing of tools: the tools and the tags are
# described in the system prompt instead. A candidate fallback beside BARE_JSON.
TAGGED_JSON = CallFormat(
    "tagged_json", CallSyntax("<tool_call>", "</tool_call>", "\n", MAX_PARALLEL_CALLS), native=False
)
FORMATS = {fmt.name: fmt for fmt in (HERMES, BARE_JSON, TAGGED_JSON)}


def _blocks(text: str, syntax: CallSyntax) -> list[str]:
    opening, closing = syntax.open.strip(), syntax.close.strip()
    pattern = re.compile(re.escape(opening) + r"(.*?)" + re.escape(closing), re.DOTALL)
    bodies = [match.group(1) for match in pattern.finditer(text)]
    rest = pattern.sub("", text).strip()
    if not bodies or rest:
        raise ValueError(f"incomplete tool call: every {opening} needs its {closing}")
    return bodies


def format_for(tokenizer: Any) -> CallFormat:
    """HERMES where the chat template renders tools with ``<tool_call>`` tags, else BARE_JSON."""
    probe_tool = {"type": "function", "function": {"name": "probe", "parameters": {"type": "object"}}}
    try:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tools=[probe_tool], add_generation_prompt=True, tokenize=False
        )
    except Exception:  # a template without tool support may refuse the argument
        return BARE_JSON
    return HERMES if isinstance(rendered, str) and "<tool_call>" in rendered and '"probe"' in rendered else BARE_JSON
