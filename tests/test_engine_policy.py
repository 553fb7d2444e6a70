"""The policy inside the engine: recovery after back-off, gates, logits processors."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from specrag.decoding import Engine, GenerationRequest
from specrag.decoding.policy import CostModel, PolicyConfig
from tests.conftest import tiny_causal_lm
from tests.test_engine import POOR_DRAFT, TARGET, VOCAB, plain_reference, repetitive_prompt, run, speculative_runs

# A frozen cost model (decay 0): decisions then depend on acceptance alone, not on timing.
FROZEN_COSTS = CostModel({1: 1.0, 2: 1.1, 4: 1.25, 8: 1.6, 16: 2.5}, 0.05, 0.02, decay=0.0)


def test_speculation_backs_off_on_a_misleading_source_and_returns_when_it_turns_useful() -> None:
    prompt = list(range(40, 48))
    reference = plain_reference(prompt, 90)
    # One passage: first decoys (an n-gram of the early output, then wrong tokens), then the
    # true later output. Early lookups hit the decoys; later ones hit the true text.
    decoys = []
    for position in range(3, 40):
        wrong = [(reference[position] + shift) % VOCAB for shift in (1, 2, 3)]
        decoys += [*reference[position - 3 : position], *wrong]
    passage = decoys + reference[45:]
    engine = Engine(
        TARGET,
        min_ngram=3,
        max_ngram=3,
        cost_model=FROZEN_COSTS,
        debug=True,
        policy=PolicyConfig(probe_interval=4, probe_gamma=2),
    )
    request = GenerationRequest(prompt, max_tokens=90, speculation="auto", stop_token_ids=[], lookup_sources=[passage])
    output, final = run(engine, request)
    stats = final.stats
    assert output == reference
    assert stats.speculation_off_reasons["low_acceptance"] >= 4  # it backed off ...
    assert stats.probe_cycles >= 1  # ... probed ...
    gammas = stats.gamma_per_cycle
    late = gammas[len(gammas) // 2 :]
    assert sum(1 for gamma in late if gamma > 2) >= 3  # ... and speculated at length again later
    assert stats.accepted_by_source["passage:0"] >= 20


class BanToken:
    """Bans one token: depends on nothing but the logits, so it is safe to apply to q too."""

    speculative_safe = True

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        return logits.index_fill(-1, torch.tensor([self.token]), float("-inf"))


class NoRepeatLastToken:
    """Forbids repeating the previous token: needs each verify row's own prefix."""

    speculative_safe = True

    def __call__(self, token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        return logits.index_fill(-1, torch.tensor([token_ids[-1]]), float("-inf"))


class CallCounter:
    """Stateful, not marked safe: speculation must be switched off for it."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return logits


def test_speculative_safe_processors_keep_greedy_parity() -> None:
    prompt = repetitive_prompt(11, 30)
    plain_output = plain_reference(prompt, 40)
    processors = [BanToken(plain_output[3]), NoRepeatLastToken()]
    reference = run(
        Engine(TARGET),
        GenerationRequest(prompt, max_tokens=40, speculation="off", stop_token_ids=[], logits_processors=processors),
    )[0]
    assert plain_output[3] not in reference
    assert all(left != right for left, right in itertools.pairwise(reference))
    for output, final in speculative_runs(prompt, 40, processors, [prompt[::-1]]):
        assert output == reference
        assert final.stats.drafted_tokens > 0


def test_an_unsafe_processor_turns_auto_speculation_off() -> None:
    counter = CallCounter()
    request = GenerationRequest(
        repetitive_prompt(12, 30), max_tokens=12, stop_token_ids=[], logits_processors=[counter]
    )
    _, final = run(Engine(TARGET, cost_model=FROZEN_COSTS), request)
    assert final.stats.drafted_tokens == 0 and counter.calls == 12
    assert final.stats.speculation_off_reasons["unsupported"] == 10  # + prefill, + the last token


def test_batch_gate_fires_when_too_many_sequences_are_active() -> None:
    engine = Engine(TARGET, TARGET, cost_model=FROZEN_COSTS, policy=PolicyConfig(max_active_sequences=1))
    ids = [
        engine.add(GenerationRequest(repetitive_prompt(seed, 20), max_tokens=8, stop_token_ids=[])) for seed in (1, 2)
    ]
    finals = {}
    while engine.has_unfinished():
        for event in engine.step():
            if event.finished:
                finals[event.seq_id] = event.stats
    assert all(finals[seq_id].speculation_off_reasons["batch_saturated"] > 0 for seq_id in ids)


def test_short_output_gate_spares_a_model_drafter_its_prefill() -> None:
    request = GenerationRequest(
        repetitive_prompt(13, 40), max_tokens=6, stop_token_ids=[], min_tokens_for_speculation=16
    )
    engine = Engine(TARGET, POOR_DRAFT, default_drafter="model", cost_model=FROZEN_COSTS, debug=True)
    output, final = run(engine, request)
    assert output == plain_reference(list(request.prompt_tokens), 6)
    assert final.stats.speculation_off_reasons["short_output"] == 4  # then max_tokens for the last
    assert final.stats.drafted_tokens == 0


def test_auto_calibrates_a_cost_model_when_none_is_given() -> None:
    engine = Engine(tiny_causal_lm(VOCAB, seed=0))
    assert engine.cost_model is None
    run(engine, GenerationRequest([1, 2, 3], max_tokens=4, stop_token_ids=[]))
    assert engine.cost_model is not None and engine.cost_model.forward_seconds(8) > 0


def test_auto_prefers_the_drafter_with_the_better_expected_rate() -> None:
    prompt = list(range(40, 48))
    reference = plain_reference(prompt, 60)
    # A passage that always matches the output's n-grams but continues wrongly: lookup has
    # a proposal every cycle, and the target drafting for itself is always right.
    decoys = []
    for position in range(3, 60):
        decoys += [*reference[position - 3 : position], (reference[position] + 1) % VOCAB]
    engine = Engine(TARGET, TARGET, min_ngram=3, max_ngram=3, cost_model=FROZEN_COSTS, debug=True)
    request = GenerationRequest(prompt, max_tokens=60, stop_token_ids=[], lookup_sources=[decoys])
    output, final = run(engine, request)
    assert output == reference
    by_source = final.stats.accepted_by_source
    assert by_source["draft_model"] > 30 and by_source["passage:0"] <= 2


def test_a_rejected_history_gives_way_to_the_lookup_chain_it_displaced() -> None:
    """A tenant's history that matches 4 tokens of the output and then goes wrong, against
    a passage that matches 3 and is right: the history's longer match ranks it first, and
    the planner must still verify the passage once the estimates say it is the better one
    (without ``Draft.rivals`` every cycle would verify or decline the history)."""
    prompt = list(range(40, 48))
    reference = plain_reference(prompt, 60)
    decoys = []
    for position in range(4, 60):
        decoys += [*reference[position - 4 : position], (reference[position] + 1) % VOCAB]
    engine = Engine(TARGET, min_ngram=3, max_ngram=3, cost_model=FROZEN_COSTS, debug=True)
    engine.history.add("tenant", decoys)
    request = GenerationRequest(prompt, max_tokens=60, stop_token_ids=[], lookup_sources=[reference], tenant="tenant")
    output, final = run(engine, request)
    assert output == reference
    by_source = final.stats.accepted_by_source
    assert by_source["passage:0"] >= 40 and by_source["history"] <= 2
    assert final.stats.target_calls <= 15
