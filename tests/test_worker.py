"""The engine worker: concurrent requests progress together, match their solo runs, are
bounded, and a caller that leaves early frees its sequence."""

from __future__ import annotations

import threading
import time

import pytest

from specrag.agent.worker import EngineWorker, QueueFull
from specrag.decoding import Engine, GenerationRequest
from tests.conftest import tiny_causal_lm

VOCAB = 32
TARGET = tiny_causal_lm(VOCAB, seed=11)


def request(seed: int, max_tokens: int = 24) -> GenerationRequest:
    prompt = [(seed * 7 + index * 3) % VOCAB for index in range(10 + seed)]
    return GenerationRequest(prompt, max_tokens=max_tokens, speculation="on", stop_token_ids=[])


def solo(req: GenerationRequest) -> list[int]:
    return [token for event in Engine(TARGET).generate(req) for token in event.token_ids]


def test_concurrent_requests_interleave_and_match_their_solo_runs() -> None:
    worker = EngineWorker(Engine(TARGET, prefix_cache=True), max_in_flight=8)
    outputs: dict[int, list[int]] = {}
    cycles_seen_while_others_ran: dict[int, int] = {}

    def client(seed: int) -> None:
        tokens: list[int] = []
        for event in worker.generate(request(seed)):
            tokens += event.token_ids
            cycles_seen_while_others_ran[seed] = max(cycles_seen_while_others_ran.get(seed, 0), worker.in_flight)
        outputs[seed] = tokens

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    worker.stop()
    assert {seed: outputs[seed] for seed in range(6)} == {seed: solo(request(seed)) for seed in range(6)}
    assert max(cycles_seen_while_others_ran.values()) > 1  # they were in flight together
    assert worker.in_flight == 0 and not worker.engine.has_unfinished()


def test_beyond_the_bound_submit_is_refused() -> None:
    worker = EngineWorker(Engine(TARGET), max_in_flight=2)
    first, second = worker.generate(request(1, 200)), worker.generate(request(2, 200))
    next(first), next(second)  # both admitted and running
    with pytest.raises(QueueFull):
        next(worker.generate(request(3)))
    first.close(), second.close()
    deadline = time.monotonic() + 10
    while worker.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.in_flight == 0
    assert len(list(worker.generate(request(4, 5)))) >= 1  # room again
    worker.stop()


def test_leaving_early_cancels_and_frees_the_sequence() -> None:
    engine = Engine(TARGET)
    worker = EngineWorker(engine)
    events = worker.generate(request(5, 500))
    next(events)
    events.close()  # as a disconnected client
    deadline = time.monotonic() + 10
    while (engine.has_unfinished() or worker.in_flight) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.has_unfinished() and worker.in_flight == 0
    worker.stop()


def test_a_bad_request_fails_alone() -> None:
    worker = EngineWorker(Engine(TARGET))
    with pytest.raises(ValueError, match="max_tokens"):
        list(worker.generate(GenerationRequest([1, 2, 3], max_tokens=0)))
    assert worker.in_flight == 0
    assert solo(request(6)) == [token for event in worker.generate(request(6)) for token in event.token_ids]
    worker.stop()
