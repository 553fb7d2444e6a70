"""The drafter protocol (DESIGN.md): propose candidates, then hear what was committed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


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
    def propose(self, context: Sequence[int], max_tokens: int) -> Draft:
        """Up to ``max_tokens`` candidates continuing ``context`` (all committed tokens)."""
        ...

    def on_commit(self, committed: Sequence[int], accepted_len: int) -> None:
        """The tokens committed this cycle (accepted prefix + one target token)."""
        ...
