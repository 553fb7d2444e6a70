"""Prompt-lookup drafting: continue the longest recent n-gram match found in the sources.

Sources are the committed stream (prompt, then the output so far) and each retrieved
passage separately, also passages that did not fit in the prompt. Unlike transformers'
prompt lookup, which rescans the whole input every step, the n-grams live in hash
indexes that are filled once (passages) or extended by the newly committed tokens
(stream), so a lookup costs O(max_ngram) whatever the length of the sources.

Match preference, longest n first; for equal n: the output so far (a repeat of what the
model is writing), then the passages in the order given (so accepted tokens are
attributed to a passage even when the prompt holds the same text), then the prompt.
Within the stream the most recent occurrence wins; across passages the first one.

Drafts copy with the edits the model has been seen to make to the text it copies
(``decoding/drafters/edits.py``: a renamed identifier is drafted renamed).
"""

from __future__ import annotations

from collections.abc import Sequence

from specrag.decoding.drafters.base import Draft, FreeDrafter
from specrag.decoding.drafters.edits import EditTracker

OUTPUT = "output"
PROMPT = "prompt"
NO_MATCH = "none"


class PromptLookupDrafter(FreeDrafter):
    def __init__(
        self,
        prompt: Sequence[int],
        passages: Sequence[Sequence[int]] = (),
        *,
        passage_names: Sequence[str] | None = None,
        min_ngram: int = 2,
        max_ngram: int = 4,
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if passage_names is not None and len(passage_names) != len(passages):
            raise ValueError("passage_names must name every passage")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self._prompt_len = len(prompt)
        self._passages = [list(passage) for passage in passages]
        self._passage_names = list(passage_names or (f"passage:{index}" for index in range(len(passages))))
        # n-gram -> start of its continuation in the stream (most recent occurrence)
        self._stream: list[int] = []
        self._stream_index: dict[tuple[int, ...], int] = {}
        # n-gram -> (passage index, start of its continuation) (first occurrence)
        self._passage_index: dict[tuple[int, ...], tuple[int, int]] = {}
        self._edits = EditTracker()
        for passage_id, passage in enumerate(self._passages):
            for position in range(1, len(passage)):
                for key in self._ngrams_ending_before(passage, position):
                    self._passage_index.setdefault(key, (passage_id, position))
        self._extend(prompt)

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft:
        self._extend(context[len(self._stream) :])
        self._edits.discard_proposal()
        if max_tokens <= 0:
            return Draft([], None, NO_MATCH)
        contexts = [context, *self._edits.alternate_contexts(context)]
        for ngram in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
            for looked_up in contexts:
                hit = self._lookup(tuple(looked_up[-ngram:]))
                if hit is not None:
                    sequence, start, source = hit
                    tokens = self._edits.copy(sequence, start, max_tokens)
                    if tokens:
                        return Draft(tokens, None, source, ngram)
        return Draft([], None, NO_MATCH)

    def on_commit(self, committed: Sequence[int], accepted_len: int) -> None:
        """The stream is indexed from the context at the next proposal, and the engine
        attributes accepted tokens to ``Draft.source``; the edit tracker compares."""
        self._edits.observe(committed)

    def _lookup(self, key: tuple[int, ...]) -> tuple[list[int], int, str] | None:
        """The sequence whose continuation of ``key`` is preferred, where it starts, its name."""
        stream_start = self._stream_index.get(key)
        if stream_start is not None and stream_start >= self._prompt_len:
            return self._stream, stream_start, OUTPUT
        passage_hit = self._passage_index.get(key)
        if passage_hit is not None:
            passage_id, start = passage_hit
            return self._passages[passage_id], start, self._passage_names[passage_id]
        if stream_start is not None:
            return self._stream, stream_start, PROMPT
        return None

    def _extend(self, new_tokens: Sequence[int]) -> None:
        """Index the n-grams that the appended tokens give a continuation to."""
        for token in new_tokens:
            self._stream.append(token)
            position = len(self._stream) - 1
            for key in self._ngrams_ending_before(self._stream, position):
                self._stream_index[key] = position

    def _ngrams_ending_before(self, tokens: Sequence[int], position: int) -> list[tuple[int, ...]]:
        """The n-grams (min..max n) that end just before ``position``."""
        longest = min(self.max_ngram, position)
        return [tuple(tokens[position - n : position]) for n in range(self.min_ngram, longest + 1)]
