"""Unit tests of the acceptance rules: prefix logic and the edge cases."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specrag.decoding.acceptance import greedy_accept, speculative_accept


def _one_hot_logits(choices: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(choices), vocab)
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 5.0
    return logits


def test_greedy_all_match_commits_the_bonus_token() -> None:
    accepted_len, committed = greedy_accept(torch.tensor([3, 1, 4]), _one_hot_logits([3, 1, 4, 7]))
    assert accepted_len == 3
    assert committed.tolist() == [3, 1, 4, 7]


def test_greedy_first_mismatch_commits_the_target_choice_and_nothing_after() -> None:
    accepted_len, committed = greedy_accept(torch.tensor([3, 2, 4]), _one_hot_logits([3, 1, 4, 7]))
    assert accepted_len == 1
    assert committed.tolist() == [3, 1]  # the later match at position 2 is never committed


def test_greedy_rejects_at_position_zero() -> None:
    accepted_len, committed = greedy_accept(torch.tensor([5, 1]), _one_hot_logits([0, 1, 2]))
    assert (accepted_len, committed.tolist()) == (0, [0])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=6), st.data())
def test_greedy_matches_a_reference_loop(draft: list[int], data: st.DataObject) -> None:
    targets = data.draw(st.lists(st.integers(0, 3), min_size=len(draft) + 1, max_size=len(draft) + 1))
    reference: list[int] = []
    for position, token in enumerate(draft):
        if token != targets[position]:
            break
        reference.append(token)
    reference.append(targets[len(reference)])
    accepted_len, committed = greedy_accept(torch.tensor(draft, dtype=torch.long), _one_hot_logits(targets, 4))
    assert committed.tolist() == reference
    assert accepted_len == len(reference) - 1


def test_sampling_commits_accepted_prefix_plus_one() -> None:
    generator = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(4, 6, generator=generator), dim=-1)
    draft_probs = torch.softmax(torch.randn(3, 6, generator=generator), dim=-1)
    draft = torch.multinomial(draft_probs, 1, generator=generator).squeeze(-1)
    for _ in range(50):
        accepted_len, committed = speculative_accept(draft, draft_probs, target, generator)
        assert len(committed) == accepted_len + 1
        assert committed[:accepted_len].tolist() == draft[:accepted_len].tolist()


def test_identical_p_and_q_accept_everything() -> None:
    generator = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(5, 7, generator=generator), dim=-1)
    draft = torch.multinomial(probs[:4], 1, generator=generator).squeeze(-1)
    for _ in range(100):
        accepted_len, _ = speculative_accept(draft, probs[:4], probs, generator)
        assert accepted_len == 4


def test_draft_token_with_zero_q_is_rejected_and_replaced_by_a_sample_of_p() -> None:
    # q(x) = 0 for the proposed token: rejection is certain, so the committed token must
    # follow p exactly (not the residual, which would exclude q's support).
    p = torch.tensor([[0.2, 0.3, 0.5], [1 / 3, 1 / 3, 1 / 3]])
    q = torch.tensor([[0.0, 1.0, 0.0]])
    generator = torch.Generator().manual_seed(2)
    counts = torch.zeros(3)
    for _ in range(6000):
        accepted_len, committed = speculative_accept(torch.tensor([0]), q, p, generator)
        assert accepted_len == 0
        counts[committed[0]] += 1
    torch.testing.assert_close(counts / counts.sum(), p[0], atol=0.025, rtol=0)


def test_zero_residual_mass_falls_back_to_p() -> None:
    # p == q up to rounding: if a rejection happens anyway, the token must still be valid.
    p = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    q = p[:1] + torch.tensor([[1e-12, -1e-12, 0.0]])
    generator = torch.Generator().manual_seed(3)
    for _ in range(200):
        accepted_len, committed = speculative_accept(torch.tensor([1]), q, p, generator)
        assert committed[-1].item() in (0, 1, 2)
        assert accepted_len == 0 or committed.tolist() == [1, 2]


def test_one_hot_draft_accepts_with_probability_p_of_the_token() -> None:
    p = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    q = torch.tensor([[0.0, 1.0]])
    generator = torch.Generator().manual_seed(4)
    accepted = sum(speculative_accept(torch.tensor([1]), q, p, generator)[0] for _ in range(8000))
    assert abs(accepted / 8000 - 0.75) < 0.02
    # on rejection the residual is p without the drafted token: always token 0
    for _ in range(200):
        accepted_len, committed = speculative_accept(torch.tensor([1]), q, p, generator)
        if accepted_len == 0:
            assert committed.tolist() == [0]


def test_gamma_zero_samples_from_the_first_row() -> None:
    p = torch.tensor([[0.0, 1.0, 0.0]])
    accepted_len, committed = speculative_accept(torch.zeros(0, dtype=torch.long), torch.zeros(0, 3), p)
    assert (accepted_len, committed.tolist()) == (0, [1])
