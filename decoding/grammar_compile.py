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

import torch
import xgrammar as xgr

from specrag.decoding.cut_words import word_prefix_table
from specrag.decoding.grammar import Grammar
from specrag.decoding.schema_merge import UnsupportedSchemaError, canonical_json
from specrag.decoding.schema_support import check_schema, enforceable_schema

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
    bare (the JSON alone, one call, compact), or between tags as Qwen's and Hermes' chat
    templates ask (``<tool_call>\n{...}\n</tool_call>``, several in one turn, one per line).

    With tags, a call written the other ways the Qwen coder models write one unprompted is
    read too: bare, or fenced (```json ... ```), its JSON pretty-printed or not. Measured:
    shown Qwen's own template, qwen2.5-coder-1.5b wrote ``{{"name": ...}}`` or a fenced
    block, never the tags; held to the tags alone, it wrote the fenced call as text."""

    open: str = ""
    close: str = ""
    separator: str = "\n"
    max_calls: int = 1

    @property
    def lenient(self) -> bool:
        return bool(self.open)


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
    """Text that cannot be read as a call: it does not open a JSON object and, for tagged
    calls, never contains the opening tag or a call's ``"arguments`` key (a small model
    blocked from the first wrote ``>{"name": ...`` instead)."""
    if not syntax.lenient:
        return xgr.Grammar.from_ebnf(_TEXT_ANSWER_EBNF)
    forbidden = [syntax.open.strip(), *CALL_KEY_QUOTES, *JSON_OBJECT_OPENINGS]
    return xgr.Grammar.from_ebnf(text_without_ebnf(forbidden, first_not="{"))


# A JSON object's opening brace and first key, as models lay it out. Held to text after the
# irrelevance gate, qwen2.5-coder-1.5b wrote its call with other keys in a code fence
# (```json {"function": "convert_length", "parameters": ...}). Dicts in Python's own quotes
# ({'a': 1}) stay writable.
JSON_OBJECT_OPENINGS = ('{"', '{ "', '{\t"', *("{\n" + " " * indent + '"' for indent in range(9)))
# A call's keys with a quote on either side, a space between allowed: held to text, the
# Qwen coder models wrote their calls as {"name": ..., "arguments': ...}, {"name": ...,
# " arguments": ...} and <tools>{"name": ..., " arguments ": ...}</tools> (tool-use eval).
# A quoted "name" or "arguments" in prose is the price.
CALL_KEY_QUOTES = tuple(
    spelled
    for key in ("name", "arguments")
    for quote in ('"', "'")
    for spelled in (quote + key, quote + " " + key, key + quote)
)


def text_without_ebnf(forbidden: Sequence[str], first_not: str = "") -> str:
    """EBNF of non-empty text that contains none of ``forbidden`` and does not start with a
    character of ``first_not``: a substring-avoiding automaton whose states are the longest
    suffix of the text so far that begins one of the forbidden strings (Aho-Corasick)."""
    prefixes = sorted({word[:length] for word in forbidden for length in range(len(word))})
    state_of = {prefix: index for index, prefix in enumerate(prefixes)}  # "" is state 0
    alphabet = sorted({char for word in forbidden for char in word})

    def advance(state: str, char: str) -> str | None:
        text = state + char
        if any(text.endswith(word) for word in forbidden):
            return None
        return next(text[start:] for start in range(len(text) + 1) if text[start:] in state_of)

    def moves(state: str, excluded: str = "") -> list[str]:
        steps = []
        for char in alphabet:
            target = advance(state, char)
            if target is not None and char not in excluded:
                steps.append(f"{json.dumps(char)} s{state_of[target]}")
        other_chars = "".join(_class_char(char) for char in sorted(set(alphabet) | set(excluded)))
        return [*steps, f"[^{other_chars}] s0"]

    rules = [f"root ::= {' | '.join(moves('', first_not))}"]
    rules += [f's{state_of[prefix]} ::= "" | {" | ".join(moves(prefix))}' for prefix in prefixes]
    return "\n".join(rules)


def _class_char(char: str) -> str:
    if char in "\n\t\r":
        return json.dumps(char)[1:-1]  # the escape, not the character: a class holds no newline
    return "\\" + char if char in "\\]^-[" else char


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
        cut_words: bool = True,
    ) -> None:
        self.tokenizer_info = tokenizer_info
        self.encode = encode  # spells forced text as the model would (see Grammar)
        self.cut_words = cut_words  # pour a cut word's probability into its allowed part
        self._word_prefixes: torch.Tensor | None = None  # built with the first grammar
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
            one = self._from_schema(calls, any_whitespace=syntax.lenient)
            if syntax.lenient:
                fenced = xgr.Grammar.concat(_literal("```json\n"), one, _literal("\n```"))
                one = xgr.Grammar.union(_tagged_calls(one, syntax), one, fenced)
            return xgr.Grammar.union(one, _text_answer(syntax)) if allow_text else one

        return self._cached(key, build)

    def text_answer(self, syntax: CallSyntax = BARE_CALLS) -> Grammar:
        """Free text that cannot be read as a call in ``syntax``: a step offered no tools."""
        return self._cached(f"text_answer:{syntax}", lambda: _text_answer(syntax))

    def _from_schema(self, schema: dict[str, Any], strict: bool = True, any_whitespace: bool = False) -> xgr.Grammar:
        try:
            return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=any_whitespace, strict_mode=strict)
        except RuntimeError as error:  # xgrammar reports schema errors as RuntimeError
            message = str(error).strip().splitlines()[-1]
            raise UnsupportedSchemaError("schema", "#", message.split(": ", 1)[-1]) from None

    def _cached(self, key: str, build: Callable[[], xgr.Grammar]) -> Grammar:
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            if self.cut_words and self._word_prefixes is None:
                self._word_prefixes = word_prefix_table(self.tokenizer_info.decoded_vocab)
            grammar = Grammar(self._compiler.compile_grammar(build()), key, self.encode, self._word_prefixes)
            self._cache[key] = grammar
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return grammar
