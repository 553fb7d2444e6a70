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
   or, with an NLI judge (``nli=``, evals/groundedness/nli.py, local weights only), entailed by one of the
   ``NLI_CANDIDATES`` passage windows closest in meaning (P ≥ ``min_entailment``).

Thresholds were tuned on the odd half of the calibration set (evals/studies/calibrate_groundedness.py
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
from typing import Any

import numpy as np

from specrag.agent.grounding import claim_rules as rules
from specrag.agent.grounding import text_match as tm
from specrag.agent.grounding.types import (
    MIN_CONTENT_STEMS,
    NLI_CANDIDATES,
    TOO_SHORT,
    GroundednessResult,
    PreparedPassage,
    ScorerSettings,
    SentenceVerdict,
)


class GroundednessScorer:
    """Scores answers against passages; keeps passage embeddings between calls (an eval run
    checks many answers against the same passages). ``embedder``: anything with
    ``encode(texts) -> normalised rows`` (specrag.retrieval.Embedder); None loads MiniLM when
    ``settings.semantic``. ``nli``: anything with ``entailment(premises, hypothesis) ->
    probabilities`` (specrag.evals.groundedness.nli.NliJudge); it then decides the in-between sentences."""

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
            from specrag.retrieval import Embedder

            self._embedder = Embedder()
        return self._embedder

    def score(self, answer: str, passages: Sequence[str], question: str | None = None) -> GroundednessResult:
        """Per-sentence support of ``answer`` by ``passages`` (any of them may support any sentence).

        With ``question``, an answer too short to be a claim on its own ("9100.") is judged as
        the answer to it, by the support judge when there is one.
        """
        return self._score_prepared(answer, [PreparedPassage.of(text) for text in passages], question)

    def _score_prepared(
        self, answer: str, prepared: Sequence[PreparedPassage], question: str | None = None
    ) -> GroundednessResult:
        verdicts = [self.judge(sentence, prepared) for sentence in tm.split_sentences(answer)]
        if question:
            verdicts = [rules.restating(verdict, question) or verdict for verdict in verdicts]
        if question and len(verdicts) == 1 and verdicts[0].reason == TOO_SHORT:
            verdicts = [self._judge_short_answer(answer, question, prepared)]
        elif self.support_judge is not None:
            verdicts = [self._second_opinion(verdict, question, prepared) for verdict in verdicts]
        scorable = [v for v in verdicts if v.supported is not None]
        value = sum(1 for v in scorable if v.supported) / len(scorable) if scorable else None
        return GroundednessResult(value, verdicts)

    def judge(self, sentence: str, passages: Sequence[PreparedPassage]) -> SentenceVerdict:
        labels = tm.cited_labels(sentence)
        if sentence.startswith("```"):
            return rules.judge_code(sentence, passages, labels)
        if tm.is_abstention(sentence):
            reason = "abstention: says the documents do not answer"
            return SentenceVerdict(sentence, None, None, "", reason, 0.0, labels)
        stems = tm.content_stems(sentence)
        if len(set(stems)) < MIN_CONTENT_STEMS:
            return SentenceVerdict(sentence, None, None, "", TOO_SHORT, 0.0, labels)
        if not passages:
            return SentenceVerdict(sentence, False, None, "", "no passages", 0.0, labels)
        return self._judge_claim(sentence, stems, passages, labels)

    def _judge_short_answer(self, answer: str, question: str, passages: Sequence[PreparedPassage]) -> SentenceVerdict:
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
        self, verdict: SentenceVerdict, question: str | None, passages: Sequence[PreparedPassage]
    ) -> SentenceVerdict:
        """The support judge reads every claim the rules let through: a meaning changed with the
        passages' own words (a flipped comparison, a fact moved to another subject) passes them."""
        if not verdict.supported:
            return verdict
        return self._ask_judge(verdict, question, passages)

    def _ask_judge(
        self, verdict: SentenceVerdict, question: str | None, passages: Sequence[PreparedPassage]
    ) -> SentenceVerdict:
        texts = [passage.text for passage in passages]
        probability = self.support_judge.support(texts, question, tm.strip_citations(verdict.text))
        if probability >= self.settings.min_judge_support:
            return dataclasses.replace(verdict, reason=f"{verdict.reason}; judge P(yes) {probability:.2f}")
        return dataclasses.replace(verdict, supported=False, reason=f"judge: P(yes) {probability:.2f}")

    def _judge_claim(
        self, sentence: str, stems: list[str], passages: Sequence[PreparedPassage], labels: list[str]
    ) -> SentenceVerdict:
        verbatim = rules.verbatim_passage(sentence, passages)
        if verbatim is not None:
            evidence = rules.aligned_sentence(set(stems), [passages[verbatim]])
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
        self, sentence: str, stems: list[str], passages: Sequence[PreparedPassage], labels: list[str]
    ) -> SentenceVerdict:
        wanted = set(stems)
        ranked = sorted(range(len(passages)), key=lambda i: -len(wanted & passages[i].stems))
        best, evidence_ids = ranked[0], ranked[:1]
        coverage = rules.coverage(wanted, [passages[best]])
        if coverage < self.settings.lexical_coverage and len(ranked) > 1:  # a sentence may join two facts
            joined = rules.coverage(wanted, [passages[i] for i in ranked[:2]])
            if joined > coverage:
                coverage, evidence_ids = joined, ranked[:2]
        evidence_passages = [passages[i] for i in evidence_ids]
        aligned = rules.aligned_sentence(wanted, evidence_passages)
        problem = (
            rules.number_problem(sentence, aligned, passages)
            or rules.name_problem(sentence, aligned, passages)
            or tm.negation_conflict(sentence, aligned, [s for p in passages for s in p.sentences])
        )
        if problem:
            supported, reason, evidence = False, problem, aligned
        else:
            supported, reason, evidence = self._content_support(sentence, stems, coverage, passages[best], passages)
        return SentenceVerdict(sentence, supported, best, evidence or aligned, reason, round(coverage, 3), labels)

    def _content_support(
        self,
        sentence: str,
        stems: list[str],
        coverage: float,
        best: PreparedPassage,
        passages: Sequence[PreparedPassage],
    ) -> tuple[bool, str, str]:
        """(supported, reason, evidence or "") once numbers, names and negation agree."""
        settings = self.settings
        if rules.in_order_share(stems, best.ordered_stems) >= settings.verbatim_coverage:
            return True, "near-verbatim span", ""
        if coverage >= settings.lexical_coverage:
            return True, f"{coverage:.0%} of its content words in the evidence; numbers and names agree", ""
        if coverage < settings.min_coverage or not settings.semantic:
            return False, f"only {coverage:.0%} of its content words are in the evidence", ""
        clause = rules.unsupported_clause(sentence, passages, settings.clause_coverage)
        if clause:
            return False, f"clause with no support: '{clause}'", ""
        if self.nli is not None:
            return self._entailed(sentence, coverage, passages)
        return self._paraphrased(sentence, coverage, passages)

    def _paraphrased(
        self, sentence: str, coverage: float, passages: Sequence[PreparedPassage]
    ) -> tuple[bool, str, str]:
        [(similarity, closest)] = self._nearest(sentence, passages, 1)
        if similarity >= self.settings.min_similarity:
            return True, f"paraphrase: cosine {similarity:.2f} to a passage sentence", closest
        return False, f"{coverage:.0%} of its content words in the evidence, closest cosine {similarity:.2f}", ""

    def _entailed(self, sentence: str, coverage: float, passages: Sequence[PreparedPassage]) -> tuple[bool, str, str]:
        windows = [window for _, window in self._nearest(sentence, passages, NLI_CANDIDATES)]
        probabilities = self.nli.entailment(windows, tm.strip_citations(sentence))
        best = int(np.argmax(probabilities))
        if probabilities[best] >= self.settings.min_entailment:
            return True, f"entailed: NLI P={probabilities[best]:.2f} from a passage sentence", windows[best]
        return False, f"{coverage:.0%} of its content words in the evidence, NLI P≤{probabilities[best]:.2f}", ""

    def _nearest(self, sentence: str, passages: Sequence[PreparedPassage], count: int) -> list[tuple[float, str]]:
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


def citation_scores(
    answer: str, shown: Mapping[str, str], scorer: GroundednessScorer | None = None, question: str | None = None
) -> dict[str, Any]:
    """Citation checks for an answer whose ``[Pn]`` markers refer to ``shown`` (label → text).

    precision: (sentence, cited passage) pairs where that passage supports the sentence, alone or
    with the other passages the sentence cites; recall: supported sentences carrying a citation.
    ``unresolved``: markers naming a passage that was never shown.
    """
    scorer = scorer or default_scorer()
    prepared = {label: PreparedPassage.of(text) for label, text in shown.items()}
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
    scorer: GroundednessScorer, sentence: str, label: str, cited: Sequence[str], passages: Mapping[str, PreparedPassage]
) -> bool:
    if scorer.judge(sentence, [passages[label]]).supported:
        return True
    if len(cited) < 2 or not scorer.judge(sentence, [passages[other] for other in cited]).supported:
        return False
    # Jointly supported: this citation must contribute some of the sentence's content.
    wanted = set(tm.content_stems(sentence))
    return len(wanted & passages[label].stems) >= max(1, len(wanted) // 4)
