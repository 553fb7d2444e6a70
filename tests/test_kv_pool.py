"""Paged KV: the pool bounds memory, admission keeps every promise, and no block is ever
leaked or owned twice, whatever requests do (finish, get cancelled, roll back, hit the
prefix cache)."""

from __future__ import annotations

import random

import pytest
import torch

from specrag.decoding import Engine, GenerationRequest, SamplingParams
from specrag.decoding.kv import SequenceKV
from specrag.decoding.kv_pool import KVPool, KVPoolExhausted
from specrag.decoding.prefix_cache import PrefixCache
from tests.conftest import tiny_causal_lm

VOCAB = 24
TARGET = tiny_causal_lm(VOCAB, seed=5)
DRAFT = tiny_causal_lm(VOCAB, seed=6, hidden_size=16, layers=1)
BLOCK = 4


def pool_of(blocks: int, model: object = TARGET) -> KVPool:
    pool = KVPool(block_tokens=BLOCK, num_blocks=blocks)
    pool.configure(model.config, model.dtype, model.device)
    return pool


def all_tables(engine: Engine) -> tuple[list[list[int]], list[list[int]]]:
    active = list(engine._active.values())
    target = [seq.kv.table.blocks for seq in active]
    draft = [kv.table.blocks for seq in active for kv in seq.draft_kvs()]
    return target, draft


def test_a_paged_cache_gives_the_growable_caches_logits_bit_for_bit() -> None:
    """Scattered blocks (another sequence's between them), a rollback and a verify."""
    pool = pool_of(64)
    paged, other, growable = SequenceKV(TARGET.config, pool=pool), SequenceKV(TARGET.config, pool=pool), TARGET.new_kv()
    prompt = [(5 * i) % VOCAB for i in range(30)]
    TARGET.prefill(paged, prompt[:9])
    TARGET.prefill(other, prompt[:6])
    assert torch.equal(TARGET.prefill(paged, prompt[9:]), TARGET.prefill(growable, prompt))
    assert paged.table.blocks != list(range(paged.table.blocks[0], paged.table.blocks[0] + len(paged.table.blocks)))
    for kv in (paged, growable):
        kv.crop(27)
    assert torch.equal(TARGET.forward(paged, [1, 2, 3, 4, 5]), TARGET.forward(growable, [1, 2, 3, 4, 5]))
    assert len(paged.table.blocks) == 8  # 32 positions
    paged.crop(17)
    assert len(paged.table.blocks) == 5  # rollback gave whole blocks back
    pool.check([paged.table.blocks, other.table.blocks])


def test_a_full_pool_refuses_an_unpromised_block_and_keeps_its_promises() -> None:
    pool = pool_of(4)
    promised = SequenceKV(TARGET.config, pool=pool)
    assert promised.table.reserve(3)
    assert not pool.reserve(2) and pool.available() == 1
    greedy = SequenceKV(TARGET.config, pool=pool)
    TARGET.prefill(greedy, [1, 2, 3])  # the one unpromised block
    with pytest.raises(KVPoolExhausted):
        TARGET.forward(greedy, [4, 5])  # a second one would break the promise
    TARGET.prefill(promised, list(range(12)))  # all three promised blocks are there
    assert pool.usage() == 1.0


def test_a_request_no_pool_could_hold_is_refused_when_added() -> None:
    engine = Engine(TARGET, prefix_cache=PrefixCache(pool_of(8)))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add(GenerationRequest(list(range(20)), max_tokens=13))  # 33 positions, 9 blocks
    engine.add(GenerationRequest(list(range(20)), max_tokens=12))


def test_when_the_pool_is_full_new_requests_wait_and_running_ones_finish() -> None:
    engine = Engine(TARGET, prefix_cache=PrefixCache(pool_of(10)), debug=True)
    requests = [
        GenerationRequest([index, *range(11)], max_tokens=8, stop_token_ids=[], speculation="off") for index in range(3)
    ]
    alone = [[t for e in Engine(TARGET).generate(request) for t in e.token_ids] for request in requests]
    ids = [engine.add(request) for request in requests]  # 5 blocks each: two fit
    outputs: dict[int, list[int]] = {seq_id: [] for seq_id in ids}
    waited = False
    while engine.has_unfinished():
        for event in engine.step():
            outputs[event.seq_id] += event.token_ids
        waited |= engine.num_running() == 2 and engine.num_waiting() == 1 and not engine._active[ids[2]].admitted
        assert engine.kv_cache_usage() <= 1.0
    assert waited and [outputs[seq_id] for seq_id in ids] == alone


@pytest.mark.parametrize("seed", [0])
def test_a_thousand_random_requests_leak_no_block_and_own_none_twice(seed: int) -> None:
    """Random prompts over few stems (prefix hits), speculation on and off with a draft model
    (rollbacks in both pools), greedy and sampled, cancellations at random steps, a pool
    small enough that requests wait. After every step every block is free, evictable or held
    exactly as often as tables name it; at the end nothing is held or promised."""
    rng = random.Random(seed)
    cache = PrefixCache(pool_of(48))
    engine = Engine(TARGET, DRAFT, prefix_cache=cache, debug=True)
    stems = [[rng.randrange(VOCAB) for _ in range(rng.randrange(4, 13))] for _ in range(4)]
    submitted = finished = cancelled = 0
    while submitted < 1000 or engine.has_unfinished():
        for _ in range(rng.randrange(3) if submitted < 1000 else 0):
            prompt = [*rng.choice(stems), *[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 8))]]
            engine.add(
                GenerationRequest(
                    prompt,
                    max_tokens=rng.randrange(1, 10),
                    stop_token_ids=[rng.randrange(VOCAB)],
                    speculation=rng.choice(["on", "off"]),
                    num_speculative_tokens=rng.randrange(1, 5),
                    sampling=rng.choice([SamplingParams(), SamplingParams(temperature=1.0, seed=rng.randrange(99))]),
                )
            )
            submitted += 1
        if engine._active and rng.random() < 0.1:
            engine.cancel(rng.choice(list(engine._active)))
            cancelled += 1
        finished += sum(event.finished for event in engine.step())
        target_tables, draft_tables = all_tables(engine)
        cache.pool.check(target_tables)
        engine.kv.draft_pool.check(draft_tables)
    assert finished + cancelled >= 1000 and cancelled > 50
    for pool in (cache.pool, engine.kv.draft_pool):
        pool.check([])
        assert pool.reserved == 0 and pool.used() == 0 and pool.unpromised_allocations == 0
    assert cache.stats.hits > 100 and cache.stats.evicted_blocks > 100
