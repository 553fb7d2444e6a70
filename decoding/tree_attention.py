"""Attention for a draft tree's rows, each row seeing the cache and its own ancestors.

A tree verify appends the pending token and the tree's nodes in depth-first preorder
(``decoding/tree.py``). Each root-to-leaf path's new rows are a contiguous run of that
order (``path_segments``), so the tree is attended one path at a time, and each path by
the very call a chain verify of that path would make: for the length of the call, the
path's ancestors and its own rows are written where a chain would hold them, right after
the committed keys, then the appended rows are put back. No mask with holes is ever made.

Why not one call with a tree mask: a masked key adds exactly 0, but the kernel's blocking
and vector lanes run over key positions, so a node whose ancestors sit apart would sum
its terms in another grouping than the one-token step at its position; in row-exact mode
(``decoding/batch_invariance.py``) that breaks bit equality with plain decoding. Written
the chain's way, a node's row is one row of the chain's call: the same bits.

The cost is one attention call per leaf and a copy of at most the tree's rows per leaf
and layer; the linear layers, which dominate a CPU forward, see every row once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specrag.decoding.tree import Segment, node_depths, path_segments

# (query rows of one chain, its keys, its values) -> attention output, the chain's own call
ChainAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TreeRows:
    """What a packed forward needs of a tree chunk: each row's depth (its position after
    the cache is ``len(kv) + depth``; the pending token's is 0) and the path segments."""

    depths: tuple[int, ...]
    segments: tuple[Segment, ...]

    @classmethod
    def of(cls, parents: Sequence[int]) -> TreeRows:
        return cls((0, *node_depths(parents)), tuple(path_segments(parents)))


def attend_tree(
    rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tree: TreeRows, attend_chain: ChainAttention
) -> torch.Tensor:
    """Attention output for a tree chunk's query ``rows`` [B, H, N+1, D], whose keys and
    values are the last N+1 positions of ``key``/``value`` [B, KV, L, D], in row order.

    ``key`` and ``value`` are written in place for the duration of the call (they are the
    sequence's cache, or a gathered copy of it) and hold the appended rows again on return.
    """
    appended = rows.shape[2]
    base = key.shape[2] - appended
    fresh_keys = key[:, :, base:].clone()
    fresh_values = value[:, :, base:].clone()
    outputs = []
    moved = False
    try:
        for segment in tree.segments:
            order = [*segment.ancestor_rows, *range(segment.start_row, segment.end_row)]
            width = len(order)
            if order != list(range(width)):  # lay the path out as a chain would hold it
                index = torch.tensor(order, dtype=torch.long, device=key.device)
                key[:, :, base : base + width] = fresh_keys.index_select(2, index)
                value[:, :, base : base + width] = fresh_values.index_select(2, index)
                moved = True
            outputs.append(
                attend_chain(
                    rows[:, :, segment.start_row : segment.end_row],
                    key[:, :, : base + width],
                    value[:, :, : base + width],
                )
            )
    finally:
        if moved:
            key[:, :, base:] = fresh_keys
            value[:, :, base:] = fresh_values
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
