"""Groundedness without a judge model: is each sentence of an answer supported by the passages?

The formula is RAGAS faithfulness (supported sentences ÷ scorable sentences) so figures compare;
the judge is string evidence plus a sentence embedding instead of an LLM, checked in the order
a reviewer would:

1. a number in no passage, or another number than the aligned passage sentence states → unsupported;
2. a code name (exception, dunder, dotted name, keyword named as such) in no passage, or swapped
   for the one the aligned sentence uses → unsupported;
3. negation: the claim negates what the evidence states, or drops a negation → unsupported;
4. near-verbatim (its content stems in order inside one passage) → supported;
5. content: stem coverage by the best passage (or best two, for a sentence joining two facts)
   ≥ ``lexical_coverage`` → supported; below ``min_coverage`` → unsupported; in between, the
   sentence must be close in meaning to a passage sentence (MiniLM cosine ≥ ``min_similarity``),
   or, with an NLI judge (``nli=``, evals/nli.py, local weights only), entailed by one of the
   ``NLI_CANDIDATES`` passage windows closest in meaning (P ≥ ``min_entailment``).

Thresholds were tuned on the odd half of the calibration set (evals/calibrate_groundedness.py
reports the held-out half too). What it cannot see: a claim that reuses the passage's words
with a changed meaning beyond negation (swapped subject and object, "before" for "after"), and
negation said with other words ("is forbidden" for "is not allowed"). Sentences that say the
documents do not answer are abstentions, not claims: they are not scored.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from evals import text_match as tm

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
    min_judge_support: float = 0.4  # with a support judge (agent/support_judge.py): P(yes) a claim needs


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
class _Passage:
    text: str
    stems: frozenset[str]
    ordered_stems: tuple[str, ...]
    numbers: frozenset[str]
    identifiers: frozenset[str]
    sentences: tuple[str, ...]

    @classmethod
    def of(cls, text: str) -> _Passage:
        ordered = tuple(tm.content_stems(text))
        return cls(
            text,
            frozenset(ordered),
            ordered,
            frozenset(tm.numbers(text)),
            frozenset(tm.identifier_tokens(text)),
            tuple(tm.split_passage_sentences(text)),
        )


class GroundednessScorer:
    """Scores answers against passages; keeps passage embeddings between calls (an eval run
    checks many answers against the same passages). ``embedder``: anything with
    ``encode(texts) -> normalised rows`` (retrieval.Embedder); None loads MiniLM when
    ``settings.semantic``. ``nli``: anything with ``entailment(premises, hypothesis) ->
    probabilities`` (evals.nli.NliJudge); it then decides the in-between sentences."""

    def __init__(
        self, settings: ScorerSettings | None = None, embedder: Any = None, nli: Any = None, judge: Any = None
    ) -> None:
        self.settings = settings or ScorerSettings()
        self._embedder = embedder
        self.nli = nli
        self.support_judge = judge
        self._windows: dict[str, tuple[list[str], np.ndarray]] = {}

    @property
    def embedder(self) -> Any:
        if self._embedder is None:
            from retrieval import Embedder

            self._embedder = Embedder()
        return self._embedder

    def score(self, answer: str, passages: Sequence[str], question: str | None = None) -> GroundednessResult:
        """Per-sentence support of ``answer`` by ``passages`` (any of them may support any sentence).

        With ``question``, an answer too short to be a claim on its own ("9100.") is judged as
        the answer to it, by the support judge when there is one.
        """
        return self._score_prepared(answer, [_Passage.of(text) for text in passages], question)

    def _score_prepared(
        self, answer: str, prepared: Sequence[_Passage], question: str | None = None
    ) -> GroundednessResult:
        verdicts = [self.judge(sentence, prepared) for sentence in tm.split_sentences(answer)]
        if question:
            verdicts = [_restating(verdict, question) or verdict for verdict in verdicts]
        if question and len(verdicts) == 1 and verdicts[0].reason == TOO_SHORT:
            verdicts = [self._judge_short_answer(answer, question, prepared)]
        elif self.support_judge is not None:
            verdicts = [self._second_opinion(verdict, question, prepared) for verdict in verdicts]
        scorable = [v for v in verdicts if v.supported is not None]
        value = sum(1 for v in scorable if v.supported) / len(scorable) if scorable else None
        return GroundednessResult(value, verdicts)

    def judge(self, sentence: str, passages: Sequence[_Passage]) -> SentenceVerdict:
        labels = tm.cited_labels(sentence)
        if sentence.startswith("```"):
            return _judge_code(sentence, passages, labels)
        if tm.is_abstention(sentence):
            reason = "abstention: says the documents do not answer"
            return SentenceVerdict(sentence, None, None, "", reason, 0.0, labels)
        stems = tm.content_stems(sentence)
        if len(set(stems)) < MIN_CONTENT_STEMS:
            return SentenceVerdict(sentence, None, None, "", TOO_SHORT, 0.0, labels)
        if not passages:
            return SentenceVerdict(sentence, False, None, "", "no passages", 0.0, labels)
        return self._judge_claim(sentence, stems, passages, labels)

    def _judge_short_answer(self, answer: str, question: str, passages: Sequence[_Passage]) -> SentenceVerdict:
        """A bare answer ("9100.", "The Pushgateway.") read as the answer to ``question``: a
        number in no passage is unsupported; otherwise only the support judge can tell a right
        value from another one the passages also hold, and without it the answer is not scored."""
        labels = tm.cited_labels(answer)
        missing = tm.numbers(answer, words=False) - set().union(*(p.numbers for p in passages))
        if missing:
            return SentenceVerdict(
                answer, False, None, "", f"number {', '.join(sorted(missing))} in no passage", 0.0, labels
            )
        if self.support_judge is None:
            return SentenceVerdict(answer, None, None, "", TOO_SHORT, 0.0, labels)
        if hasattr(self.support_judge, "answer"):  # the model answers too: agree with it
            own = self.support_judge.answer([passage.text for passage in passages], question)
            agrees = tm.short_answers_agree(tm.strip_citations(answer), own)
            reason = f"short answer {'agrees' if agrees else 'disagrees'} with the judge's own: {own[:80]!r}"
            return SentenceVerdict(answer, agrees, None, own, reason, 0.0, labels)
        return self._ask_judge(SentenceVerdict(answer, True, None, "", "short answer", 0.0, labels), question, passages)

    def _second_opinion(
        self, verdict: SentenceVerdict, question: str | None, passages: Sequence[_Passage]
    ) -> SentenceVerdict:
        """The support judge reads every claim the rules let through: a meaning changed with the
        passages' own words (a flipped comparison, a fact moved to another subject) passes them."""
        if not verdict.supported:
            return verdict
        return self._ask_judge(verdict, question, passages)

    def _ask_judge(
        self, verdict: SentenceVerdict, question: str | None, passages: Sequence[_Passage]
    ) -> SentenceVerdict:
        texts = [passage.text for passage in passages]
        probability = self.support_judge.support(texts, question, tm.strip_citations(verdict.text))
        if probability >= self.settings.min_judge_support:
            return dataclasses.replace(verdict, reason=f"{verdict.reason}; judge P(yes) {probability:.2f}")
        return dataclasses.replace(verdict, supported=False, reason=f"judge: P(yes) {probability:.2f}")

    def _judge_claim(
        self, sentence: str, stems: list[str], passages: Sequence[_Passage], labels: list[str]
    ) -> SentenceVerdict:
        verbatim = _verbatim_passage(sentence, passages)
        if verbatim is not None:
            evidence = _aligned_sentence(set(stems), [passages[verbatim]])
            return SentenceVerdict(sentence, True, verbatim, evidence, "verbatim: the passage contains it", 1.0, labels)
        verdict = self._judge_with(sentence, stems, passages, labels)
        if verdict.supported or len(passages) < 2:
            return verdict
        # Supported when any passage supports it: the passage sharing the most words can hold a
        # conflicting sentence ("... doesn't create a tuple") while another states the claim.
        for index, passage in enumerate(passages):
            if index != verdict.best_passage:
                alone = self._judge_with(sentence, stems, [passage], labels)
                # Where the best passage is contradicted outright (the claim adds a negation or
                # flips a word), only a passage with the claim's own words may overrule it: a
                # paraphrase by cosine would let the contradiction through on a passage about
                # something else.
                lexical = alone.coverage >= self.settings.lexical_coverage
                if alone.supported and (lexical or not tm.is_contradiction(verdict.reason)):
                    return dataclasses.replace(alone, best_passage=index)
        return verdict

    def _judge_with(
        self, sentence: str, stems: list[str], passages: Sequence[_Passage], labels: list[str]
    ) -> SentenceVerdict:
        wanted = set(stems)
        ranked = sorted(range(len(passages)), key=lambda i: -len(wanted & passages[i].stems))
        best, evidence_ids = ranked[0], ranked[:1]
        coverage = _coverage(wanted, [passages[best]])
        if coverage < self.settings.lexical_coverage and len(ranked) > 1:  # a sentence may join two facts
            joined = _coverage(wanted, [passages[i] for i in ranked[:2]])
            if joined > coverage:
                coverage, evidence_ids = joined, ranked[:2]
        evidence_passages = [passages[i] for i in evidence_ids]
        aligned = _aligned_sentence(wanted, evidence_passages)
        problem = (
            _number_problem(sentence, aligned, passages)
            or _name_problem(sentence, aligned, passages)
            or tm.negation_conflict(sentence, aligned, [s for p in passages for s in p.sentences])
        )
        if problem:
            supported, reason, evidence = False, problem, aligned
        else:
            supported, reason, evidence = self._content_support(sentence, stems, coverage, passages[best], passages)
        return SentenceVerdict(sentence, supported, best, evidence or aligned, reason, round(coverage, 3), labels)

    def _content_support(
        self, sentence: str, stems: list[str], coverage: float, best: _Passage, passages: Sequence[_Passage]
    ) -> tuple[bool, str, str]:
        """(supported, reason, evidence or "") once numbers, names and negation agree."""
        settings = self.settings
        if _in_order_share(stems, best.ordered_stems) >= settings.verbatim_coverage:
            return True, "near-verbatim span", ""
        if coverage >= settings.lexical_coverage:
            return True, f"{coverage:.0%} of its content words in the evidence; numbers and names agree", ""
        if coverage < settings.min_coverage or not settings.semantic:
            return False, f"only {coverage:.0%} of its content words are in the evidence", ""
        clause = _unsupported_clause(sentence, passages, settings.clause_coverage)
        if clause:
            return False, f"clause with no support: '{clause}'", ""
        if self.nli is not None:
            return self._entailed(sentence, coverage, passages)
        return self._paraphrased(sentence, coverage, passages)

    def _paraphrased(self, sentence: str, coverage: float, passages: Sequence[_Passage]) -> tuple[bool, str, str]:
        [(similarity, closest)] = self._nearest(sentence, passages, 1)
        if similarity >= self.settings.min_similarity:
            return True, f"paraphrase: cosine {similarity:.2f} to a passage sentence", closest
        return False, f"{coverage:.0%} of its content words in the evidence, closest cosine {similarity:.2f}", ""

    def _entailed(self, sentence: str, coverage: float, passages: Sequence[_Passage]) -> tuple[bool, str, str]:
        windows = [window for _, window in self._nearest(sentence, passages, NLI_CANDIDATES)]
        probabilities = self.nli.entailment(windows, tm.strip_citations(sentence))
        best = int(np.argmax(probabilities))
        if probabilities[best] >= self.settings.min_entailment:
            return True, f"entailed: NLI P={probabilities[best]:.2f} from a passage sentence", windows[best]
        return False, f"{coverage:.0%} of its content words in the evidence, NLI P≤{probabilities[best]:.2f}", ""

    def _nearest(self, sentence: str, passages: Sequence[_Passage], count: int) -> list[tuple[float, str]]:
        """The ``count`` passage windows closest in meaning, closest first."""
        windows, vectors = [], []
        for passage in passages:
            texts, matrix = self._passage_windows(passage.text)
            windows.extend(texts)
            vectors.append(matrix)
        claim = self.embedder.encode([tm.strip_citations(sentence)])
        similarities = np.concatenate(vectors) @ np.asarray(claim)[0]
        order = np.argsort(-similarities, kind="stable")[:count]
        return [(float(similarities[index]), windows[index]) for index in order]

    def _passage_windows(self, text: str) -> tuple[list[str], np.ndarray]:
        """Every sentence of the passage (code too) and every adjacent pair, embedded once."""
        if text not in self._windows:
            sentences = [
                part for block in re.split(r"\n\s*\n", text) for part in tm.split_prose_block(" ".join(block.split()))
            ] or [text]
            windows = sentences + [a + " " + b for a, b in itertools.pairwise(sentences)]
            self._windows[text] = (windows, np.asarray(self.embedder.encode(windows)))
        return self._windows[text]


@functools.cache
def default_scorer() -> GroundednessScorer:
    """One shared scorer (and MiniLM) for the module-level ``score``."""
    return GroundednessScorer()


def score(answer: str, passages: Sequence[str], settings: ScorerSettings | None = None) -> GroundednessResult:
    """Per-sentence support of ``answer`` by ``passages``: ``GroundednessResult(score, sentences)``."""
    scorer = default_scorer() if settings is None else GroundednessScorer(settings, default_scorer()._embedder)
    return scorer.score(answer, passages)


def _verbatim_passage(sentence: str, passages: Sequence[_Passage]) -> int | None:
    """The index of a passage containing the sentence word for word (case and spacing aside)."""
    needle = _normalized(tm.strip_citations(sentence))
    if not needle:
        return None
    return next((index for index, passage in enumerate(passages) if needle in _normalized(passage.text)), None)


def _normalized(text: str) -> str:
    """Lower case, one space between words, no punctuation around the ends (quotes, brackets, stops)."""
    return " ".join(text.lower().split()).strip(" .,;:!?()[]\"'`*")


def _unsupported_clause(sentence: str, passages: Sequence[_Passage], min_coverage: float) -> str | None:
    """A clause (of a sentence judged by its meaning) whose own words are mostly in no passage:
    the sentence as a whole can be close to a passage while one clause adds a claim."""
    known = set().union(*(p.stems for p in passages))
    for clause in tm.clauses(sentence):
        wanted = set(tm.content_stems(clause))
        if len(wanted) >= MIN_CONTENT_STEMS and len(wanted & known) / len(wanted) < min_coverage:
            return clause.strip()
    return None


def _number_problem(sentence: str, aligned: str, passages: Sequence[_Passage]) -> str | None:
    """A number in no passage, or a number where the aligned passage sentence has another.

    Number words ("two dicts") count only when the aligned sentence itself states a number:
    in prose they are mostly not quantities.
    """
    known = set().union(*(p.numbers for p in passages))
    aligned_numbers = tm.numbers(aligned)
    claimed = tm.numbers(sentence) if aligned_numbers else tm.numbers(sentence, words=False)
    missing = claimed - known
    if missing:
        return f"number {', '.join(sorted(missing))} in no passage"
    for number in sorted(tm.numbers(sentence, words=False)):
        context = _number_context(sentence, number, passages)
        if context < NUMBER_CONTEXT:
            return f"number {number} is stated about something else (best context share {context:.2f})"
    extra, absent = claimed - aligned_numbers, aligned_numbers - tm.numbers(sentence)
    if extra and absent and _aligned_share(sentence, aligned) >= SWAP_ALIGNMENT:
        return f"number {', '.join(sorted(extra))} where the passage says {', '.join(sorted(absent))}"
    return None


def _name_problem(sentence: str, aligned: str, passages: Sequence[_Passage]) -> str | None:
    """A code name in no passage, or one swapped for the name the aligned passage sentence uses."""
    known = set().union(*(p.identifiers for p in passages))
    claimed = tm.code_names(sentence)
    missing = {
        name
        for name in claimed
        if name not in known and name.removesuffix("s") not in known and not _spelled_out(name, passages)
    }
    if missing:
        return f"name {', '.join(sorted(missing))} in no passage"
    aligned_names = tm.code_names(aligned)
    extra, absent = claimed - aligned_names, aligned_names - claimed - tm.identifier_tokens(sentence)
    if extra and absent and _aligned_share(sentence, aligned) >= SWAP_ALIGNMENT:
        return f"name {', '.join(sorted(extra))} where the passage says {', '.join(sorted(absent))}"
    # A product or project named where the evidence names another ("the SNMP Exporter's
    # textfile collector" for the Node Exporter's): often a name from another shown passage.
    said, stated = _singular(tm.proper_names(sentence)), _singular(tm.proper_names(aligned))
    extra, absent = said - stated - _singular(_words(aligned)), stated - said - _singular(_words(sentence))
    if extra and absent and _aligned_share(sentence, aligned) >= SWAP_ALIGNMENT:
        return f"name {', '.join(sorted(extra))} where the passage says {', '.join(sorted(absent))}"
    return None


def _words(text: str) -> set[str]:
    return {word.lower() for word in re.findall(r"\w+", text)}


def _singular(words: set[str]) -> set[str]:
    return {word.removesuffix("s") for word in words}


def _restating(verdict: SentenceVerdict, question: str) -> SentenceVerdict | None:
    """An unsupported verdict for a sentence that only turns the question around ("The
    evaluation_interval setting is the option that sets the evaluation interval"): it says
    the question's words twice over and adds at most ``RESTATEMENT_NEW_STEMS`` of its own."""
    if verdict.supported is None or _carries_an_answer(verdict.text, question):
        return None
    asked = set(_stems_with_parts(question))
    said = _stems_with_parts(verdict.text)
    repeated = [stem for stem in asked if said.count(stem) >= 2]
    new = set(said) - asked
    if len(repeated) >= 2 and len(new) <= RESTATEMENT_NEW_STEMS:
        reason = f"restates the question ({', '.join(sorted(repeated))} twice; adds only {', '.join(sorted(new))})"
        return dataclasses.replace(verdict, supported=False, reason=reason)
    return None


def _carries_an_answer(sentence: str, question: str) -> bool:
    """A value, a polarity or a yes/no: what a restatement lacks ("Yes, ...", "... is not
    valid", "... released on 2026-07-01")."""
    opening = sentence.lstrip().split(maxsplit=1)[0].strip(",.!").lower() if sentence.strip() else ""
    return (
        opening in {"yes", "no"}
        or tm.has_negation(sentence)
        or bool(tm.numbers(sentence, words=False) - tm.numbers(question, words=False))
    )


def _stems_with_parts(text: str) -> list[str]:
    """Content stems, with a snake_case name also counted as its words."""
    spelled = re.sub(r"(?<=[a-z0-9])_(?=[a-z0-9])", " ", text)
    return tm.content_stems(text) + [stem for stem in tm.content_stems(spelled) if "_" not in stem]


def _number_context(sentence: str, number: str, passages: Sequence[_Passage]) -> float:
    """How much of the claim's wording surrounds ``number`` where a passage states it: the best
    share of the claim's content stems in a passage sentence holding it.
    A number taken from another shown passage's sentence ("2012" from the founding date, in a
    claim about joining the CNCF) shares little with the claim there."""
    wanted = set(tm.content_stems(sentence)) - {number}
    if not wanted or float(number) < 10:  # small values recur everywhere: bucket bounds, counts, indexes
        return 1.0
    shares = []
    for passage in passages:
        sentences = passage.sentences or (passage.text,)
        for text in sentences:
            if number in tm.numbers(text, words=False):
                shares.append(len(wanted & set(tm.content_stems(text))) / len(wanted))
    return max(shares, default=1.0)  # held only outside prose sentences (a table, code): not judged here


def _spelled_out(name: str, passages: Sequence[_Passage]) -> bool:
    """``min_shards`` where a passage writes "min shards" (prose naming a setting)."""
    words = " ".join(part for part in name.split("_") if part)
    return "_" in name and any(words in " ".join(passage.text.lower().split()) for passage in passages)


def _aligned_share(sentence: str, aligned: str) -> float:
    wanted = set(tm.content_stems(sentence))
    return len(wanted & set(tm.content_stems(aligned))) / len(wanted) if wanted else 0.0


def _coverage(wanted: set[str], passages: Sequence[_Passage]) -> float:
    found = set().union(*(p.stems for p in passages)) & wanted
    return len(found) / len(wanted) if wanted else 0.0


def _aligned_sentence(wanted: set[str], passages: Sequence[_Passage]) -> str:
    """The passage sentence sharing most content stems with the claim (a window of two on ties)."""
    best_text, best_overlap = "", -1
    for passage in passages:
        sentences = passage.sentences or (passage.text,)
        for index, sentence in enumerate(sentences):
            overlap = len(wanted & set(tm.content_stems(sentence)))
            if overlap > best_overlap:
                best_text, best_overlap = sentence, overlap
            if index + 1 < len(sentences):
                pair = sentence + " " + sentences[index + 1]
                pair_overlap = len(wanted & set(tm.content_stems(pair)))
                if pair_overlap > best_overlap + 1:  # a window only when it adds real evidence
                    best_text, best_overlap = pair, pair_overlap
    return best_text


def _in_order_share(stems: Sequence[str], passage_stems: Sequence[str]) -> float:
    """Longest common subsequence of the claim's stems and a passage's, over the claim's length."""
    if not stems:
        return 0.0
    positions: dict[str, list[int]] = {}
    for index, token in enumerate(passage_stems):
        positions.setdefault(token, []).append(index)
    # LCS by patience-style DP over the claim (claims are short: O(len(claim) * occurrences)).
    previous = [0] * (len(passage_stems) + 1)
    for token in stems:
        current = previous[:]
        for index in positions.get(token, ()):
            current[index + 1] = max(current[index + 1], previous[index] + 1)
        for index in range(1, len(current)):
            current[index] = max(current[index], current[index - 1])
        previous = current
    return previous[-1] / len(stems)


def _judge_code(block: str, passages: Sequence[_Passage], labels: list[str]) -> SentenceVerdict:
    lines = [tm.whitespace_normalized(line) for line in block.strip("`").splitlines()[1:]]
    lines = [line for line in lines if line and not line.startswith("#")]
    if not lines:
        return SentenceVerdict(block, None, None, "", "empty code block", 0.0, labels)
    texts = [tm.whitespace_normalized(p.text) for p in passages]
    found = [line for line in lines if any(line in text for text in texts)]
    share = len(found) / len(lines)
    best = max(range(len(texts)), key=lambda i: sum(line in texts[i] for line in lines)) if texts else None
    if share >= 0.8:
        return SentenceVerdict(block, True, best, found[0], "code lines appear in a passage", share, labels)
    return SentenceVerdict(block, False, best, "", f"only {share:.0%} of code lines appear in a passage", share, labels)


def citation_scores(
    answer: str, shown: Mapping[str, str], scorer: GroundednessScorer | None = None, question: str | None = None
) -> dict[str, Any]:
    """Citation checks for an answer whose ``[Pn]`` markers refer to ``shown`` (label → text).

    precision: (sentence, cited passage) pairs where that passage supports the sentence, alone or
    with the other passages the sentence cites; recall: supported sentences carrying a citation.
    ``unresolved``: markers naming a passage that was never shown.
    """
    scorer = scorer or default_scorer()
    prepared = {label: _Passage.of(text) for label, text in shown.items()}
    result = scorer._score_prepared(answer, list(prepared.values()), question)  # passages parsed once
    pairs = precise = unresolved = cited_supported = 0
    for sentence in result.sentences:
        valid = [label for label in sentence.citations if label in prepared]
        unresolved += len(sentence.citations) - len(valid)
        if sentence.supported is None:
            continue
        if sentence.supported and valid:
            cited_supported += 1
        for label in valid:
            pairs += 1
            precise += _citation_supports(scorer, sentence.text, label, valid, prepared)
    return {
        "precision": precise / pairs if pairs else None,
        "recall": cited_supported / result.supported if result.supported else None,
        "citations": pairs,
        "unresolved": unresolved,
        "groundedness": result,
    }


def _citation_supports(
    scorer: GroundednessScorer, sentence: str, label: str, cited: Sequence[str], passages: Mapping[str, _Passage]
) -> bool:
    if scorer.judge(sentence, [passages[label]]).supported:
        return True
    if len(cited) < 2 or not scorer.judge(sentence, [passages[other] for other in cited]).supported:
        return False
    # Jointly supported: this citation must contribute some of the sentence's content.
    wanted = set(tm.content_stems(sentence))
    return len(wanted & passages[label].stems) >= max(1, len(wanted) // 4)
