"""Text pieces of the groundedness scorer: sentences, content stems, numbers, code names.

No model here: everything is string work, so every decision can be read back as a reason.
Numbers and code names (exceptions, dunder methods, dotted names, keywords named as such) are
the facts a small model most often gets subtly wrong, so they are extracted exactly; the rest
of a sentence is compared as a bag of crude stems.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

CITATION = re.compile(r"\[P(\d+)\]")
_CITATIONS_AFTER = r"(?:\s*\[P\d+\](?:\s*,\s*\[P\d+\])*)*"
_ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.", "Fig.", "approx.")
# A sentence may start in lower case: answers about code begin sentences with keywords ("break ends ...").
# A marker after the full stop belongs to the sentence before it ("... a condition. [P2]"), so
# no sentence starts with one.
_SENTENCE_END = re.compile(r"(?<=[.!?])(" + _CITATIONS_AFTER + r")\s+(?!\[P\d+\])(?=[\"'`(\[A-Za-z0-9*_-])")
_FENCE = re.compile(r"```.*?(?:```|\Z)", re.S)
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+(?:\.\d+)?")

_STOPWORD_TEXT = """a an the and or but if then else of to in on at by for from with without as into onto over under
    is are was were be been being am do does did done doing has have had having can could may might must
    shall should will would need needs this that these those it its it's itself they them their there here
    which who whom whose what when where why how than so such also only just very more most much many
    some any each every all both either neither other another same own one's
    i you we he she me my your our his her us
    about above after again against before below between during through until up down out off
    further once few too s t don now use used uses using usage
    passage passages document documents p1 p2 p3 p4 p5 p6 p7 p8 p9 p10 according said says say state states stated
    not no never nor cannot"""
STOPWORDS = frozenset(_STOPWORD_TEXT.split())
NEGATIONS = frozenset({"not", "no", "never", "cannot", "nor", "neither", "without"})
_NEGATION = re.compile(r"\b(?:not|no|never|cannot|nor|neither|without)\b|n['’]t\b", re.I)

# Python words that name one thing: swapping one for another changes the claim.
_CODE_WORD_TEXT = """nonlocal elif lambda async await yield del assert global def
    isinstance issubclass hasattr getattr setattr delattr callable repr len divmod enumerate zip
    chr ord hex oct bin bytearray frozenset memoryview classmethod staticmethod
    exec eval globals locals none true false notimplemented ellipsis"""
_CODE_WORDS = frozenset(_CODE_WORD_TEXT.split())
_KEYWORD_TEXT = """and as assert async await break class continue def del elif else except finally for from global
    if import in is lambda nonlocal not or pass raise return try while with yield"""
_KEYWORDS = frozenset(_KEYWORD_TEXT.split())
_KEYWORD_ROLE = re.compile(
    r"[\"'`]?\b([a-z]+)\b[\"'`]?\s+(?:statements?|keywords?|clauses?|expressions?|operators?|loops?|blocks?)\b"
)
_CALLED = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)\(\)")  # len(), str()
_QUOTED = re.compile(r"`([^`\n]{1,60})`|\"([^\"\n]{1,40})\"")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
# A quantity may carry its unit ("30ms", "2h", "64MB"): the unit is not part of the number.
_UNIT = r"(?:ns|us|µs|ms|s|m|h|d|w|y|b|kb|mb|gb|tb|kib|mib|gib|tib|x|%)"
_NUMBER = re.compile(rf"(?<![\w.])\d+(?:,\d{{3}})*(?:\.\d+)?(?:[eE][-+]?\d+)?(?={_UNIT}?(?![\w]))", re.I)
_SMALL_NUMBERS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty"
)
_NUMBER_WORDS = {word: value for value, word in enumerate(_SMALL_NUMBERS.split())} | {
    "thirty": 30,
    "forty": 40,
    "fifty": 50,
    "sixty": 60,
    "seventy": 70,
    "eighty": 80,
    "ninety": 90,
    "hundred": 100,
}
del _NUMBER_WORDS["one"]  # "one expression", "one of": mostly not a count in prose
_NUMBER_WORD = re.compile(r"\b(" + "|".join(_NUMBER_WORDS) + r")\b", re.I)
_ABSTAIN = re.compile(
    r"not (?:\w+ )?(?:in|within|covered (?:by|in)|found in|mentioned in|present in) the (?:provided |given )?"
    r"(?:documents?|passages?|context|sources?|text)"
    r"|(?:documents?|passages?|context|sources?|text) (?:do(?:es)?n[o']t|do(?:es)? not|did not|never) "
    r"(?:say|state|mention|specify|contain|provide|cover|include|describe|explain|address|give|discuss|answer)"
    r"|\bno (?:information|mention|details?)\b|\bi (?:do not|don't) know\b"
    r"|\b(?:cannot|can't|unable to) (?:find|answer|determine|tell)\b"
    r"|\bnot (?:specified|mentioned|stated|provided|documented|covered) (?:in|by)\b",
    re.I,
)


def strip_citations(text: str) -> str:
    return " ".join(CITATION.sub(" ", text).split())


def cited_labels(text: str) -> list[str]:
    """``["P1", "P3"]`` for the markers in ``text``, in order, without repeats."""
    return list(dict.fromkeys(f"P{m.group(1)}" for m in CITATION.finditer(text)))


def split_sentences(text: str) -> list[str]:
    """Sentences of an answer; a citation after the full stop stays with its sentence.

    Fenced code blocks are kept whole; lines and list items are split as sentences.
    """
    pieces: list[str] = []
    cursor = 0
    for fence in _FENCE.finditer(text):
        pieces.extend(_split_prose(text[cursor : fence.start()]))
        pieces.append(fence.group(0).strip())
        cursor = fence.end()
    pieces.extend(_split_prose(text[cursor:]))
    return [piece for piece in pieces if piece.strip()]


def _split_prose(text: str) -> list[str]:
    protected = text
    for abbreviation in _ABBREVIATIONS:
        protected = protected.replace(abbreviation, abbreviation.replace(".", "\0"))
    out: list[str] = []
    for line in re.split(r"\n\s*(?:[-*•]|\d+[.)])?\s*", protected):
        out.extend(part.replace("\0", ".").strip() for part in _split_at_sentence_ends(line))
    return [sentence for sentence in out if sentence]


def _split_at_sentence_ends(line: str) -> list[str]:
    """Cut after each sentence end and the citation markers that follow it."""
    parts, start = [], 0
    for end in _SENTENCE_END.finditer(line):
        parts.append(line[start : end.end(1)])
        start = end.end()
    parts.append(line[start:])
    return parts


def split_passage_sentences(text: str) -> list[str]:
    """Prose sentences of a passage, for alignment; pydoc wraps lines, so they are joined first.

    Code examples and grammar rules (``if not x: raise ...``) are left out: their ``not`` is
    not a statement's negation. A block is prose when it has a sentence end and no prompt.
    """
    out: list[str] = []
    for block in re.split(r"\n\s*\n", text):
        joined = " ".join(block.split())
        if joined and _is_prose(block, joined):
            out.extend(part for part in _split_at_sentence_ends(joined) if part)
    return out


_CLAUSE_BREAK = re.compile(
    r"[;:]\s+|,\s+(?:and|but|which|while|so|whereas)\s+|\s+(?:and|but)\s+(?=(?:is|are|was|were|can|may|must|will|has|have|it|they)\b)"
)


def clauses(sentence: str) -> list[str]:
    """A sentence cut at clause joints ("; ", ", and ", " and is "): each part states its own claim."""
    return [part for part in _CLAUSE_BREAK.split(sentence) if part.strip()]


def split_prose_block(text: str) -> list[str]:
    """Sentences of one paragraph whose lines are already joined."""
    return [part for part in _split_at_sentence_ends(text) if part]


def _is_prose(block: str, joined: str) -> bool:
    if ">>>" in block or "::=" in block:
        return False
    return bool(re.search(r"[A-Za-z)\"*]{2,}[.!?:](?:\s|$)", joined))


def stem(word: str) -> str:
    """A crude suffix stripper: 'raise', 'raises', 'raised', 'raising' → 'rais'. Enough for overlap."""
    word = word.lower()
    if len(word) <= 3 or "_" in word or word.isdigit():
        return word
    for suffix in ("ations", "ation", "ments", "ment", "ings", "ing", "ies", "ied", "ers", "er", "es", "ed", "ly", "s"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3 and not (suffix == "s" and word.endswith("ss")):
            return word[: -len(suffix)]
    return word[:-1] if word.endswith("e") and len(word) > 4 else word


def content_stems(text: str) -> list[str]:
    """Stems of the words that carry content (no stopwords, no citation markers)."""
    words = _WORD.findall(strip_citations(text))
    return [stem(word) for word in words if word.lower() not in STOPWORDS and not _is_number_token(word)]


def _is_number_token(word: str) -> bool:
    return word[0].isdigit()


def numbers(text: str, words: bool = True) -> set[str]:
    """Numbers written with digits or (``words``) as words, canonicalised ('1,000' → '1000', 'five' → '5')."""
    found: set[str] = set()
    for match in _NUMBER.finditer(strip_citations(text)):
        raw = match.group(0).replace(",", "")
        value = float(raw)
        found.add(str(int(value)) if value.is_integer() and "e" not in raw.lower() else repr(value))
    for match in _NUMBER_WORD.finditer(text) if words else ():
        found.add(str(_NUMBER_WORDS[match.group(1).lower()]))
    return found


def code_names(text: str) -> set[str]:
    """Names of Python things in ``text``: lower-cased, dotted names reduced to their last part."""
    text = strip_citations(text)
    names: set[str] = set()
    for match in _QUOTED.finditer(text):
        quoted = match.group(1) or match.group(2) or ""
        names.update(_identifiers_in_code(quoted))
    for token in _IDENTIFIER.findall(text):
        last = token.split(".")[-1]
        if _looks_like_code(token):
            names.add(last.lower())
    names.update(match.group(1).lower() for match in _CALLED.finditer(text))
    for match in _KEYWORD_ROLE.finditer(text):
        if match.group(1) in _KEYWORDS:
            names.add(match.group(1))
    return names


def _identifiers_in_code(code: str) -> set[str]:
    """Names inside a quoted span: code-looking tokens and Python keywords ("finally"), not
    ordinary words a writer put in quotes ("termination")."""
    return {
        token.split(".")[-1].lower()
        for token in _IDENTIFIER.findall(code)
        if _looks_like_code(token) or token.lower() in _KEYWORDS
    }


def _looks_like_code(token: str) -> bool:
    if "_" in token:
        return True
    if "." in token:  # a dotted name (os.path.join), not "e.g" or "i.e"
        return all(len(part) > 1 for part in token.split("."))
    if re.fullmatch(r"[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+", token):  # ValueError, StopIteration
        return True
    return token.lower() in _CODE_WORDS and (token.lower() not in ("none", "true", "false") or token[0].isupper())


_CAPITALISED = re.compile(r"(?<![\w`'])([A-Z][A-Za-z0-9]*[A-Z0-9][A-Za-z0-9]*|[A-Z][a-z]+)(?![\w`'])")
_SENTENCE_START = re.compile(r"(?:^|[.!?:;]\s+|\n\s*[*\-#>]*\s*|\[P\d+\]\s*)$")


def proper_names(text: str) -> set[str]:
    """Capitalised words that are not a sentence's first word ("SNMP", "Pushgateway",
    "Kubernetes"), lower-cased: the names of products, projects and people in prose."""
    text = strip_citations(text)
    names = set()
    for match in _CAPITALISED.finditer(text):
        if _SENTENCE_START.search(text[: match.start()]) or match.group(1).lower() in STOPWORDS:
            continue
        names.add(match.group(1).lower())
    return names


def identifier_tokens(text: str) -> set[str]:
    """Every identifier part in ``text``, lower-cased: what a code name is looked up in."""
    parts: set[str] = set()
    for token in _IDENTIFIER.findall(text):
        parts.update(part.lower() for part in token.split("."))
    return parts


# "no more than 5 graphs" bounds a value, it does not negate: read as "at most 5 graphs".
_BOUND = re.compile(r"\b(?:no|not)\s+(?:more|fewer|less|later|earlier|greater|longer)\s+than\b", re.I)


def without_bounds(text: str) -> str:
    return _BOUND.sub("at most", text)


def has_negation(text: str) -> bool:
    return bool(_NEGATION.search(without_bounds(text)))


_SCOPE_TOKEN = re.compile(r"[A-Za-z]+n['’]t\b|[A-Za-z_][A-Za-z0-9_]*|\d+(?:\.\d+)?|[,;:.()!?]")
_CLAUSE_WORDS = "but if when which that so because while unless although whereas"
_SCOPE_END = frozenset(",;:.()!?") | frozenset(_CLAUSE_WORDS.split())
_NEGATING_PREFIXES = ("un", "dis", "non", "in", "im", "il", "ir")
SCOPE_STEMS = 3  # content words a negation reaches when no clause boundary comes first


def negation_scopes(text: str) -> list[set[str]]:
    """The content stems each negation governs: up to ``SCOPE_STEMS`` words, ending at a clause
    boundary. "is not supported, it should return X" → [{"support"}]; X is outside the scope."""
    scopes: list[set[str]] = []
    current: set[str] | None = None
    reach = 0
    for token in _SCOPE_TOKEN.findall(without_bounds(strip_citations(text))):
        lower = token.lower()
        if lower in NEGATIONS or lower.endswith(("n't", "n’t")):
            if current:
                scopes.append(current)
            current, reach = set(), 0
        elif current is not None and (lower in _SCOPE_END or reach >= SCOPE_STEMS):
            if current:
                scopes.append(current)
            current = None
        elif current is not None and lower not in STOPWORDS and not _is_number_token(token):
            current.add(stem(token))
            reach += 1
    if current:
        scopes.append(current)
    return scopes


def negation_conflict(claim: str, aligned: str, evidence_sentences: Sequence[str]) -> str | None:
    """Why the claim and its evidence disagree on negation, or None when they agree.

    The claim negates words that evidence sentences state without negating them (no evidence
    sentence negates them), or the aligned evidence sentence negates words the claim states
    plainly. Negations about other words do not count.
    """
    claim_stems = set(content_stems(claim))
    claim_scopes = negation_scopes(claim)
    # Closeness is measured per clause of the claim: a second clause ("..., so the post is a
    # good start") must not hide a first one that contradicts the evidence.
    parts = [set(content_stems(part)) for part in clauses(claim)]
    parts = [part for part in parts if len(part) >= 3] or [claim_stems]
    for scope in claim_scopes:
        # A holder states most of the negated words (all but one of three: "cannot easily
        # start" against "can start") in a sentence close to the claim.
        holders = [
            sentence
            for sentence in evidence_sentences
            if len(scope & set(content_stems(sentence))) >= _most(scope) and _closeness(parts, sentence) >= 0.5
        ]
        negated = any(scope & other for sentence in holders for other in negation_scopes(sentence))
        if holders and not negated:
            return f"{CLAIM_NEGATES} '{', '.join(sorted(scope))}', the evidence does not"
    close = [aligned] + [s for s in evidence_sentences if _closeness(parts, s) >= DROPPED_SHARE]
    for sentence in close:
        for scope in negation_scopes(sentence):
            shared = scope & claim_stems
            enough = len(scope) if len(scope) < 2 else max(2, len(scope) - 1)
            if len(shared) >= enough and not any(scope & other for other in claim_scopes):
                return f"the evidence negates '{', '.join(sorted(shared))}', the claim does not"
    return _prefix_antonym(claim, aligned) or _antonym_swap(claim, aligned)


def _closeness(parts: Sequence[set[str]], sentence: str) -> float:
    stems = set(content_stems(sentence))
    return max(len(part & stems) / len(part) for part in parts)


CLAIM_NEGATES = "the claim negates"
FLIPPED = "where the evidence says"


def is_contradiction(reason: str) -> bool:
    """A reason of ``negation_conflict`` that says the claim contradicts its evidence outright:
    a negation the evidence lacks, or a word flipped to its opposite."""
    return reason.startswith(CLAIM_NEGATES) or FLIPPED in reason


def _most(scope: set[str]) -> int:
    return len(scope) if len(scope) < 3 else len(scope) - 1


def _antonym_swap(claim: str, aligned: str) -> str | None:
    """'oldest first' in the claim where the evidence says 'newest first' (or 'before' for
    'after', 'lower' for 'higher'): the claim keeps the evidence's words and flips one."""
    claim_words = {word.lower() for word in _WORD.findall(strip_citations(claim))}
    aligned_words = {word.lower() for word in _WORD.findall(aligned)}
    if _share(set(content_stems(claim)), aligned) < SWAP_SHARE:
        return None
    for first, second in _ANTONYMS:
        for said, stated in ((first, second), (second, first)):
            flipped = said in claim_words and stated in aligned_words
            if flipped and said not in aligned_words and stated not in claim_words:
                return f"'{said}' {FLIPPED} '{stated}'"
    return None


DROPPED_SHARE = 0.6  # an evidence sentence this close to the claim may not negate what it states
SWAP_SHARE = 0.5  # share of the claim's words in the evidence sentence for an antonym to be a flip
_ANTONYMS = (
    ("oldest", "newest"),
    ("older", "newer"),
    ("earliest", "latest"),
    ("earlier", "later"),
    ("before", "after"),
    ("first", "last"),
    ("higher", "lower"),
    ("highest", "lowest"),
    ("more", "less"),
    ("more", "fewer"),
    ("most", "least"),
    ("larger", "smaller"),
    ("largest", "smallest"),
    ("increases", "decreases"),
    ("increasing", "decreasing"),
    ("minimum", "maximum"),
    ("above", "below"),
    ("faster", "slower"),
    ("easier", "harder"),
    ("better", "worse"),
    ("push", "pull"),
    ("pushed", "pulled"),
    ("always", "never"),
    ("enabled", "disabled"),
    ("inside", "outside"),
)


def _share(stems: set[str], sentence: str) -> float:
    return len(stems & set(content_stems(sentence))) / len(stems) if stems else 0.0


def _prefix_antonym(claim: str, aligned: str) -> str | None:
    """'allowed' in the claim where the evidence says 'disallowed' (or the other way round)."""
    claim_words = {word.lower() for word in _WORD.findall(claim)}
    aligned_words = {word.lower() for word in _WORD.findall(aligned)}
    for first, second in ((claim_words, aligned_words), (aligned_words, claim_words)):
        for word in first - second:
            for prefix in _NEGATING_PREFIXES:
                if len(word) > 4 and prefix + word in second and prefix + word not in first:
                    return f"'{word}' against '{prefix + word}'"
    return None


def is_abstention(text: str) -> bool:
    """True when the text says the documents do not answer (the right reply to an unanswerable question)."""
    return bool(_ABSTAIN.search(text))


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = strip_citations(text).lower()
    text = "".join(" " if ch in string.punctuation else ch for ch in text)
    return " ".join(word for word in text.split() if word not in ("a", "an", "the"))


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD token F1 between an answer and a reference."""
    predicted, gold = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not predicted or not gold:
        return float(predicted == gold)
    common = sum((Counter(predicted) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, reference: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(reference)


def short_answers_agree(given: str, own: str) -> bool:
    """Whether a bare answer ("9100.", "The Pushgateway.") says what another answer says:
    the same numbers, one inside the other once quotes and stops are stripped, or half its
    content words."""

    def bare(text: str) -> str:
        return " ".join(text.lower().replace("`", " ").split()).strip(" .,;:!?\"'()")

    if not bare(own):
        return False
    given_numbers = numbers(given, words=False)
    if given_numbers:
        return given_numbers <= numbers(own, words=False)
    padded_given, padded_own = f" {bare(given)} ", f" {bare(own)} "
    if padded_given in padded_own or padded_own in padded_given:  # whole words only
        return True
    stems = set(content_stems(given))
    return bool(stems) and len(stems & set(content_stems(own))) / len(stems) >= 0.5


def whitespace_normalized(text: str) -> str:
    return " ".join(text.split())
