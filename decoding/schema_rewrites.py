"""Keyword rewrites of one schema node into what xgrammar can enforce: exact, or stricter.

A stricter rewrite accepts fewer documents than the original, never more: every document
the grammar writes still validates. Each function takes one node (a dict whose children
are already normalised) and returns the rewritten node, or raises UnsupportedSchemaError.

- regex named groups become plain groups; draft-04 tuple ``items`` become ``prefixItems``
  (both exact).
- ``uniqueItems: true`` is enforced by allowing at most one item (stricter; exact when
  ``maxItems`` was already 1). With ``minItems`` >= 2 it is refused.
- ``not`` is rewritten where its complement is a constraint the grammar has: ``not:
  {required: [a, ...]}`` forbids ``a`` (exact for one name, stricter for more); ``not:
  {enum|const}`` removes the values from a finite ``enum``; under ``propertyNames``, a
  ``not: {enum}`` forbids those names when the object admits no names beyond its listed
  properties. Any other ``not`` is refused.
- ``dependentRequired`` / ``dependentSchemas`` / ``dependencies``: for each trigger
  property, "absent, or present together with what it needs", as ``anyOf``.
- ``finalize``: a schema that is never written (``false`` from the rewrites and merges, or
  a reference outside the document, which is not fetched) is removed where the rest
  allows it: a forbidden property is dropped and its object closed (stricter when the
  object allowed other names), an ``anyOf`` branch is dropped, array items become none;
  anywhere else the schema is refused. xgrammar has no ``false`` schema, and a reference
  it cannot resolve must never mean "anything". A required name that ``properties`` does
  not list is listed, with the schema its name gets (a matching ``patternProperties``
  entry, else ``additionalProperties``, else any value): the strict grammar writes only
  listed names and dropped such a requirement (a SchemaStore schema requiring ``variable``
  without listing it got an answer without it). Where ``additionalProperties: false``
  forbids the name, no object satisfies the node: refused, naming ``required``.
"""

from __future__ import annotations

import re
from typing import Any

from specrag.decoding.schema_merge import (
    EXTERNAL,
    LITERALS,
    NAME_MAPS,
    UnsupportedSchemaError,
    finite_values,
    never_written,
    same_value,
)

_NAMED_GROUP = re.compile(r"\(\?P?<(?![=!])[A-Za-z_][A-Za-z0-9_]*>")


def rewrite_regex_groups(node: dict[str, Any], path: str) -> dict[str, Any]:
    """Named groups ``(?<name>...)`` become plain groups: the same language, which xgrammar parses."""
    if isinstance(node.get("pattern"), str) and _NAMED_GROUP.search(node["pattern"]):
        node = {**node, "pattern": _NAMED_GROUP.sub("(", node["pattern"])}
    patterns = node.get("patternProperties")
    if isinstance(patterns, dict) and any(_NAMED_GROUP.search(key) for key in patterns):
        node = {**node, "patternProperties": {_NAMED_GROUP.sub("(", key): value for key, value in patterns.items()}}
    return node


def rewrite_tuple_items(node: dict[str, Any], path: str) -> dict[str, Any]:
    """Draft-04..2019 ``items: [a, b]`` + ``additionalItems`` is 2020-12's ``prefixItems`` + ``items``."""
    if not isinstance(node.get("items"), list):
        return node
    rest = {key: value for key, value in node.items() if key not in ("items", "additionalItems")}
    rest["prefixItems"] = node["items"]
    if "additionalItems" in node:
        rest["items"] = node["additionalItems"]
    return rest


def rewrite_unique_items(node: dict[str, Any], path: str) -> dict[str, Any]:
    if "uniqueItems" not in node:
        return node
    rest = {key: value for key, value in node.items() if key != "uniqueItems"}
    if node["uniqueItems"] is not True:
        return rest
    if rest.get("minItems", 0) > 1:
        raise UnsupportedSchemaError("uniqueItems", path, "distinct items cannot be enforced with minItems above 1")
    return {**rest, "maxItems": min(rest.get("maxItems", 1), 1)}


def rewrite_not(node: dict[str, Any], path: str) -> dict[str, Any]:
    if "not" not in node:
        node = _rewrite_property_names_not(node, path)
        return node
    negated = node["not"]
    rest = {key: value for key, value in node.items() if key != "not"}
    if isinstance(negated, dict) and set(negated) == {"required"} and negated["required"]:
        name = negated["required"][0]  # this one absent: then not all of them are present
        if name in rest.get("required", []):
            raise UnsupportedSchemaError("not", path, f"{name!r} is both required and negated")
        return {**rest, "properties": {**rest.get("properties", {}), name: False}}
    excluded = finite_values(negated) if isinstance(negated, dict) and set(negated) <= {"enum", "const"} else None
    allowed = finite_values(rest)
    if excluded is not None and allowed is not None:
        kept = [value for value in allowed if not any(same_value(value, other) for other in excluded)]
        if not kept:
            raise UnsupportedSchemaError("not", path, "every allowed value is negated")
        return {**{key: value for key, value in rest.items() if key != "const"}, "enum": kept}
    raise UnsupportedSchemaError("not", path, "only 'not' of required names or of constants can be enforced")


def _rewrite_property_names_not(node: dict[str, Any], path: str) -> dict[str, Any]:
    names = node.get("propertyNames")
    if not isinstance(names, dict) or "not" not in names:
        return node
    excluded = finite_values(names["not"]) if set(names["not"]) <= {"enum", "const"} else None
    if excluded is None or node.get("additionalProperties", False) is not False or node.get("patternProperties"):
        raise UnsupportedSchemaError("not", f"{path}/propertyNames", "names outside a fixed list cannot be excluded")
    properties = {name: False if name in excluded else schema for name, schema in node.get("properties", {}).items()}
    rest_of_names = {key: value for key, value in names.items() if key != "not"}
    rewritten = {**node, "properties": properties}
    if rest_of_names:
        rewritten["propertyNames"] = rest_of_names
    else:
        del rewritten["propertyNames"]
    return rewritten


def rewrite_dependencies(node: dict[str, Any], path: str) -> dict[str, Any]:
    """``{a: [b, c]}`` / ``{a: {schema}}``: anyOf (a absent) or (a, b, c present / schema holds)."""
    dependencies: dict[str, Any] = {}
    for keyword in ("dependencies", "dependentRequired", "dependentSchemas"):
        value = node.get(keyword)
        if value is not None and not isinstance(value, dict):
            raise UnsupportedSchemaError(keyword, path, f"{keyword} must be an object")
        dependencies.update(value or {})
    if not dependencies:
        return node
    rest = {k: v for k, v in node.items() if k not in ("dependencies", "dependentRequired", "dependentSchemas")}
    conditions = []
    for trigger, needs in dependencies.items():
        present = (
            {"required": [trigger, *needs]} if isinstance(needs, list) else {"allOf": [needs], "required": [trigger]}
        )
        absent = {"properties": {trigger: False}}
        conditions.append({"anyOf": [absent, present]})
    return {**rest, "allOf": [*rest.get("allOf", []), *conditions]}


def finalize(node: Any, path: str = "#", names: bool = False) -> Any:
    """Remove every schema that is never written (``false``, an external reference) from
    where the rest allows it: a property (forbidden, its object closed), an ``anyOf``
    branch (dropped), array items (no items) or ``additionalProperties``; refuse elsewhere.
    xgrammar has no ``false`` schema, and an unknown reference must never mean "anything"."""
    if isinstance(node, list):
        return [finalize(item, f"{path}/{index}") for index, item in enumerate(node)]
    if not isinstance(node, dict) or names:
        if names and isinstance(node, dict):
            return {key: finalize(value, f"{path}/{key}") for key, value in node.items()}
        return node
    if never_written(node):
        reason = node.get(EXTERNAL) if isinstance(node, dict) else None
        raise UnsupportedSchemaError("$ref" if reason else "false", path, _never_why(reason))
    node = _list_required_names(_drop_never_written(dict(node), path), path)
    return {
        key: value if key in LITERALS else finalize(value, f"{path}/{key}", key in NAME_MAPS)
        for key, value in node.items()
    }


def _drop_never_written(node: dict[str, Any], path: str) -> dict[str, Any]:
    properties = node.get("properties")
    if isinstance(properties, dict) and any(never_written(value) for value in properties.values()):
        if node.get("patternProperties"):
            raise UnsupportedSchemaError("patternProperties", path, "a forbidden name could still match a pattern")
        for name in node.get("required", []):
            if never_written(properties.get(name)):
                external = isinstance(properties[name], dict) and EXTERNAL in properties[name]
                feature = "$ref" if external else "required"  # e.g. a required string no pattern admits
                raise UnsupportedSchemaError(feature, f"{path}/properties/{name}", _never_why(properties[name]))
        node["properties"] = {name: value for name, value in properties.items() if not never_written(value)}
        node["additionalProperties"] = False
    if never_written(node.get("additionalProperties")):
        node["additionalProperties"] = False
    if isinstance(node.get("anyOf"), list):
        kept = [branch for branch in node["anyOf"] if not never_written(branch)]
        if not kept:
            raise UnsupportedSchemaError("anyOf", path, _never_why(node["anyOf"][0]))
        node["anyOf"] = kept
    listed = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    if node.get("minProperties", 0) > len(listed) and "additionalProperties" not in node:
        node["additionalProperties"] = True  # the strict grammar would otherwise allow no other names
    prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
    if "items" not in node and node.get("minItems", 0) > len(prefix):
        node["items"] = True  # unlisted items are allowed; the strict grammar would refuse them
    if never_written(node.get("items")):
        if node.get("minItems", 0) > len(node.get("prefixItems", [])):
            raise UnsupportedSchemaError("items", path, _never_why(node["items"]))
        del node["items"]
        node["maxItems"] = min(node.get("maxItems", len(node.get("prefixItems", []))), len(node.get("prefixItems", [])))
    return node


def _list_required_names(node: dict[str, Any], path: str) -> dict[str, Any]:
    """``properties`` gains every required name it does not list (see the module doc)."""
    required = node.get("required")
    properties = node.get("properties", {})
    if not isinstance(required, list) or not isinstance(properties, dict):
        return node
    missing = [name for name in required if isinstance(name, str) and name not in properties]
    if not missing:
        return node
    listed = dict(properties)
    for name in missing:
        schema = _schema_for_unlisted_name(node, name)
        if never_written(schema):  # false included
            raise UnsupportedSchemaError(
                "required", f"{path}/required", f"{name!r} is required but its object allows no such property"
            )
        listed[name] = {} if schema is True else schema
    return {**node, "properties": listed}


def _schema_for_unlisted_name(node: dict[str, Any], name: str) -> Any:
    patterns = node.get("patternProperties")
    if isinstance(patterns, dict):
        for pattern, schema in patterns.items():
            if re.search(pattern, name):
                return schema
    return node.get("additionalProperties", True)


def _never_why(value: Any) -> str:
    if isinstance(value, dict) and EXTERNAL in value:
        return f"only references inside the schema ('#/...') are resolved offline, not {value[EXTERNAL]!r}"
    if isinstance(value, str):
        return f"only references inside the schema ('#/...') are resolved offline, not {value!r}"
    return "no value can satisfy it"
