"""Prefix KV cache: prompts that share a prefix share its prefill (vLLM's automatic prefix caching).

A token sequence is cut into fixed blocks. Block i's key hashes its tokens together with
block i-1's key, so a key names the whole prefix up to the end of its block and a lookup
walks from the first block until the first miss: the longest cached block-aligned prefix.
Each entry also keeps its tokens and they are compared on a hit, so even a hash collision
could not hand back another prompt's KV.

Blocks are shared by reference. The cache indexes blocks of the engine's KV pool
(``decoding/kv_pool.py``): ``insert`` names a sequence's full blocks, ``lookup`` hands the
longest named chain to a new sequence, which holds them (a reference each) and appends
after them. A named block is never written again: a sequence that must write into one
copies it first (``BlockTable.prepare_write``). So requests sharing a prefix cannot
corrupt each other, and a hit costs no copy at all.

Eviction is the pool's: a named block nobody holds stays readable until the pool needs a
block and has no free one, least recently released first. A sequence gives its blocks
back from the last to the first (``BlockTable.release``), so a chain's head (shared by
the most prompts) is the most recently released and a chain loses its tail before its
head; a chain whose head were evicted would be unreachable anyway, since every key
depends on its parent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from specrag.decoding.kv import SequenceKV
from specrag.decoding.kv_pool import DEFAULT_BLOCK_TOKENS, KVPool

if TYPE_CHECKING:
    from specrag.decoding.model import CausalLM


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0  # prompt tokens looked up (as vLLM's prefix_cache_queries)
    hit_tokens: int = 0  # of which served from the cache (prefix_cache_hits)
    lookups: int = 0
    hits: int = 0  # lookups that reused at least one block
    misses: int = 0
    inserted_blocks: int = 0
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class PrefixCache:
    """Block-hashed index over one model's KV pool (``namespace`` keeps models apart)."""

    def __init__(self, pool: KVPool | None = None, namespace: str = "") -> None:
        self.pool = pool if pool is not None else KVPool()
        if self.pool.on_evict is not None:
            raise ValueError("this KV pool already has a prefix cache")
        self.pool.on_evict = self._forget
        self.block_tokens = self.pool.block_tokens
        self.namespace = namespace
        self.stats = PrefixCacheStats()
        self._blocks: dict[bytes, tuple[int, tuple[int, ...]]] = {}  # key -> (block, its tokens)
        self._keys: dict[int, bytes] = {}  # block -> key

    @classmethod
    def for_model(
        cls, model: CausalLM, budget_bytes: int | None = None, block_tokens: int = DEFAULT_BLOCK_TOKENS
    ) -> PrefixCache:
        """A prefix cache over a new pool sized for ``model``."""
        pool = KVPool(budget_bytes, block_tokens)
        pool.configure(model.config, model.dtype, model.device)
        return cls(pool, namespace=model.name)

    def new_kv(self) -> SequenceKV:
        """An empty cache paged in this cache's pool (which must be configured)."""
        if self.pool.config is None:
            raise ValueError("the pool is not sized for a model yet (KVPool.configure)")
        return SequenceKV(self.pool.config, pool=self.pool)

    @property
    def used_bytes(self) -> int:
        """Bytes of the blocks the cache names (held by sequences or evictable)."""
        return len(self._blocks) * self.pool.block_bytes

    def __len__(self) -> int:
        return len(self._blocks)

    def block_keys(self, token_ids: Sequence[int]) -> list[bytes]:
        """The chained key of every full block of ``token_ids``."""
        ids = np.asarray(token_ids, dtype=np.int64)
        keys = []
        parent = hashlib.sha256(self.namespace.encode()).digest()
        for start in range(0, len(ids) - self.block_tokens + 1, self.block_tokens):
            parent = hashlib.sha256(parent + ids[start : start + self.block_tokens].tobytes()).digest()
            keys.append(parent)
        return keys

    def lookup(self, token_ids: Sequence[int]) -> list[int]:
        """The blocks of the longest cached block-aligned prefix, each retained for the caller
        (who hands them to a cache with ``SequenceKV.adopt`` or releases them)."""
        with self.pool.lock:
            chain = []
            for index, key in enumerate(self.block_keys(token_ids)):
                entry = self._blocks.get(key)
                start = index * self.block_tokens
                if entry is None or entry[1] != tuple(token_ids[start : start + self.block_tokens]):
                    break
                chain.append(entry[0])
            for block in chain:
                self.pool.retain(block)
            self.stats.lookups += 1
            self.stats.queried_tokens += len(token_ids)
            if not chain:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
                self.stats.hit_tokens += len(chain) * self.block_tokens
            return chain

    def insert(self, kv: SequenceKV) -> int:
        """Name the full blocks of a paged ``kv`` not cached yet; returns how many were added."""
        if kv.table is None or kv.table.pool is not self.pool:
            raise ValueError("the prefix cache indexes caches paged in its own pool")
        token_ids = kv.token_ids
        keys = self.block_keys(token_ids)
        with self.pool.lock:
            added = 0
            for index, key in enumerate(keys):
                block = kv.table.blocks[index]
                if key in self._blocks or block in self._keys:
                    continue  # cached already (maybe in another block), or the block has a name
                start = index * self.block_tokens
                self._blocks[key] = (block, tuple(token_ids[start : start + self.block_tokens]))
                self._keys[block] = key
                self.pool.name(block)
                added += 1
            self.stats.inserted_blocks += added
            return added

    def clear(self) -> None:
        """Forget every block (those nobody holds go back to the free list)."""
        with self.pool.lock:
            for block in list(self._keys):
                self.pool.unname(block)
            self._blocks.clear()
            self._keys.clear()

    def _forget(self, block: int) -> None:
        """The pool reused an evictable block: its name goes."""
        key = self._keys.pop(block)
        del self._blocks[key]
        self.stats.evicted_blocks += 1


def prefill_cached(
    model: CausalLM, kv: SequenceKV, token_ids: Sequence[int], cache: PrefixCache | None
) -> tuple[torch.Tensor, int]:
    """Prefill ``token_ids`` into an empty ``kv`` reusing the longest cached prefix.

    Returns the last position's logits and how many prompt tokens came from the cache.
    The last prompt token is always forwarded (its logits are the point of a prefill), and
    the prompt's full blocks are named afterwards so the next request sharing them hits.
    """
    if cache is None or kv.table is None or kv.table.pool is not cache.pool:
        return model.prefill(kv, token_ids), 0
    blocks = cache.lookup(token_ids[:-1])
    cached_len = len(blocks) * cache.block_tokens
    if blocks:
        kv.adopt(blocks, token_ids[:cached_len])
    logits = model.prefill(kv, token_ids[cached_len:])
    cache.insert(kv)
    return logits, cached_len
