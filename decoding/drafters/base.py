"""The drafter protocol (docs/design.md): propose candidates, then hear what was committed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from specrag.decoding.kv import SequenceKV


@dataclass
class Draft:
    """Proposed tokens. ``probs`` [len(tokens), V] holds the distributions they were
    drawn from; None for a deterministic drafter (acceptance treats q as one-hot).
    ``match_ngram``: for prompt lookup, the length of the n-gram the proposal continues
    (0 for other drafters); the policy keeps its acceptance estimates apart by it.
    ``match_back``: how many tokens before the proposal agree with the context, that
    n-gram included (prompt lookup measures up to 32; 0: not measured). A tree counts an
    alternative as the chain's peer only where it matched as far back.

    A draft tree (``decoding/tree.py``) sets ``parents``: the tokens are its nodes in
    depth-first preorder, ``parents[i]`` is node i's parent (-1: a child of the pending
    token), the first root-to-leaf path is the chain ``source`` proposed, and
    ``node_sources`` names each node's source. Trees are deterministic (``probs`` None).
    ``alternatives``: other chains the drafter found (prompt lookup's other matches, the
    draft model's runner-ups), from which the policy may grow a tree
    (``decoding/tree_sizing.py``). ``rivals``: the best chains of other kinds of source
    (prompt lookup's against a tenant's history), each with its own alternatives: the
    planner verifies whichever its estimates promise the higher rate, so a source that
    keeps being rejected cannot displace one that is accepted by matching longer."""

    tokens: list[int]
    probs: torch.Tensor | None
    source: str
    match_ngram: int = 0
    parents: list[int] | None = None
    node_sources: list[str] | None = None
    branch_keys: list[str] | None = None  # a tree's branch starts: the estimate each is judged by
    alternatives: list[Draft] = field(default_factory=list)
    rivals: list[Draft] = field(default_factory=list)
    match_back: int = 0

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    def truncated(self, gamma: int) -> Draft:
        """The first ``gamma`` tokens (and their distributions); a tree's first path."""
        if self.parents is not None:
            return self.first_path().truncated(gamma)
        if gamma >= len(self.tokens):
            return self
        probs = self.probs[:gamma] if self.probs is not None else None
        return Draft(self.tokens[:gamma], probs, self.source, self.match_ngram, match_back=self.match_back)

    def subtree(self, kept: Sequence[int]) -> Draft:
        """The tree with only the ``kept`` nodes (preorder indices, each kept node's parent
        kept too), renumbered in preorder; nothing kept: an empty chain."""
        assert self.parents is not None
        if not kept:
            return Draft([], None, self.source, self.match_ngram)
        index = {node: position for position, node in enumerate(kept)}
        parents = [-1 if self.parents[node] < 0 else index[self.parents[node]] for node in kept]

        def pick(values: list[str] | None) -> list[str] | None:
            return [values[node] for node in kept] if values is not None else None

        tokens = [self.tokens[node] for node in kept]
        return Draft(
            tokens,
            None,
            self.source,
            self.match_ngram,
            parents=parents,
            node_sources=pick(self.node_sources),
            branch_keys=pick(self.branch_keys),
        )

    def first_path(self) -> Draft:
        """The chain the tree was grown from: its first path up to the first branch node
        (a chain is its own)."""
        if self.parents is None:
            return self
        keys = self.branch_keys or [""] * len(self.tokens)
        length = 0  # in preorder the first path is the leading run of nodes each under the last
        while length < len(self.parents) and self.parents[length] == length - 1 and not keys[length]:
            length += 1
        return Draft(self.tokens[:length], None, self.source, self.match_ngram)


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
