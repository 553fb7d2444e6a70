"""Rewriting a JSON schema into the subset xgrammar enforces, without accepting more.

xgrammar 0.2.9 compiles ``anyOf`` branches on their own, so keywords beside ``anyOf`` /
``oneOf`` were lost (``{"properties": {...}, "anyOf": [{"required": [...]}]}`` let the model
write a bare string); ``allOf`` of more than one schema is not supported; ``$ref`` is only
followed into ``$defs``/``definitions``. ``normalize_schema`` returns a schema without
those shapes whose documents all validate against the original:

- every local ``$ref`` (any JSON pointer into the document, the root too) points into
  ``$defs``; targets elsewhere are copied there under a fresh name. A reference that
  leaves the document is refused: nothing is fetched;
- ``allOf`` is merged into its parent (``decoding/schema_merge.py``);
- keywords beside ``anyOf``/``oneOf`` are merged into every branch;
- ``oneOf`` becomes ``anyOf`` when no document written for one branch can validate against
  another (types, constants, required or forbidden property names tell them apart); else
  it is refused, since the grammar cannot enforce "exactly one";
- ``if``/``then``/``else`` becomes ``anyOf`` when ``if`` tests required properties against
  constants and those properties' values are a known finite set, so that "not if" is a
  set of constants too; any other ``if`` is refused.

What remains unenforceable is refused by ``check_schema`` with the keyword and its JSON
pointer, and the server answers 400. Completed responses are validated against the
caller's original schema all the same (``decoding/schema_validate.py``).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Iterator
from typing import Any

from specrag.decoding.schema_merge import (
    LITERALS,
    MAX_BRANCHES,
    NAME_MAPS,
    Unsatisfiable,
    UnsupportedSchemaError,
    canonical_json,
    external,
    finite_values,
    merge_schemas,
    never_written,
    property_schema,
    same_value,
    type_set,
    types_overlap,
    validation_keys,
)
from specrag.decoding.schema_rewrites import (
    finalize,
    rewrite_dependencies,
    rewrite_not,
    rewrite_regex_groups,
    rewrite_tuple_items,
    rewrite_unique_items,
)
from specrag.decoding.schema_strings import rewrite_strings, string_only, strings_exclusive

_NODE_REWRITES = (rewrite_tuple_items, rewrite_unique_items, rewrite_not, rewrite_dependencies)

__all__ = ["UnsupportedSchemaError", "normalize_schema"]

_DEFS = "$defs"
_CHILD_MAPS = ("properties", "patternProperties", "dependentSchemas")
_CHILD_VALUES = ("items", "additionalProperties", "propertyNames", "additionalItems", "contains", "not")
_CHILD_LISTS = ("prefixItems", "allOf", "anyOf", "oneOf")
_ABSENT = object()  # a tested property's "value" when it is not there


def normalize_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """An equivalent-or-stricter schema: local refs into ``$defs``, no ``allOf``, nothing
    beside ``anyOf``, no ``oneOf`` or ``if`` (see the module doc)."""
    document = _hoist_refs(copy.deepcopy(schema))
    definitions = document.pop(_DEFS, {})
    normalizer = _Normalizer(definitions)
    root = normalizer.normalize(document, "#")
    normalized_defs = {name: normalizer._normalized_definition(name, f"#/{_DEFS}/{name}") for name in definitions}
    normalized_defs.update(normalizer.recursive_definitions)
    if normalized_defs:
        root = {**root, _DEFS: normalized_defs}
    return finalize(root)


# -- references ------------------------------------------------------------------------------


def _hoist_refs(document: dict[str, Any]) -> dict[str, Any]:
    """Rewrite every local ``$ref`` to ``#/$defs/<name>``, copying targets that live elsewhere;
    a reference to a definition that is never written is replaced by that marker."""
    document = replace_external_refs(document)
    original = copy.deepcopy(document)
    definitions: dict[str, Any] = {}
    renamed: dict[str, str] = {}
    for container in (_DEFS, "definitions"):
        for name, body in (document.pop(container, None) or {}).items():
            key = name if name not in definitions else f"{container}.{name}"
            definitions[key] = body
            renamed[f"#/{container}/{name}"] = f"#/{_DEFS}/{key}"
    pending = [ref for ref in _refs(document, "#") if ref not in renamed]
    pending += [ref for body in definitions.values() for ref in _refs(body, "#") if ref not in renamed]
    while pending:
        ref = pending.pop()
        if ref in renamed:
            continue
        name = _fresh_name(ref, definitions)
        if ref in ("#", "#/"):
            target = {key: value for key, value in document.items()}
        else:
            target = copy.deepcopy(_resolve_pointer(original, ref))
        definitions[name] = target
        renamed[ref] = f"#/{_DEFS}/{name}"
        pending += [inner for inner in _refs(target, ref) if inner not in renamed]
    markers = {f"#/{_DEFS}/{name}": body for name, body in definitions.items() if never_written(body)}
    rewritten = _rewrite(document, renamed, markers)
    kept = {name: _rewrite(body, renamed, markers) for name, body in definitions.items() if not never_written(body)}
    if kept:
        rewritten[_DEFS] = kept
    return rewritten


def replace_external_refs(node: Any, replacement: Any = None, names: bool = False) -> Any:
    """Every subschema that is a reference leading outside the document, replaced (by
    default with the never-written marker; the validator uses ``{"not": {}}``)."""
    if isinstance(node, list):
        return [replace_external_refs(item, replacement) for item in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if not names and isinstance(ref, str) and not ref.startswith("#"):
        return external(ref) if replacement is None else replacement
    return {
        key: value
        if not names and key in LITERALS
        else replace_external_refs(value, replacement, not names and key in NAME_MAPS)
        for key, value in node.items()
    }


def _refs(node: Any, path: str, names: bool = False) -> Iterator[str]:
    """Every ``$ref`` below ``node``; ``names``: node maps names to schemas (``properties``)."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and not names:
            yield ref
        for key, value in node.items():
            if names or key not in LITERALS:
                yield from _refs(value, f"{path}/{key}", not names and key in NAME_MAPS)
    elif isinstance(node, list):
        for index, item in enumerate(node):
            yield from _refs(item, f"{path}/{index}")


def _resolve_pointer(document: Any, ref: str) -> Any:
    node = document
    for raw in ref.removeprefix("#").split("/")[1:]:
        part = raw.replace("~1", "/").replace("~0", "~")
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError, TypeError):
            raise UnsupportedSchemaError("$ref", ref, "the reference points at nothing") from None
    return node


def _fresh_name(ref: str, taken: dict[str, Any]) -> str:
    base = ref.strip("#/").replace("/", ".") or "root"
    name = base
    for counter in itertools.count(2):
        if name not in taken:
            break
        name = f"{base}.{counter}"
    return name


def _rewrite(node: Any, renamed: dict[str, str], markers: dict[str, Any], names: bool = False) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if not names and isinstance(ref, str) and renamed.get(ref, ref) in markers:
            return markers[renamed.get(ref, ref)]
        rewritten = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and not names:
                rewritten[key] = renamed.get(value, value)
            elif names or key not in LITERALS:
                rewritten[key] = _rewrite(value, renamed, markers, not names and key in NAME_MAPS)
            else:
                rewritten[key] = value
        return rewritten
    if isinstance(node, list):
        return [_rewrite(item, renamed, markers) for item in node]
    return node


# -- the rewrite -----------------------------------------------------------------------------


class _Normalizer:
    def __init__(self, definitions: dict[str, Any]) -> None:
        self.definitions = definitions
        self._inlining: list[str] = []
        # A node met again inside its own normalisation (a recursive schema reached through a
        # merge, which inlines references) becomes a reference to a definition holding it.
        self._in_progress: dict[str, str | None] = {}
        self.recursive_definitions: dict[str, Any] = {}
        self._normalized: dict[str, Any] = {}

    def inline(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        """``node`` with a top-level ``$ref`` replaced by its target merged with the rest."""
        ref = node.get("$ref")
        if not isinstance(ref, str):
            return node
        if ref in self._inlining:
            raise UnsupportedSchemaError("$ref", path, "a recursive reference cannot be merged with other keywords")
        target = self._normalized_definition(ref.removeprefix(f"#/{_DEFS}/"), path)
        self._inlining.append(ref)
        try:
            rest = {key: value for key, value in node.items() if key != "$ref"}
            return self.merge(target, rest, path) if validation_keys(rest) else self.inline(dict(target), path)
        finally:
            self._inlining.pop()

    def _normalized_definition(self, name: str, path: str) -> Any:
        if name not in self.definitions:  # a recursive node's definition, still being built
            raise UnsupportedSchemaError("$ref", path, "a recursive reference cannot be merged with other keywords")
        if name not in self._normalized:
            self._normalized[name] = self.normalize(self.definitions[name], f"#/{_DEFS}/{name}")
        return self._normalized[name]

    def merge(self, first: Any, second: Any, path: str) -> dict[str, Any]:
        return merge_schemas(first, second, path, self.inline)

    def normalize(self, node: Any, path: str) -> Any:
        if not isinstance(node, dict):
            return node
        key = canonical_json(node)
        if key in self._in_progress:
            name = self._in_progress[key] or f"recursive.{len(self.recursive_definitions) + len(self._in_progress)}"
            self._in_progress[key] = name
            return {"$ref": f"#/{_DEFS}/{name}"}
        self._in_progress[key] = None
        try:
            result = self._normalize_node(node, path)
        finally:
            name = self._in_progress.pop(key)
        if name is None:
            return result
        self.recursive_definitions[name] = result
        return {"$ref": f"#/{_DEFS}/{name}"}

    def _normalize_node(self, node: dict[str, Any], path: str) -> Any:
        node = self._normalize_children(node, path)
        node = rewrite_strings(rewrite_regex_groups(node, path), path, self.inline)
        for rewrite in _NODE_REWRITES:
            node = rewrite(node, path)
        if "allOf" in node:
            return self.normalize(self._merge_all_of(node, path), path)
        if "if" in node:
            return self.normalize(self._translate_if(node, path), path)
        if "oneOf" in node:
            return self.normalize(self._one_of_as_any_of(node, path), path)
        if "anyOf" in node and validation_keys(node) != {"anyOf"}:
            return self._distribute(node, path)
        return node

    def _normalize_children(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        node = dict(node)
        for key in _CHILD_MAPS:
            if isinstance(node.get(key), dict):
                node[key] = {name: self._child(sub, f"{path}/{key}/{name}") for name, sub in node[key].items()}
        for key in _CHILD_VALUES:
            if key == "propertyNames" and isinstance(node.get(key), dict) and validation_keys(node[key]) == {"not"}:
                continue  # "none of these names" is the parent's to rewrite (schema_strings, schema_rewrites)
            if isinstance(node.get(key), dict):
                node[key] = self.normalize(node[key], f"{path}/{key}")
        for key in _CHILD_LISTS:
            if isinstance(node.get(key), list):
                node[key] = [self._normalize_entry(sub, f"{path}/{key}/{index}") for index, sub in enumerate(node[key])]
        for key in ("then", "else"):  # "if" stays as written: it is read, never compiled
            if isinstance(node.get(key), dict):
                node[key] = self._normalize_entry(node[key], f"{path}/{key}")
        return node

    def _child(self, sub: Any, path: str) -> Any:
        """A property's schema; ``false`` when no value can satisfy it, which ``finalize``
        turns into a forbidden name (or a refusal when the name is required)."""
        try:
            return self.normalize(sub, path)
        except Unsatisfiable:
            return False

    def _normalize_entry(self, entry: Any, path: str) -> Any:
        """A conditional entry of allOf waits for its parent: only the parent knows the
        values its tested properties can take."""
        if _is_conditional(entry):
            return self._normalize_children(entry, path)
        return self.normalize(entry, path)

    def _merge_all_of(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        entries = node["allOf"]
        if not isinstance(entries, list):
            raise UnsupportedSchemaError("allOf", path, "allOf must be an array of schemas")
        merged: dict[str, Any] = {key: value for key, value in node.items() if key != "allOf"}
        conditionals = []
        for index, entry in enumerate(entries):
            if _is_conditional(entry):
                conditionals.append((index, entry))
            else:
                merged = self.merge(merged, entry, f"{path}/allOf/{index}")
        for index, conditional in conditionals:  # each against everything else, in turn
            merged = self.normalize(self._translate_if({**merged, **conditional}, f"{path}/allOf/{index}"), path)
        return merged

    def _distribute(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        siblings = {key: value for key, value in node.items() if key != "anyOf"}
        branches = []
        for index, branch in enumerate(node["anyOf"]):
            try:
                merged = self.normalize(self.merge(siblings, branch, f"{path}/anyOf/{index}"), path)
            except Unsatisfiable:
                continue  # a branch the siblings rule out
            branches += merged["anyOf"] if validation_keys(merged) == {"anyOf"} else [merged]
        if not branches:
            raise UnsupportedSchemaError("anyOf", path, "no branch is compatible with the keywords beside it")
        if len(branches) > MAX_BRANCHES:
            raise UnsupportedSchemaError("anyOf", path, f"more than {MAX_BRANCHES} branches after merging")
        annotations = {key: value for key, value in node.items() if key not in validation_keys(node)}
        return {**annotations, "anyOf": branches}

    def _one_of_as_any_of(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        siblings = {key: value for key, value in node.items() if key != "oneOf"}
        branches: list[tuple[int, dict[str, Any]]] = []
        for index, branch in enumerate(node["oneOf"]):
            try:
                branches.append((index, self.merge(siblings, branch, f"{path}/oneOf/{index}")))
            except Unsatisfiable:
                continue
        branches = [(index, self._inline_properties(branch, path)) for index, branch in _without_twins(branches, path)]
        if not _pairwise_exclusive(branches):
            branches = _exclusive_by_absence(branches)
        string_branches = strings_exclusive(branches) if not _pairwise_exclusive(branches) else None
        if string_branches is not None:  # string pairs proven disjoint; patterns now as proven
            branches = string_branches
        for (i, left), (j, right) in itertools.combinations(branches, 2):
            if string_branches is not None and string_only(left) and string_only(right):
                continue
            if not (_writes_only_for(left, right) and _writes_only_for(right, left)):
                why = f"branches {i} and {j} can match the same document, and the grammar cannot enforce 'exactly one'"
                raise UnsupportedSchemaError("oneOf", path, why)
        annotations = {key: value for key, value in siblings.items() if key not in validation_keys(siblings)}
        return {**annotations, "anyOf": [branch for _, branch in branches]}

    def _inline_properties(self, branch: dict[str, Any], path: str) -> dict[str, Any]:
        """The branch with its properties' references to (non-recursive) definitions
        resolved, so that the exclusivity rules can read their constants."""
        properties = branch.get("properties")
        if not isinstance(properties, dict):
            return branch
        resolved = {}
        for name, sub in properties.items():
            resolved[name] = sub
            ref = sub.get("$ref") if isinstance(sub, dict) else None
            # Only definitions already normalised: inlining one still in progress would
            # record it as recursive. Anything unresolved is read as unknown by the rules.
            if isinstance(ref, str) and ref.removeprefix(f"#/{_DEFS}/") in self._normalized:
                with contextlib.suppress(UnsupportedSchemaError):
                    resolved[name] = self.inline(sub, f"{path}/properties/{name}")
        return {**branch, "properties": resolved}

    def _translate_if(self, node: dict[str, Any], path: str) -> dict[str, Any]:
        rest = {key: value for key, value in node.items() if key not in ("if", "then", "else")}
        resolved = self.inline(rest, path)
        if validation_keys(resolved) == {"anyOf"}:  # each branch knows its own values: ask each
            conditional = {key: node[key] for key in ("if", "then", "else") if key in node}
            return {**resolved, "anyOf": [{**branch, **conditional} for branch in resolved["anyOf"]]}
        try:
            return self._if_as_cases(node, rest, resolved, path)
        except UnsupportedSchemaError as exact_failed:
            # Stricter: a document satisfying "then" and "else" both satisfies the
            # conditional whichever way its condition goes.
            merged = rest
            try:
                for key in ("then", "else"):
                    if key in node:
                        merged = self.merge(merged, node[key], f"{path}/{key}")
            except UnsupportedSchemaError:
                raise exact_failed from None
            return merged

    def _if_as_cases(
        self, node: dict[str, Any], rest: dict[str, Any], resolved: dict[str, Any], path: str
    ) -> dict[str, Any]:
        cases = []
        for case, holds in _constant_cases(node["if"], resolved, path):
            consequence = node.get("then" if holds else "else", {})
            try:
                cases.append(self.merge(case, consequence, f"{path}/{'then' if holds else 'else'}"))
            except Unsatisfiable:
                continue
        if not cases:
            raise UnsupportedSchemaError("if", path, "neither then nor else can be satisfied")
        return {**rest, "allOf": [{"anyOf": cases}]}


def _is_conditional(entry: Any) -> bool:
    return isinstance(entry, dict) and "if" in entry and validation_keys(entry) <= {"if", "then", "else"}


def _without_twins(branches: list[tuple[int, dict[str, Any]]], path: str) -> list[tuple[int, dict[str, Any]]]:
    """``oneOf`` branches that validate the same documents (the same keywords, annotations
    aside) can never be the only match: any document valid for one is valid for its twin.
    Both go; with none left the ``oneOf`` is unsatisfiable (an optional property holding
    it is then never written)."""
    keys = [canonical_json({k: v for k, v in branch.items() if k in validation_keys(branch)}) for _, branch in branches]
    kept = [entry for entry, key in zip(branches, keys, strict=True) if keys.count(key) == 1]
    if branches and not kept:
        raise Unsatisfiable("oneOf", path, "every branch has a twin, so no document matches exactly one")
    return kept


def _writes_only_for(writer: dict[str, Any], other: dict[str, Any]) -> bool:
    """No document the strict grammar writes for ``writer`` validates against ``other``."""
    writer_types, other_types = type_set(writer), type_set(other)
    if writer_types is not None and other_types is not None and not types_overlap(writer_types, other_types):
        return True
    mine, theirs = finite_values(writer), finite_values(other)
    if mine is not None and theirs is not None and not _overlap(mine, theirs):
        return True
    return writer_types == {"object"} and _object_rules_out(writer, other)


def _pairwise_exclusive(branches: list[tuple[int, dict[str, Any]]]) -> bool:
    return all(
        _writes_only_for(left, right) and _writes_only_for(right, left)
        for (_, left), (_, right) in itertools.combinations(branches, 2)
    )


def _exclusive_by_absence(branches: list[tuple[int, dict[str, Any]]]) -> list[tuple[int, dict[str, Any]]]:
    """Stricter object branches: each forbids the names only the others require, so no
    document it writes has all of another's required names (``{"required": ["src"]}`` /
    ``{"required": ["handle"]}``: src without handle, or handle without src). A branch whose
    required names include another's cannot exclude it and is dropped."""
    required = {index: set(branch.get("required", [])) for index, branch in branches}
    kept = []
    for index, branch in branches:
        others = [names - required[index] for other, names in required.items() if other != index]
        if type_set(branch) != {"object"} or not all(others):
            continue
        forbidden = {name: False for names in others for name in names}
        kept.append((index, {**branch, "properties": {**branch.get("properties", {}), **forbidden}}))
    return kept or branches


def _object_rules_out(writer: dict[str, Any], other: dict[str, Any]) -> bool:
    properties = writer.get("properties", {})
    names = {name for name, schema in properties.items() if not never_written(schema)}
    # the strict grammar writes no other names; a forbidden one closes the object (finalize)
    closed = writer.get("additionalProperties", False) is False or len(names) < len(properties)
    if closed and set(other.get("required", [])) - names:
        return True  # never writes a name the other requires
    for name in writer.get("required", []):
        their_schema = property_schema(other, name)
        if their_schema is None:
            return True  # always writes a name the other forbids
        my_values, their_values = finite_values(properties.get(name)), finite_values(their_schema)
        if my_values is not None and their_values is not None and not _overlap(my_values, their_values):
            return True
    return False


def _overlap(left: list[Any], right: list[Any]) -> bool:
    return any(same_value(value, other) for value in left for other in right)


def _constant_cases(condition: Any, rest: dict[str, Any], path: str) -> Iterator[tuple[dict[str, Any], bool]]:
    """One case per combination of the tested properties' allowed values, and whether the
    ``if`` holds for it. Only ``{"properties": {name: {const|enum}}, "required": [...]}``
    over properties that are always present and whose values are a finite set."""
    why = "only an 'if' that tests always-present properties against constants from a finite set can be enforced"
    if not isinstance(condition, dict) or validation_keys(condition) - {"properties", "required"}:
        raise UnsupportedSchemaError("if", path, why)
    tested = condition.get("properties")
    if not isinstance(tested, dict) or not tested:
        raise UnsupportedSchemaError("if", path, why)
    always_present = set(rest.get("required", []))
    needed = set(condition.get("required", []))
    domains = []
    for name, test in tested.items():
        allowed, accepted = finite_values(property_schema(rest, name)), finite_values(test)
        if allowed is None or accepted is None or validation_keys(test) - {"const", "enum", "anyOf", "type"}:
            raise UnsupportedSchemaError("if", path, why)
        cases = [(name, value, _overlap([value], accepted)) for value in allowed]
        if name not in always_present:  # absent: a properties test holds, a required one fails
            cases.append((name, _ABSENT, name not in needed))
        domains.append(cases)
    combinations = list(itertools.product(*domains))
    if len(combinations) > MAX_BRANCHES:
        raise UnsupportedSchemaError("if", path, f"more than {MAX_BRANCHES} cases")
    for combination in combinations:
        properties = {name: False if value is _ABSENT else {"const": value} for name, value, _ in combination}
        required = [name for name, value, _ in combination if value is not _ABSENT]
        yield {"properties": properties, "required": required}, all(holds for _, _, holds in combination)
