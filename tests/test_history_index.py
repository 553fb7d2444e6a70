"""The cross-request suffix index (``decoding/drafters/history.py``, issue 21).

Every check goes through the public API: what is proposed, with which counts and shares,
and how many tokens are held. A stale occurrence left by an eviction would either be
proposed, skew a count, or fail the lookup outright, so each eviction test looks up the
evicted text and a key it shared with the survivors.
"""

from __future__ import annotations

import random
import threading

import pytest

from specrag.decoding.drafters.history import MAX_OCCURRENCES_PER_KEY, Continuation, HistoryIndex


def proposals(
    index: HistoryIndex, tenant: str, context: list[int], max_tokens: int = 8, **kwargs: int
) -> list[list[int]]:
    return [c.tokens for c in index.continuations(tenant, context, max_tokens, **kwargs)]


def test_a_repeated_output_is_proposed_for_the_same_context() -> None:
    index = HistoryIndex()
    index.add("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    [continuation] = index.continuations("a", [90, 91, 3, 4, 5], max_tokens=3)
    assert continuation == Continuation(tokens=[6, 7, 8], count=1, share=1.0, match_ngram=3)


def test_a_continuation_stops_at_the_end_of_its_output() -> None:
    index = HistoryIndex()
    index.add("a", [1, 2, 3, 4])
    assert proposals(index, "a", [1, 2], max_tokens=10) == [[3, 4]]
    assert proposals(index, "a", [3, 4]) == []  # nothing followed the output's last tokens


def test_the_most_frequent_next_token_ranks_first_with_its_share() -> None:
    index = HistoryIndex()
    index.add("a", [1, 2, 3, 7, 8])
    index.add("a", [1, 2, 3, 7, 9])
    index.add("a", [1, 2, 3, 5, 6])  # the most recent, but its next token is the rarer one
    first, second = index.continuations("a", [1, 2, 3], max_tokens=4)
    # Token 7 followed twice; its tokens come from its most recent occurrence.
    assert (first.tokens, first.count, first.share) == ([7, 9], 2, pytest.approx(2 / 3))
    assert (second.tokens, second.count, second.share) == ([5, 6], 1, pytest.approx(1 / 3))
    assert first.match_ngram == second.match_ngram == 3


def test_equal_counts_put_the_most_recent_occurrence_first() -> None:
    index = HistoryIndex()
    index.add("a", [1, 2, 5])
    index.add("a", [1, 2, 6])
    index.add("a", [1, 2, 7])
    assert proposals(index, "a", [1, 2]) == [[7], [6], [5]]


def test_the_longest_match_wins_over_a_more_frequent_shorter_one() -> None:
    index = HistoryIndex()
    index.add("a", [1, 2, 3, 4, 50])
    for _ in range(3):
        index.add("a", [9, 3, 4, 60, 61])
    [continuation] = index.continuations("a", [1, 2, 3, 4], max_tokens=4)
    assert (continuation.tokens, continuation.count, continuation.share, continuation.match_ngram) == ([50], 1, 1.0, 4)
    # Where only the 2-gram matches, every occurrence of it counts.
    first, second = index.continuations("a", [8, 3, 4], max_tokens=4)
    assert (first.tokens, first.count, first.share, first.match_ngram) == ([60, 61], 3, 0.75, 2)
    assert (second.tokens, second.count, second.share) == ([50], 1, 0.25)


def test_a_tenant_never_gets_another_tenants_tokens() -> None:
    index = HistoryIndex(max_tokens_per_tenant=8)
    index.add("a", [1, 2, 3, 4, 5])
    assert proposals(index, "b", [1, 2, 3]) == []
    index.add("b", [1, 2, 3, 40, 50])
    assert proposals(index, "b", [1, 2, 3]) == [[40, 50]]
    assert proposals(index, "a", [1, 2, 3]) == [[4, 5]]
    # After A's output is evicted (by A's next output), B still sees only its own.
    index.add("a", [7, 8, 9, 10, 11])
    assert proposals(index, "a", [1, 2, 3]) == []
    assert proposals(index, "b", [1, 2, 3]) == [[40, 50]]
    index.forget("a")
    assert proposals(index, "b", [1, 2, 3]) == [[40, 50]]
    assert index.tokens_held("a") == 0


def test_eviction_keeps_the_cap_and_leaves_no_stale_occurrence() -> None:
    index = HistoryIndex(max_tokens_per_tenant=20)
    index.add("a", [1, 2, 10, 11, 12, 13, 14, 15])
    index.add("a", [1, 2, 20, 21, 22, 23, 24, 25])
    assert index.tokens_held("a") == 16
    index.add("a", [30, 31, 32, 33, 34, 35, 36, 37])  # 24 > 20: the oldest output goes
    assert index.tokens_held("a") == 16
    assert index.tokens_held() == 16
    assert proposals(index, "a", [11, 12]) == []
    # The key (1, 2) was shared: only the survivor's occurrence may count.
    [continuation] = index.continuations("a", [1, 2], max_tokens=2)
    assert (continuation.tokens, continuation.count, continuation.share) == ([20, 21], 1, 1.0)


def test_eviction_follows_use_not_age() -> None:
    index = HistoryIndex(max_tokens_per_tenant=24)
    index.add("a", [1, 2, 10, 11, 12, 13, 14, 15])
    index.add("a", [3, 4, 20, 21, 22, 23, 24, 25])
    index.add("a", [5, 6, 30, 31, 32, 33, 34, 35])
    assert proposals(index, "a", [1, 2], max_tokens=2) == [[10, 11]]  # the oldest, now used
    index.add("a", [7, 8, 40, 41, 42, 43, 44, 45])
    assert proposals(index, "a", [3, 4]) == []
    assert proposals(index, "a", [1, 2], max_tokens=2) == [[10, 11]]
    assert index.tokens_held("a") == 24


def test_evicting_an_output_whose_occurrences_the_cap_had_dropped() -> None:
    # The first output's occurrence of (1, 2) is pushed out of the key by newer ones; the
    # newer ones are evicted first (the first output is used), which empties the key.
    first = [1, 2, 7, 8, 9]
    newer = [[1, 2, 100 + i] for i in range(MAX_OCCURRENCES_PER_KEY)]
    cap = len(first) + 3 * len(newer)
    index = HistoryIndex(max_tokens_per_tenant=cap)
    index.add("a", first)
    for output in newer:
        index.add("a", output)
    assert proposals(index, "a", [1, 2], max_branches=1) == [[100 + MAX_OCCURRENCES_PER_KEY - 1]]
    assert 7 not in [tokens[0] for tokens in proposals(index, "a", [1, 2], max_branches=1000)]
    assert proposals(index, "a", [7, 8]) == [[9]]  # marks the first output used
    index.add("a", list(range(1000, 1000 + cap - 2)))  # evicts the newer ones, then the first
    assert index.tokens_held("a") == cap - 2
    assert proposals(index, "a", [1, 2]) == []
    assert proposals(index, "a", [7, 8]) == []


def test_a_hot_key_keeps_its_most_recent_occurrences() -> None:
    index = HistoryIndex()
    for i in range(MAX_OCCURRENCES_PER_KEY + 6):
        index.add("a", [1, 2, 100 + i])
    continuations = index.continuations("a", [1, 2], max_tokens=1, max_branches=1000)
    assert [c.tokens[0] for c in continuations] == [100 + i for i in range(MAX_OCCURRENCES_PER_KEY + 5, 5, -1)]
    assert {c.share for c in continuations} == {1 / MAX_OCCURRENCES_PER_KEY}


def test_the_least_recently_used_tenant_is_dropped() -> None:
    index = HistoryIndex(max_tenants=2)
    index.add("a", [1, 2, 3])
    index.add("b", [1, 2, 4])
    assert proposals(index, "a", [1, 2]) == [[3]]  # a is now more recent than b
    index.add("c", [1, 2, 5])
    assert index.tokens_held("b") == 0
    assert proposals(index, "b", [1, 2]) == []
    assert proposals(index, "a", [1, 2]) == [[3]]
    assert proposals(index, "c", [1, 2]) == [[5]]
    assert index.tokens_held() == 6


def test_an_output_longer_than_the_cap_keeps_its_last_tokens() -> None:
    index = HistoryIndex(max_tokens_per_tenant=10)
    index.add("a", [50, 51, 52])
    index.add("a", list(range(15)))
    assert index.tokens_held("a") == 10
    assert proposals(index, "a", [50, 51]) == []  # evicted to make room
    assert proposals(index, "a", [2, 3]) == []  # among the dropped first five
    assert proposals(index, "a", [5, 6], max_tokens=3) == [[7, 8, 9]]


def test_max_tokens_and_max_branches_are_respected() -> None:
    index = HistoryIndex()
    for first in range(10, 16):
        index.add("a", [1, 2, first, 20, 21, 22, 23])
    continuations = index.continuations("a", [1, 2], max_tokens=2, max_branches=3)
    assert [c.tokens for c in continuations] == [[15, 20], [14, 20], [13, 20]]
    assert index.continuations("a", [1, 2], max_tokens=0) == []
    assert index.continuations("a", [1, 2], max_tokens=4, max_branches=0) == []


def test_empty_short_and_unknown_contexts_propose_nothing() -> None:
    index = HistoryIndex()
    index.add("a", [1, 2, 3])
    index.add("a", [4])  # too short to index: not stored
    assert index.tokens_held("a") == 3
    assert index.continuations("a", [], max_tokens=4) == []
    assert index.continuations("a", [2], max_tokens=4) == []  # shorter than min_ngram
    assert index.continuations("a", [8, 9], max_tokens=4) == []
    assert index.continuations("nobody", [1, 2], max_tokens=4) == []
    unigrams = HistoryIndex(min_ngram=1)
    unigrams.add("a", [1, 2, 3])
    assert proposals(unigrams, "a", [2]) == [[3]]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        HistoryIndex(min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError):
        HistoryIndex(min_ngram=0)
    with pytest.raises(ValueError):
        HistoryIndex(max_tokens_per_tenant=0)


def test_concurrent_adds_and_lookups_keep_the_invariants() -> None:
    # Each tenant writes from its own token range, so a leak shows as a foreign token.
    tenants, cap = [f"t{i}" for i in range(6)], 300
    index = HistoryIndex(max_tokens_per_tenant=cap, max_tenants=4, min_ngram=1, max_ngram=3)
    errors: list[BaseException] = []

    def token_range(tenant: str) -> range:
        base = 1000 * (int(tenant[1:]) + 1)
        return range(base, base + 6)

    def check(tenant: str, continuations: list[Continuation]) -> None:
        assert len(continuations) <= 3
        assert len({c.tokens[0] for c in continuations}) == len(continuations)
        for c in continuations:
            assert set(c.tokens) <= set(token_range(tenant))  # never another tenant's token
            assert c.count >= 1 and 0 < c.share <= 1

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                tenant = rng.choice(tenants)
                tokens = [rng.choice(token_range(tenant)) for _ in range(rng.randint(1, 40))]
                if rng.random() < 0.4:
                    index.add(tenant, tokens)
                else:
                    check(tenant, index.continuations(tenant, tokens, max_tokens=5, max_branches=3))
                assert index.tokens_held(tenant) <= cap
        except BaseException as error:  # a thread's failure is reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert index.tokens_held() <= 4 * cap
    held = [tenant for tenant in tenants if index.tokens_held(tenant) > 0]
    assert len(held) == 4  # six tenants wrote; the four most recently used are kept
    for tenant in held:  # still answering, and only with its own tokens
        check(tenant, index.continuations(tenant, list(token_range(tenant)), max_tokens=5, max_branches=3))
