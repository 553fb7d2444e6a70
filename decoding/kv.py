"""One sequence's KV cache for one model, with the token ids it holds.

Rollback is a crop: after a rejection the cache must hold exactly the tokens that were
committed (DESIGN.md, "KV commit/rollback"). Keeping the ids beside the tensors lets the
engine assert that invariant cheaply in debug mode.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import DynamicCache, PretrainedConfig


class SequenceKV:
    """KV tensors of one sequence plus the ids of the tokens they were computed from."""

    def __init__(self, config: PretrainedConfig) -> None:
        self.cache = DynamicCache(config=config)
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
