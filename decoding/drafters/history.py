"""A cross-request suffix index: what followed the current suffix in a tenant's earlier outputs.

Agent traffic repeats itself across requests (the same tool calls, argument shapes and
sentences). This index keeps each tenant's finished outputs and, given the end of the
current context, proposes the continuations that followed it before, scored by how often
each followed: SuffixDecoding's global suffix tree, simplified to the n-gram hash indexes
of prompt lookup (issue 21, docs/design/trees.md section 5).

Isolation: a tenant's outputs are only ever proposed to that same tenant. Acceptance
timing tells a client whether a draft was right, so an index shared across users would
leak one user's text to another. There is no cross-tenant mode in this class; sharing
across API keys, if it is ever wanted, is the caller's choice of tenant string.

Lookup: the longest n (``max_ngram`` down to ``min_ngram``) whose last n context tokens
occur in the tenant's outputs followed by at least one token. Its occurrences are grouped
by the token that followed; one continuation per group, most frequent first (ties: the
group whose latest occurrence is the most recent). ``share`` is the group's count over
all occurrences of the key: an estimate of P(first token). A continuation copies the
group's most recent occurrence, up to ``max_tokens`` and never past the end of that
output. Deeper tokens follow recency rather than a per-depth vote: a repeated template's
latest instance is the likeliest to match again (argument values drift), and a vote would
cost occurrences × depth per lookup.

"Recent" is the order in which outputs were added (and positions within an output).
"Used", for eviction, is different: an output is used when it is added and each time one
of its continuations is returned, so a template that keeps being drafted stays.

Cost: each key keeps only its ``MAX_OCCURRENCES_PER_KEY`` most recent occurrences (older
ones are dropped as newer arrive), so a hot key stays cheap; counts and shares are over
these. A lookup makes at most ``max_ngram - min_ngram + 1`` hash probes, then reads the
key's occurrences and copies the returned tokens: O(max_ngram + occurrences + returned
tokens), never a rescan of the stored text. Adding an output of L tokens indexes
O(L × (max_ngram - min_ngram + 1)) keys; evicting it visits the same keys and filters
their (capped) occurrence lists. Memory is about ``max_ngram - min_ngram + 1`` index
entries per stored token; size ``max_tokens_per_tenant × max_tenants`` accordingly.

Thread safety: one lock around every mutation and lookup, since requests finish (``add``)
on server threads while the engine thread looks up.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

# Occurrences kept per key, most recent: bounds a lookup's work on keys that every output
# shares (a tool call's opening tokens), at the price of forgetting their oldest followers.
MAX_OCCURRENCES_PER_KEY = 64

Key = tuple[int, ...]
# (output id, position of the token that followed the key in that output)
Occurrence = tuple[int, int]


@dataclass(frozen=True)
class Continuation:
    """A proposed continuation of the context.

    ``count``: the retained occurrences of the matched suffix that were followed by
    ``tokens[0]``; ``share``: count over all retained occurrences of the suffix, an
    estimate of P(first token); ``match_ngram``: the length of the matched suffix.
    """

    tokens: list[int]
    count: int
    share: float
    match_ngram: int


class _TenantHistory:
    """One tenant's outputs and their n-gram index. Not thread-safe: HistoryIndex locks."""

    def __init__(self, min_ngram: int, max_ngram: int, max_tokens: int) -> None:
        self._min_ngram = min_ngram
        self._max_ngram = max_ngram
        self._max_tokens = max_tokens
        # output id -> its tokens, least recently used first. Ids are never reused, so an
        # occurrence can only ever point at the output it was recorded for.
        self._outputs: OrderedDict[int, list[int]] = OrderedDict()
        # key -> its occurrences, oldest first (ids grow with each add, positions along an
        # output), so the most recent is last and the cap drops from the front.
        self._index: dict[Key, list[Occurrence]] = {}
        self._next_id = 0
        self.held = 0

    def add(self, tokens: list[int]) -> None:
        """Store an output (at most the cap's tokens, which the caller has truncated to)."""
        while self._outputs and self.held + len(tokens) > self._max_tokens:
            self._evict_least_recently_used()
        output_id = self._next_id
        self._next_id += 1
        self._outputs[output_id] = tokens
        self.held += len(tokens)
        for key, position in self._keys(tokens):
            self._record(key, (output_id, position))

    def continuations(self, tail: list[int], max_tokens: int, max_branches: int) -> list[Continuation]:
        match = self._longest_match(tail)
        if match is None:
            return []
        ngram, occurrences = match
        counts, latest = self._group_by_next_token(occurrences)
        # sorted() is stable and the groups were met newest first: ties stay most recent first.
        ranked = sorted(counts, key=lambda token: -counts[token])[:max_branches]
        return [
            self._continuation(latest[token], counts[token], len(occurrences), ngram, max_tokens) for token in ranked
        ]

    def _longest_match(self, tail: list[int]) -> tuple[int, list[Occurrence]] | None:
        """The longest n whose last-n-tokens key has occurrences, and those occurrences."""
        for ngram in range(min(self._max_ngram, len(tail)), self._min_ngram - 1, -1):
            occurrences = self._index.get(tuple(tail[-ngram:]))
            if occurrences:
                return ngram, occurrences
        return None

    def _group_by_next_token(self, occurrences: list[Occurrence]) -> tuple[dict[int, int], dict[int, Occurrence]]:
        """Per following token: how many occurrences it followed, and its most recent one.
        Both dicts are filled newest first, so their order is that of the latest occurrences."""
        counts: dict[int, int] = {}
        latest: dict[int, Occurrence] = {}
        for occurrence in reversed(occurrences):
            output_id, position = occurrence
            token = self._outputs[output_id][position]
            counts[token] = counts.get(token, 0) + 1
            latest.setdefault(token, occurrence)
        return counts, latest

    def _continuation(
        self, occurrence: Occurrence, count: int, total: int, ngram: int, max_tokens: int
    ) -> Continuation:
        """Copy the continuation at ``occurrence`` and mark its output used."""
        output_id, position = occurrence
        self._outputs.move_to_end(output_id)
        tokens = self._outputs[output_id][position : position + max_tokens]
        return Continuation(tokens, count, count / total, ngram)

    def _keys(self, tokens: list[int]) -> Iterator[tuple[Key, int]]:
        """Every n-gram of ``tokens`` that some token follows, with that token's position."""
        for position in range(self._min_ngram, len(tokens)):
            for ngram in range(self._min_ngram, min(self._max_ngram, position) + 1):
                yield tuple(tokens[position - ngram : position]), position

    def _record(self, key: Key, occurrence: Occurrence) -> None:
        occurrences = self._index.setdefault(key, [])
        occurrences.append(occurrence)
        if len(occurrences) > MAX_OCCURRENCES_PER_KEY:
            del occurrences[0]  # the oldest; O(cap), as the lookup that reads the list is

    def _evict_least_recently_used(self) -> None:
        output_id, tokens = self._outputs.popitem(last=False)
        self.held -= len(tokens)
        for key in {key for key, _ in self._keys(tokens)}:
            self._unrecord(key, output_id)

    def _unrecord(self, key: Key, output_id: int) -> None:
        """Remove every occurrence of ``key`` in the output, and the key when none is left."""
        occurrences = self._index.get(key)
        # Missing: the cap had dropped this output's occurrences and evictions of newer
        # outputs then emptied the key.
        if occurrences is None:
            return
        kept = [occurrence for occurrence in occurrences if occurrence[0] != output_id]
        if kept:
            self._index[key] = kept
        else:
            del self._index[key]


class HistoryIndex:
    """Earlier outputs per tenant, and the continuations they suggest (module docstring).

    Bounds: each tenant holds at most ``max_tokens_per_tenant`` tokens of outputs (adding
    beyond evicts its least recently used outputs; an output longer than the cap keeps its
    last ``max_tokens_per_tenant`` tokens), and at most ``max_tenants`` tenants are kept (a
    new one drops the least recently used tenant whole; a tenant is used by each ``add``
    and each lookup).
    """

    def __init__(
        self,
        *,
        min_ngram: int = 2,
        max_ngram: int = 6,
        max_tokens_per_tenant: int = 200_000,
        max_tenants: int = 64,
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if max_tokens_per_tenant < 1 or max_tenants < 1:
            raise ValueError(f"need positive caps, got {max_tokens_per_tenant} tokens, {max_tenants} tenants")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.max_tokens_per_tenant = max_tokens_per_tenant
        self.max_tenants = max_tenants
        self._lock = threading.Lock()
        # tenant -> its history, least recently used first
        self._tenants: OrderedDict[str, _TenantHistory] = OrderedDict()

    def add(self, tenant: str, tokens: Sequence[int]) -> None:
        """Store a finished output of ``tenant``."""
        # int(): token ids may come as numpy or tensor scalars, which would hash by identity.
        kept = [int(token) for token in tokens[-self.max_tokens_per_tenant :]]
        if len(kept) <= self.min_ngram:
            return  # no n-gram in it has a follower: it could never be proposed
        with self._lock:
            self._tenant_for_add(tenant).add(kept)

    def continuations(
        self, tenant: str, context: Sequence[int], max_tokens: int, max_branches: int = 4
    ) -> list[Continuation]:
        """Up to ``max_branches`` continuations of ``context`` (one per distinct first token,
        most frequent first), each at most ``max_tokens`` long, from ``tenant``'s outputs only."""
        if max_tokens <= 0 or max_branches <= 0:
            return []
        tail = [int(token) for token in context[-self.max_ngram :]]
        with self._lock:
            history = self._tenants.get(tenant)
            if history is None:
                return []
            self._tenants.move_to_end(tenant)
            return history.continuations(tail, max_tokens, max_branches)

    def forget(self, tenant: str) -> None:
        """Drop everything stored for ``tenant`` (e.g. its key was revoked)."""
        with self._lock:
            self._tenants.pop(tenant, None)

    def tokens_held(self, tenant: str | None = None) -> int:
        """Tokens stored for ``tenant``, or for all tenants together."""
        with self._lock:
            if tenant is not None:
                history = self._tenants.get(tenant)
                return history.held if history is not None else 0
            return sum(history.held for history in self._tenants.values())

    def _tenant_for_add(self, tenant: str) -> _TenantHistory:
        """The tenant's history, made (dropping the least recently used tenant when full)."""
        history = self._tenants.get(tenant)
        if history is not None:
            self._tenants.move_to_end(tenant)
            return history
        if len(self._tenants) >= self.max_tenants:
            self._tenants.popitem(last=False)
        history = _TenantHistory(self.min_ngram, self.max_ngram, self.max_tokens_per_tenant)
        self._tenants[tenant] = history
        return history
