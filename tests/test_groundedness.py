"""The groundedness scorer on hand-made cases of every planted error, on paraphrases that must
pass, on citations, and on the calibration set (its number/entity F1 is the issue's target)."""

from __future__ import annotations

import pytest

from specrag.agent.grounding import GroundednessScorer, ScorerSettings, citation_scores, score
from specrag.evals.studies.calibrate_groundedness import evaluate, load

WITH = (
    'The "with" statement is used to wrap the execution of a block with methods defined by a context manager. '
    'The context manager\'s __enter__() method is invoked. If a target was included in the "with" statement, '
    "the return value from __enter__() is assigned to it. The context manager's __exit__() method is invoked. "
    "If the suite was exited due to an exception, and the return value from the __exit__() method was false, "
    "the exception is reraised."
)
FLOAT = (
    "Floating point numbers are usually implemented using double in C. Python floats have 53 bits of precision. "
    "The integer and exponent parts are always interpreted using radix 10."
)
BREAK = (
    '"break" may only occur syntactically nested in a "for" or "while" loop, but not nested in a function or '
    "class definition within that loop. It terminates the nearest enclosing loop, skipping the optional "
    '"else" clause if the loop has one.'
)

SUPPORTED = {
    "verbatim": (
        "It terminates the nearest enclosing loop, skipping the optional else clause if the loop has one [P1].",
        BREAK,
    ),
    "paraphrase_scope": (
        "You can only use break inside a for or while loop, and not inside a function or class defined in that loop.",
        BREAK,
    ),
    "paraphrase_enter": (
        "When the with block is entered, the context manager's __enter__() runs and whatever it returns "
        "is bound to the target, if there is one.",
        WITH,
    ),
    "paraphrase_float": ("Python floats carry 53 bits of precision and are normally C doubles underneath.", FLOAT),
    "number_kept": ("The integer and exponent parts of a float literal are read in radix 10.", FLOAT),
}

PLANTED = {
    "number": ("Python floats have 64 bits of precision.", FLOAT, "64"),
    "number_word": ("Python floats have fifty bits of precision.", FLOAT, "50"),
    "entity_swapped": (
        "If a target was included in the with statement, the return value from __exit__() is assigned to it.",
        WITH,
        "__exit__",
    ),
    "entity_invented": (
        "If the suite was exited due to an exception, a RuntimeError is raised by the context manager.",
        WITH,
        "runtimeerror",
    ),
    "invented_clause": (
        "break terminates the nearest enclosing loop and is the fastest way to leave nested generator pipelines.",
        BREAK,
        "clause",
    ),
    "negation_dropped": (
        '"break" may occur nested in a function or class definition within that loop.',
        BREAK,
        "negates",
    ),
    "negation_added": ("break does not terminate the nearest enclosing loop.", BREAK, "negates"),
    "wrong_passage": (
        "continue skips the rest of the loop body and starts the next iteration of the loop.",
        BREAK,
        "content words",
    ),
}


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_supported_sentences_pass(name: str) -> None:
    answer, passage = SUPPORTED[name]
    result = score(answer, [passage])
    assert result.score == 1.0, [(s.text, s.reason) for s in result.sentences]


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_each_planted_error_is_flagged_with_its_reason(name: str) -> None:
    answer, passage, reason_part = PLANTED[name]
    result = score(answer, [passage])
    assert result.score == 0.0
    verdict = result.sentences[0]
    assert verdict.supported is False and reason_part in verdict.reason, verdict.reason


def test_one_bad_sentence_among_good_ones_scores_the_fraction() -> None:
    answer = (
        "Python floats have 53 bits of precision [P1]. They are usually implemented using double in C [P1]. "
        "Python floats have 64 bits of precision [P1]."
    )
    result = score(answer, [FLOAT])
    assert [s.supported for s in result.sentences] == [True, True, False]
    assert result.score == pytest.approx(2 / 3)
    assert result.sentences[0].citations == ["P1"]
    assert result.sentences[0].best_passage == 0 and "53 bits" in result.sentences[0].evidence


def test_abstentions_and_fragments_are_not_scored() -> None:
    result = score("The documents do not say which version added it. In short:", [BREAK])
    assert result.score is None and result.scorable == 0
    assert "abstention" in result.sentences[0].reason


def test_a_sentence_is_supported_by_whichever_passage_holds_it() -> None:
    answer = "Python floats have 53 bits of precision. break terminates the nearest enclosing loop."
    result = score(answer, [BREAK, FLOAT])
    assert [s.best_passage for s in result.sentences] == [1, 0]
    assert result.score == 1.0


TUPLE = (
    "The trailing comma is required only to create a single tuple (a.k.a. a\n*singleton*); it is optional in all "
    "other cases.  A single expression\nwithout a trailing comma doesn’t create a tuple, but rather yields the\n"
    'value of that expression. (To create an empty tuple, use an empty pair\nof parentheses: "()".)'
)
LAMBDA = (
    "Lambda expressions (sometimes called lambda forms) are used to create\nanonymous functions. "
    "Note that functions created with lambda expressions cannot contain\nstatements or annotations."
)
DEF = (
    "Note that the lambda\nexpression is merely a shorthand for a simplified function definition. "
    'The “"def"” form is actually more powerful since it\nallows the execution of multiple statements '
    "and annotations."
)


def test_a_sentence_the_passage_contains_word_for_word_is_supported() -> None:
    # The aligned passage sentence ("... doesn't create a tuple") holds a negation the copy does not.
    result = score('(To create an empty tuple, use an empty pair of parentheses: "()".) [P1]', [TUPLE])
    assert result.score == 1.0 and result.sentences[0].reason.startswith("verbatim"), result.sentences[0]


def test_a_sentence_is_supported_when_any_single_passage_supports_it() -> None:
    claim = "A function defined with `def` can contain statements and annotations, while a lambda cannot."
    # LAMBDA shares the most words but reads as negating them; DEF states the claim on its own.
    assert score(claim, [LAMBDA]).score == 0.0
    result = score(claim, [LAMBDA, DEF])
    assert result.score == 1.0 and result.sentences[0].best_passage == 1, result.sentences[0]


def test_no_passages_means_nothing_is_supported() -> None:
    assert score("Python floats have 53 bits of precision.", []).score == 0.0


def test_lexical_mode_needs_the_words_themselves() -> None:
    paraphrase = SUPPORTED["paraphrase_enter"][0]
    assert GroundednessScorer(ScorerSettings(semantic=False)).score(paraphrase, [WITH]).score == 0.0
    assert score(paraphrase, [WITH]).score == 1.0


def test_code_blocks_must_appear_in_a_passage() -> None:
    passage = "Example:\n\n   if __debug__:\n       if not expression: raise AssertionError\n"
    found = score("```python\nif __debug__:\n    if not expression: raise AssertionError\n```", [passage])
    invented = score("```python\nassert_debug(expression, strict=True)\n```", [passage])
    assert (found.score, invented.score) == (1.0, 0.0)


def test_citation_precision_recall_and_unresolved_markers() -> None:
    shown = {"P1": FLOAT, "P2": BREAK}
    answer = (
        "Python floats have 53 bits of precision [P1]. "  # right citation
        "break terminates the nearest enclosing loop [P1]. "  # wrong passage cited
        "The integer and exponent parts are always interpreted using radix 10. "  # supported, uncited
        "break may only occur nested in a for or while loop [P2][P7]."  # right one plus one never shown
    )
    checks = citation_scores(answer, shown)
    assert checks["citations"] == 3 and checks["unresolved"] == 1
    assert checks["precision"] == pytest.approx(2 / 3)
    assert checks["recall"] == pytest.approx(3 / 4)
    assert checks["groundedness"].score == 1.0


def test_a_sentence_joining_two_passages_credits_both_citations() -> None:
    answer = "Python floats have 53 bits of precision, and break terminates the nearest enclosing loop [P1][P2]."
    checks = citation_scores(answer, {"P1": FLOAT, "P2": BREAK})
    assert checks["groundedness"].score == 1.0 and checks["precision"] == 1.0


def test_calibration_set_meets_the_number_and_entity_target() -> None:
    """The issue's target: F1 ≥ 0.9 on planted numbers and entities. Also guards the rest from
    regressing (figures of this scorer: overall F1 0.93, paraphrases flagged 6 of 35)."""
    items = load()
    assert len(items) >= 100
    labels = [item["label"] for item in items]
    assert labels.count("supported") == labels.count("unsupported")
    result = evaluate(items, GroundednessScorer())
    assert result["by_kind"]["number"]["f1"] >= 0.9
    assert result["by_kind"]["entity"]["f1"] >= 0.9
    assert result["f1"] >= 0.9
    assert result["by_kind"]["paraphrase"]["false_positive_rate"] <= 0.25
