"""Engine behaviour on tiny float64 models: exact greedy parity, stops, stats, many sequences."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specrag.decoding import Engine, GenerationRequest, SamplingParams
from tests.conftest import tiny_causal_lm

VOCAB = 48
TARGET = tiny_causal_lm(VOCAB, seed=0)
POOR_DRAFT = tiny_causal_lm(VOCAB, seed=1, hidden_size=16, layers=1)


def run(engine: Engine, request: GenerationRequest) -> tuple[list[int], object]:
    events = list(engine.generate(request))
    assert all(not event.finished for event in events[:-1]) and events[-1].finished
    return [token for event in events for token in event.token_ids], events[-1]


def repetitive_prompt(seed: int, length: int) -> list[int]:
    """Random segments with repeats, so that n-gram lookup finds matches."""
    generator = torch.Generator().manual_seed(seed)
    segments = [torch.randint(0, VOCAB, (6,), generator=generator).tolist() for _ in range(3)]
    order = torch.randint(0, 3, (length // 6 + 1,), generator=generator).tolist()
    return [token for index in order for token in segments[index]][:length]


def speculative_runs(
    prompt: list[int], max_tokens: int, processors: list, lookup_sources: list[list[int]]
) -> list[tuple[list[int], object]]:
    """Greedy speculation under ``processors`` with each drafter: lookup alone, the target
    drafting for itself, a poor draft model."""
    runs = []
    for draft_model in (None, TARGET, POOR_DRAFT):
        engine = Engine(TARGET, draft_model, debug=True, min_ngram=1)
        request = GenerationRequest(
            prompt,
            max_tokens=max_tokens,
            speculation="on",
            stop_token_ids=[],
            logits_processors=processors,
            lookup_sources=lookup_sources,
        )
        runs.append(run(engine, request))
    return runs


def plain_reference(prompt: list[int], max_tokens: int, **kwargs: object) -> list[int]:
    request = GenerationRequest(prompt, max_tokens=max_tokens, speculation="off", stop_token_ids=[], **kwargs)
    return run(Engine(TARGET, debug=True), request)[0]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    gamma=st.integers(1, 8),
    prompt_len=st.integers(2, 60),
    max_tokens=st.integers(1, 40),
    drafter=st.sampled_from(["lookup", "self", "poor", "both"]),
)
def test_greedy_speculation_equals_plain_greedy(
    seed: int, gamma: int, prompt_len: int, max_tokens: int, drafter: str
) -> None:
    prompt = repetitive_prompt(seed, prompt_len)
    draft_model = {"lookup": None, "self": TARGET, "poor": POOR_DRAFT, "both": POOR_DRAFT}[drafter]
    kind = {"lookup": "lookup", "self": "model", "poor": "model", "both": "both"}[drafter]
    engine = Engine(TARGET, draft_model, default_drafter=kind, debug=True, min_ngram=1, max_ngram=3)
    request = GenerationRequest(
        prompt,
        max_tokens=max_tokens,
        speculation="on",
        num_speculative_tokens=gamma,
        stop_token_ids=[],
        lookup_sources=[prompt[::-1]],
    )
    output, final = run(engine, request)
    assert output == plain_reference(prompt, max_tokens)
    assert len(output) == max_tokens and final.finish_reason == "length"
    stats = final.stats
    assert stats.output_tokens == max_tokens
    assert stats.target_calls == 1 + len(stats.gamma_per_cycle)
    assert stats.accepted_tokens == sum(stats.acceptance_by_position)
    assert stats.drafted_tokens == sum(stats.gamma_per_cycle) == sum(stats.drafted_by_position)
    assert stats.wasted_verify_tokens == stats.drafted_tokens - stats.accepted_tokens
    if drafter == "self":  # a model drafting for itself is always right
        assert stats.accepted_tokens == stats.drafted_tokens


def test_self_drafting_commits_gamma_plus_one_per_call() -> None:
    prompt = repetitive_prompt(3, 20)
    request = GenerationRequest(prompt, max_tokens=31, speculation="on", num_speculative_tokens=4, stop_token_ids=[])
    output, final = run(Engine(TARGET, TARGET, default_drafter="model", debug=True), request)
    assert output == plain_reference(prompt, 31)
    assert final.stats.gamma_per_cycle == [4] * 6
    assert final.stats.accepted_len_hist == [0, 0, 0, 0, 6] and final.stats.bonus_count == 6
    assert final.stats.target_calls == 7  # prefill + 6 cycles of 5 tokens


def test_stop_token_inside_an_accepted_candidate_ends_generation_there() -> None:
    prompt = repetitive_prompt(5, 24)
    reference = plain_reference(prompt, 30)
    stop = reference[9]
    stop_at = reference.index(stop)
    request = GenerationRequest(
        prompt, max_tokens=30, speculation="on", num_speculative_tokens=8, stop_token_ids=[stop]
    )
    output, final = run(Engine(TARGET, TARGET, default_drafter="model", debug=True), request)
    assert output == reference[: stop_at + 1]
    assert final.finish_reason == "stop" and final.stats.output_tokens == stop_at + 1


def test_stop_sequence_inside_an_accepted_candidate_ends_generation_there() -> None:
    prompt = repetitive_prompt(6, 24)
    reference = plain_reference(prompt, 30)
    stop_sequence = reference[10:12]
    first_end = next(end for end in range(2, 31) if reference[end - 2 : end] == stop_sequence)
    request = GenerationRequest(
        prompt,
        max_tokens=30,
        speculation="on",
        num_speculative_tokens=8,
        stop_token_ids=[],
        stop_sequences=[stop_sequence],
    )
    output, final = run(Engine(TARGET, TARGET, default_drafter="model", debug=True), request)
    assert output == reference[:first_end] and final.finish_reason == "stop"


def test_default_stop_ids_are_the_models_eos() -> None:
    prompt = repetitive_prompt(7, 10)
    reference = plain_reference(prompt, 20)
    TARGET.model.generation_config.eos_token_id = reference[4]
    try:
        output, final = run(Engine(TARGET, TARGET), GenerationRequest(prompt, max_tokens=20, speculation="on"))
    finally:
        TARGET.model.generation_config.eos_token_id = None
    assert output == reference[: reference.index(reference[4]) + 1] and final.finish_reason == "stop"


def test_a_cycle_without_a_proposal_is_a_plain_step() -> None:
    prompt = list(range(20))  # no repeated n-gram, no passages: nothing to look up at first
    request = GenerationRequest(prompt, max_tokens=12, speculation="on", stop_token_ids=[])
    output, final = run(Engine(TARGET, debug=True, min_ngram=3, max_ngram=3), request)
    stats = final.stats
    assert output == plain_reference(prompt, 12)
    plain_steps = stats.gamma_per_cycle.count(0)
    reasons = stats.speculation_off_reasons
    assert reasons["no_proposal"] > 0 and reasons["no_proposal"] + reasons["max_tokens"] == plain_steps
    assert stats.target_calls == 1 + len(stats.gamma_per_cycle)


def test_off_never_drafts_and_records_why() -> None:
    output, final = run(
        Engine(TARGET, TARGET), GenerationRequest([1, 2, 3], max_tokens=5, speculation="off", stop_token_ids=[])
    )
    assert len(output) == 5
    assert final.stats.drafted_tokens == 0 and final.stats.target_calls == 5
    assert final.stats.speculation_off_reasons == {"off": 4}


def test_many_sequences_step_together_and_match_their_solo_runs() -> None:
    engine = Engine(TARGET, POOR_DRAFT, debug=True)
    prompts = [repetitive_prompt(seed, 12 + seed) for seed in range(4)]
    requests = [
        GenerationRequest(prompt, max_tokens=10 + index, speculation=["on", "off"][index % 2], stop_token_ids=[])
        for index, prompt in enumerate(prompts)
    ]
    ids = [engine.add(request) for request in requests]
    outputs: dict[int, list[int]] = {seq_id: [] for seq_id in ids}
    while engine.has_unfinished():
        for event in engine.step():
            outputs[event.seq_id] += event.token_ids
    for seq_id, prompt, request in zip(ids, prompts, requests, strict=True):
        assert outputs[seq_id] == plain_reference(prompt, request.max_tokens)


def test_cancel_frees_the_sequence_at_once() -> None:
    engine = Engine(TARGET)
    seq_id = engine.add(GenerationRequest([1, 2, 3], max_tokens=50, stop_token_ids=[]))
    engine.step()
    engine.cancel(seq_id)
    assert not engine.has_unfinished() and engine.step() == []


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"prompt_tokens": []}, "prompt_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"speculation": "sometimes"}, "speculation"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"drafter": "model"}, "draft model"),
        ({"stop_sequences": [[]]}, "stop_sequences"),
    ],
)
def test_bad_requests_name_the_field(changes: dict[str, object], message: str) -> None:
    request = GenerationRequest(**{"prompt_tokens": [1, 2], **changes})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        Engine(TARGET).add(request)


def test_a_draft_with_another_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(TARGET, tiny_causal_lm(VOCAB + 1, seed=2))


@pytest.mark.parametrize("speculation", ["off", "on"])
def test_seeded_sampling_is_reproducible(speculation: str) -> None:
    # With "auto", γ follows measured timings, so a seed fixes the distribution, not the draw.
    def sample() -> list[int]:
        request = GenerationRequest(
            [1, 2, 3],
            max_tokens=15,
            speculation=speculation,
            stop_token_ids=[],  # type: ignore[arg-type]
            sampling=SamplingParams(temperature=1.0, seed=123),
        )
        return run(Engine(TARGET, POOR_DRAFT), request)[0]

    assert sample() == sample()


def test_every_event_says_what_its_cycle_did() -> None:
    prompt = repetitive_prompt(7, 30)
    request = GenerationRequest(prompt, max_tokens=20, speculation="on", stop_token_ids=[])
    events = list(Engine(TARGET, debug=True).generate(request))
    cycles = [event.cycle for event in events]
    assert all(cycle is not None for cycle in cycles)
    assert cycles[0].kind == "prefill" and cycles[0].stage_seconds["prefill"] > 0
    for event, cycle in zip(events[1:], cycles[1:], strict=True):
        assert cycle.start_ns <= cycle.end_ns
        if cycle.kind == "speculative":
            assert cycle.gamma >= 1 and cycle.source is not None and cycle.stage_seconds["verify"] > 0
            assert len(event.token_ids) <= cycle.accepted_len + 1
        else:
            assert cycle.gamma == 0 and len(event.token_ids) == 1
    stats = events[-1].stats
    assert sum(cycle.accepted_len for cycle in cycles) == stats.accepted_tokens
    assert sum(cycle.gamma for cycle in cycles) == stats.drafted_tokens
