"""The engine's KV memory: its block pools, their prefix caches, and admission.

A sequence is *admitted* (may start its prefill) once every pool it uses has promised it
the blocks it can ever need: its prompt plus ``max_tokens`` positions, less the blocks a
prefix-cache hit already gives it. A verify never writes past that bound: γ is capped at
the tokens left (``RequestPolicy.plan``), so the pending token and γ drafts end at most at
position ``prompt + max_tokens``. So a running sequence never finds the pool full, and none
is ever preempted or killed for memory; a request that cannot be promised its blocks
waits, oldest first (vLLM's FCFS waiting queue), and one that could never fit is refused
at ``add`` with ``RequestTooLarge`` (a ValueError).

The target and a draft model each get a pool with the same number of blocks (a draft's
cache never runs ahead of the target's), and each its own prefix cache when prefix
caching is on. A model whose layers are not all plain full attention (a sliding window)
keeps unpooled growable caches and is admitted without a promise.
"""

from __future__ import annotations

from collections.abc import Iterable

from specrag.decoding.kv import SequenceKV, pageable
from specrag.decoding.kv_pool import KVPool
from specrag.decoding.model import CausalLM
from specrag.decoding.prefix_cache import PrefixCache
from specrag.decoding.request import GenerationRequest


class RequestTooLarge(ValueError):
    """A request whose prompt plus ``max_tokens`` no empty KV pool could hold."""


class KVManager:
    def __init__(
        self,
        target: CausalLM,
        draft: CausalLM | None,
        prefix_cache: PrefixCache | bool,
        kv_cache_bytes: int | None = None,
    ) -> None:
        self.target, self.draft = target, draft
        self.pool: KVPool | None = None
        self.prefix_cache: PrefixCache | None = None
        if isinstance(prefix_cache, PrefixCache):  # shared with other engines of the same model
            self.pool, self.prefix_cache = prefix_cache.pool, prefix_cache
        elif pageable(target.config):
            self.pool = KVPool(kv_cache_bytes)
            self.prefix_cache = PrefixCache(self.pool, namespace=target.name) if prefix_cache else None
        if self.pool is not None:
            self.pool.configure(target.config, target.dtype, target.device)
        self.owns_pool = not isinstance(prefix_cache, PrefixCache)
        self.draft_pool: KVPool | None = None
        self.draft_prefix_cache: PrefixCache | None = None
        if draft is not None and self.pool is not None and pageable(draft.config):
            self.draft_pool = KVPool(block_tokens=self.pool.block_tokens, num_blocks=self.pool.num_blocks)
            self.draft_pool.configure(draft.config, draft.dtype, draft.device)
            if self.prefix_cache is not None:
                self.draft_prefix_cache = PrefixCache(self.draft_pool, namespace=draft.name)

    def new_kv(self) -> SequenceKV:
        """An empty target cache: paged in the pool, else growable."""
        if self.pool is None:
            return self.target.new_kv()
        return SequenceKV(self.target.config, pool=self.pool)

    def new_draft_kv(self) -> SequenceKV | None:
        if self.draft is None:
            return None
        if self.draft_pool is None:
            return self.draft.new_kv()
        return SequenceKV(self.draft.config, pool=self.draft_pool)

    def blocks_needed(self, request: GenerationRequest) -> int:
        """Blocks of the furthest position a sequence can write: prompt + max_tokens."""
        if self.pool is None:
            return 0
        return -(-(len(request.prompt_tokens) + request.max_tokens) // self.pool.block_tokens)

    def check_fits(self, request: GenerationRequest) -> None:
        """A request no empty pool could hold is refused now rather than waiting forever."""
        needed = self.blocks_needed(request)
        if self.pool is not None and needed > self.pool.num_blocks:
            raise RequestTooLarge(
                f"prompt_tokens + max_tokens = {len(request.prompt_tokens) + request.max_tokens} positions need "
                f"{needed} KV blocks of {self.pool.block_tokens}; the pool holds {self.pool.num_blocks} "
                "(raise SPECRAG_KV_CACHE_BYTES or lower max_tokens)"
            )

    def admit(self, request: GenerationRequest, target_kv: SequenceKV, draft_kvs: Iterable[SequenceKV]) -> int | None:
        """Start ``target_kv`` from the longest cached prefix of the prompt and reserve the
        rest; returns the prompt tokens served from the cache, or None when the pools cannot
        promise the blocks yet (nothing is held then)."""
        needed = self.blocks_needed(request)
        prompt = request.prompt_tokens
        cached_len = 0
        if self.prefix_cache is not None:
            blocks = self.prefix_cache.lookup(prompt[:-1])  # the last token is always forwarded
            cached_len = len(blocks) * self.prefix_cache.block_tokens
            if blocks:
                target_kv.adopt(blocks, prompt[:cached_len])
        drafts = [kv for kv in draft_kvs if kv.table is not None]
        if target_kv.table is not None and not target_kv.table.reserve(needed - len(target_kv.table.blocks)):
            target_kv.release()
            return None
        for index, kv in enumerate(drafts):
            if not kv.table.reserve(needed):
                for taken in [target_kv, *drafts[:index]]:
                    taken.release()
                return None
        return cached_len

    def cache_finished(self, target_kv: SequenceKV, draft_kvs: Iterable[SequenceKV]) -> None:
        """Name a finished conversation's full blocks: a follow-up turn extends it."""
        if self.prefix_cache is not None and target_kv.table is not None:
            self.prefix_cache.insert(target_kv)
        if self.draft_prefix_cache is not None:
            for kv in draft_kvs:
                if kv.table is not None and kv.table.pool is self.draft_pool:
                    self.draft_prefix_cache.insert(kv)

    def usage(self) -> float:
        """Fraction of the target pool held by sequences (vLLM's kv_cache_usage_perc / 100)."""
        return self.pool.usage() if self.pool is not None else 0.0

    def check(self, target_kvs: Iterable[SequenceKV], draft_kvs: Iterable[SequenceKV]) -> None:
        """Debug: no block leaked or double-owned, and nothing allocated beyond a promise."""
        for pool, kvs in ((self.pool, target_kvs), (self.draft_pool, draft_kvs)):
            if pool is None or (pool is self.pool and not self.owns_pool):
                continue  # a pool shared with other engines holds their blocks too
            pool.check(kv.table.blocks for kv in kvs if kv.table is not None)
            if pool.unpromised_allocations:
                raise AssertionError(f"{pool.unpromised_allocations} blocks were allocated beyond a reservation")
