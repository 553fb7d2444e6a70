"""The engine step's scheduler: prefill chunks under a token budget beside running
sequences, prompt rows whose bits do not depend on how the prompt is cut, and a failing
sequence that fails alone."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F

from specrag.decoding.engine import Engine
from specrag.decoding.fast_paths import attend_prompt_blocks
from specrag.decoding.model import PREFILL_CHUNK_TOKENS, CausalLM
from specrag.decoding.request import GenerationEvent, GenerationRequest
from specrag.decoding.sampling import SamplingParams
from tests.conftest import tiny_causal_lm

LONG_PROMPT = [(5 * i + 3) % 48 for i in range(2 * PREFILL_CHUNK_TOKENS + 88)]  # three chunks


def tiny(row_exact: bool) -> CausalLM:
    target = tiny_causal_lm(48, seed=0)
    target.row_exact = row_exact  # forced: float64 rows agree to ~1e-15, so packing is exact
    return target


def request(prompt: Sequence[int], **overrides: object) -> GenerationRequest:
    fields: dict = {"max_tokens": 10, "stop_token_ids": [], "lookup_sources": [list(prompt)[::-1]]}
    fields.update(overrides)
    return GenerationRequest(list(prompt), **fields)


def alone(target: CausalLM, one: GenerationRequest) -> list[int]:
    return [token for event in Engine(target, debug=True).generate(one) for token in event.token_ids]


@pytest.mark.parametrize("row_exact", [True, False], ids=["packed", "one-by-one"])
def test_a_long_prompt_is_prefilled_a_chunk_a_step_while_the_others_decode(row_exact: bool) -> None:
    target = tiny(row_exact)
    engine = Engine(target, debug=True, min_ngram=1)
    short = [request([3, 17, 5, 22, 9, 31, 4] * 3, max_tokens=30), request([8, 1, 8, 2] * 4, speculation="off")]
    ids = [engine.add(one) for one in short]
    outputs: dict[int, list[int]] = {seq_id: [] for seq_id in ids}
    for event in engine.step():  # both short prompts prefill in the first step
        outputs[event.seq_id] += event.token_ids
    long_request = request(LONG_PROMPT, max_tokens=6)
    long_id = engine.add(long_request)
    outputs[long_id] = []
    steps_to_first_token = 0
    while not outputs[long_id]:
        events = {event.seq_id: event for event in engine.step()}
        steps_to_first_token += 1
        for seq_id in ids:  # never stalled by the prefill: a token (or more) every step
            assert events[seq_id].token_ids
        for seq_id, event in events.items():
            outputs[seq_id] += event.token_ids
    assert steps_to_first_token == 3  # 256 + 256 + 88 prompt tokens
    while engine.has_unfinished():
        for event in engine.step():
            outputs[event.seq_id] += event.token_ids
    for seq_id, one in zip([*ids, long_id], [*short, long_request], strict=True):
        assert outputs[seq_id] == alone(target, one)


def test_the_budget_admits_the_oldest_prompt_chunk_and_more_only_while_it_lasts() -> None:
    engine = Engine(tiny(True), debug=True, max_num_batched_tokens=300)
    prompts = [[(seed + i) % 48 for i in range(200)] for seed in range(3)]
    ids = [engine.add(request(prompt, speculation="off")) for prompt in prompts]
    assert (engine.num_running(), engine.num_waiting()) == (0, 3)
    assert [event.seq_id for event in engine.step()] == ids[:1]  # 200 + 200 > 300
    assert (engine.num_running(), engine.num_waiting()) == (1, 2)
    assert [event.seq_id for event in engine.step()] == ids[:2]  # 1 decode token + 200
    assert [event.seq_id for event in engine.step()] == ids  # 2 + 200
    assert (engine.num_running(), engine.num_waiting()) == (3, 0)


def run_to_the_end(engine: Engine, ids: list[int]) -> tuple[dict[int, list[int]], dict[int, GenerationEvent]]:
    """Step until every sequence finished: each one's tokens, and the events that carried an error."""
    outputs: dict[int, list[int]] = {seq_id: [] for seq_id in ids}
    errors: dict[int, GenerationEvent] = {}
    while engine.has_unfinished():
        for event in engine.step():
            outputs[event.seq_id] += event.token_ids
            if event.error is not None:
                errors[event.seq_id] = event
    return outputs, errors


class FailsAt:
    """A prefix-only processor that raises once the output reaches ``position`` tokens."""

    speculative_safe = True

    def __init__(self, prompt_len: int, position: int) -> None:
        self.limit = prompt_len + position

    def __call__(self, token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        if len(token_ids) >= self.limit:
            raise RuntimeError("planted processor failure")
        return logits


@pytest.mark.parametrize("row_exact", [True, False], ids=["packed", "one-by-one"])
def test_a_sequence_whose_processor_raises_fails_alone(row_exact: bool) -> None:
    target = tiny(row_exact)
    prompts = [[(7 * seed + 3 * i) % 48 for i in range(12 + seed)] * 2 for seed in range(3)]
    healthy = [
        request(prompts[0], max_tokens=14),
        request(prompts[2], max_tokens=14, speculation="on", sampling=SamplingParams(temperature=0.8, seed=3)),
    ]
    failing = request(prompts[1], max_tokens=14, logits_processors=[FailsAt(len(prompts[1]), 4)])
    engine = Engine(target, debug=True, min_ngram=1)
    ids = [engine.add(one) for one in (healthy[0], failing, healthy[1])]
    outputs, errors = run_to_the_end(engine, ids)
    assert list(errors) == [ids[1]]
    assert errors[ids[1]].finished and errors[ids[1]].finish_reason == "error"
    assert "planted" in str(errors[ids[1]].error)
    assert outputs[ids[0]] == alone(target, healthy[0])
    assert outputs[ids[2]] == alone(target, healthy[1])


@pytest.mark.parametrize("row_exact", [True, False], ids=["packed", "one-by-one"])
def test_a_sequence_whose_forward_raises_fails_alone(row_exact: bool) -> None:
    """Its cache's second layer raises part-way through the (packed) forward: the other
    caches drop what that forward half-appended, are answered alone, and finish as alone."""
    target = tiny(row_exact)
    prompts = [[(5 * seed + 2 * i) % 48 for i in range(10 + seed)] * 2 for seed in range(3)]
    requests = [request(prompts[0], max_tokens=12), request(prompts[1], max_tokens=12)]
    requests.append(request(prompts[2], max_tokens=12, speculation="on", sampling=SamplingParams(0.8, seed=5)))
    engine = Engine(target, debug=True, min_ngram=1)
    ids = [engine.add(one) for one in requests]
    failing_kv = engine._active[ids[1]].kv
    layer = failing_kv.cache.layers[1]
    real_update = layer.update

    def update(*args: object, **kwargs: object) -> object:
        if len(failing_kv) >= len(prompts[1]) + 3:
            raise RuntimeError("planted forward failure")
        return real_update(*args, **kwargs)

    layer.update = update
    outputs, errors = run_to_the_end(engine, ids)
    assert list(errors) == [ids[1]] and "planted" in str(errors[ids[1]].error)
    assert outputs[ids[0]] == alone(target, requests[0]) and outputs[ids[2]] == alone(target, requests[2])
    engine.kv.pool.check([])  # the failed sequence gave its blocks back too


def test_the_worker_raises_a_failed_sequence_to_its_own_caller_only() -> None:
    from specrag.agent.worker import EngineWorker

    target = tiny(True)
    worker = EngineWorker(Engine(target, debug=True))
    try:
        prompt = [4, 9, 2, 33] * 5
        failing = worker.generate(request(prompt, logits_processors=[FailsAt(len(prompt), 2)]))
        fine = worker.generate(request(prompt, max_tokens=8))
        first = next(fine)
        with pytest.raises(RuntimeError, match="planted"):
            list(failing)
        tokens = first.token_ids + [token for event in fine for token in event.token_ids]
        assert tokens == alone(target, request(prompt, max_tokens=8))
        assert worker.in_flight == 0
    finally:
        worker.stop()


@pytest.mark.parametrize("start", [0, 32, 64, 70])
def test_prompt_blocks_are_causal_attention(start: int) -> None:
    generator = torch.Generator().manual_seed(start)
    total = 150
    query = torch.randn(1, 4, total - start, 8, generator=generator, dtype=torch.float64)
    key, value = (torch.randn(1, 2, total, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    hidden = torch.arange(total)[None, :] > torch.arange(start, total)[:, None]
    mask = torch.zeros(hidden.shape, dtype=torch.float64).masked_fill(hidden, float("-inf"))
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=mask[None, None], enable_gqa=True)
    torch.testing.assert_close(attend_prompt_blocks(query, key, value, None), expected, atol=1e-12, rtol=0)


def test_where_bf16_is_row_exact_a_prompt_gets_the_same_bits_however_it_is_cut() -> None:
    """smollm2 in bfloat16 (row-exact where the probe passes): a prompt prefilled whole, in
    the engine's chunks beside another sequence, and after a prefix-cache hit gives the
    same last-row logits, bit for bit."""
    from specrag.decoding.model import load_model
    from specrag.decoding.packed import Chunk, packed_forward
    from specrag.decoding.prefix_cache import PrefixCache, prefill_cached

    lm = load_model("smollm2-135m", dtype="bfloat16", progress=False)
    if not lm.row_exact:
        pytest.skip("bf16 is not row-exact on this CPU (decoding/batch_invariance.py)")
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40_000, (300,), generator=generator).tolist()
    whole = lm.prefill(lm.new_kv(), prompt)
    kv, other = lm.new_kv(), lm.new_kv()
    lm.prefill(other, prompt[:40])
    packed_forward(lm, [Chunk(kv, prompt[:96], prompt=True, last_only=True), Chunk(other, [7])])
    cut = packed_forward(lm, [Chunk(other, [8, 9]), Chunk(kv, prompt[96:], prompt=True, last_only=True)])[1][-1]
    assert torch.equal(cut, whole)
    cache = PrefixCache.for_model(lm, 1 << 28)
    prefill_cached(lm, cache.new_kv(), [*prompt[:200], 5, 6], cache)
    hit, cached_len = prefill_cached(lm, cache.new_kv(), prompt, cache)
    assert cached_len == 192 and torch.equal(hit, whole)


def test_the_stall_benchmark_reports_the_decoders_gaps_until_the_long_prompts_first_token(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import json

    from specrag.evals.bench.prefill_stall import main

    args = ["--model", "smollm2-135m", "--dtype", "float32", "--decoders", "2", "--prompt-tokens", "300"]
    assert main([*args, "--warm-steps", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["steps_to_first_token"] == 2  # 256 + 44 prompt tokens
    assert 0 < result["itl_p50_s"] <= result["itl_p99_s"] <= result["itl_max_s"] <= result["long_prompt_ttft_s"]


def test_verify_tokens_count_against_the_budget_of_a_packed_step(monkeypatch: pytest.MonkeyPatch) -> None:
    from specrag.decoding import step_driver

    target = tiny(True)
    sizes: list[list[int]] = []
    real = step_driver.packed_forward

    def counted(lm: CausalLM, chunks: list) -> list[torch.Tensor]:
        sizes.append([len(chunk.token_ids) for chunk in chunks])
        return real(lm, chunks)

    monkeypatch.setattr(step_driver, "packed_forward", counted)
    prompt = [3, 17, 5, 22, 9, 31, 4, 8] * 4  # repetitive: prompt lookup always proposes
    requests = [request(prompt, max_tokens=20, speculation="on", num_speculative_tokens=8) for _ in range(3)]
    engine = Engine(target, debug=True, min_ngram=1, max_num_batched_tokens=12)
    ids = [engine.add(one) for one in requests]
    outputs: dict[int, list[int]] = {seq_id: [] for seq_id in ids}
    while engine.has_unfinished():
        for event in engine.step():
            outputs[event.seq_id] += event.token_ids
    decode_steps = [step for step in sizes if len(step) == 3 and max(step) <= 9]  # no prompt chunk in them
    assert any(step[0] == 9 for step in decode_steps)
    for step in decode_steps:  # each chain fits what the earlier ones left; a plain token is never cut
        assert all(size <= max(1, 12 - sum(step[:index])) for index, size in enumerate(step))
    assert [1, 1, 32] in sizes  # beside the oldest prompt's chunk, the others verify nothing
    for seq_id, one in zip(ids, requests, strict=True):
        assert outputs[seq_id] == alone(target, one)


def test_a_packed_forward_feeds_the_cost_model_at_the_steps_token_count() -> None:
    """The policy reads C(step tokens) (StepLoad): the shared forward's time is that point."""
    from specrag.decoding.policy import CostModel

    cost = CostModel({1: 10.0, 2: 10.0}, decay=1.0)  # decay 1: the newest observation is the point
    engine = Engine(tiny(True), cost_model=cost, max_num_batched_tokens=512)
    for seed in range(3):
        engine.add(request([(seed + i) % 48 for i in range(5)], speculation="off"))
    engine.step()  # three prefill chunks of 5: one packed forward over 15 tokens
    assert 15 in cost._forward and cost.forward_seconds(15) < 1.0  # a real forward's seconds, not 10
    engine.step()  # three decode tokens
    assert cost.forward_seconds(3) < 1.0


def test_the_step_budget_is_the_knee_of_the_measured_curve() -> None:
    """The fewest tokens whose forward reaches 90% of the best tokens/second: a bigger
    step past the knee buys little throughput and delays every running sequence."""
    from specrag.decoding.policy import step_budget

    assert step_budget({128: 0.2, 256: 0.25, 512: 0.5}) == 256  # 640, 1024, 1024 tok/s
    assert step_budget({128: 0.1, 256: 0.3, 512: 0.6}) == 128  # already at its best
    assert step_budget({128: 0.4, 256: 0.5, 512: 0.55}) == 512  # still climbing
    assert step_budget({128: 0.2, 256: 0.3, 512: 0.5}, fraction=0.8) == 256  # 640, 853, 1024
    with pytest.raises(ValueError):
        step_budget({})


def test_the_engine_takes_its_budget_from_the_cost_model_unless_given() -> None:
    from specrag.decoding.policy import BUDGET_TOKEN_COUNTS, CostModel, step_budget

    # decode and verify tokens up to the knee, plus the chunk the oldest waiting prompt gets
    knee_at_512 = CostModel({1: 0.01}, prompt_seconds={128: 0.4, 256: 0.5, 512: 0.55})
    assert Engine(tiny(True), cost_model=knee_at_512).max_num_batched_tokens == 512 + PREFILL_CHUNK_TOKENS
    flat = CostModel({1: 0.01}, prompt_seconds={128: 0.1, 256: 0.2, 512: 0.4})  # knee 128: one chunk at least
    assert Engine(tiny(True), cost_model=flat).max_num_batched_tokens == 2 * PREFILL_CHUNK_TOKENS
    assert Engine(tiny(True), cost_model=knee_at_512, max_num_batched_tokens=300).max_num_batched_tokens == 300
    engine = Engine(tiny(True))
    engine.calibrate()  # times prompt chunks of every budget count on the real (tiny) model
    assert sorted(engine.cost_model.prompt_seconds) == sorted(BUDGET_TOKEN_COUNTS)
    knee = step_budget(engine.cost_model.prompt_seconds)
    assert engine.max_num_batched_tokens == max(knee, PREFILL_CHUNK_TOKENS) + PREFILL_CHUNK_TOKENS


def test_the_steps_one_mask_serves_each_row_and_a_misfit_fails_alone() -> None:
    """One bitmask over every constrained row of a step; a need whose mask does not fit
    its rows gets an error (its sequence fails), the others their masked rows."""
    from specrag.decoding.grammar import pack_allowed
    from specrag.decoding.step_driver import ForwardNeed, prepared

    vocab = 40
    allowed = torch.zeros(3, vocab, dtype=torch.bool)
    allowed[0, [1, 2]] = allowed[1, [5]] = allowed[2, [39]] = True
    bitmask = pack_allowed(allowed)
    verify = ForwardNeed(None, [1, 2], bitmask=bitmask[:2])  # type: ignore[arg-type]
    plain = ForwardNeed(None, [3], last_only=True, bitmask=bitmask[2:])  # type: ignore[arg-type]
    free = ForwardNeed(None, [4], prepare=lambda rows: rows * 2)  # type: ignore[arg-type]
    logits = [torch.randn(2, vocab), torch.randn(1, vocab), torch.ones(1, vocab)]
    answers = prepared([verify, plain, free], logits)
    assert torch.isfinite(answers[0]).tolist() == allowed[:2].tolist()
    assert torch.isfinite(answers[1]).tolist() == allowed[2:].tolist()
    assert torch.equal(answers[2], torch.full((1, vocab), 2.0))
    misfit = ForwardNeed(None, [3], last_only=True, bitmask=bitmask)  # type: ignore[arg-type]  # 3 rows for 1
    answers = prepared([verify, misfit], logits[:2])
    assert isinstance(answers[1], Exception)
    assert torch.isfinite(answers[0]).tolist() == allowed[:2].tolist()
