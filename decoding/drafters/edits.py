"""The edits a model makes to a text it copies, learned so that drafts copy them too.

A code edit ("rename `penguin` to `animals`, keep everything else") copies the source with
the same substitution at every occurrence. Plain prompt lookup drafts the old name each
time: the verify rejects it, the target's token starts the new name, and the next lookup
finds no continuation of the new name in any source, so each occurrence costs two or three
target calls (measured on the 1.5B's code_edit: 14 calls for 38 tokens, four of them lost
this way).

The tracker watches each proposal against what was committed:

- a proposal that copied at least one token and then differed marks a **divergence**: the
  source position where the copy broke, and the tokens committed since;
- a later proposal from the same source, starting a little after that position, whose
  first token is accepted marks the **resumption**: the source skipped ``S`` while the
  output wrote ``R`` (common prefix and suffix trimmed), so ``S -> R`` is learned;
- drafts copy the source with every learned substitution applied (``copy``), and a
  context that ends in ``R`` is also looked up as ending in ``S`` (``alternate_contexts``),
  so the text after the new name is found where the old name stands;
- a substituted token that is rejected drops its substitution.

Drafts are only proposals: a wrong substitution costs acceptance, never exactness.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_SPAN = 4  # the longest S or R learned, in tokens (a renamed identifier)
MAX_GAP = 8  # how far after a divergence, in source and output tokens, a resumption may be
MAX_EDITS = 16  # substitutions kept per request; the oldest goes first

Origin = int | tuple[int, ...]  # a copied token's source position, or the S it replaced


@dataclass
class _Proposal:
    source: list[int]
    tokens: list[int]
    origins: list[Origin]


class EditTracker:
    def __init__(self) -> None:
        self.substitutions: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._pending: _Proposal | None = None
        self._divergence: tuple[list[int], int] | None = None  # (source, position where the copy broke)
        self._since: list[int] = []  # tokens committed since the divergence

    def copy(self, source: list[int], start: int, max_tokens: int, overlapping: bool = False) -> list[int]:
        """``source[start:]`` with the learned substitutions applied, up to ``max_tokens``;
        remembered as the pending proposal, which ``observe`` compares with the commit.

        ``overlapping``: ``source`` is the stream the draft continues, so a copy that reaches
        its end goes on copying the draft itself (as LZ77 copies overlap): a match ``P``
        tokens back drafts a text that repeats with period ``P`` for as long as asked, where
        the plain copy would stop after ``P`` tokens. A model caught in a loop (smollm2
        repeating one sentence) is drafted a whole γ a cycle, as transformers' prompt lookup,
        which copies from the earliest occurrence, does too."""
        tokens: list[int] = []
        origins: list[Origin] = []
        position = start
        end = len(source)
        while len(tokens) < max_tokens and (position < end or (overlapping and position - end < len(tokens))):
            if position >= end:  # the draft's own token: it will stand at this position once committed
                tokens.append(tokens[position - end])
                origins.append(position)
                position += 1
                continue
            replaced = self._substitution_at(source, position)
            if replaced is None:
                tokens.append(source[position])
                origins.append(position)
                position += 1
                continue
            tokens.extend(self.substitutions[replaced])
            origins.extend([replaced] * len(self.substitutions[replaced]))
            position += len(replaced)
        self._pending = _Proposal(source, tokens[:max_tokens], origins[:max_tokens])
        return self._pending.tokens

    def discard_proposal(self) -> None:
        """A new proposal is being made: the last one was never committed against."""
        self._pending = None

    def alternate_contexts(self, context: Sequence[int]) -> list[list[int]]:
        """``context`` with a trailing ``R`` put back as its ``S``, for each substitution."""
        return [
            [*context[: len(context) - len(new)], *old]
            for old, new in self.substitutions.items()
            if new and len(context) >= len(new) and tuple(context[-len(new) :]) == new
        ]

    def observe(self, committed: Sequence[int]) -> None:
        """The tokens committed after the last proposal (if any was made since the last commit)."""
        proposal, self._pending = self._pending, None
        if proposal is None or not proposal.tokens:
            self._note(committed)
            return
        matched = _common_prefix(proposal.tokens, committed)
        first = proposal.origins[0]
        if matched >= 1 and isinstance(first, int):
            self._learn(proposal.source, first)
        if matched < min(len(proposal.tokens), len(committed)):
            self._diverged(proposal, matched, committed)
        elif matched >= 1:
            self._divergence = None

    def _diverged(self, proposal: _Proposal, matched: int, committed: Sequence[int]) -> None:
        origin = proposal.origins[matched]
        if isinstance(origin, tuple):  # the substitution itself was wrong here
            self.substitutions.pop(origin, None)
            self._divergence = None
        elif matched >= 1:  # a copy that held and then broke: an edit may start here
            self._divergence, self._since = (proposal.source, origin), list(committed[matched:])
        else:  # a misaligned proposal says nothing about the copy
            self._note(committed)

    def _note(self, committed: Sequence[int]) -> None:
        if self._divergence is not None:
            self._since.extend(committed)
            if len(self._since) > MAX_GAP:
                self._divergence = None

    def _learn(self, source: list[int], resumed_at: int) -> None:
        if self._divergence is None:
            return
        diverged_source, diverged_at = self._divergence
        self._divergence = None
        if source is not diverged_source or not diverged_at < resumed_at <= diverged_at + MAX_GAP:
            return
        old, new = _trim(source[diverged_at:resumed_at], self._since)
        if not 1 <= len(old) <= MAX_SPAN or len(new) > MAX_SPAN or old == new:
            return
        if len(self.substitutions) >= MAX_EDITS:
            self.substitutions.pop(next(iter(self.substitutions)))
        self.substitutions[tuple(old)] = tuple(new)

    def _substitution_at(self, source: list[int], position: int) -> tuple[int, ...] | None:
        for old in self.substitutions:
            if tuple(source[position : position + len(old)]) == old:
                return old
        return None


def _common_prefix(first: Sequence[int], second: Sequence[int]) -> int:
    count = 0
    for one, other in zip(first, second, strict=False):
        if one != other:
            break
        count += 1
    return count


def _trim(old: Sequence[int], new: Sequence[int]) -> tuple[list[int], list[int]]:
    """``old`` and ``new`` without their common suffix, then without their common prefix."""
    old, new = list(old), list(new)
    while old and new and old[-1] == new[-1]:
        old.pop()
        new.pop()
    prefix = _common_prefix(old, new)
    return old[prefix:], new[prefix:]
