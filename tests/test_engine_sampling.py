"""End to end through the engine: speculative sampling with a model drafter samples the
target model's own distribution (tiny models, so the exact distribution is computable)."""

from __future__ import annotations

import itertools

import pytest
import scipy.stats
import torch
import xgrammar as xgr

from decoding import Engine, GenerationRequest, SamplingParams, acceptance
from decoding.grammar import Grammar, GrammarState
from decoding.grammar_compile import GrammarCompiler
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


def sampled_second_and_third_token(grammar: Grammar | None = None) -> torch.Tensor:
    engine = Engine(TARGET, DRAFT, default_drafter="model")
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    speculated = rejections = 0
    for seed in range(RUNS):
        request = GenerationRequest(
            PROMPT,
            max_tokens=4,
            speculation="on",
            num_speculative_tokens=2,
            stop_token_ids=[],
            sampling=SamplingParams(temperature=1.0, top_k=5, seed=seed),
            grammar=grammar,
        )
        events = list(engine.generate(request))
        output = [token for event in events for token in event.token_ids]
        counts[output[1], output[2]] += 1
        stats = events[-1].stats
        assert stats is not None
        speculated += stats.drafted_tokens > 0
        rejections += stats.wasted_verify_tokens > 0
    assert speculated > RUNS // 2 and rejections > RUNS // 10  # drafts verified, residual path taken
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


# -- the same check under a grammar that removes part of the support --------------------------

CHARS = "abcxyz"  # token i is CHARS[i]
ITEM_EBNF = 'root ::= item*\nitem ::= "a" [xy] | "b" [yz] | "c" [xz] | "x"'
FOLLOWERS = {"a": "xy", "b": "yz", "c": "xz"}  # what the grammar allows after an item's head


def allowed_after(output: list[int]) -> list[int]:
    """The grammar's allowed next tokens, written out independently of xgrammar."""
    text = "".join(CHARS[token] for token in output)
    pending_head = ""
    for char in text:
        pending_head = "" if pending_head else (char if char in FOLLOWERS else "")
    allowed = FOLLOWERS[pending_head] if pending_head else "abcx"
    return [CHARS.index(char) for char in allowed]


def exact_constrained_pairs() -> torch.Tensor:
    def probs(output: list[int]) -> torch.Tensor:
        logits = TARGET.forward(TARGET.new_kv(), [*PROMPT, *output])[-1].clone()
        forbidden = [token for token in range(VOCAB) if token not in allowed_after(output)]
        logits[forbidden] = float("-inf")
        return probs_from_logits(logits, PARAMS)

    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    first = probs([])
    for t1, t2 in itertools.product(range(VOCAB), repeat=2):
        if first[t1] == 0:
            continue
        second = probs([t1])
        if second[t2] > 0:
            joint[t2] += first[t1] * second[t2] * probs([t1, t2])
    return joint


def sampled_constrained_pairs() -> torch.Tensor:
    info = xgr.TokenizerInfo(list(CHARS), vocab_size=VOCAB, stop_token_ids=[])
    return sampled_second_and_third_token(GrammarCompiler(info).ebnf(ITEM_EBNF))


@pytest.mark.slow
def test_constrained_engine_sampling_matches_the_masked_target() -> None:
    assert pvalue(sampled_constrained_pairs(), exact_constrained_pairs()) > 0.001


@pytest.mark.slow
def test_constrained_check_catches_an_unmasked_draft_q(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the mask on q, cutting the chain at an ungrammatical draft biases the output."""
    monkeypatch.setattr(GrammarState, "draft_processor", lambda self, prompt_len: lambda prefix, logits: logits)
    assert pvalue(sampled_constrained_pairs(), exact_constrained_pairs()) < 1e-4
