"""Prefix KV cache: prompts that share a prefix share its prefill (vLLM's automatic prefix caching).

A token sequence is cut into fixed blocks. Block i's key hashes its tokens together with
block i-1's key, so a key names the whole prefix up to the end of its block and a lookup
walks from the first block until the first miss: the longest cached block-aligned prefix.
Each entry also keeps its tokens and they are compared on a hit, so even a hash collision
could not hand back another prompt's KV.

Segments are immutable: an entry holds its own copy of the block's keys and values for
every layer (one tensor, [layers, 2, kv_heads, block_size, head_dim]), and a hit copies
them into the requesting sequence's cache. Sequences never write into the cache's
tensors, so concurrent requests sharing a prefix cannot corrupt each other; the price is
one memory copy per hit, small next to the prefill it saves.

Eviction is LRU under a byte budget. A lookup or insert touches a chain's blocks from the
last to the first, so the first (shared by the most prompts) are the most recently used
and a chain loses its tail before its head; a chain whose head were evicted would be
unreachable anyway, since every key depends on its parent.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers.cache_utils import DynamicLayer

from decoding.kv import GrowableLayer, SequenceKV

if TYPE_CHECKING:
    from decoding.model import CausalLM

DEFAULT_BLOCK_TOKENS = 32
_MAX_DEFAULT_BYTES = 4 << 30


def default_budget_bytes() -> int:
    """``$SPECRAG_PREFIX_CACHE_BYTES``, else a tenth of physical memory, at most 4 GiB."""
    configured = os.environ.get("SPECRAG_PREFIX_CACHE_BYTES")
    if configured:
        return int(configured)
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        physical = 8 << 30
    return min(_MAX_DEFAULT_BYTES, physical // 10)


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


@dataclass
class _Block:
    tokens: tuple[int, ...]
    kv: torch.Tensor  # [layers, 2, kv_heads, block_tokens, head_dim], never written after insert
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = self.kv.numel() * self.kv.element_size()


class PrefixCache:
    """Block-hashed prefix KV store for one model (``namespace`` keeps models apart)."""

    def __init__(
        self, budget_bytes: int | None = None, block_tokens: int = DEFAULT_BLOCK_TOKENS, namespace: str = ""
    ) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.budget_bytes = default_budget_bytes() if budget_bytes is None else budget_bytes
        self.block_tokens = block_tokens
        self.namespace = namespace
        self.stats = PrefixCacheStats()
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # an engine is single-threaded, a shared cache need not be

    @property
    def used_bytes(self) -> int:
        return self._bytes

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

    def lookup(self, token_ids: Sequence[int]) -> tuple[int, torch.Tensor | None]:
        """Longest cached block-aligned prefix: (its length, its KV [layers, 2, heads, len, dim])."""
        with self._lock:
            chain = []
            for index, key in enumerate(self.block_keys(token_ids)):
                block = self._blocks.get(key)
                start = index * self.block_tokens
                if block is None or block.tokens != tuple(token_ids[start : start + self.block_tokens]):
                    break
                chain.append((key, block))
            self._touch([key for key, _ in chain])
            self.stats.lookups += 1
            self.stats.queried_tokens += len(token_ids)
            if not chain:
                self.stats.misses += 1
                return 0, None
            cached_len = len(chain) * self.block_tokens
            self.stats.hits += 1
            self.stats.hit_tokens += cached_len
            return cached_len, torch.cat([block.kv for _, block in chain], dim=3)

    def insert(self, kv: SequenceKV) -> int:
        """Store the full blocks of ``kv`` not cached yet; returns how many were added."""
        token_ids = kv.token_ids
        keys = self.block_keys(token_ids)
        with self._lock:
            first_new = 0
            while first_new < len(keys) and keys[first_new] in self._blocks:
                first_new += 1
            added = 0
            if first_new < len(keys):
                start, end = first_new * self.block_tokens, len(keys) * self.block_tokens
                stacked = _stack_layers(kv, start, end)
                for offset, key in enumerate(keys[first_new:]):
                    begin = offset * self.block_tokens
                    block_tokens = tuple(token_ids[start + begin : start + begin + self.block_tokens])
                    block = _Block(block_tokens, stacked[:, :, :, begin : begin + self.block_tokens].clone())
                    if not self._make_room(block.nbytes, protected=set(keys)):
                        break  # keep a prefix of the chain rather than evict its head for its tail
                    self._blocks[key] = block
                    self._bytes += block.nbytes
                    added += 1
            self.stats.inserted_blocks += added
            self._touch(keys)
            return added

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._bytes = 0

    def _touch(self, chain_keys: list[bytes]) -> None:
        for key in reversed(chain_keys):  # the head ends most recent: tails are evicted first
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def _make_room(self, nbytes: int, protected: set[bytes]) -> bool:
        if nbytes > self.budget_bytes:
            return False
        while self._bytes + nbytes > self.budget_bytes:
            oldest = next(iter(self._blocks))
            if oldest in protected:
                return False
            self._bytes -= self._blocks.pop(oldest).nbytes
            self.stats.evicted_blocks += 1
        return True


def supports_prefix_cache(kv: SequenceKV) -> bool:
    """Only plain full-attention layers: a sliding window's cache is not a prefix's KV."""
    return all(type(layer) in (DynamicLayer, GrowableLayer) for layer in kv.cache.layers)


def _stack_layers(kv: SequenceKV, start: int, end: int) -> torch.Tensor:
    """Positions [start, end) of every layer as one [layers, 2, heads, end-start, dim] tensor."""
    layers = kv.cache.layers
    return torch.stack([torch.stack((layer.keys[0, :, start:end], layer.values[0, :, start:end])) for layer in layers])


def restore(kv: SequenceKV, token_ids: Sequence[int], segment: torch.Tensor) -> None:
    """Write a cached segment into an empty sequence cache (copies: the segment stays intact)."""
    if len(kv):
        raise ValueError("a prefix can only be restored into an empty cache")
    for layer, layer_kv in zip(kv.cache.layers, segment, strict=True):
        layer.update(layer_kv[0].unsqueeze(0), layer_kv[1].unsqueeze(0))
    kv.record(token_ids[: segment.shape[3]])


def prefill_cached(
    model: CausalLM, kv: SequenceKV, token_ids: Sequence[int], cache: PrefixCache | None
) -> tuple[torch.Tensor, int]:
    """Prefill ``token_ids`` into an empty ``kv`` reusing the longest cached prefix.

    Returns the last position's logits and how many prompt tokens came from the cache.
    The last prompt token is always forwarded (its logits are the point of a prefill), and
    the prompt's full blocks are stored afterwards so the next request sharing them hits.
    """
    if cache is None or not supports_prefix_cache(kv):
        return model.prefill(kv, token_ids), 0
    cached_len, segment = cache.lookup(token_ids[:-1])
    if segment is not None:
        restore(kv, token_ids, segment)
    logits = model.prefill(kv, token_ids[cached_len:])
    cache.insert(kv)
    return logits, cached_len


def prefix_caches_for(
    setting: PrefixCache | bool, target: CausalLM, draft: CausalLM | None
) -> tuple[PrefixCache | None, PrefixCache | None]:
    """``True``: a machine-sized cache for the target and a quarter of that for the draft."""
    if setting is False:
        return None, None
    target_cache = setting if isinstance(setting, PrefixCache) else PrefixCache(namespace=target.name)
    if draft is None:
        return target_cache, None
    return target_cache, PrefixCache(target_cache.budget_bytes // 4, target_cache.block_tokens, namespace=draft.name)
