"""Growing a draft tree from prompt lookup's alternatives (decoding/tree_sizing.py): the
drafter offers every match, the policy keeps the branches that pay at the measured cost,
and what a tree verify showed goes to the chain's and the branches' estimates apart."""

from __future__ import annotations

import pytest

from specrag.decoding.drafters import Draft
from specrag.decoding.drafters.prompt_lookup import PromptLookupDrafter
from specrag.decoding.policy import CostModel, PolicyConfig, RequestPolicy, estimate_key
from specrag.decoding.tree_sizing import grow_tree, observe_tree

# Passages that agree on "1 2" and then go three ways.
PASSAGES = [[1, 2, 3, 4, 5], [1, 2, 6, 7, 8], [9, 1, 2, 10, 11]]


def policy(verify_cost: float, mode: str = "auto") -> RequestPolicy:
    """A cost curve where each verified token beyond the first costs ``verify_cost`` steps."""
    cost = CostModel({k: 1.0 + verify_cost * (k - 1) for k in (1, 2, 4, 8, 16, 64)})
    return RequestPolicy(mode, 4, PolicyConfig(tree_nodes=16), cost)  # type: ignore[arg-type]


def test_lookup_offers_every_continuation_of_the_match_once() -> None:
    drafter = PromptLookupDrafter([0], PASSAGES, branches=4)
    draft = drafter.propose([0, 1, 2], 4)
    assert draft.tokens == [3, 4, 5] and draft.source == "passage:0"
    assert [(alt.tokens, alt.source) for alt in draft.alternatives] == [
        ([6, 7, 8], "passage:1"),
        ([10, 11], "passage:2"),
    ]
    assert PromptLookupDrafter([0], PASSAGES).propose([0, 1, 2], 4).alternatives == []  # chains only by default


def test_the_stream_offers_its_recent_occurrences_before_the_passages() -> None:
    drafter = PromptLookupDrafter([5, 6, 1, 5, 6, 2, 5, 6, 3], [[5, 6, 4]], branches=4)
    draft = drafter.propose([5, 6, 1, 5, 6, 2, 5, 6, 3, 0, 5, 6], 2)
    # the prompt's occurrences come after the passage's; the most recent first
    assert [draft.tokens, *(alt.tokens for alt in draft.alternatives)] == [[4], [3, 0], [2, 5], [1, 5]]


def test_cheap_verification_grows_the_tree_and_dear_verification_keeps_the_chain() -> None:
    lone = grow_tree(policy(0.001), Draft([3, 4, 5], None, "passage:0", 2), [Draft([9, 9], None, "P", 1)], 16)
    assert lone.parents == [-1, 0, 1, -1, 3]  # a shorter match: what the chain (0.8) leaves, at most b = 0.3
    drafter = PromptLookupDrafter([0], PASSAGES, branches=4)
    draft = drafter.propose([0, 1, 2], 4)
    cheap = grow_tree(policy(0.001), draft.truncated(3), draft.alternatives, 16)
    # a three-way fork at the root: the chain gets a third of its estimate, the peers the rest
    assert cheap.parents == [-1, 0, 1, -1, 3, 4, -1, 6] and cheap.tokens == [3, 4, 5, 6, 7, 8, 10, 11]
    assert cheap.node_sources == ["passage:0"] * 3 + ["passage:1"] * 3 + ["passage:2"] * 2
    assert cheap.branch_keys == ["", "", "", "branch@peer", "", "", "branch@peer", ""]  # judged as peers
    assert cheap.first_path().tokens == [3, 4, 5]
    dear = grow_tree(policy(1.0), draft.truncated(3), draft.alternatives, 16)
    assert dear.parents is None and dear.tokens == [3, 4, 5]
    paths_dear = policy(0.001)
    assert paths_dear.cost is not None
    paths_dear.cost.tree_path_seconds = 1.0  # rows are cheap, but each path's attention is not
    assert grow_tree(paths_dear, draft.truncated(3), draft.alternatives, 16).parents is None
    on = grow_tree(policy(1.0, mode="on"), draft.truncated(3), draft.alternatives, 5)
    # "on": the best nodes up to the node limit; the three versions score alike (0.8 / 3 each
    # at the fork, 0.8 of that after it), so each keeps its first node and two their second
    assert on.parents == [-1, 0, -1, 2, -1]


def test_where_the_node_limit_binds_a_better_branch_takes_the_chains_deepest_node() -> None:
    chain = Draft([1, 2, 3, 4, 5, 6, 7, 8], None, "passage:0", 4)
    fork = Draft([1, 9, 10], None, "passage:1", 4)  # a peer that parts from the chain after one token
    # chain nodes score 0.8, then 0.8 * 0.8 / 2 at the fork and x0.8 each after; the peer,
    # unmeasured, scores as the chain does: 0.32 at the fork, 0.256 after it, above the
    # chain's 0.105 and 0.084 at depths 7 and 8
    tree = grow_tree(policy(0.001), chain, [fork], 8)
    assert len(tree.tokens) == 8 and tree.first_path().tokens == chain.tokens[:6]
    assert tree.parents is not None and tree.parents[tree.tokens.index(9)] == 0
    assert sorted(tree.tokens) == [1, 2, 3, 4, 5, 6, 9, 10]
    assert grow_tree(policy(0.001), chain, [fork], 16).first_path().tokens == chain.tokens  # room for both


def test_only_a_match_as_long_and_as_far_back_is_a_peer_that_splits_the_chains_vote() -> None:
    chain = Draft([1, 2, 3, 4, 5, 6, 7, 8], None, "passage:0", 4, match_back=32)
    version = Draft([1, 9, 10], None, "passage:1", 4, match_back=32)  # another version of the copied text
    repeat = Draft([1, 9, 10], None, "passage:0", 4, match_back=4)  # the passage repeats its last 4 tokens
    # a peer halves the chain's score where they part and takes the other half, so the
    # branch takes the chain's deepest nodes ...
    assert sorted(grow_tree(policy(0.001), chain, [version], 8).tokens) == [1, 2, 3, 4, 5, 6, 9, 10]
    # ... but a shorter match is no vote against a copy in progress: 0.8 ** 8 = 0.168 beats
    # the branch's min(1 - 0.8, b = 0.3) of 0.8 = 0.16
    assert grow_tree(policy(0.001), chain, [repeat], 8).first_path().tokens == chain.tokens


def test_lookup_records_how_far_back_each_match_agrees() -> None:
    passages = [[7, 8, 1, 2, 3], [5, 1, 2, 4]]
    draft = PromptLookupDrafter([0], passages, branches=4).propose([0, 7, 8, 1, 2], 4)
    assert (draft.tokens, draft.match_ngram, draft.match_back) == ([3], 4, 4)
    assert [(alt.tokens, alt.match_ngram, alt.match_back) for alt in draft.alternatives] == [([4], 2, 2)]
    assert draft.truncated(1).match_back == 4


def test_a_branch_that_keeps_failing_stops_being_grown() -> None:
    drafter = PromptLookupDrafter([0], PASSAGES, branches=4)
    draft = drafter.propose([0, 1, 2], 4)
    right = policy(0.001)
    trees = 0
    for _ in range(30):  # the chain is always right, so no branch is ever reachable...
        tree = grow_tree(right, draft.truncated(3), draft.alternatives, 16)
        if tree.parents is None:
            break
        trees += 1
        observe_tree(right, tree, [0, 1, 2])
    assert trees > 0 and tree.parents is None  # ... and the chain claims what they could win
    assert right.estimate("branch@peer").rate(0) < 0.05  # each taken chain child rejected them
    wrong = policy(0.001)
    trees = 0
    for _ in range(30):  # the chain fails at once, and every branch too
        tree = grow_tree(wrong, draft.truncated(3), draft.alternatives, 16)
        if tree.parents is None:
            break
        trees += 1
        observe_tree(wrong, tree, [])
    assert trees > 0 and tree.parents is None
    assert wrong.estimate("branch@peer").rate(0) < 0.05


def test_observing_a_tree_credits_the_chain_and_each_reachable_branch() -> None:
    request = policy(0.01)
    chain_key = estimate_key("passage:0", 2)
    keys = ["", "", "branch@n4+", "", "branch@n1"]
    tree = Draft([3, 4, 6, 7, 10], None, "passage:0", 2, parents=[-1, 0, -1, 2, -1], node_sources=list("aabbc"))
    tree.branch_keys = keys
    observe_tree(request, tree, [2, 3])  # the first branch was taken all the way
    chain = request.estimate(chain_key)
    assert chain.observed == 1 and chain.rates[0] < PolicyConfig().acceptance_prior
    taken, beside = request.estimate("branch@n4+"), request.estimate("branch@n1")
    assert taken.observed == 1 and taken.rates[:2] == pytest.approx([0.51, 0.51])  # 2 of 2 accepted
    assert beside.observed == 1 and beside.rates[0] < PolicyConfig().branch_prior  # its sibling was taken
    request.observe("branch@n1", 1, 0)
    observe_tree(request, Draft([3, 4], None, "passage:0", 2, parents=[-1, 0], branch_keys=["", ""]), [])
    assert request.estimate("branch@n1").observed == 2  # a tree without branches teaches no branch


def test_earlier_outputs_draft_for_their_own_tenant_only() -> None:
    from specrag.decoding.engine import Engine, GenerationRequest
    from tests.conftest import tiny_causal_lm

    target = tiny_causal_lm(24, seed=5)
    engine = Engine(target, debug=True)
    options = dict(max_tokens=30, speculation="on", num_speculative_tokens=4, stop_token_ids=[])

    def run(prompt: list[int], tenant: str | None) -> tuple[list[int], object]:
        events = list(engine.generate(GenerationRequest(prompt, tenant=tenant, **options)))
        return [token for event in events for token in event.token_ids], events[-1].stats

    plain_request = GenerationRequest([1, 2, 3], max_tokens=30, speculation="off", stop_token_ids=[])
    plain = [token for event in Engine(target).generate(plain_request) for token in event.token_ids]
    first, stats = run([1, 2, 3], "alice")
    assert first == plain
    assert stats.accepted_by_source["history"] == 0  # nothing was stored before it
    again, stats = run([1, 2, 3], "alice")
    assert again == first and stats.accepted_by_source["history"] > 0
    other, stats = run([1, 2, 3], "bob")
    assert other == first and stats.accepted_by_source["history"] == 0
    anonymous, stats = run([1, 2, 3], None)
    assert anonymous == first and stats.accepted_by_source["history"] == 0
    # each output is kept with the prompt's last tokens, the key to how answers start
    assert engine.history.tokens_held("bob") == len(first) + 3
    assert engine.history.tokens_held("alice") == 2 * engine.history.tokens_held("bob")
