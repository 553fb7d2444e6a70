"""The groundedness scorer's settings, verdicts and passages prepared once per answer."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from specrag.agent.grounding import text_match as tm

MIN_CONTENT_STEMS = 3  # fewer content words than this is not a claim ("Yes.", "In short:")
TOO_SHORT = "too short to be a claim"
NLI_CANDIDATES = 4  # passage windows (closest by cosine) the NLI judge reads per sentence
RESTATEMENT_NEW_STEMS = 4  # content stems beyond the question's that a restatement may add
NUMBER_CONTEXT = 0.2  # share of a claim's words around a number where a passage states it
SWAP_ALIGNMENT = 0.6  # share of a claim's words in one passage sentence for "same statement, other value"


@dataclass(frozen=True)
class ScorerSettings:
    lexical_coverage: float = 0.85  # this share of content stems in the evidence is support on its own
    min_coverage: float = 0.4  # below this share, no similarity rescues a sentence
    min_similarity: float = 0.55  # cosine to the closest passage sentence (or pair) in between
    verbatim_coverage: float = 0.9  # in-order share that counts as a near-verbatim span
    clause_coverage: float = 0.25  # a clause of a paraphrase needs this share of its words in some passage
    semantic: bool = True  # False: lexical only (a sentence needs lexical_coverage)
    min_entailment: float = 0.5  # with an NLI judge: P(entailment) that supports an in-between sentence
    min_judge_support: float = 0.4  # with a support judge (agent/grounding/support_judge.py): P(yes) a claim needs


@dataclass
class SentenceVerdict:
    text: str
    supported: bool | None  # None: not scorable (abstention, too short)
    best_passage: int | None  # index into the passages
    evidence: str  # the passage sentence the claim aligns with
    reason: str
    coverage: float = 0.0
    citations: list[str] = field(default_factory=list)  # "P1" markers carried by the sentence

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GroundednessResult:
    score: float | None  # supported ÷ scorable; None when nothing is scorable
    sentences: list[SentenceVerdict]

    @property
    def scorable(self) -> int:
        return sum(1 for sentence in self.sentences if sentence.supported is not None)

    @property
    def supported(self) -> int:
        return sum(1 for sentence in self.sentences if sentence.supported)

    def as_dict(self) -> dict[str, Any]:
        return {"score": self.score, "scorable": self.scorable, "sentences": [s.as_dict() for s in self.sentences]}


@dataclass(frozen=True)
class PreparedPassage:
    """A passage's text with its stems, numbers, identifiers and sentences, computed once."""

    text: str
    stems: frozenset[str]
    ordered_stems: tuple[str, ...]
    numbers: frozenset[str]
    identifiers: frozenset[str]
    sentences: tuple[str, ...]

    @classmethod
    def of(cls, text: str) -> PreparedPassage:
        ordered = tuple(tm.content_stems(text))
        return cls(
            text,
            frozenset(ordered),
            ordered,
            frozenset(tm.numbers(text)),
            frozenset(tm.identifier_tokens(text)),
            tuple(tm.split_passage_sentences(text)),
        )
