"""Sampling transforms produce exactly the normalised distribution that is sampled."""

from __future__ import annotations

import pytest
import torch

from specrag.decoding.sampling import SamplingParams, probs_from_logits, select_token

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def test_temperature_scales_logits_before_softmax() -> None:
    probs = probs_from_logits(LOGITS, SamplingParams(temperature=0.5))
    torch.testing.assert_close(probs, torch.softmax(LOGITS / 0.5, dim=-1))


def test_top_k_keeps_the_k_largest_and_renormalises() -> None:
    probs = probs_from_logits(LOGITS, SamplingParams(temperature=1.0, top_k=3))
    expected = torch.softmax(LOGITS[:3], dim=-1)
    torch.testing.assert_close(probs[:3], expected)
    assert probs[3:].sum() == 0


def test_top_k_keeps_ties_with_the_kth_value() -> None:
    logits = torch.tensor([3.0, 1.0, 1.0, 0.0])
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs > 0).tolist() == [True, True, True, False]


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.8))
    # mass before each token: 0, .5, .8, .95 -> keep the first two only
    torch.testing.assert_close(kept, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    # p just above 0.8 also admits the third token
    kept = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.81))
    torch.testing.assert_close(kept, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)


def test_top_p_always_keeps_the_top_token() -> None:
    probs = probs_from_logits(LOGITS, SamplingParams(temperature=1.0, top_p=1e-6))
    assert probs[0] == 1.0 and probs[1:].sum() == 0


def test_subnormal_top_p_keeps_the_top_token() -> None:
    # 5e-324 rounds to 0.0 in float32; schemathesis found it made every mass 0 and the draw nan.
    probs = probs_from_logits(LOGITS, SamplingParams(temperature=1.0, top_p=5e-324))
    assert probs[0] == 1.0 and probs[1:].sum() == 0


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-6])
def test_a_vanishing_temperature_is_greedy(temperature: float) -> None:
    params = SamplingParams(temperature=temperature)
    assert params.greedy
    assert select_token(LOGITS, params, torch.Generator().manual_seed(0)) == 0
    assert torch.isfinite(probs_from_logits(LOGITS, params)).all()


def test_transforms_apply_rowwise_on_batches() -> None:
    batch = torch.stack([LOGITS, LOGITS.flip(0)])
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    probs = probs_from_logits(batch, params)
    torch.testing.assert_close(probs[0], probs_from_logits(LOGITS, params))
    torch.testing.assert_close(probs[1], probs_from_logits(LOGITS.flip(0), params))
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))


def test_greedy_is_argmax_and_one_hot() -> None:
    params = SamplingParams()
    assert select_token(LOGITS, params, None) == 0
    assert probs_from_logits(LOGITS, params).tolist() == [1.0, 0, 0, 0, 0, 0]


def test_sampling_uses_only_the_given_generator() -> None:
    params = SamplingParams(temperature=1.0)
    draws = [select_token(LOGITS, params, torch.Generator().manual_seed(7)) for _ in range(5)]
    assert len(set(draws)) == 1
    torch.manual_seed(0)
    first = select_token(LOGITS, params, torch.Generator().manual_seed(7))
    torch.manual_seed(1)
    assert select_token(LOGITS, params, torch.Generator().manual_seed(7)) == first


@pytest.mark.parametrize("bad", [{"temperature": -1.0}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}])
def test_invalid_params_are_rejected(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)
