"""Prompt-lookup drafting: continue the longest recent n-gram match found in the sources.

Sources are the committed stream (prompt, then the output so far) and each retrieved
passage separately, also passages that did not fit in the prompt. Unlike transformers'
prompt lookup, which rescans the whole input every step, the n-grams live in hash
indexes that are filled once (passages) or extended by the newly committed tokens
(stream), so a lookup costs O(max_ngram) whatever the length of the sources.

Match preference, longest n first; among the occurrences of that n-gram, the one whose
match reaches furthest back (the tokens before the n-gram also agree with the context, up
to ``MATCH_BACK_LIMIT``): a copy in progress is continued where it stands rather than
from another occurrence of its last few tokens (smollm2's rag_branching, γ = 10: 24
target calls -> 23, against transformers' 22). Among equal matches: the output so far (a
repeat of what the model is writing), then the passages in the order given (so accepted
tokens are attributed to a passage even when the prompt holds the same text), then the
prompt. Within the stream the most recent occurrence wins; across passages the first one. A copy
from the stream that reaches its end goes on copying the draft (``EditTracker.copy``,
``overlapping``): a repeated span is drafted in full, not only up to where the stream ends.

Drafts copy with the edits the model has been seen to make to the text it copies
(``decoding/drafters/edits.py``: a renamed identifier is drafted renamed).

With ``branches`` > 0 the draft also carries alternatives for a draft tree
(``decoding/tree_sizing.py``): the continuations of the other occurrences of the matched
n-grams, longest n first, in the same order of preference, each as its own chain with its
source. Every key remembers up to ``OCCURRENCES_PER_KEY`` occurrences for them.

``history`` adds the continuations a tenant's earlier outputs suggest
(``decoding/drafters/history.py``, source ``history``): the draft when lookup finds
nothing, an alternative when it does, ahead of lookup's own where its match is longer.
The best chain of the other kind goes along as a rival (``Draft.rivals``): the planner
verifies whichever the per-source acceptance estimates favour, since a longer match in
another user request's output is no evidence that this model will write it again
(smollm2's agent_repeat: history drafts were accepted in 2 of 22 cycles, and displaced
prompt drafts that transformers' lookup had accepted).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from specrag.decoding.drafters.base import Draft, FreeDrafter
from specrag.decoding.drafters.edits import EditTracker
from specrag.decoding.drafters.history import HistoryIndex

OUTPUT = "output"
PROMPT = "prompt"
NO_MATCH = "none"
HISTORY = "history"
OCCURRENCES_PER_KEY = 4  # most recent in the stream, first in the passages
BRANCH_TOKENS = 8  # an alternative is a branch of the tree: it needs no long tail
MATCH_BACK_LIMIT = 32  # how far back a match is measured to rank the n-gram's occurrences

# (context, most tokens, most chains) -> drafts from earlier outputs, preferred first
HistoryLookup = Callable[[Sequence[int], int, int], list[Draft]]


def history_drafts(
    index: HistoryIndex, tenant: str, context: Sequence[int], max_tokens: int, count: int
) -> list[Draft]:
    """``tenant``'s earlier outputs' continuations of ``context`` as drafts."""
    found = index.continuations(tenant, context, max_tokens, max_branches=count)
    # A history match is a suffix of the context: its length is how far back it agrees.
    return [
        Draft(found_one.tokens, None, HISTORY, found_one.match_ngram, match_back=found_one.match_ngram)
        for found_one in found
    ]


class PromptLookupDrafter(FreeDrafter):
    def __init__(
        self,
        prompt: Sequence[int],
        passages: Sequence[Sequence[int]] = (),
        *,
        passage_names: Sequence[str] | None = None,
        min_ngram: int = 2,
        max_ngram: int = 4,
        branches: int = 0,
        history: HistoryLookup | None = None,
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if passage_names is not None and len(passage_names) != len(passages):
            raise ValueError("passage_names must name every passage")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.branches = branches
        self._history = history
        self._prompt_len = len(prompt)
        self._passages = [list(passage) for passage in passages]
        self._passage_names = list(passage_names or (f"passage:{index}" for index in range(len(passages))))
        # n-gram -> starts of its continuations in the stream (most recent first)
        self._stream: list[int] = []
        self._stream_index: dict[tuple[int, ...], list[int]] = {}
        # n-gram -> (passage index, start of its continuation) (first occurrences first)
        self._passage_index: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self._edits = EditTracker()
        for passage_id, passage in enumerate(self._passages):
            for position in range(1, len(passage)):
                for key in self._ngrams_ending_before(passage, position):
                    hits = self._passage_index.setdefault(key, [])
                    if len(hits) < OCCURRENCES_PER_KEY:
                        hits.append((passage_id, position))
        self._extend(prompt)

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft:
        self._extend(context[len(self._stream) :])
        self._edits.discard_proposal()
        if max_tokens <= 0:
            return Draft([], None, NO_MATCH)
        chains = self._lookup_chains(context, max_tokens)
        if self._history is not None:
            chains = _merged(chains, self._history(context, max_tokens, self.branches + 1))
        if not chains:
            return Draft([], None, NO_MATCH)
        first = chains[0]
        rivals = [chain for chain in chains[1:] if (chain.source == HISTORY) != (first.source == HISTORY)]
        return self._with_alternatives(first, chains, [self._with_alternatives(rival, chains) for rival in rivals[:1]])

    def _with_alternatives(self, chain: Draft, chains: list[Draft], rivals: list[Draft] | None = None) -> Draft:
        """``chain`` carrying up to ``branches`` of the other ``chains`` for a tree."""
        others = [other for other in chains if other is not chain][: self.branches]
        return Draft(
            chain.tokens,
            None,
            chain.source,
            chain.match_ngram,
            alternatives=others,
            rivals=rivals or [],
            match_back=chain.match_back,
        )

    def _lookup_chains(self, context: Sequence[int], max_tokens: int) -> list[Draft]:
        """The preferred chain and up to ``branches`` others (module docstring), each unique."""
        contexts = [context, *self._edits.alternate_contexts(context)]
        chains: list[Draft] = []
        for ngram in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
            found = [
                (_matched_back(looked_up, sequence, start), sequence, start, source)
                for looked_up in contexts
                for sequence, start, source in self._lookup(tuple(looked_up[-ngram:]))
            ]
            found.sort(key=lambda one: -one[0])  # stable: the source preference breaks ties
            for matched, sequence, start, source in found:
                limit = max_tokens if not chains else min(max_tokens, BRANCH_TOKENS)
                tokens = self._edits.copy(sequence, start, limit, overlapping=sequence is self._stream)
                if tokens and not _repeats(tokens, chains):
                    chains.append(Draft(tokens, None, source, ngram, match_back=matched))
                if len(chains) > self.branches:
                    return chains
        return chains

    def on_commit(self, committed: Sequence[int], accepted_len: int) -> None:
        """The stream is indexed from the context at the next proposal, and the engine
        attributes accepted tokens to ``Draft.source``; the edit tracker compares."""
        self._edits.observe(committed)

    def _lookup(self, key: tuple[int, ...]) -> list[tuple[list[int], int, str]]:
        """The continuations of ``key``, preferred first: (sequence, where it starts, source)."""
        stream_starts = self._stream_index.get(key, [])
        in_output = [(self._stream, start, OUTPUT) for start in stream_starts if start >= self._prompt_len]
        in_passages = [
            (self._passages[passage_id], start, self._passage_names[passage_id])
            for passage_id, start in self._passage_index.get(key, [])
        ]
        in_prompt = [(self._stream, start, PROMPT) for start in stream_starts if start < self._prompt_len]
        return [*in_output, *in_passages, *in_prompt]

    def _extend(self, new_tokens: Sequence[int]) -> None:
        """Index the n-grams that the appended tokens give a continuation to."""
        for token in new_tokens:
            self._stream.append(token)
            position = len(self._stream) - 1
            for key in self._ngrams_ending_before(self._stream, position):
                starts = self._stream_index.setdefault(key, [])
                starts.insert(0, position)
                del starts[OCCURRENCES_PER_KEY:]

    def _ngrams_ending_before(self, tokens: Sequence[int], position: int) -> list[tuple[int, ...]]:
        """The n-grams (min..max n) that end just before ``position``."""
        longest = min(self.max_ngram, position)
        return [tuple(tokens[position - n : position]) for n in range(self.min_ngram, longest + 1)]


def _matched_back(context: Sequence[int], sequence: Sequence[int], start: int) -> int:
    """How many tokens before ``sequence[start]`` equal the end of ``context`` (at most
    ``MATCH_BACK_LIMIT``): the length of the match, the n-gram and whatever agrees before it."""
    limit = min(MATCH_BACK_LIMIT, start, len(context))
    matched = 0
    while matched < limit and sequence[start - 1 - matched] == context[-1 - matched]:
        matched += 1
    return matched


def _repeats(tokens: list[int], chains: list[Draft]) -> bool:
    """Whether an earlier chain already proposes ``tokens`` (or more after them)."""
    return any(tokens == chain.tokens[: len(tokens)] for chain in chains)


def _merged(lookup: list[Draft], history: list[Draft]) -> list[Draft]:
    """Both sources' chains, a longer match first (lookup first among equals), each unique."""
    merged: list[Draft] = []
    for chain in sorted([*lookup, *history], key=lambda chain: -chain.match_ngram):
        if not _repeats(chain.tokens, merged):
            merged.append(chain)
    return merged
