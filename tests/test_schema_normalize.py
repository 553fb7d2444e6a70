"""Schema normalisation: equivalent or stricter, never looser, checked with jsonschema as the oracle.

For each schema, every value of a small universe of JSON documents is validated against
the original and the normalised schema: a document the normalised schema accepts must
validate against the original (the grammar may never be looser), and for the rewrites
that are meant to be exact, the two accept the same documents.
"""

from __future__ import annotations

import itertools
from typing import Any

import jsonschema
import pytest

from specrag.decoding.schema_merge import Unsatisfiable, UnsupportedSchemaError, merge_schemas
from specrag.decoding.schema_normalize import normalize_schema

SHAPES: dict[str, Any] = {
    "kind": ["circle", "square", "rect", 3],
    "radius": [1, -1, "x"],
    "length": [2, None],
    "width": [3],
    "name": ["a", "toolong-name"],
}


def universe() -> list[Any]:
    documents: list[Any] = [None, True, 0, 2.5, "s", [], [1, "a"], [1, 1], ["a"], {}]
    names = list(SHAPES)
    for count in (1, 2, 3):
        for chosen in itertools.combinations(names, count):
            for values in itertools.product(*(SHAPES[name] for name in chosen)):
                documents.append(dict(zip(chosen, values, strict=True)))
    return documents


DOCUMENTS = universe()


def accepted(schema: dict[str, Any]) -> list[bool]:
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema)
    return [validator.is_valid(document) for document in DOCUMENTS]


EXACT = {
    "siblings of anyOf (the issue's schema)": {
        "type": "object",
        "properties": {"radius": {"type": "number"}, "length": {"type": "number"}, "width": {"type": "number"}},
        "anyOf": [{"required": ["length", "width"]}, {"required": ["radius"]}],
    },
    "allOf of objects": {
        "allOf": [
            {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
            {"properties": {"name": {"maxLength": 4}, "radius": {"minimum": 0}}},
        ]
    },
    "allOf with a closed side": {
        "allOf": [
            {"type": "object", "properties": {"name": {}, "radius": {}}, "additionalProperties": False},
            {"type": "object", "properties": {"radius": {"type": "integer"}, "width": {}}},
        ]
    },
    "ref outside $defs": {
        "type": "object",
        "properties": {"radius": {"type": "integer", "minimum": 0}, "length": {"$ref": "#/properties/radius"}},
    },
    "recursive root ref": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "kind": {"$ref": "#"}},
        "additionalProperties": False,
    },
    "definitions and allOf of a ref": {
        "definitions": {"positive": {"type": "number", "minimum": 0}},
        "type": "object",
        "properties": {"radius": {"allOf": [{"$ref": "#/definitions/positive"}, {"type": "integer"}]}},
    },
    "exclusive oneOf by const": {
        "oneOf": [
            {"type": "object", "properties": {"kind": {"const": "circle"}, "radius": {}}, "required": ["kind"]},
            {"type": "object", "properties": {"kind": {"const": "square"}, "width": {}}, "required": ["kind"]},
        ]
    },
    "if/then/else on a discriminator": {
        "type": "object",
        "properties": {"kind": {"enum": ["circle", "square", "rect"]}, "radius": {}, "width": {}},
        "required": ["kind"],
        "if": {"properties": {"kind": {"const": "circle"}}},
        "then": {"required": ["radius"]},
        "else": {"required": ["width"]},
    },
    "allOf of two conditionals": {
        "type": "object",
        "properties": {"kind": {"enum": ["circle", "square"]}, "radius": {}, "width": {}, "length": {}},
        "required": ["kind"],
        "allOf": [
            {"if": {"properties": {"kind": {"const": "circle"}}}, "then": {"required": ["radius"]}},
            {"if": {"properties": {"kind": {"const": "square"}}}, "then": {"required": ["width"]}},
        ],
    },
}


@pytest.mark.parametrize("name", EXACT)
def test_exact_rewrites_accept_the_same_documents(name: str) -> None:
    original = EXACT[name]
    normalized = normalize_schema(original)
    assert not {"allOf", "oneOf", "if"} & set(_all_keys(normalized)), normalized
    assert accepted(normalized) == accepted(original)


def test_the_issue_schema_no_longer_loses_the_siblings() -> None:
    normalized = normalize_schema(EXACT["siblings of anyOf (the issue's schema)"])
    assert all(branch["type"] == "object" and "properties" in branch for branch in normalized["anyOf"])
    assert not accepted(normalized)[DOCUMENTS.index("s")]  # the bare string the issue saw


@pytest.mark.parametrize(
    ("schema", "keyword", "path"),
    [
        ({"oneOf": [{"type": "number"}, {"type": "integer"}]}, "oneOf", "#"),  # 3 matches both
        ({"properties": {"a": {"$ref": "https://x.org/a.json"}}, "required": ["a"]}, "$ref", "#/properties/a"),
        # "then" and "else" cannot both hold, so the stricter fallback has nothing to write
        (
            {"if": {"properties": {"a": {"minimum": 3}}}, "then": {"type": "object"}, "else": {"type": "string"}},
            "if",
            "#",
        ),
        ({"allOf": [{"pattern": "^a"}, {"pattern": "b$"}]}, "allOf", "#/allOf/1"),
    ],
)
def test_what_cannot_be_enforced_is_refused_with_keyword_and_path(
    schema: dict[str, Any], keyword: str, path: str
) -> None:
    with pytest.raises(UnsupportedSchemaError) as error:
        normalize_schema(schema)
    assert error.value.feature == keyword and error.value.path == path


def test_an_external_reference_is_never_written_where_the_rest_allows_it() -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "extra": {"$ref": "https://x.org/extra.json"}},
        "anyOf": [{"$ref": "https://x.org/thing.json"}, {"required": ["name"]}],
    }
    normalized = normalize_schema(schema)  # nothing is fetched: the parts behind the refs go
    assert normalized["anyOf"] == [
        {
            "type": "object",
            "properties": {"name": {"type": "string"}},
            "required": ["name"],
            "additionalProperties": False,
        }
    ]


def test_an_unsatisfiable_merge_is_refused_not_compiled() -> None:
    with pytest.raises(Unsatisfiable, match="no document can satisfy"):
        normalize_schema({"allOf": [{"type": "string"}, {"type": "integer"}]})
    merged = merge_schemas({"type": ["integer", "string"]}, {"type": "number"}, "#", lambda node, path: node)
    assert merged["type"] == "integer"


def test_an_incompatible_anyof_branch_is_dropped() -> None:
    normalized = normalize_schema({"type": "string", "anyOf": [{"type": "integer"}, {"maxLength": 3}]})
    assert normalized["anyOf"] == [{"type": "string", "maxLength": 3}]


def _all_keys(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [*node, *(key for value in node.values() for key in _all_keys(value))]
    if isinstance(node, list):
        return [key for item in node for key in _all_keys(item)]
    return []


STRICTER = {
    "oneOf told apart by forbidding the other's required name": {
        "type": "object",
        "properties": {"length": {}, "width": {}, "name": {}},
        "oneOf": [{"required": ["length"]}, {"required": ["width"]}],
    },
    "uniqueItems capped at one item": {"type": "array", "uniqueItems": True},
    "not of a required name": {"type": "object", "properties": {"name": {}}, "not": {"required": ["name"]}},
    "dependencies": {"type": "object", "properties": {"radius": {}}, "dependencies": {"radius": ["width"]}},
    "if on a non-constant condition: then and else both hold": {
        "type": "object",
        "properties": {"radius": {}, "width": {}, "name": {}},
        "if": {"properties": {"radius": {"minimum": 3}}},
        "then": {"required": ["width"]},
        "else": {"properties": {"name": {"maxLength": 4}}},
    },
    "oneOf with twin branches: the property is never written": {
        "type": "object",
        "properties": {"name": {}, "kind": {"oneOf": [{"type": "string"}, {"type": "string", "title": "again"}]}},
    },
    "if on an optional property": {
        "type": "object",
        "properties": {"kind": {"enum": ["circle", "square"]}, "radius": {}},
        "if": {"properties": {"kind": {"const": "circle"}}},
        "then": {"required": ["radius"]},
    },
}


@pytest.mark.parametrize("name", STRICTER)
def test_stricter_rewrites_never_accept_what_the_original_refuses(name: str) -> None:
    original, normalized = accepted(STRICTER[name]), accepted(normalize_schema(STRICTER[name]))
    assert not [DOCUMENTS[i] for i, ok in enumerate(normalized) if ok and not original[i]]
    assert any(normalized)  # and something is still writable


def test_the_subset_check_catches_a_looser_rewrite() -> None:
    looser = {"type": "object", "properties": {"length": {}, "width": {}}}  # oneOf dropped: both allowed
    original = accepted(STRICTER["oneOf told apart by forbidding the other's required name"])
    assert [i for i, ok in enumerate(accepted(looser)) if ok and not original[i]]


def test_a_required_name_that_properties_does_not_list_is_still_required() -> None:
    # SchemaStore's solidarity schema requires "variable" without listing it; the strict
    # grammar writes only listed names, so the requirement was dropped and an answer
    # without it came out (caught by the validation of finished answers, as a 500).
    import json

    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"]}
    normalized = normalize_schema(schema)
    assert normalized["properties"]["b"] == {}
    grammar = xgr.Grammar.from_json_schema(json.dumps(normalized), any_whitespace=False, strict_mode=True)
    assert not _is_grammar_accept_string(grammar, '{"a": "x"}')
    assert _is_grammar_accept_string(grammar, '{"a": "x", "b": [1, null]}')
    patterned = {"type": "object", "patternProperties": {"^x-": {"type": "integer"}}, "required": ["x-y"]}
    assert normalize_schema(patterned)["properties"]["x-y"] == {"type": "integer"}
    closed = {"type": "object", "properties": {"a": {}}, "required": ["b"], "additionalProperties": False}
    with pytest.raises(UnsupportedSchemaError) as refused:
        normalize_schema(closed)
    assert refused.value.feature == "required" and refused.value.path == "#/required"


def test_a_pattern_naming_a_backslash_or_quote_is_never_handed_to_xgrammar() -> None:
    # xgrammar 0.2.9 matches such literals against the JSON text: for this SchemaStore
    # pattern it wrote "CSharpProject2\binaries.dll" (a backspace), which fails validation.
    import json

    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    needs_backslash = {"type": "string", "pattern": r"\w+[\\](\w+\.)*\w+\.dll"}
    optional = {"type": "object", "properties": {"path": needs_backslash, "n": {"type": "integer"}}}
    assert normalize_schema(optional)["properties"] == {"n": {"type": "integer"}}  # never written, so forbidden
    with pytest.raises(UnsupportedSchemaError) as refused:
        normalize_schema({**optional, "required": ["path"]})
    assert refused.value.feature == "required" and refused.value.path == "#/properties/path"
    with pytest.raises(UnsupportedSchemaError):
        normalize_schema({"type": "string", "pattern": 'a"b'})  # xgrammar wrote the broken JSON "a"b"
    rewritten = normalize_schema({"type": "string", "pattern": r"^[\w\\/]+$"})
    grammar = xgr.Grammar.from_json_schema(json.dumps(rewritten), any_whitespace=False, strict_mode=True)
    assert _is_grammar_accept_string(grammar, '"a/b_1"')
    assert not _is_grammar_accept_string(grammar, r'"a\b"')
