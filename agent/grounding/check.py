"""The run's own groundedness check: mark, or withhold, an answer the passages do not hold.

The answerability probe reads the model's P(no) before it answers, and for qwen2.5-coder-0.5b
that is chance (AUROC 0.47). Checking what the model did write works with any model: the
answer's sentences are scored against the evidence the run showed (its passages and its tool
results) by the groundedness scorer, the same one the evals report, and an answer whose share
of supported claims is below ``min_supported`` is not grounded. A model answering an
unanswerable question from memory writes claims the passages do not hold; one answering from
the passages mostly copies or rewords them.

Modes, per request (``RunOptions.grounding``):

- ``"mark"`` (the default): the answer is returned as written, with ``grounding.grounded`` and
  the unsupported sentences; streaming is unchanged.
- ``"abstain"``: an answer that is not grounded is replaced by ``ABSTENTION``; the answer the
  model wrote is kept in ``grounding.withheld_answer``. The answer is then not streamed token by
  token: it is sent whole once checked (a streamed answer cannot be taken back).
- ``"off"``: no check.

An answer with no scorable claim (an abstention, a bare "Yes.") is grounded: there is nothing
in it to be wrong.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from specrag.agent.grounding import text_match as tm
from specrag.agent.grounding.types import GroundednessResult

GROUNDING_MODES = ("off", "mark", "abstain")
# Measured: the share of supported claims below which an answer is not grounded (docs/evals.md,
# "Grounded answers on documents nobody here has seen"; python -m specrag.evals.studies.grounding_gate).
DEFAULT_MIN_SUPPORTED = 0.5
_WORD = re.compile(r"[A-Za-z0-9]")


def is_grounded(result: GroundednessResult, min_supported: float) -> bool:
    """Supported claims ÷ scorable claims reaches ``min_supported``; nothing scorable is
    grounded, unless the answer says nothing at all (a bare "[P1]")."""
    if not any(_WORD.search(tm.strip_citations(sentence.text)) for sentence in result.sentences):
        return False
    return result.score is None or result.score >= min_supported


def grounding_record(result: GroundednessResult, min_supported: float) -> dict[str, Any]:
    """The run result's ``grounding`` field: the verdict and the sentences that failed it."""
    return {
        "grounded": is_grounded(result, min_supported),
        "score": result.score,
        "scorable": result.scorable,
        "min_supported": min_supported,
        "unsupported": [
            {"text": sentence.text, "reason": sentence.reason}
            for sentence in result.sentences
            if sentence.supported is False
        ],
    }


def tool_evidence(name: str, arguments: Mapping[str, Any], content: str) -> str:
    """A tool call and its result as a sentence: an answer states the values it was called
    with as well as what it returned ("1234 plus 4321 is 5555")."""
    called = ", ".join(f"{key} {value}" for key, value in arguments.items())
    with_arguments = f" called with {called}" if called else ""
    return f"The {name} tool{with_arguments} returned {content}"


def evidence_texts(passages: Sequence[str], tool_results: Sequence[str]) -> list[str]:
    """What an answer may rest on: the passages shown and the tool results the model read."""
    return [*passages, *(text for text in tool_results if text.strip())]


def check_answer(
    answer: str, question: str, evidence: Sequence[str], embedder: Any, min_supported: float, judge: Any = None
) -> dict[str, Any]:
    """Score ``answer`` against ``evidence`` (a scorer per run: its passage cache dies with it)."""
    from specrag.agent.grounding.scorer import GroundednessScorer

    result = GroundednessScorer(embedder=embedder, judge=judge).score(answer, evidence, question)
    return grounding_record(result, min_supported)
