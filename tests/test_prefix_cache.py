"""Prefix cache: a hit gives the cold prefill's logits, eviction never serves a wrong prefix,
and sequences sharing cached blocks (by reference, in the KV pool) cannot corrupt each
other or the cache."""

from __future__ import annotations

import random

import pytest
import torch

from specrag.decoding import Engine, GenerationRequest, SamplingParams
from specrag.decoding.kv_pool import KVPool
from specrag.decoding.model import CausalLM
from specrag.decoding.prefix_cache import PrefixCache, prefill_cached
from tests.conftest import tiny_causal_lm

VOCAB = 24
TARGET = tiny_causal_lm(VOCAB, seed=5)
DRAFT = tiny_causal_lm(VOCAB, seed=6, hidden_size=16, layers=1)
BLOCK = 4


def cold_logits(model: CausalLM, tokens: list[int]) -> torch.Tensor:
    return model.prefill(model.new_kv(), tokens)


def cold_segment(model: CausalLM, tokens: list[int]) -> torch.Tensor:
    """KV of ``tokens`` from a fresh prefill, stacked [layers, 2, heads, len, dim]."""
    kv = model.new_kv()
    model.prefill(kv, tokens)
    return torch.stack([torch.stack((layer.keys[0], layer.values[0])) for layer in kv.cache.layers])


def pooled_segment(pool: KVPool, blocks: list[int]) -> torch.Tensor:
    """What ``blocks`` hold in the pool, stacked like ``cold_segment``."""
    layers = []
    for layer in range(len(pool._keys)):
        keys, values = pool.storage(layer)
        heads, _, size, dim = keys.shape
        layers.append(torch.stack([part[:, blocks].reshape(heads, len(blocks) * size, dim) for part in (keys, values)]))
    return torch.stack(layers)


def small_cache(blocks: int) -> PrefixCache:
    cache = PrefixCache.for_model(TARGET, block_tokens=BLOCK)
    small = KVPool(block_tokens=BLOCK, num_blocks=blocks)
    small.configure(TARGET.config, TARGET.dtype, TARGET.device)
    return PrefixCache(small, namespace=cache.namespace)


def prefill_and_finish(cache: PrefixCache, prompt: list[int]) -> None:
    """A request's prefill through the cache, then its end: its blocks stay named, unheld."""
    kv = cache.new_kv()
    prefill_cached(TARGET, kv, prompt, cache)
    kv.release()


def test_keys_chain_every_block_to_its_whole_prefix() -> None:
    cache = PrefixCache(KVPool(block_tokens=BLOCK))
    tokens = list(range(13))
    keys = cache.block_keys(tokens)
    assert len(keys) == 3  # the 13th token is not a full block
    changed_first = cache.block_keys([99, *tokens[1:]])
    assert all(a != b for a, b in zip(keys, changed_first, strict=True))
    changed_last = cache.block_keys([*tokens[:8], 99, *tokens[9:]])
    assert changed_last[:2] == keys[:2] and changed_last[2] != keys[2]
    assert PrefixCache(KVPool(block_tokens=BLOCK), namespace="other").block_keys(tokens)[0] != keys[0]


@pytest.mark.parametrize("cached_prefix", [4, 9, 16, 17])
def test_logits_after_a_hit_equal_a_cold_prefill(cached_prefix: int) -> None:
    generator = torch.Generator().manual_seed(cached_prefix)
    shared = torch.randint(0, VOCAB, (cached_prefix,), generator=generator).tolist()
    cache = PrefixCache.for_model(TARGET, block_tokens=BLOCK)
    prefill_cached(TARGET, cache.new_kv(), [*shared, 1, 2, 3], cache)
    prompt = [*shared, 7, 8]
    kv = cache.new_kv()
    logits, cached_len = prefill_cached(TARGET, kv, prompt, cache)
    assert cached_len == (min(cached_prefix + 1, len(prompt) - 1) // BLOCK) * BLOCK
    assert kv.token_ids == prompt and kv.cached_length() == len(prompt)
    torch.testing.assert_close(logits, cold_logits(TARGET, prompt), rtol=1e-10, atol=1e-10)


def test_a_prompt_cached_whole_still_forwards_its_last_token() -> None:
    prompt = list(range(12))  # exactly three blocks
    cache = PrefixCache.for_model(TARGET, block_tokens=BLOCK)
    prefill_cached(TARGET, cache.new_kv(), prompt, cache)
    logits, cached_len = prefill_cached(TARGET, cache.new_kv(), prompt, cache)
    assert cached_len == 8
    torch.testing.assert_close(logits, cold_logits(TARGET, prompt), rtol=1e-10, atol=1e-10)


@pytest.mark.slow
def test_logits_after_a_hit_equal_a_cold_prefill_on_smollm2(smollm2: CausalLM) -> None:
    generator = torch.Generator().manual_seed(0)
    system = torch.randint(100, 40_000, (300,), generator=generator).tolist()
    cache = PrefixCache.for_model(smollm2, 1 << 28)
    prefill_cached(smollm2, cache.new_kv(), [*system, 11, 12, 13], cache)
    prompt = [*system, 21, 22, 23, 24]
    logits, cached_len = prefill_cached(smollm2, cache.new_kv(), prompt, cache)
    assert cached_len == 288
    torch.testing.assert_close(logits, cold_logits(smollm2, prompt), rtol=1e-4, atol=1e-4)


def test_eviction_in_a_small_pool_never_returns_a_wrong_prefix() -> None:
    cache = small_cache(7)
    rng = random.Random(0)
    stems = [[rng.randrange(3) for _ in range(8)] for _ in range(3)]  # few stems: many shared prefixes
    hits = 0
    for _ in range(60):
        prompt = rng.choice(stems) + [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
        blocks = cache.lookup(prompt[:-1])
        if blocks:
            hits += 1
            cached = pooled_segment(cache.pool, blocks)
            torch.testing.assert_close(cached, cold_segment(TARGET, prompt[: cached.shape[3]]), rtol=1e-10, atol=1e-10)
        for block in blocks:
            cache.pool.release(block)
        prefill_and_finish(cache, prompt)
        assert len(cache) <= 7
        cache.pool.check([])
    assert hits > 20 and cache.stats.evicted_blocks > 20


def test_tokens_are_compared_on_a_hit_so_a_hash_collision_cannot_serve_another_prompt() -> None:
    class CollidingCache(PrefixCache):
        def block_keys(self, token_ids: list[int]) -> list[bytes]:
            return [b"same" for _ in super().block_keys(token_ids)]

    pool = KVPool(block_tokens=BLOCK)
    pool.configure(TARGET.config, TARGET.dtype, TARGET.device)
    cache = CollidingCache(pool)
    prefill_cached(TARGET, cache.new_kv(), [1, 2, 3, 4, 5], cache)
    assert cache.lookup([9, 9, 9, 9, 9]) == []


def test_chains_lose_their_tail_before_their_head() -> None:
    cache = small_cache(5)
    first = list(range(13))  # three full blocks and a partial one
    prefill_and_finish(cache, first)
    prefill_and_finish(cache, [20, 21, 22, 23, 20, 21, 22, 23, 0])  # three blocks: one named must go
    assert len(cache.lookup(first)) == 2  # the head two blocks survive, the tail went


def test_a_write_into_a_shared_block_copies_it_first() -> None:
    """Copy-on-write: a sequence that rolls back into a block another sequence (and the
    cache) holds, then writes there, gets its own copy; the holders see no change."""
    cache = PrefixCache.for_model(TARGET, block_tokens=BLOCK)
    prompt = list(range(10))
    owner = cache.new_kv()
    prefill_cached(TARGET, owner, prompt, cache)
    shared_blocks = list(owner.table.blocks[:2])
    before = pooled_segment(cache.pool, shared_blocks)
    reader = cache.new_kv()
    _, cached_len = prefill_cached(TARGET, reader, [*prompt[:9], 3], cache)
    assert cached_len == 8 and reader.table.blocks[:2] == shared_blocks
    reader.crop(6)  # back into the second shared block
    logits = TARGET.forward(reader, [23, 22, 21], last_only=True)[-1]
    torch.testing.assert_close(logits, cold_logits(TARGET, [*prompt[:6], 23, 22, 21]), rtol=1e-10, atol=1e-10)
    assert reader.table.blocks[0] == shared_blocks[0] and reader.table.blocks[1] != shared_blocks[1]
    assert torch.equal(pooled_segment(cache.pool, shared_blocks), before)
    cache.pool.check([owner.table.blocks, reader.table.blocks])


def test_engine_reports_cached_prompt_tokens_and_keeps_outputs() -> None:
    prompt = [random.Random(1).randrange(VOCAB) for _ in range(30)]
    request = GenerationRequest(prompt, max_tokens=12, speculation="on", stop_token_ids=[])
    plain = list(Engine(TARGET, debug=True).generate(request))
    engine = Engine(TARGET, prefix_cache=PrefixCache(KVPool(block_tokens=BLOCK)), debug=True)
    cold = list(engine.generate(request))
    follow_up = GenerationRequest([*prompt, *[t for e in cold for t in e.token_ids], 3, 4], max_tokens=5)
    warm = list(engine.generate(request))
    assert [e.token_ids for e in cold] == [e.token_ids for e in warm]
    assert [t for e in plain for t in e.token_ids] == [t for e in warm for t in e.token_ids]
    assert cold[-1].stats.cached_prompt_tokens == 0 and warm[-1].stats.cached_prompt_tokens == 28
    assert warm[-1].stats.to_dict()["cached_prompt_tokens"] == 28
    # The finished conversation was cached too, so a follow-up turn hits past the prompt.
    turn = list(engine.generate(follow_up))
    assert turn[-1].stats.cached_prompt_tokens > len(prompt)


def test_sequences_sharing_cached_blocks_do_not_corrupt_each_other_or_the_cache() -> None:
    rng = random.Random(2)
    shared = [rng.randrange(VOCAB) for _ in range(24)]
    prompts = [[*shared, *[rng.randrange(VOCAB) for _ in range(3 + index)]] for index in range(4)]
    sampling = [SamplingParams(), SamplingParams(temperature=0.9, seed=3)]

    def request(index: int) -> GenerationRequest:
        return GenerationRequest(
            prompts[index], max_tokens=16, speculation="on", sampling=sampling[index % 2], stop_token_ids=[]
        )

    solo = [[t for e in Engine(TARGET, DRAFT, debug=True).generate(request(i)) for t in e.token_ids] for i in range(4)]
    cache = PrefixCache(KVPool(block_tokens=BLOCK))
    engine = Engine(TARGET, DRAFT, prefix_cache=cache, debug=True)
    prefill_cached(TARGET, cache.new_kv(), [*shared, 0], cache)
    named = [block for block, _ in cache._blocks.values()]
    snapshot = pooled_segment(cache.pool, named)
    ids = [engine.add(request(index)) for index in range(4)]
    outputs: dict[int, list[int]] = {seq_id: [] for seq_id in ids}
    while engine.has_unfinished():  # interleaved cycles, each with rollbacks into shared blocks
        for event in engine.step():
            outputs[event.seq_id] += event.token_ids
    assert [outputs[seq_id] for seq_id in ids] == solo
    assert torch.equal(pooled_segment(cache.pool, named), snapshot)
    assert engine.draft_prefix_cache is not None and engine.draft_prefix_cache.stats.hit_tokens > 0
