"""Prompt-lookup drafting: matches, source preference, attribution, incremental indexing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specrag.decoding.drafters import Draft, PromptLookupDrafter
from specrag.decoding.drafters import prompt_lookup as lookup_module


def test_continues_the_longest_match_in_the_prompt() -> None:
    prompt = [1, 2, 3, 4, 5, 6, 9, 9, 2, 3]
    drafter = PromptLookupDrafter(prompt, min_ngram=1, max_ngram=3)
    draft = drafter.propose(prompt, 3)
    assert draft.tokens == [4, 5, 6]
    assert draft.source == "prompt"
    assert draft.probs is None


def test_longer_ngram_wins_over_a_more_recent_shorter_one() -> None:
    # suffix [7, 2, 3]: the 3-gram occurs at the start (-> 8), the 2-gram [2, 3] later (-> 5)
    prompt = [7, 2, 3, 8, 0, 2, 3, 5, 0, 7, 2, 3]
    draft = PromptLookupDrafter(prompt, min_ngram=2, max_ngram=3).propose(prompt, 2)
    assert draft.tokens == [8, 0]


def test_output_so_far_is_preferred_and_grows_incrementally() -> None:
    prompt = [10, 11, 12, 13]
    drafter = PromptLookupDrafter(prompt, min_ngram=2, max_ngram=2)
    context = [*prompt, 20, 21, 22, 11, 12]
    assert drafter.propose(context, 4).source == "prompt"  # [11, 12] -> 13 in the prompt
    context += [30, 11, 12]
    draft = drafter.propose(context, 3)
    assert draft.source == "output"  # most recent occurrence is now in the output
    assert draft.tokens == [30, 11, 12]


def test_a_copy_that_reaches_the_end_of_the_stream_repeats_what_it_copied() -> None:
    """A match 3 tokens back drafts a text of period 3 for the whole budget (the loop a
    small model falls into); a plain copy would stop where the stream ends."""
    prompt = [10, 11, 12, 13]
    context = [*prompt, 7, 8, 9, 7, 8, 9, 7, 8]
    draft = PromptLookupDrafter(prompt, min_ngram=2, max_ngram=2).propose(context, 8)
    assert (draft.source, draft.tokens) == ("output", [9, 7, 8, 9, 7, 8, 9, 7])
    passage = [1, 2, 3]  # a passage is not continued past its end: the draft is no part of it
    draft = PromptLookupDrafter([5], [passage], min_ngram=2).propose([5, 1, 2], 4)
    assert (draft.source, draft.tokens) == ("passage:0", [3])


def test_the_occurrence_matched_furthest_back_wins_over_the_preferred_source() -> None:
    """Both occurrences of [4, 5, 6] match the 3-gram; the prompt's also matches the 2, 3
    before it, as a copy in progress does, so it is continued ahead of the output's."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    context = [*prompt, 20, 4, 5, 6, 9, 21, 2, 3, 4, 5, 6]
    draft = PromptLookupDrafter(prompt, min_ngram=2, max_ngram=3).propose(context, 2)
    assert (draft.tokens, draft.source, draft.match_ngram) == ([7, 8], "prompt", 3)
    context[-4] = 22  # now both match 3 tokens back: the output so far is preferred again
    draft = PromptLookupDrafter(prompt, min_ngram=2, max_ngram=3).propose(context, 2)
    assert (draft.tokens, draft.source, draft.match_ngram) == ([9, 21], "output", 3)


def test_a_match_is_measured_back_only_so_far() -> None:
    text = list(range(100, 150))
    assert lookup_module._matched_back([*text, *text[:45]], text, 45) == lookup_module.MATCH_BACK_LIMIT
    assert lookup_module._matched_back([7, *text[:3]], text, 3) == 3  # the sequence starts there
    assert lookup_module._matched_back([7, 101, 102], text, 3) == 2


def test_passages_are_attributed_even_when_the_prompt_holds_the_same_text() -> None:
    passage_a, passage_b = [40, 41, 42, 43, 44], [50, 51, 52, 53]
    prompt = [1, *passage_a, *passage_b, 2, 51, 52]
    drafter = PromptLookupDrafter(prompt, [passage_a, passage_b], passage_names=["P1", "P2"], max_ngram=2)
    draft = drafter.propose(prompt, 5)
    assert (draft.tokens, draft.source) == ([53], "P2")


def test_passages_not_in_the_prompt_are_searched() -> None:
    unseen_passage = [7, 8, 9, 10, 11]
    prompt = [1, 2, 3, 7, 8]
    draft = PromptLookupDrafter(prompt, [unseen_passage]).propose(prompt, 8)
    assert (draft.tokens, draft.source) == ([9, 10, 11], "passage:0")


def test_no_match_and_zero_budget_propose_nothing() -> None:
    prompt = [1, 2, 3, 4]
    drafter = PromptLookupDrafter(prompt)
    assert drafter.propose([*prompt, 99], 5).tokens == []
    assert drafter.propose([*prompt, 99, 1, 2], 0).tokens == []


def test_the_trailing_ngram_never_matches_itself() -> None:
    prompt = [5, 6, 7]
    assert PromptLookupDrafter(prompt, min_ngram=1).propose(prompt, 4).tokens == []


def test_indexing_work_per_step_does_not_grow_with_the_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    long_prompt = list(range(1000)) * 32  # 32k tokens of sources
    drafter = PromptLookupDrafter(long_prompt, [long_prompt[:2000]])
    calls = []
    original = PromptLookupDrafter._ngrams_ending_before
    monkeypatch.setattr(
        PromptLookupDrafter,
        "_ngrams_ending_before",
        lambda self, tokens, position: calls.append(position) or original(self, tokens, position),
    )
    context = list(long_prompt)
    for token in (5, 6, 7):
        context.append(token)
        drafter.propose(context, 8)
    assert len(calls) == 3  # one new token indexed per step, nothing rescanned


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=40),
    st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=15), max_size=3),
    st.integers(1, 3),
    st.integers(1, 2),
    st.integers(1, 6),
)
def test_every_proposal_is_a_real_continuation_of_a_matched_ngram(
    context: list[int], passages: list[list[int]], max_ngram: int, min_ngram: int, budget: int
) -> None:
    min_ngram = min(min_ngram, max_ngram)
    split = len(context) // 2 or 1
    drafter = PromptLookupDrafter(context[:split], passages, min_ngram=min_ngram, max_ngram=max_ngram)
    draft = drafter.propose(context, budget)
    assert len(draft.tokens) <= budget
    if not draft.tokens:
        return
    # In the stream a match may not be the trailing n-gram itself (start < len(context)),
    # and a copy from it that reaches its end goes on over the draft itself.
    stream = [*context, *draft.tokens]
    sources = {"prompt": stream, "output": stream, lookup_module.NO_MATCH: []}
    sources.update({f"passage:{index}": passage for index, passage in enumerate(passages)})
    source_tokens = sources[draft.source]
    starts = len(context) if source_tokens is stream else len(source_tokens)
    assert any(
        source_tokens[start - n : start] == context[-n:]
        and source_tokens[start : start + len(draft.tokens)] == draft.tokens
        for n in range(min_ngram, max_ngram + 1)
        for start in range(n, starts)
    )


def test_a_proposal_says_the_length_of_the_ngram_it_continues() -> None:
    drafter = PromptLookupDrafter([1, 2, 3, 4, 5, 9, 3, 7], min_ngram=1, max_ngram=4)
    assert drafter.propose([1, 2, 3, 4, 5, 9, 3, 7, 1, 2, 3, 4], 2).match_ngram == 4
    assert drafter.propose([1, 2, 3, 4, 5, 9, 3, 7, 8, 9], 2).match_ngram == 1  # only "9" was seen


def test_a_history_match_carries_the_lookup_chain_as_its_rival() -> None:
    """The longer match goes first, the best chain of the other kind of source rides along
    as a rival for the planner to weigh; a draft with one kind of source has none."""
    prompt = [1, 2, 3, 4, 5, 6]
    from_history = Draft([7, 7], None, "history", 4)
    drafter = PromptLookupDrafter(prompt, min_ngram=2, max_ngram=3, history=lambda *_: [from_history])
    draft = drafter.propose([*prompt, 0, 2, 3], 3)
    assert (draft.tokens, draft.source) == ([7, 7], "history")
    assert [(rival.tokens, rival.source) for rival in draft.rivals] == [([4, 5, 6], "prompt")]
    assert PromptLookupDrafter(prompt, min_ngram=2, max_ngram=3).propose([*prompt, 0, 2, 3], 3).rivals == []
