"""Compiling constraints to xgrammar grammars, once per schema (cached by canonical JSON).

Three shapes: an arbitrary JSON schema (``response_format: json_schema``), any JSON
object (``json_object``), and a tool choice: one call ``{"name": ..., "arguments": ...}``
to one of several tools, optionally or-else free text (the final answer). Tool calls use
``json.dumps`` separators (``", "`` and ``": "``) and no free whitespace, which is how
chat models write JSON and keeps the grammar's forced continuations long.

Every schema is first rewritten by ``decoding/schema_normalize.py`` (siblings of anyOf
distributed, allOf merged, local refs resolved, oneOf and if/then/else translated where
exact), because xgrammar 0.2.9 silently drops those shapes. JSON-schema keywords that
xgrammar parses but does not enforce (measured: a violating document is accepted) are
refused with an error naming the keyword and where it is, rather than silently producing
output that fails validation.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from decoding.grammar import Grammar
from decoding.schema_merge import UnsupportedSchemaError
from decoding.schema_support import check_schema, enforceable_schema

__all__ = [
    "BARE_CALLS",
    "CallSyntax",
    "GrammarCompiler",
    "UnsupportedSchemaError",
    "check_schema",
    "enforceable_schema",
]

_TEXT_ANSWER_EBNF = "root ::= [^{] [^]*"  # anything that does not open a JSON object


@dataclass(frozen=True)
class CallSyntax:
    """How a model writes tool calls around their JSON ``{"name": ..., "arguments": ...}``:
    bare (the JSON alone, one call), or between tags as Qwen's and Hermes' chat templates
    ask (``<tool_call>\n{...}\n</tool_call>``, several in one turn, one per line)."""

    open: str = ""
    close: str = ""
    separator: str = "\n"
    max_calls: int = 1


BARE_CALLS = CallSyntax()


def _literal(text: str) -> xgr.Grammar:
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")


def _tagged_calls(call: xgr.Grammar, syntax: CallSyntax) -> xgr.Grammar:
    """1..max_calls tagged calls, one after another."""
    tagged = xgr.Grammar.concat(_literal(syntax.open), call, _literal(syntax.close))
    then_another = xgr.Grammar.concat(_literal(syntax.separator), tagged)
    sequences = [tagged]
    for _ in range(syntax.max_calls - 1):
        sequences.append(xgr.Grammar.concat(sequences[-1], then_another))
    return xgr.Grammar.union(*sequences) if len(sequences) > 1 else tagged


def _text_answer(syntax: CallSyntax) -> xgr.Grammar:
    if not syntax.open:
        return xgr.Grammar.from_ebnf(_TEXT_ANSWER_EBNF)
    return xgr.Grammar.from_ebnf(text_without_ebnf(syntax.open.strip()))


def text_without_ebnf(forbidden: str) -> str:
    """EBNF of non-empty text that never contains ``forbidden``: a substring-avoiding
    automaton (Knuth-Morris-Pratt states: how much of ``forbidden`` the text ends with)."""
    size = len(forbidden)
    failure = [0] * size
    matched = 0
    for index in range(1, size):
        while matched and forbidden[index] != forbidden[matched]:
            matched = failure[matched - 1]
        matched += forbidden[index] == forbidden[matched]
        failure[index] = matched

    def advance(state: int, char: str) -> int:
        while state and forbidden[state] != char:
            state = failure[state - 1]
        return state + 1 if forbidden[state] == char else 0

    alphabet = sorted(set(forbidden))
    others = "[^" + "".join(_class_char(char) for char in alphabet) + "]"

    def moves(state: int) -> list[str]:
        steps = [f"{json.dumps(char)} s{advance(state, char)}" for char in alphabet if advance(state, char) < size]
        return [*steps, f"{others} s0"]

    rules = [f"root ::= {' | '.join(moves(0))}"]
    rules += [f's{state} ::= "" | {" | ".join(moves(state))}' for state in range(size)]
    return "\n".join(rules)


def _class_char(char: str) -> str:
    return "\\" + char if char in "\\]^-[" else char


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def tool_call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of one call: ``{"name": <name>, "arguments": <parameters>}``."""
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_choice_schema(tools: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """``anyOf`` the tools' call schemas, their ``$defs`` hoisted to the root.

    A tool's parameters refer to ``#/$defs/X`` of their own document; nested under the
    call they would point at nothing, so each tool's definitions move to the root under
    ``<tool>.X`` and its references are rewritten to match.
    """
    calls, definitions = [], {}
    for name, parameters in tools:
        local = parameters.get("$defs", {})
        renamed = {f"#/$defs/{key}": f"#/$defs/{name}.{key}" for key in local}
        body = _rewrite_refs({k: v for k, v in parameters.items() if k != "$defs"}, renamed)
        definitions.update({f"{name}.{key}": _rewrite_refs(value, renamed) for key, value in local.items()})
        calls.append(tool_call_schema(name, body))
    schema: dict[str, Any] = {"anyOf": calls}
    if definitions:
        schema["$defs"] = definitions
    return schema


def _rewrite_refs(node: Any, renamed: dict[str, str]) -> Any:
    if isinstance(node, dict):
        return {
            key: renamed.get(value, value) if key == "$ref" else _rewrite_refs(value, renamed)
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [_rewrite_refs(item, renamed) for item in node]
    return node


class GrammarCompiler:
    """Compiles grammars for one vocabulary; thread-safe, cached by canonical JSON."""

    def __init__(
        self,
        tokenizer_info: xgr.TokenizerInfo,
        encode: Callable[[str], list[int]] | None = None,
        max_cached: int = 256,
    ) -> None:
        self.tokenizer_info = tokenizer_info
        self.encode = encode  # spells forced text as the model would (see Grammar)
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=1)
        # Bounded: a server compiles whatever schemas its clients send.
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self.max_cached = max_cached
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int) -> GrammarCompiler:
        """From a Hugging Face tokenizer; ``vocab_size`` is the model's logits width."""
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        return cls(info, lambda text: tokenizer.encode(text, add_special_tokens=False))

    @property
    def cached(self) -> int:
        return len(self._cache)

    def json_schema(self, schema: dict[str, Any] | str) -> Grammar:
        """Any document valid under ``schema`` (additional properties off unless allowed)."""
        parsed = json.loads(schema) if isinstance(schema, str) else schema
        if not isinstance(parsed, dict):
            raise UnsupportedSchemaError("schema", "#", "a JSON schema must be an object")
        key = "json_schema:" + canonical_json(parsed)
        return self._cached(key, lambda: self._from_schema(enforceable_schema(parsed)))

    def json_object(self) -> Grammar:
        """Any JSON object (OpenAI's ``response_format: json_object``)."""
        return self._cached("json_object", lambda: self._from_schema({"type": "object"}, strict=False))

    def ebnf(self, source: str, root: str = "root") -> Grammar:
        """A grammar in xgrammar's EBNF (GBNF-like) notation."""

        def build() -> xgr.Grammar:  # parsed only on a cache miss
            try:
                return xgr.Grammar.from_ebnf(source, root_rule_name=root)
            except RuntimeError as error:
                raise ValueError(f"invalid EBNF grammar: {str(error).strip().splitlines()[-1]}") from None

        return self._cached(f"ebnf:{root}:{source}", build)

    def tool_calls(
        self, tools: Sequence[tuple[str, dict[str, Any]]], *, allow_text: bool, syntax: CallSyntax = BARE_CALLS
    ) -> Grammar:
        """Calls to ``tools`` (name, parameters schema) written in ``syntax``, or else free
        text that cannot be read as a call."""
        if not tools:
            raise ValueError("tool_calls needs at least one tool")
        normalized = []
        for name, parameters in tools:
            try:
                normalized.append((name, enforceable_schema(parameters)))
            except UnsupportedSchemaError as error:
                raise error.under(f"#/tools/{name}") from None
        calls = tool_choice_schema(normalized)
        key = f"tool_calls:text={allow_text}:{syntax}:" + canonical_json(calls)

        def build() -> xgr.Grammar:
            one = self._from_schema(calls)
            if syntax.open:
                one = _tagged_calls(one, syntax)
            return xgr.Grammar.union(one, _text_answer(syntax)) if allow_text else one

        return self._cached(key, build)

    def text_answer(self, syntax: CallSyntax = BARE_CALLS) -> Grammar:
        """Free text that cannot be read as a call in ``syntax``: a step offered no tools."""
        return self._cached(f"text_answer:{syntax}", lambda: _text_answer(syntax))

    def _from_schema(self, schema: dict[str, Any], strict: bool = True) -> xgr.Grammar:
        try:
            return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=strict)
        except RuntimeError as error:  # xgrammar reports schema errors as RuntimeError
            message = str(error).strip().splitlines()[-1]
            raise UnsupportedSchemaError("schema", "#", message.split(": ", 1)[-1]) from None

    def _cached(self, key: str, build: Callable[[], xgr.Grammar]) -> Grammar:
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            grammar = Grammar(self._compiler.compile_grammar(build()), key, self.encode)
            self._cache[key] = grammar
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return grammar
