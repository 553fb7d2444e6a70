"""String keywords xgrammar does not enforce, folded into one ``pattern`` it does.

xgrammar 0.2.9 ignores ``minLength``/``maxLength`` beside a ``pattern``, cannot read a
lookahead, and has no ``not``. For strings all of these are regular languages, so
``rewrite_strings`` intersects them (``decoding/regex_dfa.py``) and writes the result back
as one plain regex (``decoding/regex_write.py``):

- a pattern xgrammar cannot read (a lookahead at its start), or one beside a length bound,
  becomes the regex of "matches the pattern whole, and has that length";
- ``not`` of string constants, of a pattern, or of an ``anyOf`` of those, beside a string
  type, is intersected in as a complement (the negated pattern read with the validator's
  search semantics, so the complement is exact);
- ``propertyNames: {not: {enum}}`` over an object whose other names follow
  ``additionalProperties`` becomes a ``patternProperties`` entry for "any name but those";
- ``patternProperties`` keys with a lookahead are rewritten the same way.

Every rewritten string is over ``regex_dfa.ALPHABET`` (printable ASCII without ``"`` and
``\\``), a stricter language than the schema's: what the grammar writes always validates.
When a readable pattern's matches all have an allowed length already (``^[a-z]{3,}$``
beside ``minLength: 3``, by Python's own width bound) the pattern is kept as written and
the redundant length dropped.
"""

from __future__ import annotations

import re
import re._parser as sre_parse
from collections.abc import Callable
from typing import Any

from specrag.decoding import regex_dfa
from specrag.decoding.regex_dfa import DFA, RegexUnsupported
from specrag.decoding.regex_write import to_regex
from specrag.decoding.schema_merge import Unsatisfiable, UnsupportedSchemaError, validation_keys

Inline = Callable[[dict[str, Any], str], dict[str, Any]]

# What xgrammar 0.2.9 cannot read in a pattern: any "(?" group but "(?:", or a backreference.
UNREADABLE_REGEX = re.compile(r"\(\?(?!:)|\\[1-9]")
_LENGTHS = ("minLength", "maxLength")


def rewrite_strings(node: dict[str, Any], path: str, inline: Inline) -> dict[str, Any]:
    """``node`` with its string constraints in one enforceable pattern (see the module doc)."""
    node = _rewrite_pattern_keys(node, path)
    node = _rewrite_property_names(node, path)
    pattern = node.get("pattern") if isinstance(node.get("pattern"), str) else None
    lengths = pattern is not None and any(key in node for key in _LENGTHS)
    negated = _negated_strings(node, path, inline)
    specials = pattern is not None and _names_json_specials(pattern)
    unreadable = pattern is not None and (UNREADABLE_REGEX.search(pattern) or specials)
    if not (lengths or negated is not None or unreadable):
        return node
    rest = {key: value for key, value in node.items() if key not in (*_LENGTHS, "not", "pattern")}
    if negated is None and pattern is not None and not specials and _lengths_implied(pattern, node):
        return {**rest, "pattern": pattern}  # every match already has an allowed length
    keyword = "not" if negated is not None else "pattern"
    try:
        language = regex_dfa.whole_match(pattern) if pattern is not None else regex_dfa.length_between(0, None)
        bounded = regex_dfa.intersect(language, _length_language(node))
        constrained = bounded if negated is None else regex_dfa.intersect(bounded, regex_dfa.complement(negated))
        if regex_dfa.is_empty(constrained):  # e.g. a pattern that needs a backslash: never written
            raise Unsatisfiable(keyword, path, "no string the grammar can write satisfies it")
        rewritten_pattern = to_regex(constrained)
    except RegexUnsupported as why:
        raise UnsupportedSchemaError(keyword, path, f"cannot be enforced: {why}") from None
    return {**rest, "pattern": rewritten_pattern}


def _names_json_specials(pattern: str) -> bool:
    """Whether ``pattern`` names a backslash or a double quote as a literal character.
    xgrammar 0.2.9 matches such a literal against the JSON text, not the string it
    encodes: for ``\\w+[\\\\]\\w+`` it wrote ``"a\\bc"`` (a backspace: the answer failed
    validation) and for ``a"b`` the broken JSON ``"a"b"``. Ranges, negated classes and
    ``.`` leave both characters out there, which is stricter and safe."""
    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError):
        return False
    return _has_special_literal(parsed)


def _has_special_literal(items: Any) -> bool:
    for op, value in items:
        if op is sre_parse.LITERAL and value in (ord('"'), ord("\\")):
            return True
        if op is sre_parse.IN and any(kind is sre_parse.LITERAL and v in (ord('"'), ord("\\")) for kind, v in value):
            return True
        children = value if isinstance(value, (list, tuple)) else ()
        for child in children:  # groups, repeats and the alternatives of a branch
            nested = child if isinstance(child, list) else [child]
            if any(isinstance(sub, sre_parse.SubPattern) and _has_special_literal(sub) for sub in nested):
                return True
    return False


def _lengths_implied(pattern: str, node: dict[str, Any]) -> bool:
    """Whether every whole match of a readable ``pattern`` has a length the node allows
    (Python's parser bounds a regex's width in characters, Unicode included)."""
    if UNREADABLE_REGEX.search(pattern):
        return False
    try:
        shortest, longest = sre_parse.parse(pattern).getwidth()
    except (re.error, RecursionError, OverflowError):
        return False
    high = node.get("maxLength")
    return shortest >= node.get("minLength", 0) and (high is None or longest <= high)


def _length_language(node: dict[str, Any]) -> DFA:
    low, high = node.get("minLength", 0), node.get("maxLength")
    if not isinstance(low, int) or not (high is None or isinstance(high, int)):
        raise RegexUnsupported("minLength and maxLength must be integers")
    return regex_dfa.length_between(low, high)


def _negated_strings(node: dict[str, Any], path: str, inline: Inline) -> DFA | None:
    """The language ``not`` excludes, when the node is a string and ``not`` speaks of
    strings only; None when ``not`` is absent or left to ``schema_rewrites.rewrite_not``."""
    if "not" not in node or node.get("type") != "string" or "enum" in node or "const" in node:
        return None
    if not isinstance(node["not"], dict):
        return None
    try:
        return _excluded(inline(node["not"], f"{path}/not"), f"{path}/not", inline)
    except RegexUnsupported as why:
        raise UnsupportedSchemaError("not", path, f"cannot be enforced: {why}") from None


def _excluded(negated: dict[str, Any], path: str, inline: Inline) -> DFA:
    """Strings ``negated`` accepts (so the rest is its complement); RegexUnsupported beyond
    string constants, patterns and ``anyOf`` of those."""
    keys = validation_keys(negated) - {"type"}
    if negated.get("type", "string") != "string":
        raise RegexUnsupported("'not' of a non-string type beside a string")
    if keys == {"anyOf"} and isinstance(negated["anyOf"], list):
        parts = [
            _excluded(inline(branch, f"{path}/anyOf/{i}"), path, inline) for i, branch in enumerate(negated["anyOf"])
        ]
        return regex_dfa.complement(_intersect_all([regex_dfa.complement(part) for part in parts]))
    if keys in ({"enum"}, {"const"}):
        values = negated["enum"] if "enum" in negated else [negated["const"]]
        return regex_dfa.literals(value for value in values if isinstance(value, str))
    if keys and keys <= {"pattern", *_LENGTHS} and isinstance(negated.get("pattern", ""), str):
        found = regex_dfa.search(negated["pattern"]) if "pattern" in negated else regex_dfa.length_between(0, None)
        return regex_dfa.intersect(found, _length_language(negated))
    raise RegexUnsupported(f"'not' of {sorted(keys) or 'anything'}")


def _intersect_all(languages: list[DFA]) -> DFA:
    result = languages[0]
    for language in languages[1:]:
        result = regex_dfa.intersect(result, language)
    return result


def _rewrite_pattern_keys(node: dict[str, Any], path: str) -> dict[str, Any]:
    patterns = node.get("patternProperties")
    if not isinstance(patterns, dict) or not any(UNREADABLE_REGEX.search(key) for key in patterns):
        return node
    rewritten = {}
    for key, schema in patterns.items():
        try:
            rewritten[to_regex(regex_dfa.whole_match(key)) if UNREADABLE_REGEX.search(key) else key] = schema
        except RegexUnsupported as why:
            raise UnsupportedSchemaError("patternProperties", path, f"{key!r} cannot be enforced: {why}") from None
    return {**node, "patternProperties": rewritten}


def _rewrite_property_names(node: dict[str, Any], path: str) -> dict[str, Any]:
    """``propertyNames: {not: {enum}}`` where unlisted names follow ``additionalProperties``:
    those names as a pattern property ("none of these"), the object closed otherwise."""
    names = node.get("propertyNames")
    additional = node.get("additionalProperties", True)
    if not isinstance(names, dict) or set(names) != {"not"} or additional is False or node.get("patternProperties"):
        return node
    negated = names["not"]
    if not isinstance(negated, dict) or validation_keys(negated) - {"enum", "const", "type"}:
        return node
    values = negated.get("enum", [negated.get("const")])
    strings = [value for value in values if isinstance(value, str)]
    try:
        others = to_regex(regex_dfa.complement(regex_dfa.literals(strings)))
    except RegexUnsupported as why:
        raise UnsupportedSchemaError("not", f"{path}/propertyNames", f"cannot be enforced: {why}") from None
    properties = {name: schema for name, schema in node.get("properties", {}).items() if name not in strings}
    rest = {key: value for key, value in node.items() if key != "propertyNames"}
    schema = {} if additional is True else additional
    return {**rest, "properties": properties, "patternProperties": {others: schema}, "additionalProperties": False}


# -- oneOf over strings --------------------------------------------------------------------------

_STRING_KEYS = frozenset({"type", "pattern", "minLength", "maxLength", "enum", "const"})


def strings_exclusive(branches: list[tuple[int, dict[str, Any]]]) -> list[tuple[int, dict[str, Any]]] | None:
    """The ``oneOf`` branches, with every string pattern rewritten to what this module
    models, when each pair of string-only branches is disjoint: no string one branch writes
    is accepted by another (the other read as a validator reads it). None when some pair of
    string branches overlaps or cannot be decided. Non-string pairs are left to the caller."""
    rewritten = []
    languages: dict[int, tuple[DFA, DFA]] = {}
    try:
        for index, branch in branches:
            if not string_only(branch):
                rewritten.append((index, branch))
                continue
            written, accepted = _written_language(branch), _accepted_language(branch)
            languages[index] = (written, accepted)
            as_proven = {key: value for key, value in branch.items() if key not in _LENGTHS}
            rewritten.append((index, {**as_proven, "pattern": to_regex(written)} if "pattern" in branch else branch))
    except RegexUnsupported:
        return None
    for left, (written, _) in languages.items():
        for right, (_, accepted) in languages.items():
            if left != right and not regex_dfa.is_empty(regex_dfa.intersect(written, accepted)):
                return None
    return rewritten


def string_only(schema: dict[str, Any]) -> bool:
    if validation_keys(schema) - _STRING_KEYS:
        return False
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values is not None:
        return all(isinstance(value, str) for value in values)
    return schema.get("type") == "string"


def _written_language(schema: dict[str, Any]) -> DFA:
    """What the grammar writes for a string-only schema (a pattern matched whole)."""
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values is not None:
        return _exact_literals(values)
    pattern = schema.get("pattern")
    language = regex_dfa.whole_match(pattern) if isinstance(pattern, str) else regex_dfa.length_between(0, None)
    return regex_dfa.intersect(language, _length_language(schema))


def _accepted_language(schema: dict[str, Any]) -> DFA:
    """What a validator accepts of a string-only schema (a pattern found anywhere)."""
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values is not None:
        return _exact_literals(values)
    pattern = schema.get("pattern")
    language = regex_dfa.search(pattern) if isinstance(pattern, str) else regex_dfa.length_between(0, None)
    return regex_dfa.intersect(language, _length_language(schema))


def _exact_literals(values: list[str]) -> DFA:
    """Exactly these strings; RegexUnsupported when one has a character outside ALPHABET,
    which the automaton could not hold (a proof over it would miss that string)."""
    if any(char not in regex_dfa.ALPHABET for value in values for char in value):
        raise RegexUnsupported("a constant outside printable ASCII")
    return regex_dfa.literals(values)
