"""Statistical tests with real power: tree sampling (recursive rejection over siblings) preserves
the target distribution.

Toy targets as in tests/test_acceptance_distribution.py: the next-token logits are a row of a
fixed random table picked by a hash of the prefix, so the exact distribution of any
continuation is known. A tree's nodes are deterministic drafts (as prompt lookup's): the
token of a given rank in the target's own distribution at the node's prefix, so paths are
often accepted and the sibling order is not the target's. ``sample_accept_tree_batch`` runs
all generations at once, and G-tests compare the first committed token, and the first two,
with the exact target. Seeds are fixed, so the outcome is deterministic; the planted wrong
rules show that the tests have power.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import pytest
import torch

from specrag.decoding import tree as tree_module
from specrag.decoding.sampling import SamplingParams, probs_from_logits
from specrag.decoding.tree import node_depths, path_to, sample_accept_tree, sample_accept_tree_batch
from tests.test_acceptance_distribution import g_test_cells

pytestmark = pytest.mark.slow  # statistical: a few seconds in all

CYCLES = 60_000
HASH_MODULUS = 7919  # prefixes hash to this many rows; state 0 is the empty prefix


@dataclass(frozen=True)
class ToyTree:
    name: str
    vocab: int
    parents: tuple[int, ...]
    ranks: tuple[int, ...]  # node i's token: the ranks[i]-th likeliest at its parent's prefix
    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=1.0))
    seed: int = 0


class ToyTarget:
    def __init__(self, case: ToyTree) -> None:
        self.case = case
        table_generator = torch.Generator().manual_seed(case.seed)
        self.table = 1.5 * torch.randn(HASH_MODULUS, case.vocab, generator=table_generator, dtype=torch.float64)
        self.generator = torch.Generator().manual_seed(1000 + case.seed)

    def next_state(self, state: int, token: int) -> int:
        return (state * (self.case.vocab + 1) + token + 1) % HASH_MODULUS

    def probs(self, states: list[int]) -> torch.Tensor:
        return probs_from_logits(self.table[torch.tensor(states)], self.case.params).double()

    def tree_at(self, state: int) -> tuple[list[int], torch.Tensor]:
        """The case's tree drafted at ``state``: its tokens and the target rows [N + 1, V]."""
        row_states, tokens = [state], []
        for parent, rank in zip(self.case.parents, self.case.ranks, strict=True):
            parent_state = row_states[parent + 1]
            order = torch.sort(self.probs([parent_state])[0], descending=True, stable=True).indices
            tokens.append(int(order[rank]))
            row_states.append(self.next_state(parent_state, tokens[-1]))
        return tokens, self.probs(row_states)

    def cycle(self, state: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch`` independent cycles from ``state``: (accepted length [B], committed [B, D + 1],
        -1 padded)."""
        tokens, rows = self.tree_at(state)
        parents = list(self.case.parents)
        last_node, next_token = sample_accept_tree_batch(tokens, parents, rows.expand(batch, -1, -1), self.generator)
        width = max(node_depths(parents), default=1) + 1
        path_tokens = torch.full((len(tokens) + 1, width), -1)  # per row: its path's tokens
        for node in range(len(tokens)):
            path = [tokens[above] for above in path_to(parents, node)]
            path_tokens[node + 1, : len(path)] = torch.tensor(path)
        depth = torch.tensor([0, *node_depths(parents)])[last_node + 1]
        committed = path_tokens[last_node + 1]
        committed[torch.arange(batch), depth] = next_token
        return depth, committed

    def first_two_tokens(self, cycles: int) -> torch.Tensor:
        """The first two committed tokens of ``cycles`` generations ([cycles, 2]); where the first
        cycle committed one token, a second cycle from its prefix gives the second."""
        _, committed = self.cycle(0, cycles)
        first, second = committed[:, 0], committed[:, 1].clone()
        needs_second_cycle = second < 0
        for token in first[needs_second_cycle].unique().tolist():
            rows = needs_second_cycle & (first == token)
            _, more = self.cycle(self.next_state(0, token), int(rows.sum()))
            second[rows] = more[:, 0]
        return torch.stack([first, second], dim=1)

    def exact_first(self) -> torch.Tensor:
        return self.probs([0])[0]

    def exact_joint(self) -> torch.Tensor:
        """P(x1, x2) = p(x1 | empty) * p(x2 | x1), flattened to [V * V]."""
        second = self.probs([self.next_state(0, token) for token in range(self.case.vocab)])
        return (self.exact_first()[:, None] * second).reshape(-1)

    def expected_accepted(self) -> float:
        """Sum over nodes of P(its path is accepted) = the product of p along the path (with
        deterministic drafts a node is accepted exactly when the target would emit its path)."""
        tokens, rows = self.tree_at(0)
        parents = self.case.parents
        reach: list[float] = []
        for node, parent in enumerate(parents):
            above = 1.0 if parent == -1 else reach[parent]
            reach.append(above * float(rows[parent + 1, tokens[node]]))
        return sum(reach)


def pvalues(case: ToyTree) -> tuple[float, float]:
    """(first token, first two tokens) G-test p-values of CYCLES generations."""
    target = ToyTarget(case)
    samples = target.first_two_tokens(CYCLES)
    first = g_test_cells(samples[:, 0], target.exact_first())
    joint = g_test_cells(samples[:, 0] * case.vocab + samples[:, 1], target.exact_joint())
    return first, joint


CASES = [
    ToyTree("fanout_3", vocab=6, parents=(-1, -1, -1), ranks=(1, 0, 3)),
    ToyTree(
        "depth_2",
        vocab=8,
        parents=(-1, 0, 0, -1, 3, -1),
        ranks=(0, 2, 1, 1, 0, 3),
        params=SamplingParams(temperature=0.8),
        seed=1,
    ),
    ToyTree("depth_3", vocab=5, parents=(-1, 0, 1, 1, -1, 4), ranks=(1, 0, 0, 2, 0, 1), seed=2),
    ToyTree("children_cover_the_vocab", vocab=4, parents=(-1, 0, -1, -1, -1), ranks=(2, 0, 0, 3, 1), seed=3),
    ToyTree(
        "top_k_zero_mass_children",
        vocab=10,
        parents=(-1, 0, -1, 2, -1),
        ranks=(4, 0, 0, 1, 7),
        params=SamplingParams(temperature=1.0, top_k=3),
        seed=4,
    ),
    ToyTree(
        "top_p_wide",
        vocab=10,
        parents=(-1, 0, 0, 0, -1, 4),
        ranks=(0, 0, 1, 2, 1, 0),
        params=SamplingParams(temperature=1.3, top_p=0.9),
        seed=5,
    ),
    ToyTree("chain", vocab=6, parents=(-1, 0, 1), ranks=(0, 1, 0), seed=6),
]


@functools.cache
def true_rule_pvalues(name: str) -> tuple[float, float]:
    return pvalues(next(case for case in CASES if case.name == name))


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_the_first_committed_token_follows_the_target(case: ToyTree) -> None:
    first, _ = true_rule_pvalues(case.name)
    assert first > 1e-3, f"{case.name}: G-test p = {first:.2e}"


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_the_first_two_committed_tokens_follow_the_target(case: ToyTree) -> None:
    _, joint = true_rule_pvalues(case.name)
    assert joint > 1e-3, f"{case.name}: G-test p = {joint:.2e}"


def _accept_without_renormalising(
    p_child: torch.Tensor, tried_mass: torch.Tensor, row_mass: torch.Tensor
) -> torch.Tensor:
    return p_child  # planted bug: a later sibling is judged against p, not p without the rejected


def _fall_back_to_p(p: torch.Tensor, removed: torch.Tensor) -> torch.Tensor:
    return p  # planted bug: the rejected children can be drawn again


PLANTED_BUGS = {
    "sibling_accepted_with_p_not_renormalised": ("_sibling_acceptance", _accept_without_renormalising),
    "fallback_from_p_with_the_rejected_children": ("_fallback_distribution", _fall_back_to_p),
}


@pytest.mark.parametrize("bug", PLANTED_BUGS)
@pytest.mark.parametrize("case", [CASES[0], CASES[1]], ids=lambda case: case.name)
def test_the_g_tests_reject_a_planted_wrong_rule(case: ToyTree, bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    name, replacement = PLANTED_BUGS[bug]
    monkeypatch.setattr(tree_module, name, replacement)
    first, joint = pvalues(case)
    assert first < 1e-6, f"{bug} on {case.name} was not detected by the first token (p = {first:.2e})"
    assert joint < 1e-6, f"{bug} on {case.name} was not detected by the first two (p = {joint:.2e})"


# -- expected progress: the sum of the nodes' path probabilities (docs/design/trees.md, 2) --


def _mean_accepted(case: ToyTree) -> tuple[float, float, float]:
    target = ToyTarget(case)
    depth, _ = target.cycle(0, CYCLES)
    accepted = depth.double()
    return float(accepted.mean()), target.expected_accepted(), float(accepted.std() / CYCLES**0.5)


@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[5]], ids=lambda case: case.name)
def test_mean_accepted_length_is_the_sum_of_path_probabilities(case: ToyTree) -> None:
    mean, expected, standard_error = _mean_accepted(case)
    assert abs(mean - expected) < 4 * standard_error, f"mean {mean:.4f}, theory {expected:.4f} ± {standard_error:.4f}"


def test_the_progress_check_rejects_unrenormalised_siblings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tree_module, "_sibling_acceptance", _accept_without_renormalising)
    mean, expected, standard_error = _mean_accepted(CASES[1])
    assert abs(mean - expected) > 4 * standard_error


# -- the per-sequence entry point ---------------------------------------------------------


def test_the_per_sequence_rule_follows_the_target() -> None:
    """``sample_accept_tree`` one call at a time (what the engine calls), fewer cycles."""
    target = ToyTarget(CASES[1])
    tokens, rows = target.tree_at(0)
    parents = list(CASES[1].parents)
    first = [sample_accept_tree(tokens, parents, rows, target.generator)[1][0] for _ in range(3000)]
    pvalue = g_test_cells(torch.tensor(first), target.exact_first())
    assert pvalue > 1e-3, f"G-test p = {pvalue:.2e}"
