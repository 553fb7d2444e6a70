"""Draft trees under a grammar: each node is checked on a fork of its own parent's matcher,
its row gets the mask after its own path, and the matcher follows the accepted path."""

from __future__ import annotations

import torch
import xgrammar as xgr

from specrag.decoding.drafters import Draft
from specrag.decoding.engine import Engine
from specrag.decoding.grammar import GrammarState
from specrag.decoding.grammar_compile import GrammarCompiler
from specrag.decoding.policy import PolicyConfig
from specrag.decoding.request import GenerationRequest
from tests.conftest import tiny_causal_lm
from tests.test_grammar import EOS, PROMPT, SCHEMAS, VOCAB, compiler, encode, fresh_state

__all__ = ["compiler"]  # the fixture, shared with tests/test_grammar.py

SCHEMA = SCHEMAS["int_and_enum"]


def tree_of(paths: list[str]) -> tuple[list[int], list[int]]:
    """(tokens, parents) in preorder of the trie of ``paths`` (shared prefixes merged)."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}
    for path in paths:
        parent = -1
        for token in encode(path):
            if (parent, token) not in children:
                children[parent, token] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            parent = children[parent, token]
    return tokens, parents


def path_of(tokens: list[int], parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.insert(0, tokens[node])
        node = parents[node]
    return path


def grammatical(compiler: GrammarCompiler, path: list[int]) -> bool:
    matcher = xgr.GrammarMatcher(compiler.json_schema(SCHEMA).compiled)
    return all(matcher.accept_token(token) for token in path)


def test_each_node_is_checked_and_masked_on_its_own_path(compiler: GrammarCompiler) -> None:
    state = GrammarState(compiler.json_schema(SCHEMA), [EOS], len(VOCAB))
    # Keys come in the schema's order: '{"a' may start, '{"q' and '{"b' may not, and
    # nothing under them survives; 'x' after '"a"' is no colon.
    tokens, parents = tree_of(['{"a": 12', '{"a": 3', '{"qa', '{"b":', '{"a"x'])
    kept, bitmask = state.advance_tree(tokens, parents)
    assert kept == [node for node in range(len(tokens)) if grammatical(compiler, path_of(tokens, parents, node))]
    assert 0 < len(kept) < len(tokens) - 4
    assert bitmask.shape[0] == len(kept) + 1
    assert torch.equal(bitmask[0], fresh_state(compiler, SCHEMA, []).next_bitmask()[0])
    for row, node in enumerate(kept, start=1):
        path = path_of(tokens, parents, node)
        assert torch.equal(bitmask[row], fresh_state(compiler, SCHEMA, path).next_bitmask()[0]), path
    # The committed matcher was not moved: its mask is still the first one.
    assert torch.equal(state.next_bitmask()[0], bitmask[0])


def test_the_matcher_follows_the_accepted_path(compiler: GrammarCompiler) -> None:
    state = GrammarState(compiler.json_schema(SCHEMA), [EOS], len(VOCAB))
    tokens, parents = tree_of(['{"a": 1', '{"a": 2'])
    state.advance_tree(tokens, parents)
    state.follow(encode('{"a": 23'))  # the path to '2' and the target's '3'
    assert state.committed_len == 8
    assert torch.equal(state.next_bitmask(), fresh_state(compiler, SCHEMA, encode('{"a": 23')).next_bitmask())


def test_a_pruned_tree_keeps_its_shape_sources_and_branch_keys() -> None:
    tree = Draft(
        [1, 2, 3, 4, 5], None, "src", 2, [-1, 0, 1, 0, -1], ["a", "a", "a", "b", "c"], ["", "", "", "k1", "k2"]
    )
    pruned = tree.subtree([0, 3, 4])
    assert pruned.tokens == [1, 4, 5] and pruned.parents == [-1, 0, -1]
    assert pruned.node_sources == ["a", "b", "c"] and pruned.branch_keys == ["", "k1", "k2"]
    assert pruned.first_path().tokens == [1]
    assert tree.subtree([]).tokens == [] and tree.subtree([]).parents is None


def test_constrained_greedy_over_draft_trees_equals_constrained_plain(compiler: GrammarCompiler) -> None:
    engine = Engine(tiny_causal_lm(len(VOCAB), seed=0), policy=PolicyConfig(tree_nodes=12), debug=True)
    versions = [encode(text) for text in ('{"a": 12, "b": "xy"}', '{"a": 17, "b": "zz"}', '{"a": 3, "b": "xy"}')]
    grammar = compiler.json_schema(SCHEMA)
    outputs = {}
    for speculation in ("off", "on"):
        request = GenerationRequest(
            PROMPT,
            max_tokens=40,
            stop_token_ids=[EOS],
            grammar=grammar,
            speculation=speculation,
            drafter="lookup",
            lookup_sources=versions,
        )
        tokens: list[int] = []
        stats = None
        for event in engine.generate(request):
            assert event.error is None
            tokens += event.token_ids
            stats = event.stats or stats
        outputs[speculation] = (tokens, stats)
    assert outputs["on"][0] == outputs["off"][0]
    tree_stats = outputs["on"][1]
    assert tree_stats is not None and tree_stats.tree_cycles > 0
    assert tree_stats.branch_accepted_tokens > 0  # a branch, checked on its own fork, was taken
    fresh_state(compiler, SCHEMA, outputs["on"][0])  # every committed token grammatical
