"""``allOf`` of two JSON schemas as one schema: what both accept, or a refusal.

The merge is exact for the keywords it knows (types intersected, bounds tightened,
``required`` united, ``enum``/``const`` intersected, object properties merged name by
name with ``additionalProperties`` deciding names one side does not list, ``items`` and
``anyOf`` merged recursively). Two different values of a keyword it cannot intersect
(two ``pattern`` regexes, two ``multipleOf``) are refused with the keyword and path; a
merge no document can satisfy raises ``Unsatisfiable`` (an ``anyOf`` branch that becomes
unsatisfiable is dropped instead). Keywords that do not validate (title, description,
default, vendor extensions) are annotations: the first schema's value is kept.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

Inline = Callable[[dict[str, Any], str], dict[str, Any]]

VALIDATION_KEYWORDS = frozenset(
    {
        "type", "enum", "const", "properties", "required", "additionalProperties", "patternProperties",
        "propertyNames", "minProperties", "maxProperties", "items", "prefixItems", "additionalItems", "minItems",
        "maxItems", "uniqueItems", "contains", "minContains", "maxContains", "minimum", "maximum",
        "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength", "maxLength", "pattern", "format",
        "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "dependentRequired", "dependentSchemas",
        "dependencies", "unevaluatedProperties", "unevaluatedItems", "$dynamicRef",
    }
)  # fmt: skip
_LOWER_BOUNDS = frozenset({"minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties"})
_UPPER_BOUNDS = frozenset({"maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties"})
_OBJECT_KEYS = frozenset({"properties", "additionalProperties"})
LITERALS = frozenset({"enum", "const", "default", "examples"})  # JSON values, not schemas
NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})  # name -> schema
_FINITE_TYPES = {"boolean": (True, False), "null": (None,)}
MAX_BRANCHES = 64  # an anyOf × anyOf product larger than this is refused


class UnsupportedSchemaError(ValueError):
    """A JSON schema uses a feature the grammar cannot enforce."""

    def __init__(self, feature: str, path: str, why: str = "the grammar cannot enforce it") -> None:
        super().__init__(f"unsupported JSON schema feature {feature!r} at {path}: {why}")
        self.feature = feature
        self.path = path
        self.why = why

    def under(self, prefix: str) -> UnsupportedSchemaError:
        """The same refusal for a schema nested at ``prefix`` (a JSON pointer) of a larger one."""
        return UnsupportedSchemaError(self.feature, prefix + self.path.removeprefix("#"), self.why)


class Unsatisfiable(UnsupportedSchemaError):
    """No document satisfies the merged schema."""

    def __init__(self, feature: str, path: str, why: str) -> None:
        super().__init__(feature, path, why if why.startswith("no document") else f"no document can satisfy it: {why}")


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def validation_keys(schema: dict[str, Any]) -> set[str]:
    return schema.keys() & VALIDATION_KEYWORDS


EXTERNAL = "$external"  # marks where a reference leading outside the schema was


def external(ref: str) -> dict[str, str]:
    """A schema that is never written: what stood behind ``ref`` cannot be fetched offline."""
    return {EXTERNAL: ref}


def never_written(value: Any) -> bool:
    return value is False or (isinstance(value, dict) and EXTERNAL in value)


def as_schema(value: Any, path: str) -> dict[str, Any]:
    """Booleans as schemas: true accepts anything, false nothing."""
    if value is True:
        return {}
    if value is False:
        raise Unsatisfiable("false", path, "the schema is false")
    if isinstance(value, dict) and EXTERNAL in value:
        raise Unsatisfiable("$ref", path, f"{value[EXTERNAL]!r} is outside the schema and is not fetched")
    if not isinstance(value, dict):
        raise UnsupportedSchemaError("schema", path, "a schema must be an object or a boolean")
    return value


def property_schema(schema: dict[str, Any], name: str) -> dict[str, Any] | None:
    """What ``schema`` requires of property ``name`` of an object; None if it forbids it."""
    properties = schema.get("properties")
    if isinstance(properties, dict) and name in properties:
        value = properties[name]
        return None if never_written(value) else ({} if value is True else value)
    additional = schema.get("additionalProperties", True)
    if never_written(additional):
        return None
    return {} if additional is True else additional


def type_set(schema: dict[str, Any]) -> set[str] | None:
    """The JSON types a schema can accept, or None when any type may be valid."""
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared}
    if isinstance(declared, list):
        return set(declared)
    values = finite_values(schema)
    if values is not None:
        return {_json_type(value) for value in values}
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list) and branches and all(isinstance(branch, dict) for branch in branches):
        branch_types = [type_set(branch) for branch in branches]
        if all(types is not None for types in branch_types):
            return set().union(*branch_types)  # type: ignore[arg-type]
    return None


def types_overlap(left: set[str], right: set[str]) -> bool:
    if left & right:
        return True
    return ("integer" in left and "number" in right) or ("number" in left and "integer" in right)


def finite_values(schema: dict[str, Any] | None) -> list[Any] | None:
    """Every value the schema accepts, when that is a finite list (const, enum, boolean)."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return [schema["const"]]
    if isinstance(schema.get("enum"), list):
        return list(schema["enum"])
    if schema.get("type") in _FINITE_TYPES:
        return list(_FINITE_TYPES[schema["type"]])
    branches = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(branches, list) and branches:
        values = [finite_values(branch) for branch in branches]
        if all(value is not None for value in values):
            return [value for branch_values in values for value in branch_values]  # type: ignore[union-attr]
    return None


def same_value(left: Any, right: Any) -> bool:
    """JSON equality: 1 == 1.0, but True is not 1."""
    if isinstance(left, bool) or isinstance(right, bool):
        return isinstance(left, bool) and isinstance(right, bool) and left is right
    return left == right


def merge_schemas(first: Any, second: Any, path: str, inline: Inline) -> dict[str, Any]:
    """One schema accepting exactly what both accept (see the module doc)."""
    left, right = inline(as_schema(first, path), path), inline(as_schema(second, path), path)
    result = dict(left)
    for key, value in right.items():
        if key not in result:
            result[key] = value
        elif key in _OBJECT_KEYS or same_value_deep(result[key], value) or key not in VALIDATION_KEYWORDS:
            continue  # objects merge below; annotations keep the first value
        else:
            result[key] = _merge_keyword(key, result[key], value, path, inline)
    if _OBJECT_KEYS & (left.keys() | right.keys()):
        _merge_objects(left, right, result, path, inline)
    _check_consistent(result, path)
    return result


def same_value_deep(left: Any, right: Any) -> bool:
    if isinstance(left, dict) and isinstance(right, dict):
        return left.keys() == right.keys() and all(same_value_deep(left[k], right[k]) for k in left)
    if isinstance(left, list) and isinstance(right, list):
        return len(left) == len(right) and all(same_value_deep(a, b) for a, b in zip(left, right, strict=True))
    return same_value(left, right)


def _merge_keyword(key: str, mine: Any, theirs: Any, path: str, inline: Inline) -> Any:
    if key in _LOWER_BOUNDS:
        return max(mine, theirs)
    if key in _UPPER_BOUNDS:
        return min(mine, theirs)
    if key == "items" and isinstance(mine, dict | bool) and isinstance(theirs, dict | bool):
        return merge_schemas(mine, theirs, f"{path}/items", inline)
    if key == "anyOf":
        return _merge_any_of(mine, theirs, path, inline)
    if key == "allOf" and isinstance(mine, list) and isinstance(theirs, list):
        return [*mine, *theirs]  # both must hold: one longer allOf, merged later
    merge_values = _VALUE_MERGES.get(key)
    if merge_values is None:
        raise UnsupportedSchemaError("allOf", path, f"two different {key!r} cannot be combined into one")
    return merge_values(mine, theirs, path)


def _merge_required(mine: list[str], theirs: list[str], path: str) -> list[str]:
    return list(dict.fromkeys([*mine, *theirs]))


def _merge_enum(mine: list[Any], theirs: list[Any], path: str) -> list[Any]:
    kept = [value for value in mine if any(same_value(value, other) for other in theirs)]
    if not kept:
        raise Unsatisfiable("enum", path, "the enums have no value in common")
    return kept


def _merge_const(mine: Any, theirs: Any, path: str) -> Any:
    raise Unsatisfiable("const", path, f"{mine!r} and {theirs!r} differ")


def _merge_types(mine: Any, theirs: Any, path: str) -> str | list[str]:
    left = {mine} if isinstance(mine, str) else set(mine)
    right = {theirs} if isinstance(theirs, str) else set(theirs)
    common = left & right
    if ("integer" in left and "number" in right) or ("number" in left and "integer" in right):
        common.add("integer")
    if not common:
        raise Unsatisfiable("type", path, f"types {sorted(left)} and {sorted(right)} have nothing in common")
    ordered = [name for name in ("null", "boolean", "object", "array", "number", "integer", "string") if name in common]
    return ordered[0] if len(ordered) == 1 else ordered


def _merge_any_of(mine: list[Any], theirs: list[Any], path: str, inline: Inline) -> list[dict[str, Any]]:
    if len(mine) * len(theirs) > MAX_BRANCHES:
        raise UnsupportedSchemaError("anyOf", path, f"more than {MAX_BRANCHES} branches after merging")
    branches = []
    for left, right in itertools.product(mine, theirs):
        try:
            branches.append(merge_schemas(left, right, f"{path}/anyOf", inline))
        except Unsatisfiable:
            continue
    if not branches:
        raise Unsatisfiable("anyOf", path, "no pair of branches is compatible")
    return branches


def _merge_objects(
    left: dict[str, Any], right: dict[str, Any], result: dict[str, Any], path: str, inline: Inline
) -> None:
    for unconstrained, other in ((left, right), (right, left)):
        if not _constrains_names(unconstrained):  # the other side decides which names may appear
            for key in (*_OBJECT_KEYS, "patternProperties"):
                result.pop(key, None)
                if key in other:
                    result[key] = other[key]
            return
    patterns = left.get("patternProperties"), right.get("patternProperties")
    if patterns != (None, None) and not same_value_deep(*patterns):
        raise UnsupportedSchemaError("allOf", path, "patternProperties cannot be combined with other properties")
    required = set(result.get("required", []))
    properties = _merged_properties(left, right, required, path, inline)
    result.pop("properties", None)
    if properties:
        result["properties"] = properties
    additional = _merge_additional(
        left.get("additionalProperties", True), right.get("additionalProperties", True), path, inline
    )
    result.pop("additionalProperties", None)
    if additional is not True:
        result["additionalProperties"] = additional
    for name in required - properties.keys():
        if additional is False:
            raise Unsatisfiable("required", path, f"{name!r} is required but not allowed")


def _merged_properties(
    left: dict[str, Any], right: dict[str, Any], required: set[str], path: str, inline: Inline
) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    for name in dict.fromkeys([*left.get("properties", {}), *right.get("properties", {})]):
        mine, theirs = property_schema(left, name), property_schema(right, name)
        try:
            if mine is None or theirs is None:  # one side forbids it: so does the merged schema
                raise Unsatisfiable("required", path, f"{name!r} is required but not allowed")
            properties[name] = merge_schemas(mine, theirs, f"{path}/properties/{name}", inline)
        except Unsatisfiable:
            if name in required:
                raise
            properties[name] = False  # no value satisfies both: the name must not appear
    return properties


def _constrains_names(schema: dict[str, Any]) -> bool:
    return bool(schema.get("properties") or schema.get("patternProperties")) or schema.get(
        "additionalProperties", True
    ) not in (True, {})


def _merge_additional(mine: Any, theirs: Any, path: str, inline: Inline) -> Any:
    if mine is False or theirs is False:
        return False
    if mine is True or mine == {}:
        return theirs
    if theirs is True or theirs == {}:
        return mine
    return merge_schemas(mine, theirs, f"{path}/additionalProperties", inline)


def _check_consistent(schema: dict[str, Any], path: str) -> None:
    """const and enum against each other and against type."""
    if "const" in schema and isinstance(schema.get("enum"), list):
        if not any(same_value(schema["const"], value) for value in schema["enum"]):
            raise Unsatisfiable("const", path, "the const is not in the enum")
        del schema["enum"]
    declared = schema.get("type")
    if declared is None:
        return
    allowed = {declared} if isinstance(declared, str) else set(declared)
    if "const" in schema and not _has_type(schema["const"], allowed):
        raise Unsatisfiable("const", path, f"the const is not of type {declared}")
    if isinstance(schema.get("enum"), list):
        kept = [value for value in schema["enum"] if _has_type(value, allowed)]
        if not kept:
            raise Unsatisfiable("enum", path, f"no value of the enum has type {declared}")
        schema["enum"] = kept


def _has_type(value: Any, allowed: set[str]) -> bool:
    kind = _json_type(value)
    return kind in allowed or (kind == "integer" and "number" in allowed)


_VALUE_MERGES: dict[str, Callable[[Any, Any, str], Any]] = {
    "type": _merge_types,
    "required": _merge_required,
    "enum": _merge_enum,
    "const": _merge_const,
}


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"
