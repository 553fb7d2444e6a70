"""How big a draft tree to verify: the chain the policy chose, plus the alternatives that pay.

A free drafter (prompt lookup) proposes its preferred chain and the other chains it found
(``Draft.alternatives``: other occurrences of the matched n-grams, shorter matches, earlier
outputs). The policy sizes the chain as always (``best_gamma``, its probes and gates); here
the alternatives are merged into it as branches, and a branch node is kept only while it
raises the expected committed tokens per second of the forward:

    rate(tree) = (load.committed + 1 + sum of node scores) / C(load.tokens + 1 + nodes)

A node's score is the probability that its path is accepted (greedy: that the target's
argmax follows it), so the expected accepted drafts of a tree are the sum of its scores.
Along the chain the scores are the chain's estimate, as for a chain, times its share of the
vote where peers (alternatives with as long a match: the same sentence in three versions of
a document) part from it: at a three-way fork the chain gets a third. An alternative joins
the tree where it leaves it: its first new node, a child of a node reached with probability
P whose other children claim s of what follows it, scores P * min(1 - s, b(0)), and the
branch goes on with P * ... * b(k) at its k-th node. b is the ``branch`` acceptance
estimate: how often a branch node was accepted when its parent was. A peer is judged by
the peers' own (``branch@peer``) and, at positions it has not measured yet, as the chain
is: the chain's estimate times its share of the vote, so the versions of a passage start
even; a lesser match by its n-gram bucket's (``branch@n1`` for a stray one-token match).
Nodes are added best score first, which keeps every kept node's parent, and the best
prefix of that order wins; none pays: the chain alone. With speculation "on" (no cost
model asked) every branch is kept, up to the node limit.

Observation (``observe_tree``) keeps them apart: the chain is judged as if proposed alone,
each branch wherever its parent was accepted (a taken sibling counts as its rejection:
greedy accepts one child per node, so the branch's token was not the target's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specrag.decoding.drafters.base import Draft
from specrag.decoding.drafters.model_drafter import SOURCE as MODEL_SOURCE
from specrag.decoding.policy import (
    BRANCH_SOURCE,
    PEER_KEY,
    AcceptanceEstimate,
    RequestPolicy,
    StepLoad,
    estimate_key,
)


@dataclass
class _Node:
    token: int
    parent: int  # index among the nodes, -1 for a child of the pending token
    source: str
    score: float  # P(the path to this node is accepted)
    branch_key: str = ""  # a branch's first node: the estimate it is judged by
    children: list[int] = field(default_factory=list)


def grow_tree(
    policy: RequestPolicy, chain: Draft, alternatives: Sequence[Draft], max_nodes: int, load: StepLoad | None = None
) -> Draft:
    """``chain`` (already sized by the policy) with the branches from ``alternatives`` that
    raise the forward's expected rate. Nodes are taken best score first, chain and branch
    nodes alike, so where ``max_nodes`` binds a branch node takes the place of the chain's
    deepest nodes if it scores higher. ``chain`` as it is when no branch pays."""
    if not chain.tokens or not alternatives:
        return chain
    peers = [_is_peer(chain, alternative) for alternative in alternatives]
    estimate = policy.estimate(estimate_key(chain.source, chain.match_ngram))
    vote = _Vote([chain.tokens, *(alt.tokens for alt, peer in zip(alternatives, peers, strict=True) if peer)], estimate)
    nodes = _chain_nodes(chain, vote)
    for alternative, peer in zip(alternatives, peers, strict=True):
        _insert(policy, nodes, alternative, vote if peer else None)
    # Best first, the chain's first node always (the tree's first path starts there). A
    # node never scores above its parent and ties go to the lower index, which a parent
    # has: every prefix of this order holds each of its nodes' parents.
    order = [0, *sorted(range(1, len(nodes)), key=lambda index: (-nodes[index].score, index))]
    order = order[: max(max_nodes, 1)]
    if policy.mode == "auto" and policy.cost is not None:
        order = order[: _best_count(policy, nodes, order, load or StepLoad())]
    # else "on" verifies what it is offered, as it does a chain's γ
    if all(index < len(chain.tokens) for index in order):
        return chain  # no branch pays: the chain as the policy sized it
    return _preorder(chain, nodes, set(order))


@dataclass
class _Vote:
    """The chain and its peers, each a ballot for how the copied text goes on."""

    ballots: list[list[int]]
    estimate: AcceptanceEstimate  # the chain's

    def rate(self, prefix: list[int], token: int) -> float:
        """The chain's estimate at this position, times the share of the ballots that agree
        on ``prefix`` and go on with ``token``: where they part, it is a fork."""
        at = len(prefix)
        voters = [ballot[at] for ballot in self.ballots if len(ballot) > at and ballot[:at] == prefix]
        return self.estimate.rate(at) * (voters.count(token) / len(voters) if voters else 1.0)


def _chain_nodes(chain: Draft, vote: _Vote) -> list[_Node]:
    """The chain's nodes, each scored by its estimate and its share of the peers' vote."""
    nodes, score = [], 1.0
    for position, token in enumerate(chain.tokens):
        score *= vote.rate(chain.tokens[:position], token)
        nodes.append(_Node(token, position - 1, chain.source, score))
        if position:
            nodes[position - 1].children.append(position)
    return nodes


def _is_peer(chain: Draft, alternative: Draft) -> bool:
    """Whether ``alternative`` is as good a match as the chain: as long, and as far back as
    it agrees with the context. Versions of one passage are; a phrase the passage repeats is
    not (its other occurrences match 4 tokens where the copy in progress matched 32;
    smollm2's rag_branching lost a chain's accepted tail to their vote). A draft model's
    runner-ups are not votes against its argmax."""
    return (
        bool(chain.match_ngram)
        and alternative.match_ngram >= chain.match_ngram
        and alternative.match_back >= chain.match_back
    )


def _children(nodes: list[_Node], parent: int) -> list[int]:
    if parent >= 0:
        return nodes[parent].children
    return [index for index, node in enumerate(nodes) if node.parent == -1]


def _insert(policy: RequestPolicy, nodes: list[_Node], alternative: Draft, vote: _Vote | None) -> None:
    """Walk ``alternative`` down the tree; where it leaves it, add its rest as a branch.
    A peer (``vote`` given) is judged by the peers' estimate where that has been measured,
    else as the chain is (``_Vote.rate``): the versions of a passage start even."""
    key = PEER_KEY if vote is not None else branch_key(alternative)
    branch = policy.estimate(key)
    parent, parent_score, depth = -1, 1.0, -1  # depth: in the branch, once it has left the tree
    for position, token in enumerate(alternative.tokens):
        siblings = _children(nodes, parent)
        same = next((index for index in siblings if nodes[index].token == token), None)
        if same is not None and depth < 0:
            parent, parent_score = same, nodes[same].score
            continue
        depth += 1
        if vote is not None and not _measured(branch, depth):
            rate = vote.rate(alternative.tokens[:position], token)
        else:
            rate = branch.rate(depth)
        if depth == 0:  # leaving the tree: at most what the other children leave over
            claimed = sum(nodes[index].score for index in siblings) / parent_score if parent_score else 1.0
            rate = min(max(0.0, 1.0 - claimed), rate)
        score = parent_score * rate
        nodes.append(_Node(token, parent, alternative.source, score, key if depth == 0 else ""))
        if parent >= 0:
            nodes[parent].children.append(len(nodes) - 1)
        parent, parent_score = len(nodes) - 1, score


def _measured(estimate: AcceptanceEstimate, depth: int) -> bool:
    """Whether ``estimate.rate(depth)`` comes from observations rather than the prior."""
    return depth < len(estimate.rates) or (depth > 0 and estimate.continuation is not None)


def branch_key(alternative: Draft) -> str:
    """The estimate a branch is judged by: a lookup match's n-gram bucket, or the draft
    model's runner-ups (``branch@model``), which are no n-gram match."""
    if alternative.source == MODEL_SOURCE:
        return f"{BRANCH_SOURCE}@model"
    return estimate_key(BRANCH_SOURCE, max(alternative.match_ngram, 1))


def _best_count(policy: RequestPolicy, nodes: list[_Node], order: list[int], load: StepLoad) -> int:
    """How many nodes of ``order`` (best first) to verify: the count with the highest
    expected committed tokens per second of the step's forward, each path beyond the
    first paying its own attention (``CostModel.tree_forward_seconds``)."""
    assert policy.cost is not None
    expected, best, best_rate = load.committed + 1.0, 1, 0.0
    paths, parents_with_a_child = 1, set()
    for count, index in enumerate(order, start=1):
        expected += nodes[index].score
        parent = nodes[index].parent
        if parent in parents_with_a_child:
            paths += 1  # a second child starts a path; a first one extends its parent's
        parents_with_a_child.add(parent)
        rate = expected / policy.cost.tree_forward_seconds(load.tokens + 1 + count, paths)
        if rate > best_rate:
            best, best_rate = count, rate
    return best


def _preorder(chain: Draft, nodes: list[_Node], kept: set[int]) -> Draft:
    """The kept nodes in depth-first preorder, at every node the chain's child first, then
    the others best first: the first path is the chain."""
    tokens: list[int] = []
    parents: list[int] = []
    sources: list[str] = []
    keys: list[str] = []
    chain_len = len(chain.tokens)

    def ordered(indices: list[int]) -> list[int]:
        return sorted((i for i in indices if i in kept), key=lambda i: (i >= chain_len, -nodes[i].score, i))

    stack = [(index, -1) for index in reversed(ordered(_children(nodes, -1)))]
    while stack:
        index, parent = stack.pop()
        tokens.append(nodes[index].token)
        parents.append(parent)
        sources.append(nodes[index].source)
        keys.append(nodes[index].branch_key)
        here = len(tokens) - 1
        stack.extend((child, here) for child in reversed(ordered(nodes[index].children)))
    return Draft(tokens, None, chain.source, chain.match_ngram, parents=parents, node_sources=sources, branch_keys=keys)


def observe_tree(policy: RequestPolicy, draft: Draft, accepted_nodes: Sequence[int]) -> None:
    """Teach the policy what a tree verify showed: the chain (the first path) as if it had
    been proposed alone, and every branch whose parent was accepted (or is the root) under
    its branch estimate, as a chain of its own from its first node."""
    assert draft.parents is not None
    parents, accepted = draft.parents, set(accepted_nodes)
    chain = draft.first_path()
    taken = _leading(range(len(chain.tokens)), accepted)
    policy.observe(draft.source, len(chain.tokens), taken, draft.match_ngram)
    first_child: dict[int, int] = {}
    for node, parent in enumerate(parents):
        first_child.setdefault(parent, node)
    for node, key in enumerate(draft.branch_keys or ()):
        if key and (parents[node] == -1 or parents[node] in accepted):
            run = [node]
            while run[-1] in first_child:  # a branch goes on through its first children
                run.append(first_child[run[-1]])
            policy.observe(key, len(run), _leading(run, accepted))


def _leading(run: Sequence[int], accepted: set[int]) -> int:
    """How many nodes of ``run`` were accepted before the first that was not."""
    count = 0
    for node in run:
        if node not in accepted:
            break
        count += 1
    return count
