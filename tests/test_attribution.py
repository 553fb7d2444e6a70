"""Post-hoc citations (agent/attribution.py): where sentences are cut, where markers go, which
passage a sentence cites and when it cites none; the loop's option and its validation."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pytest

from specrag.agent.attribution import Attributor, attribution_record, sentence_spans, strip_markers, with_marker
from specrag.agent.loop import RunOptions

_WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class Shown:
    label: str
    id: str
    text: str


class BagOfWords:
    """A stand-in embedder: normalised word counts over a fixed vocabulary, so cosines are exact
    and easy to reason about (the real MiniLM is tested below)."""

    def __init__(self, vocabulary: frozenset[str]) -> None:
        self.index = {word: i for i, word in enumerate(sorted(vocabulary))}
        self.calls = 0

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        self.calls += 1
        rows = np.zeros((len(texts), len(self.index)))
        for row, text in enumerate(texts):
            for word in _WORD.findall(text.lower()):
                if word in self.index:  # other words carry no meaning here
                    rows[row, self.index[word]] += 1
        return rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)


PASSAGES = [
    Shown("P1", "a#0", "The break statement ends the nearest enclosing loop. It skips the else clause."),
    Shown("P2", "b#0", "The pass statement does nothing when it is executed."),
]
VOCABULARY = frozenset(
    {"break", "statement", "ends", "nearest", "enclosing", "loop", "skips", "else", "clause"}
    | {"pass", "does", "nothing", "when", "executed"}
)


def spans_text(text: str) -> list[str]:
    return [text[start:end] for start, end in sentence_spans(text)]


def test_sentences_span_wrapped_lines_but_not_list_items_or_code() -> None:
    text = (
        "The break statement ends the nearest\nenclosing loop. It skips [P1] the else clause. [P1]\n\n"
        "- first item here.\n- second item, e.g. this one.\n```python\nx = 1. y = 2\n```\nAfter the code."
    )
    assert spans_text(text) == [
        "The break statement ends the nearest\nenclosing loop.",
        "It skips [P1] the else clause. [P1]",
        "- first item here.",
        "- second item, e.g. this one.",
        "After the code.",
    ]


def test_markers_are_replaced_before_the_final_punctuation() -> None:
    assert with_marker("It skips the else clause. [P1], [P3]", "P2") == "It skips the else clause [P2]."
    assert with_marker("It skips [P4] the else clause", "P2") == "It skips the else clause [P2]"
    assert with_marker("It skips the else clause [P1].", None) == "It skips the else clause."
    assert strip_markers("a [P1], [P2] b [P3]") == "a b"


def test_each_sentence_cites_the_passage_closest_in_meaning() -> None:
    answer = "The pass statement does nothing [P1]. The break statement ends the nearest loop."
    attributed, choices = Attributor(BagOfWords(VOCABULARY)).attribute(answer, PASSAGES, min_similarity=0.5)
    assert attributed == "The pass statement does nothing [P2]. The break statement ends the nearest loop [P1]."
    assert [choice.label for choice in choices] == ["P2", "P1"]
    assert choices[0].model_labels == ("P1",) and choices[1].model_labels == ()
    assert all(0.5 <= choice.similarity <= 1.0 for choice in choices)


def test_below_the_threshold_a_sentence_cites_nothing_and_its_old_marker_goes() -> None:
    answer = "Tuples are immutable sequences of objects [P2]."
    attributed, choices = Attributor(BagOfWords(VOCABULARY)).attribute(answer, PASSAGES, min_similarity=0.5)
    assert attributed == "Tuples are immutable sequences of objects."
    assert choices[0].label is None and choices[0].similarity < 0.5


def test_only_markers_change_and_code_and_short_sentences_are_left_alone() -> None:
    code = "```python\nfor x in y:\n    break  # [P9]\n```\n"
    answer = f"Yes [P2].\n\n{code}The pass statement does nothing when executed."
    attributed, choices = Attributor(BagOfWords(VOCABULARY)).attribute(answer, PASSAGES, min_similarity=0.5)
    assert attributed.startswith(f"Yes [P2].\n\n{code}")  # untouched
    assert attributed.endswith("does nothing when executed [P2].")
    assert [choice.text for choice in choices] == ["The pass statement does nothing when executed."]
    record = attribution_record(0.5, answer, choices)
    assert record["model_answer"] == answer and record["sentences"][0]["model_labels"] == []


def test_a_passage_is_embedded_once_across_runs() -> None:
    embedder = BagOfWords(VOCABULARY)
    attributor = Attributor(embedder)
    attributor.attribute("The pass statement does nothing at all.", PASSAGES)
    first = embedder.calls
    attributor.attribute("The break statement ends the loop here.", PASSAGES)
    assert embedder.calls == first + 1  # only the new answer's sentences


def test_with_the_real_embedder_a_paraphrase_cites_its_source() -> None:
    from specrag.retrieval import Embedder

    passages = [
        Shown("P1", "x#0", "Strings are immutable sequences of Unicode code points."),
        Shown("P2", "y#0", "The with statement wraps the execution of a block with methods of a context manager."),
    ]
    answer = (
        "A context manager's methods wrap the block run by a with statement. "
        "A str is an immutable sequence of Unicode characters."
    )
    attributed, choices = Attributor(Embedder()).attribute(answer, passages, min_similarity=0.5)
    assert [choice.label for choice in choices] == ["P2", "P1"], choices
    assert attributed.count("[P2]") == 1 and attributed.count("[P1]") == 1


def test_run_options_validate_the_citation_mode_and_threshold() -> None:
    with pytest.raises(ValueError, match="citations must be one of model, attribute"):
        RunOptions(citations="post-hoc")
    with pytest.raises(ValueError, match="citation_min_similarity"):
        RunOptions(citations="attribute", citation_min_similarity=1.5)
    assert RunOptions().citations == "attribute"


def test_the_sweep_re_cites_saved_answers_and_picks_the_lowest_threshold_meeting_the_target() -> None:
    from specrag.evals.studies.attribution_sweep import choose, sweep

    record = {
        "passages": [{"label": p.label, "id": p.id, "text": p.text} for p in PASSAGES],
        "model_answer": "The pass statement does nothing when it is executed [P1].",
        "answer": "ignored when model_answer is present",
    }
    rows = sweep([{"id": "g001", **record}, {"id": "g002", **record}], BagOfWords(VOCABULARY), thresholds=(0.5, 1.01))
    assert rows[0]["dev"] == rows[0]["held_out"] == {"pairs": 1, "precision": 1.0}  # re-cited to P2, which holds it
    assert rows[1]["dev"] == {"pairs": 0, "precision": None}  # nothing reaches a cosine above 1
    assert choose(rows, 0.9) == 0.5
    low, high = {"pairs": 10, "precision": 0.8}, {"pairs": 5, "precision": 0.9}
    assert choose([{"threshold": 0.8, "dev": high}, {"threshold": 0.7, "dev": low}], 0.9) == 0.8
    assert choose([{"threshold": 0.7, "dev": low}], 0.9) is None
