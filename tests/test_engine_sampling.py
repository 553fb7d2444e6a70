"""End to end through the engine: speculative sampling with a model drafter samples the
target model's own distribution (tiny models, so the exact distribution is computable)."""

from __future__ import annotations

import itertools

import pytest
import scipy.stats
import torch

from decoding import Engine, GenerationRequest, SamplingParams, acceptance
from decoding.sampling import probs_from_logits
from tests.conftest import tiny_causal_lm

VOCAB = 6
TARGET = tiny_causal_lm(VOCAB, seed=21, init_scale=0.4)
DRAFT = tiny_causal_lm(VOCAB, seed=22, init_scale=0.4, hidden_size=16, layers=1)
PROMPT = [1, 4, 2]
PARAMS = SamplingParams(temperature=1.0, top_k=5)
RUNS = 2500


def exact_second_and_third_token() -> torch.Tensor:
    """P(t2, t3) = sum over t1 of p(t1) p(t2 | t1) p(t3 | t1, t2), as [V, V]."""

    def probs(tokens: list[int]) -> torch.Tensor:
        return probs_from_logits(TARGET.forward(TARGET.new_kv(), tokens)[-1], PARAMS)

    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    first = probs(PROMPT)
    for t1, t2 in itertools.product(range(VOCAB), repeat=2):
        second = probs([*PROMPT, t1])
        joint[t2] += first[t1] * second[t2] * probs([*PROMPT, t1, t2])
    return joint


def sampled_second_and_third_token() -> torch.Tensor:
    engine = Engine(TARGET, DRAFT, default_drafter="model")
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    rejections = 0
    for seed in range(RUNS):
        request = GenerationRequest(
            PROMPT,
            max_tokens=4,
            speculation="on",
            num_speculative_tokens=2,
            stop_token_ids=[],
            sampling=SamplingParams(temperature=1.0, top_k=5, seed=seed),
        )
        events = list(engine.generate(request))
        output = [token for event in events for token in event.token_ids]
        counts[output[1], output[2]] += 1
        stats = events[-1].stats
        assert stats is not None and stats.drafted_tokens > 0  # every run really speculated
        rejections += stats.wasted_verify_tokens > 0
    assert rejections > RUNS // 10  # and the residual path ran often
    return counts


def pvalue(counts: torch.Tensor, exact: torch.Tensor) -> float:
    observed, expected = counts.reshape(-1), exact.reshape(-1) / exact.sum() * counts.sum()
    if observed[expected == 0].sum() > 0:
        return 0.0
    keep = expected > 0
    return float(scipy.stats.power_divergence(observed[keep], expected[keep], lambda_="log-likelihood").pvalue)


@pytest.mark.slow
def test_engine_sampling_with_a_model_drafter_matches_the_target() -> None:
    assert pvalue(sampled_second_and_third_token(), exact_second_and_third_token()) > 0.001


@pytest.mark.slow
def test_engine_level_check_catches_a_planted_residual_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(acceptance, "_residual_distribution", lambda p, q: p)
    assert pvalue(sampled_second_and_third_token(), exact_second_and_third_token()) < 1e-4
