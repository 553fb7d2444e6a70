"""The answerability probe and gate: the probability, the probe prompt, the gate in a real run."""

from __future__ import annotations

import math

import pytest
import torch

from specrag.agent.answerability import ABSTENTION, PROBE, AnswerTokens, NextTokenLogits, p_unanswerable, probe_messages
from specrag.agent.loop import RunOptions
from specrag.agent.prompt import PromptParts, build_messages, encode_messages
from specrag.agent.results import ShownPassage
from specrag.agent.runtime import Agent
from specrag.decoding.model import CausalLM
from specrag.retrieval import Retriever
from tests.retrieval_helpers import sample_index, shared_embedder


@pytest.fixture(scope="module")
def retriever(tmp_path_factory: pytest.TempPathFactory) -> Retriever:
    root, _ = sample_index(tmp_path_factory.getbasetemp())
    return Retriever.open(root, shared_embedder())


def test_p_unanswerable_is_p_no_renormalised_over_yes_and_no() -> None:
    logits = torch.tensor([5.0, 1.0, 0.0, 2.0, -1.0])
    tokens = AnswerTokens(yes=(1, 2), no=(3,))
    p_yes, p_no = math.exp(1.0) + math.exp(0.0), math.exp(2.0)
    assert p_unanswerable(logits, tokens) == pytest.approx(p_no / (p_no + p_yes), rel=1e-6)
    # Mass on other tokens does not move it: only the yes/no ratio counts.
    shifted = logits.clone()
    shifted[0] = 40.0
    assert p_unanswerable(shifted, tokens) == pytest.approx(p_no / (p_no + p_yes), rel=1e-5)


def test_answer_tokens_of_a_real_tokenizer_are_yes_and_no_words(smollm2: CausalLM) -> None:
    tokens = AnswerTokens.of(smollm2.tokenizer)
    assert tokens.yes and tokens.no and not set(tokens.yes) & set(tokens.no)
    assert all(smollm2.tokenizer.decode([t]).strip().lower().startswith("y") for t in tokens.yes)
    assert all(smollm2.tokenizer.decode([t]).strip().lower().startswith("n") for t in tokens.no)


def test_the_probe_prompt_extends_the_answer_prompt_up_to_the_question(smollm2: CausalLM) -> None:
    parts = PromptParts("What does pass do?", passages=[ShownPassage("P1", "a#0", "a", "pass does nothing.")])
    answer = smollm2.tokenizer.decode(encode_messages(smollm2.tokenizer, build_messages(parts)))
    probe = smollm2.tokenizer.decode(encode_messages(smollm2.tokenizer, probe_messages(parts)))
    up_to_question = answer[: answer.index("What does pass do?") + len("What does pass do?")]
    assert probe.startswith(up_to_question)
    assert probe[len(up_to_question) :].lstrip().startswith(PROBE)


def test_next_token_logits_keeps_the_first_call_and_changes_nothing() -> None:
    capture = NextTokenLogits()
    first, second = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    assert capture([1], first) is first and capture([1, 2], second) is second
    assert torch.equal(capture.logits, first)


def test_a_threshold_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(ValueError, match="abstain_threshold"):
        RunOptions(abstain_threshold=1.5)


@pytest.mark.slow
def test_the_gate_abstains_without_generating_and_measuring_changes_no_answer(
    smollm2: CausalLM, retriever: Retriever
) -> None:
    agent = Agent(index=retriever, model=smollm2)
    question, options = "What does the pass statement do?", {"max_tokens": 24, "k": 2}
    plain = agent.run(question, **options)
    measured = agent.run(question, measure_answerability=True, **options)
    assert plain["answerability"] is None
    probability = measured["answerability"]["p_unanswerable"]
    assert 0.0 < probability < 1.0 and not measured["answerability"]["abstained"]
    assert measured["answer"] == plain["answer"]  # the probe only reads logits

    # Thresholds a hair off p: a re-run reads part of its prompt from the prefix cache.
    gated = agent.run(question, abstain_threshold=max(0.0, probability - 1e-3), **options)
    assert gated["answer"] == ABSTENTION and gated["usage"]["completion_tokens"] == 0
    assert [step["kind"] for step in gated["steps"]] == ["abstain"]
    assert gated["answerability"]["p_unanswerable"] == pytest.approx(probability, abs=1e-5)
    assert any(span["name"] == "answerability" for span in agent.trace(gated["trace_id"])["spans"])

    kept = agent.run(question, abstain_threshold=min(1.0, probability + 1e-3), **options)
    assert kept["answer"] == plain["answer"] and not kept["answerability"]["abstained"]
