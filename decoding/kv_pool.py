"""Paged KV: one fixed pool of KV blocks per model, shared by every sequence of an engine.

A block holds ``block_tokens`` consecutive positions of one sequence in every layer. A
sequence's cache is a block table (``BlockTable``): the ids of its blocks in position
order. Blocks carry reference counts, so the prefix cache shares a prompt's blocks among
the sequences that start with it instead of copying them (``decoding/prefix_cache.py``),
and a sequence that must write into a block somebody else also holds copies it first
(copy-on-write). Rollback after a rejected draft returns whole blocks past the kept
prefix to the pool.

Memory is bounded by the pool, and a running sequence must never find it full mid-step:
the engine admits a request only when the pool can promise it every block it may need
(``reserve``: its prompt plus ``max_tokens``), and those promises are subtracted from what
``available`` reports to later requests. A block nobody holds but the prefix cache still
names is *evictable*: it counts as available and is reused, least recently used first,
when no free block is left.

Layout: per layer, keys and values are ``[kv_heads, num_blocks, block_tokens, head_dim]``,
so the blocks of a sequence gather (or, when consecutive, slice) into the
``[1, kv_heads, length, head_dim]`` tensor attention reads (``decoding/kv.py``).
The storage is allocated once with ``torch.empty``: pages are only backed by memory as
blocks are written, and the free list hands out the lowest ids first, so a lightly used
pool stays small. A block is zeroed when it is handed out, because row-exact attention
reads (masked) rows past a sequence's end inside its last block, and uninitialised memory
may hold NaN, which a mask does not cancel.
"""

from __future__ import annotations

import heapq
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch
from transformers import PretrainedConfig

DEFAULT_BLOCK_TOKENS = 32  # the prefix cache's and the prompt attention's block (fast_paths.PREFILL_BLOCK)
_MAX_DEFAULT_BYTES = 4 << 30


class KVPoolExhausted(RuntimeError):
    """A block was needed that nobody had reserved and none was available."""


def default_pool_bytes() -> int:
    """``$SPECRAG_KV_CACHE_BYTES``, else a tenth of physical memory, at most 4 GiB (vLLM's
    CPU backend reserves 4 GiB by default)."""
    configured = os.environ.get("SPECRAG_KV_CACHE_BYTES")
    if configured:
        return int(configured)
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        physical = 8 << 30
    return min(_MAX_DEFAULT_BYTES, physical // 10)


def kv_layout(config: PretrainedConfig) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a decoder's cache, read from its config."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads, head_dim


class KVPool:
    """Blocks, reference counts, a free list, reservations and the evictable LRU of one model."""

    def __init__(
        self, budget_bytes: int | None = None, block_tokens: int = DEFAULT_BLOCK_TOKENS, num_blocks: int | None = None
    ) -> None:
        """A pool of ``budget_bytes`` (default ``default_pool_bytes()``), or of exactly
        ``num_blocks`` blocks; sized for a model by ``configure``."""
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.budget_bytes = default_pool_bytes() if budget_bytes is None else budget_bytes
        self.block_tokens = block_tokens
        self._fixed_blocks = num_blocks
        self.num_blocks = 0
        self.block_bytes = 0
        self.unpromised_allocations = 0  # blocks handed out beyond any reservation (debug checks)
        self.reserved = 0  # blocks promised to admitted sequences and not handed out yet
        self.on_evict: Callable[[int], None] | None = None  # the prefix cache forgets the block
        self.lock = threading.RLock()  # an engine is single-threaded; a shared pool need not be
        self._layout: tuple[int, int, int, torch.dtype, torch.device] | None = None
        self.config: PretrainedConfig | None = None
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._refs: list[int] = []
        self._free: list[int] = []  # a heap: the lowest ids first keep the touched memory compact
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refcount 0, named by the prefix cache
        self._named: set[int] = set()  # blocks the prefix cache names (immutable while named)

    # -- set-up ---------------------------------------------------------------------------

    def configure(self, config: PretrainedConfig, dtype: torch.dtype, device: torch.device) -> None:
        """Size the pool for one model (idempotent; a pool serves one model's layout)."""
        layers, heads, head_dim = kv_layout(config)
        layout = (layers, heads, head_dim, dtype, torch.device(device))
        with self.lock:
            if self._layout is not None:
                if self._layout != layout:
                    raise ValueError(f"this KV pool holds {self._layout}, not {layout}: one pool per model")
                return
            element_bytes = torch.empty((), dtype=dtype).element_size()
            block_bytes = 2 * layers * heads * self.block_tokens * head_dim * element_bytes
            self.num_blocks = self._fixed_blocks or self.budget_bytes // block_bytes
            self.budget_bytes, self.block_bytes = self.num_blocks * block_bytes, block_bytes
            if self.num_blocks < 1:
                raise ValueError(f"a KV pool of {self.budget_bytes} bytes holds no block of {block_bytes} bytes")
            shape = (heads, self.num_blocks, self.block_tokens, head_dim)
            self._keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
            self._values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
            self._refs = [0] * self.num_blocks
            self._free = list(range(self.num_blocks))  # sorted: already a heap
            self._layout, self.config = layout, config

    @property
    def configured(self) -> bool:
        return self._layout is not None

    def storage(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s keys and values, [kv_heads, num_blocks, block_tokens, head_dim]."""
        return self._keys[layer], self._values[layer]

    # -- accounting -----------------------------------------------------------------------

    def available(self) -> int:
        """Blocks a new promise may still count on: free or evictable, minus those promised."""
        return len(self._free) + len(self._evictable) - self.reserved

    def used(self) -> int:
        """Blocks some sequence holds (vLLM's kv_cache_usage counts these)."""
        return self.num_blocks - len(self._free) - len(self._evictable)

    def usage(self) -> float:
        """Fraction of the pool held by sequences, 0..1."""
        return self.used() / self.num_blocks if self.num_blocks else 0.0

    def reserve(self, blocks: int) -> bool:
        """Promise ``blocks`` future allocations if the pool can keep the promise."""
        with self.lock:
            if blocks > self.available():
                return False
            self.reserved += blocks
            return True

    def unreserve(self, blocks: int) -> None:
        with self.lock:
            if blocks > self.reserved:
                raise AssertionError(f"unreserving {blocks} blocks of {self.reserved} reserved")
            self.reserved -= blocks

    # -- blocks ---------------------------------------------------------------------------

    def allocate(self, reserved: bool) -> int:
        """A zeroed block with one reference; ``reserved`` spends one promised block."""
        with self.lock:
            if reserved:
                self.unreserve(1)
            elif self.available() < 1:
                raise KVPoolExhausted(f"the KV pool's {self.num_blocks} blocks are all held or promised")
            else:
                self.unpromised_allocations += 1
            if self._free:
                block = heapq.heappop(self._free)
            else:  # the least recently used block only the prefix cache still names
                block, _ = self._evictable.popitem(last=False)
                self._named.discard(block)
                if self.on_evict is not None:
                    self.on_evict(block)
            self._refs[block] = 1
        for keys, values in zip(self._keys, self._values, strict=True):
            keys[:, block].zero_()
            values[:, block].zero_()
        return block

    def retain(self, block: int) -> None:
        with self.lock:
            if self._refs[block] == 0:
                if block not in self._evictable:
                    raise AssertionError(f"block {block} is free; only a named block can be retained at 0")
                del self._evictable[block]
            self._refs[block] += 1

    def release(self, block: int) -> None:
        with self.lock:
            if self._refs[block] < 1:
                raise AssertionError(f"block {block} released more often than held")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._named:
                    self._evictable[block] = None  # most recently used end
                else:
                    heapq.heappush(self._free, block)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def is_shared(self, block: int) -> bool:
        """Another holder, or the prefix cache, may read this block: writes must copy it."""
        return self._refs[block] > 1 or block in self._named

    def name(self, block: int) -> None:
        """The prefix cache names ``block``: it stays readable (evictable) after its last release."""
        with self.lock:
            self._named.add(block)

    def unname(self, block: int) -> None:
        with self.lock:
            self._named.discard(block)
            if block in self._evictable:
                del self._evictable[block]
                heapq.heappush(self._free, block)

    def copy_block(self, source: int, target: int) -> None:
        for keys, values in zip(self._keys, self._values, strict=True):
            keys[:, target].copy_(keys[:, source])
            values[:, target].copy_(values[:, source])

    def check(self, tables: Iterable[list[int]]) -> None:
        """Every block is exactly one of free, evictable or held, and each held block's count
        equals the number of tables holding it (debug mode and the property test)."""
        with self.lock:
            held: dict[int, int] = {}
            for blocks in tables:
                for block in blocks:
                    held[block] = held.get(block, 0) + 1
            free, evictable = set(self._free), set(self._evictable)
            if len(free) != len(self._free) or free & evictable or free & set(held) or evictable & set(held):
                raise AssertionError("a block is in two of free / evictable / held")
            if len(free) + len(evictable) + len(held) != self.num_blocks:
                raise AssertionError(f"{self.num_blocks - len(free) - len(evictable) - len(held)} blocks leaked")
            wrong = {block: (self._refs[block], count) for block, count in held.items() if self._refs[block] != count}
            if wrong or any(self._refs[block] for block in free | evictable):
                raise AssertionError(f"reference counts disagree with the tables: {wrong}")
            if not evictable <= self._named or self.reserved < 0 or self.reserved > len(free) + len(evictable):
                raise AssertionError("an evictable block is unnamed, or the promises exceed the pool")
