"""One forward over the new tokens of several sequences: the batched step's model call.

The first piece of serving many sequences at once (docs/design/batching.md). Every
sequence contributes a chunk (its pending token, a verify chain, a prefill chunk); the
chunks are packed into one row ``[1, T]`` with each token's own position, so every linear
layer sees all T tokens in one matrix product, which is where batching pays on a CPU.
Attention is the one place sequences must not mix: each chunk attends to its own
sequence's cache only, one sequence at a time, through the same kernel call a batch-1
forward makes (``fast_paths.attend_rows``), so no dense mask over all keys is built and
no cache is gathered. KV stays per sequence (``SequenceKV``): appends are views into a
growing buffer and a rollback is a crop, as on the batch-1 path.

How it reaches the attention: transformers' decoder layers call ``cache.update`` and then
the registered attention function with the forward's extra keyword arguments. The cache
given to the model here (``_PackedCache``) writes each chunk's keys and values into its
sequence's cache layer and keeps the sequence's whole keys and values for the attention
function, which finds them under ``PACKED_KWARG``. A placeholder 4D mask passes through
transformers' mask preparation unchanged, so no causal mask over T x T is ever made.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specrag.decoding.fast_paths import PACKED_KWARG, ROW_EXACT_KWARG
from specrag.decoding.kv import SequenceKV
from specrag.decoding.linears import PROMPT_ROWS, PromptRows
from specrag.decoding.model import CausalLM
from specrag.decoding.tree_attention import TreeRows


@dataclass(frozen=True)
class Chunk:
    """New tokens for one sequence, appended after the ``len(kv)`` it already holds."""

    kv: SequenceKV
    token_ids: Sequence[int]
    prompt: bool = False  # prompt rows: attended in aligned blocks (fast_paths.attend_prompt_blocks)
    last_only: bool = False  # only the last row's logits are read (the others skip the LM head)
    tree: TreeRows | None = None  # a draft tree's rows (decoding/tree_attention.py), else a chain

    def positions(self) -> torch.Tensor:
        """Each row's position: after the cache in order, or a tree row's at its depth."""
        if self.tree is not None:
            return torch.tensor([len(self.kv) + depth for depth in self.tree.depths])
        return torch.arange(len(self.kv), len(self.kv) + len(self.token_ids))


class _PackedCache:
    """The ``cache`` a packed forward hands the model: routes each chunk's K/V to its sequence."""

    def __init__(self, chunks: Sequence[Chunk]) -> None:
        self.chunks = chunks
        ends = torch.tensor([len(chunk.token_ids) for chunk in chunks]).cumsum(0).tolist()
        self.bounds = list(zip([0, *ends[:-1]], ends, strict=True))
        self.layer_kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.layer_kv[layer_idx] = [
            chunk.kv.cache.layers[layer_idx].update(key_states[:, :, start:end], value_states[:, :, start:end])
            for chunk, (start, end) in zip(self.chunks, self.bounds, strict=True)
        ]
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are given explicitly; nothing reads this for them


@torch.inference_mode()
def packed_forward(lm: CausalLM, chunks: Sequence[Chunk]) -> list[torch.Tensor]:
    """Append every chunk to its sequence's cache in one forward; returns each chunk's
    logits as float32 ([len(chunk), V], or [1, V] for a ``last_only`` chunk), in the order
    given. Each sequence appears once."""
    if not chunks or any(not chunk.token_ids for chunk in chunks):
        raise ValueError("a packed forward needs at least one chunk, each with a token")
    if len({id(chunk.kv) for chunk in chunks}) != len(chunks):
        raise ValueError("a sequence can contribute one chunk to a packed forward")
    if any(chunk.tree is not None and len(chunk.tree.depths) != len(chunk.token_ids) for chunk in chunks):
        raise ValueError("a tree chunk needs one depth per token")
    device = lm.device
    ids = torch.tensor([[token for chunk in chunks for token in chunk.token_ids]], dtype=torch.long, device=device)
    positions = torch.cat([chunk.positions() for chunk in chunks]).to(device)[None]
    cache = _PackedCache(chunks)
    placeholder = torch.zeros((1, 1, ids.shape[1], 1), dtype=lm.dtype, device=device)  # never read
    exact = {ROW_EXACT_KWARG: True} if lm.row_exact else {}
    kept = [
        range(end - 1, end) if chunk.last_only else range(start, end)
        for chunk, (start, end) in zip(chunks, cache.bounds, strict=True)
    ]
    prompt_rows = None
    if any(chunk.prompt for chunk in chunks):  # row-blocked linears compute them apart
        prompt_rows = PromptRows.of([chunk.prompt for chunk in chunks for _ in chunk.token_ids], device)
    marked = PROMPT_ROWS.set(prompt_rows)
    try:
        output = lm.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=placeholder,
            cache=cache,
            use_cache=True,
            logits_to_keep=torch.tensor([row for rows in kept for row in rows], device=device),
            **{PACKED_KWARG: cache},
            **exact,
        )
    finally:
        PROMPT_ROWS.reset(marked)
    for chunk in chunks:
        chunk.kv.record(chunk.token_ids)
    logits = output.logits[0].float()
    ends = torch.tensor([len(rows) for rows in kept]).cumsum(0).tolist()
    return [logits[end - len(rows) : end] for rows, end in zip(kept, ends, strict=True)]
