"""Repetition penalties: the OpenAI and vLLM rules on hand-computed logits, exact under
speculation (each verify row penalised for its own prefix), and reachable over HTTP."""

from __future__ import annotations

import pytest
import torch

from specrag.decoding import Engine, GenerationRequest
from specrag.decoding.penalties import Penalties, PenaltyProcessor, penalize
from tests.test_engine import TARGET, plain_reference, repetitive_prompt, run, speculative_runs


def test_the_rules_on_hand_computed_logits() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    prompt, output = [3, 4], [0, 0, 2]
    seen = torch.tensor(prompt + output)
    openai_rule = penalize(logits, seen, torch.tensor(output), Penalties(frequency=0.5, presence=0.25))
    # token 0 twice: 2 - 0.5*2 - 0.25; token 2 once: 0.5 - 0.5 - 0.25; prompt tokens untouched
    assert openai_rule.tolist() == [0.75, -1.0, -0.25, 3.0, -2.0]
    vllm_rule = penalize(logits, seen, torch.tensor(output), Penalties(repetition=2.0))
    # seen positive logits halved, seen negative doubled, unseen (token 1) untouched
    assert vllm_rule.tolist() == [1.0, -1.0, 0.25, 1.5, -4.0]
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0, -2.0]  # a new tensor, the input kept


def test_out_of_range_penalties_name_the_field() -> None:
    with pytest.raises(ValueError, match="frequency_penalty"):
        Penalties(frequency=2.5)
    with pytest.raises(ValueError, match="repetition_penalty"):
        Penalties(repetition=0.0)
    assert not Penalties().active and Penalties(presence=0.1).active


@pytest.mark.parametrize("penalties", [Penalties(frequency=1.0, presence=0.5), Penalties(repetition=1.8)])
def test_speculative_greedy_equals_plain_greedy_under_penalties(penalties: Penalties) -> None:
    prompt = repetitive_prompt(11, 30)
    processors = [PenaltyProcessor(penalties, len(prompt))]
    reference = run(
        Engine(TARGET),
        GenerationRequest(prompt, max_tokens=40, speculation="off", stop_token_ids=[], logits_processors=processors),
    )[0]
    assert reference != plain_reference(prompt, 40)  # the penalty changed the text: the test has power
    for output, final in speculative_runs(prompt, 40, processors, [prompt, reference[5:]]):
        assert output == reference
        assert final.stats.drafted_tokens > 0 and final.stats.accepted_tokens > 0


def test_a_json_schema_request_without_a_penalty_gets_the_structured_default() -> None:
    import msgspec

    from specrag.agent.api_models import ChatCompletionRequest
    from specrag.agent.openai_compat import STRUCTURED_REPETITION_PENALTY, repetition_penalty_for

    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}

    def body(**fields: object) -> ChatCompletionRequest:
        return msgspec.convert({"messages": [{"role": "user", "content": "hi"}], **fields}, ChatCompletionRequest)

    assert repetition_penalty_for(body(response_format=schema)) == STRUCTURED_REPETITION_PENALTY == 1.1
    assert repetition_penalty_for(body(response_format=schema, repetition_penalty=1.0)) == 1.0  # as given
    assert repetition_penalty_for(body(response_format=schema, frequency_penalty=0.5)) == 1.0  # one set: no default
    assert repetition_penalty_for(body()) == 1.0
    assert repetition_penalty_for(body(response_format={"type": "json_object"})) == 1.0
