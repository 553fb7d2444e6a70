"""Statistical tests with real power: speculative sampling preserves the target distribution.

Toy language models over a vocabulary of 4-10 tokens: the next-token logits are a row of
a fixed random table picked by a hash of the prefix, so the exact joint distribution of
any prefix is known. Each test runs the real ``speculative_accept_batch`` over 50,000
cycles (vectorised over the batch) and compares the joint distribution of the first two
committed tokens with the exact target distribution by a G-test. Seeds are fixed, so the
outcome is deterministic; the planted wrong samplers show that the test has power.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import scipy.stats
import torch

from specrag.decoding import acceptance
from specrag.decoding.acceptance import speculative_accept_batch
from specrag.decoding.grammar import mask_logits, pack_allowed
from specrag.decoding.sampling import SamplingParams, probs_from_logits

CYCLES = 50_000
HASH_MODULUS = 7919  # prefixes hash to this many rows; state 0 is the empty prefix


@dataclass
class ToyPair:
    name: str
    vocab: int
    gamma: int
    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=1.0))
    disjoint: bool = False  # target and draft put mass on disjoint halves of the vocabulary
    draft_noise: float | None = None  # draft logits = target logits + noise of this scale
    one_hot_draft: bool = False  # deterministic drafter (prompt lookup): q is one-hot
    context_free: bool = False  # every position uses the same rows (independent acceptance)
    grammar_mask: bool = False  # a prefix-dependent mask removes part of the support of p and q
    planted_unmasked_q: bool = False  # bug: drafts drawn from the masked q, the unmasked q passed on
    seed: int = 0

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        rows = 1 if self.context_free else HASH_MODULUS
        target = 1.5 * torch.randn(rows, self.vocab, generator=generator, dtype=torch.float64)
        if self.draft_noise is not None:
            draft = target + self.draft_noise * torch.randn(rows, self.vocab, generator=generator, dtype=torch.float64)
        else:
            draft = 1.5 * torch.randn(rows, self.vocab, generator=generator, dtype=torch.float64)
        if self.disjoint:
            half = self.vocab // 2
            target[:, half:] = float("-inf")
            draft[:, :half] = float("-inf")
        return target, draft


class ToySimulator:
    def __init__(self, pair: ToyPair) -> None:
        self.pair = pair
        self.target_table, self.draft_table = pair.tables()
        self.generator = torch.Generator().manual_seed(1000 + pair.seed)

    def next_state(self, state: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        if self.pair.context_free:
            return torch.zeros_like(state)
        return (state * (self.pair.vocab + 1) + token + 1) % HASH_MODULUS

    def grammar_bitmask(self, state: torch.Tensor) -> torch.Tensor:
        # About two fifths of the tokens are forbidden, which ones depending on the prefix.
        tokens = torch.arange(self.pair.vocab)
        return pack_allowed((state[:, None] * 7 + tokens[None] * 3) % 5 >= 2)

    def _probs(self, table: torch.Tensor, state: torch.Tensor, masked: bool = True) -> torch.Tensor:
        logits = table[state]
        if self.pair.grammar_mask and masked:  # the engine's mask, applied before the transform
            logits = mask_logits(logits, self.grammar_bitmask(state))
        return probs_from_logits(logits, self.pair.params).double()

    def target_probs(self, state: torch.Tensor) -> torch.Tensor:
        return self._probs(self.target_table, state)

    def draft_probs(self, state: torch.Tensor, masked: bool = True) -> torch.Tensor:
        return self._probs(self.draft_table, state, masked)

    def cycle(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft-verify-accept cycle per row: (accepted_len [B], committed [B, γ+1], -1 padded)."""
        drafts, draft_rows, target_rows = [], [], []
        for _ in range(self.pair.gamma):
            q = self.draft_probs(state)
            if self.pair.one_hot_draft:
                token = q.argmax(dim=-1)
                q = torch.zeros_like(q).scatter_(-1, token[:, None], 1.0)
            else:
                token = torch.multinomial(q, 1, generator=self.generator).squeeze(-1)
                if self.pair.planted_unmasked_q:
                    q = self.draft_probs(state, masked=False)
            drafts.append(token)
            draft_rows.append(q)
            target_rows.append(self.target_probs(state))
            state = self.next_state(state, token)
        target_rows.append(self.target_probs(state))
        draft_tokens = torch.stack(drafts, dim=1)
        accepted_len, next_token = speculative_accept_batch(
            draft_tokens, torch.stack(draft_rows, dim=1), torch.stack(target_rows, dim=1), self.generator
        )
        committed = torch.cat([draft_tokens, torch.full_like(next_token[:, None], -1)], dim=1)
        positions = torch.arange(self.pair.gamma + 1)
        committed = committed.masked_fill(positions[None] > accepted_len[:, None], -1)
        committed[torch.arange(len(state)), accepted_len] = next_token
        return accepted_len, committed

    def first_two_tokens(self, cycles: int) -> torch.Tensor:
        """The first two committed tokens of ``cycles`` independent generations."""
        start = torch.zeros(cycles, dtype=torch.long)
        accepted_len, committed = self.cycle(start)
        first, second = committed[:, 0], committed[:, 1].clone()
        needs_second_cycle = accepted_len == 0
        _, more = self.cycle(self.next_state(start[needs_second_cycle], first[needs_second_cycle]))
        second[needs_second_cycle] = more[:, 0]
        return torch.stack([first, second], dim=1)

    def exact_joint(self) -> torch.Tensor:
        """P(x1, x2) = p(x1 | empty) * p(x2 | x1), flattened to [V*V]."""
        vocab = self.pair.vocab
        first = self.target_probs(torch.zeros(1, dtype=torch.long))[0]
        tokens = torch.arange(vocab)
        second = self.target_probs(self.next_state(torch.zeros(vocab, dtype=torch.long), tokens))
        return (first[:, None] * second).reshape(-1)


def g_test_pvalue(samples: torch.Tensor, exact: torch.Tensor, vocab: int) -> float:
    """G-test of observed (x1, x2) pairs against the exact joint; 0.0 for an impossible pair."""
    return g_test_cells(samples[:, 0] * vocab + samples[:, 1], exact)


def g_test_cells(cells: torch.Tensor, exact: torch.Tensor) -> float:
    """G-test of observed cell indices against exact cell probabilities (flat); 0.0 for an
    impossible cell."""
    observed = torch.bincount(cells, minlength=exact.numel()).double()
    if observed[exact == 0].sum() > 0:
        return 0.0
    expected = exact / exact.sum() * observed.sum()
    # Pool cells whose expected count is below 5, where the asymptotic law is unreliable.
    small = expected < 5
    observed_cells = torch.cat([observed[~small], observed[small].sum()[None]])
    expected_cells = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected_cells > 0
    result = scipy.stats.power_divergence(
        observed_cells[keep].numpy(), expected_cells[keep].numpy(), lambda_="log-likelihood"
    )
    return float(result.pvalue)


PAIRS = [
    ToyPair("generic", vocab=6, gamma=3),
    ToyPair("temperature", vocab=8, gamma=2, params=SamplingParams(temperature=0.7), seed=1),
    ToyPair("top_k", vocab=10, gamma=4, params=SamplingParams(temperature=1.0, top_k=3), seed=2),
    ToyPair("top_p", vocab=10, gamma=1, params=SamplingParams(temperature=1.0, top_p=0.8), seed=3),
    ToyPair("all_transforms", vocab=10, gamma=3, params=SamplingParams(temperature=1.3, top_k=6, top_p=0.9), seed=4),
    ToyPair("disjoint_supports", vocab=8, gamma=2, disjoint=True, seed=5),
    ToyPair("near_equal", vocab=5, gamma=4, draft_noise=0.05, seed=6),
    ToyPair("one_hot_draft", vocab=6, gamma=3, one_hot_draft=True, seed=7),
    ToyPair("gamma_1_vocab_4", vocab=4, gamma=1, seed=8),
    ToyPair("grammar_mask", vocab=8, gamma=3, grammar_mask=True, seed=9),
    ToyPair("grammar_mask_top_p", vocab=10, gamma=2, params=SamplingParams(1.2, top_p=0.9), grammar_mask=True, seed=10),
    ToyPair("grammar_mask_one_hot", vocab=6, gamma=3, one_hot_draft=True, grammar_mask=True, seed=15),
]


@pytest.mark.parametrize("pair", PAIRS, ids=lambda pair: pair.name)
def test_first_two_committed_tokens_follow_the_target(pair: ToyPair) -> None:
    simulator = ToySimulator(pair)
    pvalue = g_test_pvalue(simulator.first_two_tokens(CYCLES), simulator.exact_joint(), pair.vocab)
    assert pvalue > 0.001, f"{pair.name}: G-test p = {pvalue:.2e}"


def _resample_from_p(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return p  # planted bug: ignores the draft's mass after a rejection


def _accept_only_top1(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor
) -> torch.Tensor:
    gamma = draft_tokens.shape[1]
    return (target_probs[:, :gamma].argmax(dim=-1) == draft_tokens).to(target_probs.dtype)  # planted bug


PLANTED_BUGS = {
    "resample_from_p_not_residual": ("_residual_distribution", _resample_from_p),
    "accept_only_on_top1_match": ("_acceptance_probability", _accept_only_top1),
}


@pytest.mark.parametrize("bug", PLANTED_BUGS)
@pytest.mark.parametrize("pair", [PAIRS[0], PAIRS[4]], ids=lambda pair: pair.name)
def test_the_g_test_rejects_a_planted_wrong_sampler(pair: ToyPair, bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    name, replacement = PLANTED_BUGS[bug]
    monkeypatch.setattr(acceptance, name, replacement)
    simulator = ToySimulator(pair)
    pvalue = g_test_pvalue(simulator.first_two_tokens(CYCLES), simulator.exact_joint(), pair.vocab)
    assert pvalue < 1e-6, f"{bug} on {pair.name} was not detected (p = {pvalue:.2e})"


# -- expected progress (Leviathan et al., 2023, eq. 1) --------------------------------------


def _mean_committed(pair: ToyPair, cycles: int) -> tuple[float, float, float]:
    simulator = ToySimulator(pair)
    accepted_len, _ = simulator.cycle(torch.zeros(cycles, dtype=torch.long))
    committed = (accepted_len + 1).double()
    q = simulator.draft_probs(torch.zeros(1, dtype=torch.long))[0]
    p = simulator.target_probs(torch.zeros(1, dtype=torch.long))[0]
    # per-position acceptance probability: p(x) for a one-hot draft at x, else sum min(p, q)
    alpha = float(p[q.argmax()]) if pair.one_hot_draft else float(torch.minimum(p, q).sum())
    expected = (1 - alpha ** (pair.gamma + 1)) / (1 - alpha)
    standard_error = float(committed.std() / committed.numel() ** 0.5)
    return float(committed.mean()), expected, standard_error


PROGRESS_PAIRS = [
    ToyPair("alpha_generic_g1", vocab=6, gamma=1, context_free=True, seed=11),
    ToyPair("alpha_generic_g4", vocab=6, gamma=4, context_free=True, seed=12),
    ToyPair("alpha_near_equal_g6", vocab=8, gamma=6, context_free=True, draft_noise=0.3, seed=13),
    ToyPair("alpha_one_hot_g3", vocab=5, gamma=3, context_free=True, one_hot_draft=True, seed=14),
]


@pytest.mark.parametrize("pair", PROGRESS_PAIRS, ids=lambda pair: pair.name)
def test_mean_committed_per_call_matches_theory(pair: ToyPair) -> None:
    mean, expected, standard_error = _mean_committed(pair, 40_000)
    assert abs(mean - expected) < 4 * standard_error, f"mean {mean:.4f}, theory {expected:.4f} ± {standard_error:.4f}"


def test_progress_check_rejects_a_biased_acceptance(monkeypatch: pytest.MonkeyPatch) -> None:
    honest = acceptance._acceptance_probability
    monkeypatch.setattr(acceptance, "_acceptance_probability", lambda *args: 0.9 * honest(*args))
    mean, expected, standard_error = _mean_committed(PROGRESS_PAIRS[1], 40_000)
    assert abs(mean - expected) > 4 * standard_error


def test_the_g_test_rejects_a_q_that_missed_the_grammar_mask() -> None:
    """Drafts drawn from the masked q, but the acceptance rule given the unmasked q."""
    pair = ToyPair("unmasked_q", vocab=8, gamma=3, grammar_mask=True, planted_unmasked_q=True, seed=9)
    simulator = ToySimulator(pair)
    pvalue = g_test_pvalue(simulator.first_two_tokens(CYCLES), simulator.exact_joint(), pair.vocab)
    assert pvalue < 1e-6, f"the unmasked q was not detected (p = {pvalue:.2e})"
