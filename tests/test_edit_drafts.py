"""Drafts that copy the model's edits (``decoding/drafters/edits.py``).

A simulated target rewrites a source, renaming the two-token identifier ``OLD`` to the
one-token ``NEW`` everywhere; every cycle verifies the drafter's proposal against it.
Exactness does not depend on any of this (drafts are proposals; the engine's parity
property tests run prompt lookup with edits on); these tests hold the speed-up itself.
"""

from __future__ import annotations

import pytest

from specrag.decoding.drafters import PromptLookupDrafter
from specrag.decoding.drafters.edits import MAX_GAP, EditTracker

OLD, NEW = [50, 51], [60]
CODE = [1, 2, 3, *OLD, 4, 5, 6, 7, *OLD, 8, 9, 10, 11, *OLD, 12, 13, 14, 15, *OLD, 16, 17, 18, 19, 20]
PROMPT = [90, 91, *CODE, 92]


def renamed(tokens: list[int]) -> list[int]:
    out, position = [], 0
    while position < len(tokens):
        if tokens[position : position + len(OLD)] == OLD:
            out.extend(NEW)
            position += len(OLD)
        else:
            out.append(tokens[position])
            position += 1
    return out


def simulate(gamma: int = 8) -> tuple[int, list[list[int]]]:
    """Target calls to write ``renamed(CODE)`` after the prompt, and every proposal."""
    target = renamed(CODE)
    drafter = PromptLookupDrafter(PROMPT, min_ngram=1, max_ngram=4)
    context, produced, calls, proposals = [*PROMPT, target[0]], 1, 0, []
    while produced < len(target):
        draft = drafter.propose(context, gamma)
        proposals.append(draft.tokens)
        expected = target[produced:]
        accepted = 0
        while accepted < min(len(draft.tokens), len(expected)) and draft.tokens[accepted] == expected[accepted]:
            accepted += 1
        committed = expected[: accepted + 1]
        drafter.on_commit(committed, accepted)
        context += committed
        produced += len(committed)
        calls += 1
    return calls, proposals


def test_a_learned_rename_is_drafted_at_the_later_occurrences(monkeypatch: pytest.MonkeyPatch) -> None:
    calls, proposals = simulate()
    assert any(NEW[0] in tokens and tokens.index(NEW[0]) > 0 for tokens in proposals), "never drafted the new name"
    monkeypatch.setattr(EditTracker, "observe", lambda self, committed: None)  # planted: nothing is learned
    calls_without, _ = simulate()
    assert calls < calls_without, (calls, calls_without)


def test_a_misaligned_proposal_between_the_break_and_the_resumption_still_teaches_the_edit() -> None:
    source = [1, 2, 3, *OLD, 7, 8, 9, 10]
    tracker = EditTracker()
    assert tracker.copy(source, 0, 5) == [1, 2, 3, *OLD]
    tracker.observe([1, 2, 3, *NEW])  # the copy broke at OLD
    tracker.copy(source, 8, 2)  # a proposal from elsewhere ...
    tracker.observe([7])  # ... rejected at once: no new break
    tracker.copy(source, 6, 3)
    tracker.observe([8, 9, 10, 11])  # the copy resumed after OLD, 7
    assert tracker.substitutions == {tuple(OLD): tuple(NEW)}
    assert tracker.copy(source, 0, 6) == [1, 2, 3, *NEW, 7, 8]


def test_a_rejected_substitution_is_forgotten() -> None:
    source = [1, *OLD, 2, 3]
    tracker = EditTracker()
    tracker.substitutions[tuple(OLD)] = tuple(NEW)
    assert tracker.copy(source, 0, 4) == [1, *NEW, 2, 3]
    tracker.observe([1, OLD[0]])  # the target kept the old name here
    assert not tracker.substitutions
    assert tracker.copy(source, 0, 4) == [1, *OLD, 2]


@pytest.mark.parametrize("resumed_at", [3, 3 + MAX_GAP + 1])
def test_nothing_is_learned_from_a_resumption_before_the_break_or_too_far_after(resumed_at: int) -> None:
    source = list(range(100, 100 + 3 + MAX_GAP + 8))
    tracker = EditTracker()
    tracker.copy(source, 0, 5)
    tracker.observe([100, 101, 102, 7])  # broke at position 3
    tracker.copy(source, resumed_at, 2)
    tracker.observe(source[resumed_at : resumed_at + 3])
    assert not tracker.substitutions


def test_a_resumption_in_another_source_learns_nothing() -> None:
    source, other = [1, 2, 3, *OLD, 7, 8], [1, 2, 3, *OLD, 7, 8]
    tracker = EditTracker()
    tracker.copy(source, 0, 5)
    tracker.observe([1, 2, 3, *NEW])
    tracker.copy(other, 5, 2)
    tracker.observe([7, 8])
    assert not tracker.substitutions
