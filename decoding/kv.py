"""One sequence's KV cache for one model, with the token ids it holds.

Rollback is a crop: after a rejection the cache must hold exactly the tokens that were
committed (docs/design.md, "KV commit/rollback"). Keeping the ids beside the tensors lets the
engine assert that invariant cheaply in debug mode.

transformers' ``DynamicLayer`` appends with ``torch.cat``, copying the whole cache on every
forward; at 4k tokens of context that copy dominated a decode step here. ``GrowableLayer``
writes into a buffer whose capacity doubles, hands out views of the filled part, and crops
by moving the length back, so a step costs O(new tokens) and a rollback O(1).

An engine's sequences keep their KV in a shared pool of blocks instead (``PagedLayer``,
``BlockTable``, ``decoding/kv_pool.py``): bounded memory, prefix blocks shared by
reference, rollback that frees whole blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

from specrag.decoding.fast_paths import ROW_EXACT_KEY_BUCKET
from specrag.decoding.kv_pool import KVPool

# Capacities are multiples of this (a multiple of ROW_EXACT_KEY_BUCKET): row-exact
# attention reads masked padding up to the next bucket from the buffer itself.
_MIN_CAPACITY = 256


class GrowableLayer(DynamicLayer):
    """A full-attention cache layer backed by a doubling buffer."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buffer = key_states.new_empty(0)
        self._value_buffer = value_states.new_empty(0)
        self._length = 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self._length + key_states.shape[-2]
        if end > self._capacity():
            self._grow(key_states, value_states, end)
        self._key_buffer[..., self._length : end, :] = key_states
        self._value_buffer[..., self._length : end, :] = value_states
        self._set_length(end)
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes the negative number of tokens to remove")
        if tokens_to_remove and self.is_initialized:
            self._set_length(self._length + tokens_to_remove)

    def keep_rows(self, start: int, rows: Sequence[int]) -> None:
        """Positions ``start + rows[j]`` move to ``start + j`` and the cache ends after them."""
        if not self.is_initialized:
            return
        index = torch.tensor([start + row for row in rows], dtype=torch.long, device=self._key_buffer.device)
        end = start + len(rows)
        self._key_buffer[..., start:end, :] = self._key_buffer.index_select(-2, index)
        self._value_buffer[..., start:end, :] = self._value_buffer.index_select(-2, index)
        self._set_length(end)

    def _capacity(self) -> int:
        return self._key_buffer.shape[-2] if self._key_buffer.dim() == 4 else 0

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        capacity = -(-max(_MIN_CAPACITY, 2 * needed) // _MIN_CAPACITY) * _MIN_CAPACITY
        # zeros, not empty: the rows past the end are read (masked) by row-exact attention,
        # and uninitialised memory may hold NaN, which a mask does not cancel.
        keys = key_states.new_zeros((*key_states.shape[:-2], capacity, key_states.shape[-1]))
        values = value_states.new_zeros((*value_states.shape[:-2], capacity, value_states.shape[-1]))
        if self._length:
            keys[..., : self._length, :] = self._key_buffer[..., : self._length, :]
            values[..., : self._length, :] = self._value_buffer[..., : self._length, :]
        self._key_buffer, self._value_buffer = keys, values

    def _set_length(self, length: int) -> None:
        self._length = length
        self.keys = self._key_buffer[..., :length, :]
        self.values = self._value_buffer[..., :length, :]


class BlockTable:
    """One sequence's blocks in a ``KVPool``, in position order, and the blocks the pool has
    promised it (``reserved``): a sequence admitted with a reservation never finds the pool
    full, and blocks it frees by rollback go back into its own reservation."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.blocks: list[int] = []
        self.reserved = 0
        self._index: torch.Tensor | None = None
        self._run = False

    def reserve(self, blocks: int) -> bool:
        if not self.pool.reserve(blocks):
            return False
        self.reserved += blocks
        return True

    def adopt(self, blocks: list[int]) -> None:
        """Start the table with blocks another holder shares (already retained: a prefix hit)."""
        if self.blocks:
            raise ValueError("shared blocks can only start an empty table")
        self.blocks = list(blocks)
        self._index = None
        # The table will never allocate these positions: the promise shrinks by as much.
        returned = min(self.reserved, len(blocks))
        self.pool.unreserve(returned)
        self.reserved -= returned

    def prepare_write(self, start: int, end: int) -> None:
        """Make positions [start, end) writable: new blocks past the end, and a private copy
        of any block in the range that is shared (copy-on-write)."""
        size = self.pool.block_tokens
        while len(self.blocks) * size < end:
            self.blocks.append(self._allocate())
            self._index = None
        for slot in range(start // size, -(-end // size)):
            block = self.blocks[slot]
            if self.pool.is_shared(block):
                private = self._allocate()
                self.pool.copy_block(block, private)
                self.pool.release(block)
                self.blocks[slot] = private
                self._index = None

    def truncate(self, length: int) -> None:
        """Keep the blocks positions [0, length) need; the rest go back to the pool and
        into this table's reservation."""
        keep = -(-length // self.pool.block_tokens)
        dropped = self.blocks[keep:]
        if dropped:
            del self.blocks[keep:]
            self._index = None
            with self.pool.lock:
                for block in reversed(dropped):
                    self.pool.release(block)
                # Only blocks nobody else holds came back to the pool: those the promise may count.
                freed = sum(self.pool.refcount(block) == 0 for block in dropped)
                self.pool.reserved += freed
                self.reserved += freed

    def release(self) -> None:
        """Give every block and the unspent promise back (the sequence finished or left)."""
        with self.pool.lock:
            # Last to first: a chain's head (shared by the most prompts) ends the most
            # recently used of the evictable blocks, so a chain loses its tail first; a
            # chain whose head were evicted would be unreachable anyway.
            for block in reversed(self.blocks):
                self.pool.release(block)
            self.pool.unreserve(self.reserved)
        self.blocks, self.reserved, self._index = [], 0, None

    def read_index(self, device: torch.device) -> tuple[torch.Tensor, bool]:
        """The block ids as a tensor, and whether they are consecutive (then a slice reads them)."""
        if self._index is None:
            self._index = torch.tensor(self.blocks, dtype=torch.long, device=device)
            self._run = self.blocks == list(range(self.blocks[0], self.blocks[0] + len(self.blocks)))
        return self._index, self._run

    def _allocate(self) -> int:
        if self.reserved:
            self.reserved -= 1
            return self.pool.allocate(reserved=True)
        return self.pool.allocate(reserved=False)


class PagedLayer(DynamicLayer):
    """A full-attention cache layer whose positions live in a sequence's pool blocks.

    ``update`` writes the new rows into the blocks and returns the sequence's whole keys
    and values: a slice of the pool when its blocks are consecutive, else a gather of
    them. Both hold whole blocks, so row-exact attention finds its masked padding rows
    (up to the next multiple of 32) in the tensor itself, as with ``GrowableLayer``."""

    def __init__(self, table: BlockTable, layer_idx: int) -> None:
        super().__init__()
        self.table = table
        self.layer_idx = layer_idx
        self._length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != 1:
            raise ValueError("a paged cache layer holds one sequence")
        start, end = self._length, self._length + key_states.shape[-2]
        self.table.prepare_write(start, end)
        keys, values = self.table.pool.storage(self.layer_idx)
        size = self.table.pool.block_tokens
        position = start
        while position < end:  # one slice copy per block the new rows touch (usually one)
            block, offset = self.table.blocks[position // size], position % size
            stop = min(end, position - offset + size)
            rows = slice(position - start, stop - start)
            keys[:, block, offset : offset + stop - position] = key_states[0, :, rows]
            values[:, block, offset : offset + stop - position] = value_states[0, :, rows]
            position = stop
        self._length = end
        self.keys, self.values = self._read(keys), self._read(values)
        return self.keys, self.values

    def keep_rows(self, start: int, rows: Sequence[int]) -> None:
        """Positions ``start + rows[j]`` move to ``start + j``; the table frees whole blocks
        past the new end (``SequenceKV.compact``). The rows were written by this sequence's
        last forward, so their blocks are its own (``prepare_write`` made them private)."""
        if not self.is_initialized:
            return
        keys, values = self.table.pool.storage(self.layer_idx)
        kept_keys = self.keys[0, :, [start + row for row in rows]]  # [heads, rows, dim], a copy
        kept_values = self.values[0, :, [start + row for row in rows]]
        size = self.table.pool.block_tokens
        for offset in range(len(rows)):
            position = start + offset
            block, slot = self.table.blocks[position // size], position % size
            keys[:, block, slot] = kept_keys[:, offset]
            values[:, block, slot] = kept_values[:, offset]
        self._length = start + len(rows)
        self.keys, self.values = self._read(keys), self._read(values)

    def _read(self, storage: torch.Tensor) -> torch.Tensor:
        index, consecutive = self.table.read_index(storage.device)
        heads, _, size, head_dim = storage.shape
        count = len(self.table.blocks)
        first = self.table.blocks[0]
        # A slice reaches past the sequence's last block; row-exact attention may read (masked)
        # rows up to the next multiple of its bucket, which must then lie inside that block.
        sliced = consecutive and size % ROW_EXACT_KEY_BUCKET == 0
        whole = storage[:, first : first + count] if sliced else storage.index_select(1, index)
        return whole.view(heads, count * size, head_dim)[None, :, : self._length]

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes the negative number of tokens to remove")
        self._length += tokens_to_remove  # the table frees whole blocks (SequenceKV.crop)

    def restore(self, length: int) -> None:
        """The table was started with ``length`` positions of shared blocks (a prefix hit)."""
        self._length = length
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return self._length


def new_cache(config: PretrainedConfig, growable: bool = True, table: BlockTable | None = None) -> DynamicCache:
    """A DynamicCache whose plain full-attention layers are paged in ``table``'s pool, or
    growable, or transformers' own (others stay as they are)."""
    cache = DynamicCache(config=config)
    if table is not None:
        cache.layers = [PagedLayer(table, index) for index, _ in enumerate(cache.layers)]
    elif growable:
        cache.layers = [GrowableLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def pageable(config: PretrainedConfig) -> bool:
    """Only caches of plain full-attention layers are paged (a sliding window's is not a prefix's KV)."""
    return all(type(layer) is DynamicLayer for layer in DynamicCache(config=config).layers)


class SequenceKV:
    """KV tensors of one sequence plus the ids of the tokens they were computed from."""

    def __init__(self, config: PretrainedConfig, growable: bool = True, pool: KVPool | None = None) -> None:
        self.table = BlockTable(pool) if pool is not None else None
        self.cache = new_cache(config, growable, self.table)
        self.token_ids: list[int] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    def record(self, token_ids: Sequence[int]) -> None:
        """Note that the model has just appended KV for ``token_ids``."""
        self.token_ids.extend(token_ids)

    def crop(self, length: int) -> int:
        """Keep the first ``length`` tokens; returns how many were dropped."""
        if length < 0 or length > len(self.token_ids):
            raise ValueError(f"cannot crop a cache of {len(self.token_ids)} tokens to {length}")
        dropped = len(self.token_ids) - length
        if dropped:
            # transformers 5.x: a negative argument drops that many tokens from the end.
            self.cache.crop(-dropped)
            del self.token_ids[length:]
            if self.table is not None:
                self.table.truncate(length)
        return dropped

    @property
    def compacts(self) -> bool:
        """Whether every layer can keep a tree's accepted rows (``compact``)."""
        return all(hasattr(layer, "keep_rows") for layer in self.cache.layers)

    def compact(self, start: int, rows: Sequence[int]) -> None:
        """After a tree verify: keep the rows ``rows`` (offsets from ``start``, increasing)
        of the tokens appended at ``start``, moved to ``start, start + 1, ...``, and drop the
        rest. When the kept rows already lead (a chain, or the tree's first path) this is a
        crop."""
        if list(rows) != sorted(set(rows)) or (rows and (rows[0] < 0 or start + rows[-1] >= len(self))):
            raise ValueError(f"rows to keep must increase within the appended tokens, got {list(rows)}")
        if list(rows) == list(range(len(rows))):
            self.crop(start + len(rows))
            return
        with torch.inference_mode():  # the caches are inference tensors, written in place
            for layer in self.cache.layers:
                layer.keep_rows(start, rows)
        self.token_ids[start:] = [self.token_ids[start + row] for row in rows]
        if self.table is not None:
            self.table.truncate(len(self.token_ids))

    def discard_unrecorded(self) -> None:
        """After a forward that raised part-way: drop the rows some layers appended for
        tokens that were never recorded, so the cache holds its tokens again."""
        length = len(self.token_ids)
        for layer in self.cache.layers:
            extra = layer.get_seq_length() - length
            if extra > 0:
                layer.crop(-extra)
        if self.table is not None:
            self.table.truncate(length)

    def adopt(self, blocks: list[int], token_ids: Sequence[int]) -> None:
        """Start an empty paged cache with shared blocks holding ``token_ids`` (a prefix hit)."""
        if self.table is None or len(self):
            raise ValueError("only an empty paged cache adopts shared blocks")
        self.table.adopt(blocks)
        for layer in self.cache.layers:
            layer.restore(len(token_ids))
        self.token_ids = list(token_ids)

    def release(self) -> None:
        """Return a paged cache's blocks to the pool; the cache is empty afterwards."""
        if self.table is not None:
            self.table.release()
            for layer in self.cache.layers:
                layer.restore(0)
        self.token_ids = []

    def cached_length(self) -> int:
        """Length the cache tensors themselves report (for invariant checks)."""
        return self.cache.get_seq_length()
