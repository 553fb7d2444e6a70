"""Attention for a draft tree's rows, each row seeing the cache and its own ancestors.

A tree verify appends the pending token and the tree's nodes in depth-first preorder
(``decoding/tree.py``). Two ways to attend them, chosen by the model's mode:

- **Row-exact mode** (bf16 and other tie-prone dtypes, ``decoding/batch_invariance.py``):
  one path at a time (``attend_tree``). Each root-to-leaf path's new rows are a contiguous
  run of that order (``path_segments``), and each path is attended by the very call a
  chain verify of that path would make: for the length of the call, the path's ancestors
  and its own rows are written where a chain would hold them, right after the committed
  keys, then the appended rows are put back. A masked key adds exactly 0, but the
  kernel's blocking and vector lanes run over key positions, so one call with a tree mask
  would sum a node's terms in another grouping than the one-token step at its position;
  written the chain's way, a node's row is one row of the chain's call: the same bits.
  The cost is one attention call per leaf and a copy of at most the tree's rows per leaf
  and layer.
- **Otherwise** (float32): one call with a tree mask (``attend_tree_masked``). There a
  chain's own verify rows already differ from one-token steps by rounding (~1e-6, the
  near-tie rule of ``decoding/numerics.py``), so the per-path layout would buy no bit
  equality, only cost: 3.4-5.0 ms a path against 56 ms for a 16-row smollm2 forward on
  the Xeon without bf16, which kept the sizing from growing trees that paid.

Either way the linear layers, which dominate a CPU forward, see every row once, and a
tree's rows in a packed step get the bits they get alone (attention is per sequence).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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

    @functools.cached_property
    def visible(self) -> torch.Tensor:
        """[N+1, N+1] bool: row r sees appended row c (c is r or one of r's ancestors).
        Built once per forward, not per layer (17 rows' worth of indexing in each of
        smollm2's 30 layers cost 6 ms a forward, more than the per-path calls it replaced)."""
        rows = len(self.depths)
        seen = torch.zeros(rows, rows, dtype=torch.bool)
        for segment in self.segments:
            for row in range(segment.start_row, segment.end_row):
                seen[row, segment.ancestor_rows] = True
                seen[row, segment.start_row : row + 1] = True
        return seen


def attend_tree_masked(
    rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tree: TreeRows, scaling: float | None
) -> torch.Tensor:
    """Attention output for a tree chunk's query ``rows`` [B, H, N+1, D] in one call: each
    row sees every cached key and, of the last N+1 keys, its own and its ancestors'."""
    appended, total = rows.shape[2], key.shape[2]
    allowed = torch.ones(appended, total, dtype=torch.bool, device=rows.device)
    allowed[:, total - appended :] = tree.visible.to(rows.device)
    mask = torch.zeros(allowed.shape, dtype=rows.dtype, device=rows.device).masked_fill(~allowed, float("-inf"))
    gqa = key.shape[1] != rows.shape[1]
    return F.scaled_dot_product_attention(rows, key, value, attn_mask=mask[None, None], scale=scaling, enable_gqa=gqa)


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
