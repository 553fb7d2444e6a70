"""One sequence's KV cache for one model, with the token ids it holds.

Rollback is a crop: after a rejection the cache must hold exactly the tokens that were
committed (DESIGN.md, "KV commit/rollback"). Keeping the ids beside the tensors lets the
engine assert that invariant cheaply in debug mode.

transformers' ``DynamicLayer`` appends with ``torch.cat``, copying the whole cache on every
forward; at 4k tokens of context that copy dominated a decode step here. ``GrowableLayer``
writes into a buffer whose capacity doubles, hands out views of the filled part, and crops
by moving the length back, so a step costs O(new tokens) and a rollback O(1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

# Capacities are multiples of this (a multiple of fast_paths.ROW_EXACT_KEY_BUCKET): row-exact
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


def new_cache(config: PretrainedConfig, growable: bool = True) -> DynamicCache:
    """A DynamicCache whose plain full-attention layers are growable (others stay as they are)."""
    cache = DynamicCache(config=config)
    if growable:
        cache.layers = [GrowableLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


class SequenceKV:
    """KV tensors of one sequence plus the ids of the tokens they were computed from."""

    def __init__(self, config: PretrainedConfig, growable: bool = True) -> None:
        self.cache = new_cache(config, growable)
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
        return dropped

    def cached_length(self) -> int:
        """Length the cache tensors themselves report (for invariant checks)."""
        return self.cache.get_seq_length()
