"""Unit and property tests of the tree speculation maths (decoding/tree.py): structure,
attention segments, greedy and sampling acceptance on hand-built trees."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specrag.decoding.acceptance import greedy_accept
from specrag.decoding.tree import (
    Segment,
    check_tree,
    compaction_rows,
    greedy_accept_tree,
    node_depths,
    path_segments,
    path_to,
    sample_accept_tree,
    sample_accept_tree_batch,
)


@st.composite
def preorder_trees(draw: st.DrawFn, max_nodes: int = 12, vocab: int = 6) -> tuple[list[int], list[int]]:
    """(tokens, parents) of a random tree in depth-first preorder with distinct sibling tokens."""
    size = draw(st.integers(0, max_nodes))
    tokens: list[int] = []
    parents: list[int] = []
    path: list[int] = []  # the nodes from the root to the previous node
    used: dict[int, set[int]] = {}
    for node in range(size):
        keep = draw(st.integers(0, len(path)))  # hang the node below path[keep - 1] (the root for 0)
        parent = path[keep - 1] if keep else -1
        if len(used.get(parent, ())) == vocab:  # no token left for a sibling: the previous node is a leaf
            keep, parent = len(path), path[-1]
        del path[keep:]
        free = sorted(set(range(vocab)) - used.setdefault(parent, set()))
        token = draw(st.sampled_from(free))
        used[parent].add(token)
        tokens.append(token)
        parents.append(parent)
        path.append(node)
    return tokens, parents


def _one_hot_logits(choices: list[int], vocab: int) -> torch.Tensor:
    logits = torch.zeros(len(choices), vocab)
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 5.0
    return logits


# -- the tree ----------------------------------------------------------------------------


def test_a_tree_knows_its_depths_and_paths() -> None:
    parents = [-1, 0, 0, -1, 3]
    check_tree([5, 1, 2, 7, 3], parents)
    assert node_depths(parents) == [1, 2, 2, 1, 2]
    assert path_to(parents, 2) == [0, 2] and path_to(parents, 4) == [3, 4] and path_to(parents, -1) == []


@pytest.mark.parametrize(
    ("tokens", "parents", "message"),
    [
        ([1, 2], [-1], "parents"),
        ([1, 2], [-1, 1], r"not in \[-1, 1\)"),
        ([1, 2], [-2, 0], r"not in \[-1, 0\)"),
        ([1, 2, 1], [-1, -1, -1], "repeats a sibling"),
        ([1, 2, 3], [-1, -1, 0], "not preorder"),
    ],
)
def test_an_invalid_tree_is_refused(tokens: list[int], parents: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_tree(tokens, parents)


def test_the_same_token_may_appear_under_different_parents() -> None:
    check_tree([3, 3, 4, 3], [-1, 0, -1, 2])


# -- attention segments ------------------------------------------------------------------


def test_segments_of_a_hand_built_tree() -> None:
    assert path_segments([-1, 0, 0, -1]) == [Segment(0, 3, []), Segment(3, 4, [0, 1]), Segment(4, 5, [0])]
    assert path_segments([]) == [Segment(0, 1, [])]
    assert path_segments([-1, 0, 1]) == [Segment(0, 4, [])]
    assert path_segments([-1, -1, -1]) == [Segment(0, 2, []), Segment(2, 3, [0]), Segment(3, 4, [0])]


def test_segments_refuse_a_tree_out_of_preorder() -> None:
    with pytest.raises(ValueError, match="preorder"):
        path_segments([-1, -1, 0])


@settings(max_examples=200, deadline=None)
@given(preorder_trees(max_nodes=16))
def test_segments_cover_every_row_once_as_root_to_leaf_paths(tree: tuple[list[int], list[int]]) -> None:
    _, parents = tree
    segments = path_segments(parents)
    rows = [row for segment in segments for row in range(segment.start_row, segment.end_row)]
    assert rows == list(range(len(parents) + 1))
    parent_row = [-1] + [parent + 1 for parent in parents]
    leaf_rows = {row for row in range(len(parents) + 1) if row not in parent_row}
    assert len(segments) == len(leaf_rows)
    assert segments[0].start_row == 0
    assert segments[0].ancestor_rows == []
    for segment in segments:
        assert segment.end_row - 1 in leaf_rows
        expected_parent = segment.ancestor_rows[-1] if segment.ancestor_rows else -1
        for row in range(segment.start_row, segment.end_row):
            assert parent_row[row] == expected_parent
            expected_parent = row
        # The ancestors are the start row's whole path, from row 0 down.
        above, chain = parent_row[segment.start_row], []
        while above != -1:
            chain.append(above)
            above = parent_row[above]
        assert segment.ancestor_rows == chain[::-1]


def test_compaction_keeps_the_pending_row_and_the_accepted_path() -> None:
    assert compaction_rows([]) == [0]
    assert compaction_rows([0, 2, 5]) == [0, 1, 3, 6]


# -- greedy --------------------------------------------------------------------------------


def test_greedy_follows_the_argmax_into_the_second_branch() -> None:
    tokens, parents = [5, 1, 2, 3, 4], [-1, 0, 0, -1, 3]
    # rows: 0 root, 1 node0 (5), 2 node1, 3 node2, 4 node3 (3), 5 node4 (4)
    logits = _one_hot_logits([3, 0, 0, 0, 4, 6], vocab=8)
    assert greedy_accept_tree(tokens, parents, logits) == ([3, 4], [3, 4, 6])


def test_greedy_rejects_at_the_root_and_commits_the_argmax() -> None:
    logits = _one_hot_logits([7, 0, 0], vocab=8)
    assert greedy_accept_tree([5, 1], [-1, -1], logits) == ([], [7])
    assert greedy_accept_tree([], [], logits[:1]) == ([], [7])


def test_greedy_stops_at_a_leaf_with_the_bonus_token() -> None:
    logits = _one_hot_logits([5, 1, 6, 0], vocab=8)  # row 2 is node 1's: its argmax is the bonus
    assert greedy_accept_tree([5, 1, 2], [-1, 0, 0], logits) == ([0, 1], [5, 1, 6])


def test_the_rows_must_match_the_tree() -> None:
    with pytest.raises(ValueError, match="needs 3 target rows"):
        greedy_accept_tree([5, 1], [-1, 0], torch.zeros(2, 8))
    with pytest.raises(ValueError, match="needs 2 target rows"):
        sample_accept_tree([5], [-1], torch.full((3, 8), 1 / 8), torch.Generator())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=6), st.data())
def test_greedy_on_a_chain_equals_chain_greedy(draft: list[int], data: st.DataObject) -> None:
    choices = data.draw(st.lists(st.integers(0, 3), min_size=len(draft) + 1, max_size=len(draft) + 1))
    logits = _one_hot_logits(choices, vocab=4)
    accepted_len, committed = greedy_accept(torch.tensor(draft, dtype=torch.long), logits)
    accepted, tree_committed = greedy_accept_tree(draft, list(range(-1, len(draft) - 1)), logits)
    assert accepted == list(range(accepted_len))
    assert tree_committed == committed.tolist()


def test_greedy_on_a_chain_equals_chain_greedy_on_random_logits() -> None:
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        length = int(torch.randint(0, 6, (), generator=generator))
        logits = torch.randn(length + 1, 3, generator=generator)
        draft = torch.randint(0, 3, (length,), generator=generator)
        accepted_len, committed = greedy_accept(draft, logits)
        accepted, tree_committed = greedy_accept_tree(draft.tolist(), list(range(-1, length - 1)), logits)
        assert (len(accepted), tree_committed) == (accepted_len, committed.tolist())


@settings(max_examples=200, deadline=None)
@given(preorder_trees(max_nodes=12, vocab=3), st.data())
def test_the_greedy_path_follows_the_argmaxes(tree: tuple[list[int], list[int]], data: st.DataObject) -> None:
    tokens, parents = tree
    choices = data.draw(st.lists(st.integers(0, 2), min_size=len(tokens) + 1, max_size=len(tokens) + 1))
    accepted, committed = greedy_accept_tree(tokens, parents, _one_hot_logits(choices, vocab=3))
    last = accepted[-1] if accepted else -1
    assert accepted == path_to(parents, last)
    for node in accepted:
        assert tokens[node] == choices[parents[node] + 1]
    stop_row = last + 1
    assert all(tokens[node] != choices[stop_row] for node in range(len(tokens)) if parents[node] + 1 == stop_row)
    assert committed == [tokens[node] for node in accepted] + [choices[stop_row]]


# -- sampling ------------------------------------------------------------------------------


def test_sampling_accepts_a_path_the_target_is_sure_of() -> None:
    tokens, parents = [2, 1, 3], [-1, 0, -1]
    probs = torch.tensor([[0, 0, 1, 0], [0, 1, 0, 0], [0.1, 0.2, 0.3, 0.4], [0.25] * 4], dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        accepted, committed = sample_accept_tree(tokens, parents, probs, generator)
        assert accepted == [0, 1]
        assert committed[:2] == [2, 1]


def test_sampling_never_commits_a_rejected_child_as_the_fallback() -> None:
    tokens, parents = [0, 1], [-1, -1]
    probs = torch.tensor([[0.0, 0.0, 0.5, 0.5], [0.25] * 4, [0.25] * 4])
    generator = torch.Generator().manual_seed(1)
    for _ in range(200):
        accepted, committed = sample_accept_tree(tokens, parents, probs, generator)
        assert accepted == []
        assert committed[0] in {2, 3}


def test_children_that_cover_the_support_always_accept_one() -> None:
    # The last child's ratio is p(x) / p(x) = 1 (up to float32 rounding, clamped).
    tokens, parents = [1, 0, 2], [-1, -1, -1]
    probs = torch.tensor([[0.3, 0.6, 0.1, 0.0], *[[0.25] * 4] * 3])
    generator = torch.Generator().manual_seed(2)
    for _ in range(300):
        accepted, committed = sample_accept_tree(tokens, parents, probs, generator)
        assert len(accepted) == 1
        assert committed[0] == tokens[accepted[0]]


def test_an_empty_tree_samples_from_the_root_row() -> None:
    generator = torch.Generator().manual_seed(3)
    probs = torch.tensor([[0.0, 1.0, 0.0]])
    assert sample_accept_tree([], [], probs, generator) == ([], [1])


@settings(max_examples=100, deadline=None)
@given(preorder_trees(max_nodes=10, vocab=4), st.integers(0, 2**16))
def test_sampling_commits_a_root_path_plus_one_token(tree: tuple[list[int], list[int]], seed: int) -> None:
    tokens, parents = tree
    generator = torch.Generator().manual_seed(seed)
    probs = torch.softmax(2 * torch.randn(len(tokens) + 1, 4, generator=generator, dtype=torch.float64), dim=-1)
    accepted, committed = sample_accept_tree(tokens, parents, probs, generator)
    assert accepted == path_to(parents, accepted[-1] if accepted else -1)
    assert committed[:-1] == [tokens[node] for node in accepted]
    # The final token is never a child of the last accepted row (those were all rejected).
    stop_row = (accepted[-1] + 1) if accepted else 0
    assert committed[-1] not in {tokens[node] for node in range(len(tokens)) if parents[node] + 1 == stop_row}
    # The same seed gives the same outcome, and the batch form with one row is the same rule.
    again = sample_accept_tree(tokens, parents, probs, torch.Generator().manual_seed(seed + 1))
    assert again == sample_accept_tree(tokens, parents, probs, torch.Generator().manual_seed(seed + 1))
    last, token = sample_accept_tree_batch(tokens, parents, probs[None], torch.Generator().manual_seed(seed + 1))
    assert (path_to(parents, int(last[0])), int(token[0])) == (again[0], again[1][-1])
