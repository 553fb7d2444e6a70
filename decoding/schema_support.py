"""What xgrammar 0.2.9 enforces of a JSON schema, and the refusal of the rest.

``enforceable_schema`` normalises a schema (``decoding/schema_normalize.py``) and then
refuses, with the keyword and its JSON pointer, whatever xgrammar would parse but not
enforce. Measured (tests/test_grammar.py and the SchemaStore corpus, whose compile logs
name what xgrammar ignores): the keywords below; regex lookaround and inline flags in a
``pattern`` (ignored or an error); ``minLength``/``maxLength`` beside a ``pattern``
(ignored); ``multipleOf`` on non-integers (ignored).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from specrag.decoding.schema_merge import UnsupportedSchemaError
from specrag.decoding.schema_normalize import normalize_schema

# Parsed but not enforced by xgrammar 0.2.9 (see tests/test_grammar_compile.py); if/then/else,
# allOf and oneOf are rewritten by normalize_schema or refused there.
UNSUPPORTED_KEYWORDS = frozenset(
    {
        "not",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "dependentRequired",
        "dependentSchemas",
        "dependencies",
        "unevaluatedProperties",
        "unevaluatedItems",
        "$dynamicRef",
        "$dynamicAnchor",
    }
)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "propertyNames", "additionalItems", "then", "else")


# A regex feature xgrammar ignores (lookaround) or cannot parse (inline flags, named groups,
# backreferences).
_UNSUPPORTED_REGEX = re.compile(r"\(\?(?!:)|\\[1-9]")  # any "(?" group but "(?:", or a backreference


def check_schema(schema: Any, path: str = "#") -> None:
    """Raise UnsupportedSchemaError for the first feature the grammar would not enforce."""
    for node_path, node in _subschemas(schema, path):
        for keyword in sorted(UNSUPPORTED_KEYWORDS & node.keys()):
            raise UnsupportedSchemaError(keyword, node_path)
        _check_node(node, node_path)


def _check_node(node: dict[str, Any], path: str) -> None:
    patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
    patterns += list(node.get("patternProperties") or {})
    for pattern in patterns:
        if _UNSUPPORTED_REGEX.search(pattern):
            why = f"regex {pattern!r} uses lookaround, inline flags or backreferences, which the grammar cannot enforce"
            raise UnsupportedSchemaError("pattern", path, why)
    if "pattern" in node and ("minLength" in node or "maxLength" in node):
        raise UnsupportedSchemaError("pattern", path, "a pattern together with minLength/maxLength cannot be enforced")
    if "multipleOf" in node and node.get("type") != "integer":
        raise UnsupportedSchemaError("multipleOf", path, "multipleOf is enforced for integers only")


def enforceable_schema(schema: Any) -> dict[str, Any]:
    """The schema normalised into what the grammar enforces; UnsupportedSchemaError naming
    the keyword and where it is when something cannot be."""
    if not isinstance(schema, dict):
        raise UnsupportedSchemaError("schema", "#", "a JSON schema must be an object")
    normalized = normalize_schema(schema)
    check_schema(normalized)
    return normalized


def _subschemas(schema: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    if not isinstance(schema, dict):
        return
    yield path, schema
    for key in _SCHEMA_MAPS:
        mapping = schema.get(key, {})
        if not isinstance(mapping, dict):  # e.g. "properties": 5: not a schema xgrammar could read
            raise UnsupportedSchemaError(key, path, f"{key} must be an object of schemas")
        for name, sub in mapping.items():
            yield from _subschemas(sub, f"{path}/{key}/{name}")
    for key in _SCHEMA_LISTS:
        items = schema.get(key, [])
        if not isinstance(items, list):
            raise UnsupportedSchemaError(key, path, f"{key} must be an array of schemas")
        for index, sub in enumerate(items):
            yield from _subschemas(sub, f"{path}/{key}/{index}")
    for key in _SCHEMA_VALUES:
        value = schema.get(key)
        subs = value if isinstance(value, list) else [value]
        for index, sub in enumerate(subs):
            yield from _subschemas(sub, f"{path}/{key}" + (f"/{index}" if isinstance(value, list) else ""))
