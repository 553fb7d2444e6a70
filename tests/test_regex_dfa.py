"""String constraints as automata, checked against Python's ``re`` and ``jsonschema`` as oracles.

Every automaton is compared with Python's matcher on random strings; every rewritten
schema is checked by sampling strings its pattern accepts (random walks over the DFA of
the rewritten regex) and validating each against the *original* schema with jsonschema,
and xgrammar is shown to enforce the rewritten pattern. A planted wrong rule (a negated
pattern read as a whole match instead of the validator's search) is caught.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr

from specrag.decoding import regex_dfa
from specrag.decoding.regex_dfa import ALPHABET, DFA, RegexUnsupported
from specrag.decoding.regex_write import to_regex
from specrag.decoding.schema_merge import UnsupportedSchemaError
from specrag.decoding.schema_normalize import normalize_schema

PATTERNS = [
    r"^(?!org\.bukkit\.)([a-zA-Z_$][a-zA-Z\d_$]*\.)*[a-zA-Z_$][a-zA-Z\d_$]*$",
    r"^(?!@@)[@a-zA-Z0-9_-]+$",
    r"^([0-9]+y)?([0-9]+w)?([0-9]+d)?([0-9]+h)?([0-9]+m)?([0-9]+s)?([0-9]+ms)?$",
    r"^[a-zA-Z0-9](-?[a-zA-Z0-9])*$",
    r"^\d+\.\d+\.\d+(?:[+-]\S+)?$",
    r"a{2,4}b?|[^a-c.]x",
]
LETTERS = "abcxyz.-_@$0129 ymsdorgbukit+>^\t"


def _random_strings(rng: random.Random, count: int = 3000) -> list[str]:
    return ["".join(rng.choice(LETTERS) for _ in range(rng.randint(0, 12))) for _ in range(count)]


def _in_alphabet(text: str) -> bool:
    return all(char in ALPHABET for char in text)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_automata_agree_with_python_re(pattern: str) -> None:
    whole, found = regex_dfa.whole_match(pattern), regex_dfa.search(pattern) if "(?" not in pattern else None
    written = to_regex(whole)
    for text in _random_strings(random.Random(pattern)):
        expected = _in_alphabet(text) and re.fullmatch(pattern, text) is not None
        assert whole.matches(text) == expected, text
        assert (re.fullmatch(written, text) is not None) == expected, (text, written)
        if found is not None:
            assert found.matches(text) == (_in_alphabet(text) and re.search(pattern, text) is not None), text


def test_complement_intersection_and_lengths() -> None:
    names = regex_dfa.literals(["haxe", "all"])
    others = regex_dfa.intersect(regex_dfa.complement(names), regex_dfa.length_between(2, 4))
    for text in _random_strings(random.Random(1)):
        expected = _in_alphabet(text) and text not in ("haxe", "all") and 2 <= len(text) <= 4
        assert others.matches(text) == expected, text
    assert regex_dfa.is_empty(regex_dfa.intersect(names, regex_dfa.length_between(5, None)))
    assert regex_dfa.equivalent(regex_dfa.whole_match("a+"), regex_dfa.whole_match("aa*"))


def test_what_cannot_be_an_automaton_is_refused() -> None:
    for pattern in (r"(a)\1", r"^a(?=b)", r"(?i)abc", r"a^b", "a{300}"):
        with pytest.raises(RegexUnsupported):
            regex_dfa.whole_match(pattern)


def _sample(dfa: DFA, rng: random.Random, count: int = 400, hints: str = "") -> list[str]:
    """Strings the DFA accepts, by random walks that stop at accepting states.

    Most steps take a character from ``hints`` (the schema's own characters) when the
    state allows one: a uniform pick over ~90 printable characters would almost never
    spell the two-letter word a negated pattern forbids, and the check would have no power.
    """
    samples = []
    for _ in range(count * 4):
        state, text = 0, ""
        for _ in range(40):
            if state in dfa.accepting and (not dfa.transitions[state] or rng.random() < 0.25):
                samples.append(text)
                break
            allowed = sorted(dfa.transitions[state])
            hinted = [char for char in allowed if char in hints]
            char = rng.choice(hinted if hinted and rng.random() < 0.8 else allowed)
            text, state = text + char, dfa.transitions[state][char]
        if len(samples) >= count:
            break
    return samples


STRING_SCHEMAS: dict[str, dict[str, Any]] = {
    "lookahead": {"type": "string", "pattern": PATTERNS[0]},
    "pattern and length": {"type": "string", "pattern": PATTERNS[3], "maxLength": 9, "minLength": 2},
    "empty-matching pattern with minLength": {"type": "string", "pattern": PATTERNS[2], "minLength": 1},
    "not of constants and a searched pattern": {
        "type": "string",
        "pattern": "^[A-Za-z0-9_.-]{3,}$",
        "not": {"anyOf": [{"enum": ["haxe", "all"]}, {"pattern": r"\.(zip|hxml)$"}]},
    },
    "not of an unanchored pattern": {"type": "string", "maxLength": 8, "not": {"pattern": "ab"}},
}


def _literal_characters(node: Any) -> str:
    """The characters of a schema's patterns and constants (not its keywords or types)."""
    if isinstance(node, dict):
        return "".join(_literal_characters(value) for key, value in node.items() if key != "type")
    if isinstance(node, list):
        return "".join(_literal_characters(value) for value in node)
    return re.sub(r"[\\^$()|?*+{}]", "", node) if isinstance(node, str) else ""


def _rewritten_pattern(schema: dict[str, Any]) -> str:
    normalized = normalize_schema(schema)
    assert set(normalized) & {"not", "minLength", "maxLength"} == set(), normalized
    return normalized["pattern"]


@pytest.mark.parametrize("name", STRING_SCHEMAS)
def test_every_string_the_rewritten_pattern_admits_validates(name: str) -> None:
    schema = STRING_SCHEMAS[name]
    pattern = _rewritten_pattern(schema)
    samples = _sample(regex_dfa.whole_match(pattern), random.Random(name), hints=_literal_characters(schema))
    assert len(set(samples)) > 20  # not an empty or trivial language
    validator = jsonschema.Draft202012Validator(schema)
    assert [text for text in samples if not validator.is_valid(text)] == []


def test_the_sampling_check_catches_a_negation_read_as_a_whole_match(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted bug: "not: {pattern: ab}" negated as a whole match excludes only "ab"
    itself, so "xab" would be written, and jsonschema (search semantics) rejects it."""
    monkeypatch.setattr(regex_dfa, "search", regex_dfa.whole_match)
    schema = STRING_SCHEMAS["not of an unanchored pattern"]
    samples = _sample(
        regex_dfa.whole_match(_rewritten_pattern(schema)), random.Random(0), hints=_literal_characters(schema)
    )
    validator = jsonschema.Draft202012Validator(schema)
    assert [text for text in samples if not validator.is_valid(text)]


def test_property_names_outside_a_list_and_string_oneof() -> None:
    schema = {
        "type": "object",
        "properties": {"$schema": {"type": "string"}},
        "propertyNames": {"not": {"enum": ["ignore", "linters"]}},
        "additionalProperties": {"type": "integer"},
    }
    names = next(iter(normalize_schema(schema)["patternProperties"]))
    assert re.fullmatch(names, "src") and not re.fullmatch(names, "ignore") and re.fullmatch(names, "ignored")
    versions = {
        "oneOf": [
            {"enum": ["any", ""]},
            {"type": "string", "pattern": r"^\d+\.\d+\.\d+$"},
            {"type": "string", "pattern": r"^\^\d+\.\d+\.\d+$"},
        ]
    }
    assert len(normalize_schema(versions)["anyOf"]) == 3  # disjoint: "exactly one" holds by construction
    # "1.2" matches both as a validator reads them, but the grammar writes each pattern
    # whole ("1" or ".1"), and neither written string is accepted by the other branch.
    unanchored = {"oneOf": [{"type": "string", "pattern": r"^\d"}, {"type": "string", "pattern": r"\.\d$"}]}
    written = [branch["pattern"] for branch in normalize_schema(unanchored)["anyOf"]]
    assert [re.fullmatch(pattern, "1.2") for pattern in written] == [None, None]
    with pytest.raises(UnsupportedSchemaError, match="oneOf"):  # "7" is written for both: refused
        normalize_schema(
            {"oneOf": [{"type": "string", "pattern": r"^\d+$"}, {"type": "string", "pattern": "^[0-9a-f]+$"}]}
        )


def _xgrammar_accepts(schema: dict[str, Any], document: Any) -> bool:
    """Whether xgrammar's matcher accepts the whole document."""
    info = xgr.TokenizerInfo([chr(code) for code in range(32, 127)], vocab_type=xgr.VocabType.RAW)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False)
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(json.dumps(document)) and matcher.is_completed()


def test_xgrammar_enforces_the_rewritten_pattern() -> None:
    schema = normalize_schema(STRING_SCHEMAS["lookahead"])
    assert _xgrammar_accepts(schema, "com.example.Main")
    assert not _xgrammar_accepts(schema, "org.bukkit.Main")  # the lookahead, now in the pattern
    negated = normalize_schema(STRING_SCHEMAS["not of constants and a searched pattern"])
    assert _xgrammar_accepts(negated, "lime.core") and not _xgrammar_accepts(negated, "haxe")
    assert not _xgrammar_accepts(negated, "pack.zip")
