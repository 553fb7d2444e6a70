"""The speculation policy on synthetic costs and acceptance: argmax, gates, back-off, probes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specrag.decoding import policy
from specrag.decoding.policy import AcceptanceEstimate, CostModel, PolicyConfig, RequestPolicy, best_gamma

COSTS = {1: 1.0, 2: 1.05, 4: 1.15, 8: 1.4, 16: 2.2}  # seconds of a forward over k tokens


def brute_force_rate(rates: list[float], cost: CostModel, draft_cost: float, gamma: int) -> float:
    if gamma == 0:
        return 1.0 / cost.forward_seconds(1)
    expected, survive = 1.0, 1.0
    for position in range(gamma):
        survive *= rates[position] if position < len(rates) else 0.5
        expected += survive
    return expected / (gamma * draft_cost + cost.forward_seconds(gamma + 1))


@settings(max_examples=200, deadline=None)
@given(
    rates=st.lists(st.floats(0.0, 1.0), min_size=8, max_size=8),
    slope=st.floats(0.0, 0.5),
    draft_cost=st.sampled_from([0.0, 0.05, 0.3]),
    max_gamma=st.integers(1, 8),
)
def test_chosen_gamma_is_the_argmax_of_the_rate_model(
    rates: list[float], slope: float, draft_cost: float, max_gamma: int
) -> None:
    cost = CostModel({k: 1.0 + slope * (k - 1) for k in (1, 2, 4, 8, 16)})
    estimate = AcceptanceEstimate(prior=0.5, decay=0.3, rates=list(rates))
    gamma, rate = best_gamma(estimate, cost, draft_cost, max_gamma)
    expected = [brute_force_rate(rates, cost, draft_cost, g) for g in range(max_gamma + 1)]
    assert rate == pytest.approx(max(expected))
    assert expected[gamma] == pytest.approx(max(expected))


def test_per_position_acceptance_beats_a_single_alpha() -> None:
    # Position 0 is nearly always right, position 1 nearly always wrong: γ = 1 wins, which a
    # single average α (0.5) would not see.
    estimate = AcceptanceEstimate(prior=0.5, decay=0.3, rates=[0.98, 0.02, 0.5, 0.5])
    gamma, _ = best_gamma(estimate, CostModel(COSTS), 0.0, 8)
    assert gamma == 1


def test_acceptance_estimate_sees_only_positions_up_to_the_first_rejection() -> None:
    estimate = AcceptanceEstimate(prior=0.5, decay=0.5)
    estimate.observe(gamma=4, accepted_len=1)
    assert estimate.rates == [0.75, 0.25]  # position 0 accepted, 1 rejected, 2-3 unseen
    estimate.observe(gamma=2, accepted_len=2)
    assert estimate.rates == [0.875, 0.625]


def test_cost_model_interpolates_and_follows_observations() -> None:
    cost = CostModel({1: 1.0, 4: 1.3, 8: 2.1}, decay=0.5)
    assert cost.forward_seconds(2) == pytest.approx(1.1)
    assert cost.forward_seconds(16) == pytest.approx(3.7)  # extrapolated from 4 and 8
    cost.observe_forward(4, 2.3)  # 2.3 / 1.3: the machine got slower
    assert cost.forward_seconds(4) == pytest.approx(1.8)
    step = 0.5 * (2.3 / 1.3 - 1)  # unobserved points keep their shape and follow the level
    assert cost.forward_seconds(1) == pytest.approx(1.0 * (1 + step))
    assert cost.forward_seconds(8) == pytest.approx(2.1 * (1 + step))
    for _ in range(30):
        cost.observe_forward(1, 0.5)
    assert cost.forward_seconds(1) == pytest.approx(0.5, rel=1e-3)


def test_a_tree_forward_costs_its_paths_and_teaches_only_the_path_cost() -> None:
    rows = {1: 1.0, 16: 1.2}
    calls: list[tuple[int, int]] = []

    def tree_forward(tokens: int, paths: int) -> float:
        calls.append((tokens, paths))
        return rows[tokens] + 0.1 * (paths - 1)

    cost = CostModel.measure(lambda tokens: rows[tokens], counts=(1, 16), tree_forward=tree_forward)
    assert calls and cost.tree_path_seconds == pytest.approx(0.1)
    assert cost.tree_forward_seconds(16, 1) == cost.forward_seconds(16) == pytest.approx(1.2)
    assert cost.tree_forward_seconds(16, 4) == pytest.approx(1.5)
    cost.decay = 0.5
    cost.observe_tree_forward(16, 3, 1.2 + 2 * 0.3)  # paths got dearer: 0.3 each
    assert cost.tree_path_seconds == pytest.approx(0.2) and cost.forward_seconds(16) == pytest.approx(1.2)
    assert CostModel.measure(lambda tokens: rows[tokens], counts=(1, 16)).tree_path_seconds == 0.0


def make_policy(mode: str = "auto", supported: bool = True, **config: object) -> RequestPolicy:
    return RequestPolicy(mode, 4, PolicyConfig(**config), CostModel(COSTS, 0.1, 0.01), supported)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("request_policy", "remaining", "active", "reason"),
    [
        (make_policy("off"), 100, 1, policy.OFF_BY_REQUEST),
        (make_policy(), 1, 1, policy.NEAR_MAX_TOKENS),
        (make_policy(supported=False), 100, 1, policy.UNSUPPORTED),
        (make_policy(max_active_sequences=2), 100, 3, policy.BATCH_SATURATED),
    ],
)
def test_each_gate_fires_with_its_reason(
    request_policy: RequestPolicy, remaining: int, active: int, reason: str
) -> None:
    assert request_policy.plan(remaining, active) == policy.Decision(0, reason)


@pytest.mark.parametrize(("setup", "override"), [(0, 32), (10_000, None)])
def test_short_output_gate_spares_a_costly_drafter(setup: int, override: int | None) -> None:
    decision = make_policy().for_costly_drafter(
        "draft_model", 4, 0.1, setup, remaining_tokens=20, min_output_tokens=override
    )
    assert decision == policy.Decision(0, policy.SHORT_OUTPUT)


def test_gates_stay_open_when_nothing_applies() -> None:
    assert make_policy(max_active_sequences=2).plan(50, 2) == policy.Decision(16)
    assert make_policy().for_costly_drafter("draft_model", 4, 0.01, 100, remaining_tokens=500).gamma > 0
    assert make_policy("on").plan(3, 1) == policy.Decision(2)  # capped by max_tokens only


def test_short_output_threshold_comes_from_the_cost_model() -> None:
    request_policy = make_policy()
    threshold = request_policy.short_output_threshold(setup_tokens=1000)
    assert threshold > 0
    assert request_policy.short_output_threshold(setup_tokens=2000) >= 2 * threshold - 1
    assert request_policy.short_output_threshold(setup_tokens=0) == 0  # prompt lookup has no set-up


def test_low_acceptance_backs_off_then_probes_and_recovers() -> None:
    request_policy = make_policy(probe_interval=3, probe_gamma=2)
    source = "passage:0"
    assert request_policy.for_draft(source, 6).gamma > 0  # optimistic prior: try it
    for _ in range(12):
        request_policy.observe(source, 4, 0)  # everything rejected
    decisions = [request_policy.for_draft(source, 6) for _ in range(4)]
    assert decisions[:3] == [policy.Decision(0, policy.LOW_ACCEPTANCE)] * 3
    assert decisions[3] == policy.Decision(2, "probe")
    for _ in range(4):  # the source turned copy-heavy: probes now succeed
        request_policy.observe(source, 2, 2)
    assert request_policy.for_draft(source, 6).gamma > 2
    assert request_policy.for_draft("output", 6).gamma > 0  # other sources keep their own estimates


def test_on_mode_verifies_every_proposal() -> None:
    request_policy = make_policy("on")
    for _ in range(10):
        request_policy.observe("output", 4, 0)
    assert request_policy.for_draft("output", 3) == policy.Decision(3)


def test_unseen_positions_follow_the_pooled_continuation_rate() -> None:
    estimate = AcceptanceEstimate(prior=0.5, decay=0.5)
    assert estimate.rate(12) == 0.5  # nothing seen: the prior
    estimate.observe(gamma=8, accepted_len=8)  # a long copy
    assert estimate.continuation is not None and estimate.continuation > 0.9
    assert estimate.rate(12) == estimate.continuation  # beyond anything tried so far
    flat = CostModel({1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.2})  # verifying is cheap here
    assert best_gamma(estimate, flat, 0.0, 16)[0] == 16
    estimate.observe(gamma=8, accepted_len=0)  # the first position alone says nothing of the rest
    assert estimate.continuation > 0.9 and estimate.rates[0] < 1.0


def test_a_new_request_starts_from_what_earlier_requests_measured() -> None:
    shared: dict[str, AcceptanceEstimate] = {}
    first = RequestPolicy("auto", 4, PolicyConfig(), CostModel(COSTS), shared=shared)
    for _ in range(10):
        first.observe("P3", 8, 0)  # passages kept failing
    assert set(shared) == {"passage"}
    second = RequestPolicy("auto", 4, PolicyConfig(), CostModel(COSTS), shared=shared)
    assert second.estimate("P7").rate(0) == pytest.approx(shared["passage"].rate(0))  # any passage: one kind
    assert second.estimate("P7").rate(0) < 0.1 and second.estimate("output").rate(0) == PolicyConfig().acceptance_prior
    second.observe("P7", 8, 8)
    assert second.estimate("P7").rate(0) > shared["passage"].rate(0) - 1e-9  # both moved, the copy is its own


def test_lookup_estimates_are_kept_apart_by_the_length_of_the_matched_ngram() -> None:
    request_policy = make_policy()
    for _ in range(10):
        request_policy.observe("prompt", 6, 0, match_ngram=1)  # 1-gram continuations fail
    assert request_policy.for_draft("prompt", 6, match_ngram=1).gamma == 0
    assert request_policy.for_draft("prompt", 6, match_ngram=4).gamma > 0  # a 4-gram match is judged apart
    assert policy.estimate_key("prompt", 3) == policy.estimate_key("prompt", 2) != policy.estimate_key("prompt", 1)
    assert policy.source_kind(policy.estimate_key("P7", 5)) == policy.source_kind(policy.estimate_key("P2", 4))


def test_a_carried_estimate_that_declines_still_gets_one_verify_of_the_new_requests_own() -> None:
    shared: dict[str, AcceptanceEstimate] = {}
    first = RequestPolicy("auto", 4, PolicyConfig(), CostModel(COSTS), shared=shared)
    for _ in range(10):
        first.observe("output", 8, 0, match_ngram=2)  # another request's proposals kept failing
    assert first.for_draft("output", 6, match_ngram=2).gamma == 0
    second = RequestPolicy("auto", 4, PolicyConfig(), CostModel(COSTS), shared=shared)
    assert second.for_draft("output", 6, match_ngram=2) == policy.Decision(2, "probe")  # its own first look
    second.observe("output", 2, 0, match_ngram=2)
    assert second.for_draft("output", 6, match_ngram=2) == policy.Decision(0, policy.LOW_ACCEPTANCE)


def test_in_a_loaded_step_gamma_must_raise_the_whole_steps_rate() -> None:
    """A packed step's extra verify tokens slow every sequence in it: where the forward's
    cost climbs steeply with its token count, a draft that pays alone is declined under
    load, and a light load keeps it."""
    steep = CostModel({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 1.4, 64: 4.0})
    estimate = AcceptanceEstimate(0.8, 0.3)
    assert best_gamma(estimate, steep, 0.0, 8)[0] == 8
    assert best_gamma(estimate, steep, 0.0, 8, policy.StepLoad(tokens=4, committed=4.0))[0] == 8
    assert best_gamma(estimate, steep, 0.0, 8, policy.StepLoad(tokens=40, committed=40.0))[0] == 0
    alone = best_gamma(estimate, steep, 0.0, 8)
    assert best_gamma(estimate, steep, 0.0, 8, policy.StepLoad()) == alone  # no load: the batch-1 rule
