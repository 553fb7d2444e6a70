"""The scorer's rules over strings: numbers, names, negation, restatements, coverage, code.

Each rule reads a claim (an answer sentence) against the prepared passages and says what is
wrong with it, or how much of it the passages hold; ``agent/grounding/scorer.py`` applies them
in a reviewer's order.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from specrag.agent.grounding import text_match as tm
from specrag.agent.grounding.types import (
    MIN_CONTENT_STEMS,
    NUMBER_CONTEXT,
    RESTATEMENT_NEW_STEMS,
    SWAP_ALIGNMENT,
    PreparedPassage,
    SentenceVerdict,
)


def verbatim_passage(sentence: str, passages: Sequence[PreparedPassage]) -> int | None:
    """The index of a passage containing the sentence word for word (case and spacing aside)."""
    needle = _normalized(tm.strip_citations(sentence))
    if not needle:
        return None
    return next((index for index, passage in enumerate(passages) if needle in _normalized(passage.text)), None)


def _normalized(text: str) -> str:
    """Lower case, one space between words, no punctuation around the ends (quotes, brackets, stops)."""
    return " ".join(text.lower().split()).strip(" .,;:!?()[]\"'`*")


def unsupported_clause(sentence: str, passages: Sequence[PreparedPassage], min_coverage: float) -> str | None:
    """A clause (of a sentence judged by its meaning) whose own words are mostly in no passage:
    the sentence as a whole can be close to a passage while one clause adds a claim."""
    known = set().union(*(p.stems for p in passages))
    for clause in tm.clauses(sentence):
        wanted = set(tm.content_stems(clause))
        if len(wanted) >= MIN_CONTENT_STEMS and len(wanted & known) / len(wanted) < min_coverage:
            return clause.strip()
    return None


def number_problem(sentence: str, aligned: str, passages: Sequence[PreparedPassage]) -> str | None:
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


def name_problem(sentence: str, aligned: str, passages: Sequence[PreparedPassage]) -> str | None:
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


_QUOTED = re.compile(r"[\"`“]([^\"`”]{2,40})[\"`”]")


def restating(verdict: SentenceVerdict, question: str) -> SentenceVerdict | None:
    """An unsupported verdict for a sentence that only turns the question around ("The
    evaluation_interval setting is the option that sets the evaluation interval"): it says
    the question's words twice over and adds at most ``RESTATEMENT_NEW_STEMS`` of its own."""
    if verdict.supported is None or _carries_an_answer(verdict.text, question):
        return None
    asked = set(_stems_with_parts(question))
    said = _stems_with_parts(verdict.text)
    repeated = [stem for stem in asked if said.count(stem) >= 2]
    new = set(said) - asked
    answered = new & set(_stems_with_parts(verdict.evidence))
    if len(repeated) >= 2 and len(new) <= RESTATEMENT_NEW_STEMS and len(answered) < 2:
        reason = f"restates the question ({', '.join(sorted(repeated))} twice; adds only {', '.join(sorted(new))})"
        return dataclasses.replace(verdict, supported=False, reason=reason)
    return None


def _carries_an_answer(sentence: str, question: str) -> bool:
    """A value, a name, a polarity or a yes/no: what a restatement lacks ("Yes, ...", "... is
    not valid", "... released on 2026-07-01", "... is `AssertionError`")."""
    opening = sentence.lstrip().split(maxsplit=1)[0].strip(",.!").lower() if sentence.strip() else ""
    return (
        opening in {"yes", "no"}
        or tm.has_negation(sentence)
        or bool(tm.numbers(sentence, words=False) - tm.numbers(question, words=False))
        or bool(_names_beyond(sentence, question))
    )


def _names_beyond(sentence: str, question: str) -> set[str]:
    """Code names and quoted terms of the sentence the question does not hold, spelled out or
    not (``evaluation_interval`` restates "the evaluation interval"). Not proper names: the
    corpus's own subject ("Prometheus") turns up in restatements too."""
    asked_words = set(_stems_with_parts(question))

    quoted = {term.lower() for term in _QUOTED.findall(sentence)} - {term.lower() for term in _QUOTED.findall(question)}
    spelled = {
        name
        for name in tm.code_names(sentence) - tm.code_names(question)
        if not set(tm.content_stems(re.sub(r"[_.]", " ", name))) <= asked_words
    }
    # a quoted term is an answer unless the question says it ("`/metrics`" for "its metrics" is one)
    return spelled | {term for term in quoted if term not in question.lower()}


def _stems_with_parts(text: str) -> list[str]:
    """Content stems, with a snake_case name also counted as its words."""
    spelled = re.sub(r"(?<=[a-z0-9])_(?=[a-z0-9])", " ", text)
    return tm.content_stems(text) + [stem for stem in tm.content_stems(spelled) if "_" not in stem]


def _number_context(sentence: str, number: str, passages: Sequence[PreparedPassage]) -> float:
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


def _spelled_out(name: str, passages: Sequence[PreparedPassage]) -> bool:
    """``min_shards`` where a passage writes "min shards" (prose naming a setting)."""
    words = " ".join(part for part in name.split("_") if part)
    return "_" in name and any(words in " ".join(passage.text.lower().split()) for passage in passages)


def _aligned_share(sentence: str, aligned: str) -> float:
    wanted = set(tm.content_stems(sentence))
    return len(wanted & set(tm.content_stems(aligned))) / len(wanted) if wanted else 0.0


def coverage(wanted: set[str], passages: Sequence[PreparedPassage]) -> float:
    found = set().union(*(p.stems for p in passages)) & wanted
    return len(found) / len(wanted) if wanted else 0.0


def aligned_sentence(wanted: set[str], passages: Sequence[PreparedPassage]) -> str:
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


def in_order_share(stems: Sequence[str], passage_stems: Sequence[str]) -> float:
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


def judge_code(block: str, passages: Sequence[PreparedPassage], labels: list[str]) -> SentenceVerdict:
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
