"""The drafter protocol (docs/design.md): propose candidates, then hear what was committed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from specrag.decoding.kv import SequenceKV


@dataclass
class Draft:
    """Proposed tokens. ``probs`` [len(tokens), V] holds the distributions they were
    drawn from; None for a deterministic drafter (acceptance treats q as one-hot).
    ``match_ngram``: for prompt lookup, the length of the n-gram the proposal continues
    (0 for other drafters); the policy keeps its acceptance estimates apart by it."""

    tokens: list[int]
    probs: torch.Tensor | None
    source: str
    match_ngram: int = 0

    def truncated(self, gamma: int) -> Draft:
        """The first ``gamma`` tokens (and their distributions)."""
        if gamma >= len(self.tokens):
            return self
        probs = self.probs[:gamma] if self.probs is not None else None
        return Draft(self.tokens[:gamma], probs, self.source, self.match_ngram)


class Drafter(Protocol):
    """What proposes draft tokens, and what it costs.

    ``costly``: each proposed token costs a forward of its own (a draft model). The policy
    judges such a drafter on its estimates before asking it to draft, and the engine runs its
    forwards in the step's lockstep (``drafting``); a free drafter (prompt lookup, the
    grammar's forced tokens) proposes right away. ``kv``: the drafter's own cache, which the
    sequence releases with its own, or None; ``cache_matches`` says whether it is in step
    with the committed tokens (always, for a drafter without a cache).
    """

    costly: bool
    kv: SequenceKV | None

    def cache_matches(self, context: Sequence[int]) -> bool: ...

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft:
        """Up to ``max_tokens`` candidates continuing ``context`` (all committed tokens)."""
        ...

    def on_commit(self, committed: Sequence[int], accepted_len: int) -> None:
        """The tokens committed this cycle (accepted prefix + one target token)."""
        ...


class FreeDrafter:
    """The cost side of the protocol for a drafter whose proposals cost no forward."""

    costly = False
    kv: SequenceKV | None = None

    def cache_matches(self, context: Sequence[int]) -> bool:
        return True
