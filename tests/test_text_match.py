"""String pieces of the groundedness scorer: sentences, numbers, code names, negation, answers."""

from __future__ import annotations

import pytest

from specrag.agent.grounding import text_match as tm


def test_sentences_keep_their_citations_and_code_blocks() -> None:
    text = "First claim holds [P1]. break ends the loop [P2], [P3]. See e.g. the docs."
    text += "\n```py\nx = 1. y\n```\n- a list item"
    assert tm.split_sentences(text) == [
        "First claim holds [P1].",
        "break ends the loop [P2], [P3].",
        "See e.g. the docs.",
        "```py\nx = 1. y\n```",
        "a list item",
    ]
    assert tm.split_sentences("One claim. Another claim. [P2]") == ["One claim.", "Another claim. [P2]"]
    assert tm.split_sentences("One claim. [P1] [P2] Next one.") == ["One claim. [P1] [P2]", "Next one."]
    assert tm.cited_labels("x [P2] y [P1] z [P2]") == ["P2", "P1"]


def test_numbers_are_canonical_and_number_words_count() -> None:
    assert tm.numbers("53 bits, 1,000 items, 3.6 and 3.10, twelve of them, 1e3") == {
        "53",
        "1000",
        "3.6",
        "3.1",  # 3.10 reads as the number 3.1: a version string is not told apart
        "12",
        "1000.0",
    }
    assert tm.numbers("one of them; utf-8 [P12]") == {"8"}  # "one" is rarely a count; markers are not numbers
    assert tm.numbers("seven days", words=False) == set()


def test_code_names_are_names_not_prose_words() -> None:
    text = 'Raises ValueError; calls obj.__enter__() and len(); the "finally" clause; the "termination" model; floats'
    assert tm.code_names(text) == {"valueerror", "__enter__", "len", "finally"}
    assert tm.code_names("the continue statement skips; e.g. this") == {"continue"}


def test_negation_scope_stops_at_clause_boundaries() -> None:
    assert tm.negation_scopes("If it is not supported, it should return NotImplemented.") == [{"support"}]
    assert tm.negation_scopes("Underscores don't affect the value of the literal") == [{"affect", "valu", "literal"}]
    assert tm.negation_scopes("Names aren’t imported") == [{"import"}]


def test_negation_conflicts_both_ways_and_prefix_antonyms() -> None:
    evidence = "Setting method attributes on bound methods is disallowed."
    assert tm.negation_conflict("Setting attributes on bound methods is allowed.", evidence, [evidence])
    plain = "Consecutive delimiters are grouped together."
    negated = "Consecutive delimiters are not grouped together."
    assert tm.negation_conflict(plain, negated, [negated])  # the evidence negates, the claim drops it
    assert tm.negation_conflict(negated, plain, [plain])  # the claim adds a negation
    assert tm.negation_conflict(negated, negated, [negated]) is None


@pytest.mark.parametrize(
    "text",
    [
        "The documents do not say which version introduced it.",
        "This is not covered in the provided passages.",
        "I don't know.",
        "The passages don't mention the GIL.",
        "There is no information about pip here.",
    ],
)
def test_abstentions_are_recognised(text: str) -> None:
    assert tm.is_abstention(text)


@pytest.mark.parametrize("text", ["A break statement does not end the program.", "It is not in the loop body."])
def test_ordinary_negations_are_not_abstentions(text: str) -> None:
    assert not tm.is_abstention(text)


def test_token_f1_and_exact_match_follow_squad() -> None:
    assert tm.token_f1("The ValueError [P1].", "ValueError") == 1.0
    assert tm.exact_match("the ValueError", "ValueError!")
    precision, recall = 1 / 3, 1 / 2
    assert tm.token_f1("raises a TypeError here", "raises ValueError") == pytest.approx(
        2 * precision * recall / (precision + recall)
    )
    assert tm.token_f1("", "x") == 0.0


def test_stems_join_inflections() -> None:
    assert {tm.stem(w) for w in ("terminate", "terminates", "terminated", "terminating")} == {"terminat"}
    assert tm.stem("class") == "class" and tm.stem("classes") == "class"


def test_a_bound_is_not_a_negation() -> None:
    assert not tm.has_negation("Have no more than 5 graphs on a console.")
    assert not tm.negation_scopes("Keep it to not more than 5 lines per graph.")
    assert tm.has_negation("Have no graphs on a console.")
