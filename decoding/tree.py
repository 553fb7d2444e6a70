"""The pure maths of tree speculation (issue 21; plan in docs/design/trees.md).

A draft tree is ``tokens`` and ``parents`` with the nodes in depth-first preorder:
``parents[i]`` is node i's parent, or -1 for a child of the pending token (the root), so
``parents[i] < i``; siblings have distinct tokens and appear best first. The verify forward
has N + 1 rows: row 0 is the pending token, row i + 1 is node i, and ``target_*[r]`` is the
target's next-token distribution after row r's path, so node i is judged at row
``parents[i] + 1``.

Greedy rule: plain greedy commits argmax(target) at every position, so from the root move
to the child whose token is the argmax of the current row, and stop where no child is; the
committed tokens are the accepted path plus the argmax at its last row. A chain reduces to
``acceptance.greedy_accept``.

Sampling rule (deterministic drafts, q one-hot; SpecInfer's multi-draft recursive rejection,
i.e. sampling without replacement): at a row with distribution p, try the children in order;
child x is accepted with probability p(x) / (1 - sum of p over the siblings already tried
and rejected). Rejecting x conditions the committed token on "not x", which is p with x
removed and renormalised, and the next child is judged against that. If every child is
rejected, the token is drawn from p with all tried children removed. Then the committed token
at every visited row is distributed exactly as p, and the accepted path with the final token
is a sample of the target's continuation.

Pure functions over tensors and lists. Randomness only ever comes from the explicit
``torch.Generator`` argument (the engine passes each sequence's own); ``None`` is accepted only
for parity with ``acceptance``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from specrag.decoding.sampling import RESIDUAL_MASS_EPS, on_generator_device

# -- structure ---------------------------------------------------------------------------


def check_tree(tokens: Sequence[int], parents: Sequence[int]) -> None:
    """Raise ValueError unless ``tokens``/``parents`` form a tree in depth-first preorder
    with distinct sibling tokens: the acceptance rules and the attention segments rely on it
    (a repeated sibling would be tried twice; a non-preorder order breaks the segments)."""
    if len(tokens) != len(parents):
        raise ValueError(f"{len(tokens)} tokens but {len(parents)} parents")
    path: list[int] = []  # the nodes from the root to the previous node
    sibling_tokens: dict[int, set[int]] = {}
    for node, (token, parent) in enumerate(zip(tokens, parents, strict=True)):
        if not -1 <= parent < node:
            raise ValueError(f"node {node}: parent {parent} is not in [-1, {node})")
        # In preorder a node's parent is the previous node or one of its ancestors.
        while path and path[-1] != parent:
            path.pop()
        if parent != -1 and not path:
            raise ValueError(f"node {node}: parent {parent} is not on the path to node {node - 1} (not preorder)")
        path.append(node)
        seen = sibling_tokens.setdefault(parent, set())
        if token in seen:
            raise ValueError(f"node {node}: token {token} repeats a sibling's")
        seen.add(token)


def node_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node: 1 for a child of the root (its position is ``len(kv) + depth``)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent == -1 else depths[parent] + 1)
    return depths


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The node indices from the root's child down to ``node`` (empty for -1, the root)."""
    path = []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


def _children_by_row(tokens: Sequence[int], parents: Sequence[int]) -> list[dict[int, int]]:
    """For each row (0: the root, i + 1: node i), its children as {token: node}, in order."""
    children: list[dict[int, int]] = [{} for _ in range(len(parents) + 1)]
    for node, (token, parent) in enumerate(zip(tokens, parents, strict=True)):
        children[parent + 1][token] = node
    return children


# -- attention segments and KV compaction -------------------------------------------------


class Segment(NamedTuple):
    """Rows ``start_row .. end_row - 1`` form a chain (each row's parent is the row before,
    the first one's is ``ancestor_rows[-1]``); ``ancestor_rows`` are the rows above them,
    from row 0 (the pending token) down, empty for the first segment, which starts at row 0."""

    start_row: int
    end_row: int
    ancestor_rows: list[int]


def path_segments(parents: Sequence[int]) -> list[Segment]:
    """Split the forward's rows into the tree's root-to-leaf paths, in preorder.

    In preorder each path's new rows are contiguous (a new path starts right after a leaf),
    so attention can run on each segment as a causal block over its ancestors' rows: every
    row 0..N is in exactly one segment.
    """
    check_tree(range(len(parents)), parents)  # distinct dummy tokens: only the shape matters
    segments: list[Segment] = []
    start, ancestors = 0, list[int]()
    for node, parent in enumerate(parents):
        if parent != node - 1:  # node - 1 is a leaf: this node starts the next path
            segments.append(Segment(start, node + 1, ancestors))
            start, ancestors = node + 1, [0] + [above + 1 for above in path_to(parents, parent)]
    segments.append(Segment(start, len(parents) + 1, ancestors))
    return segments


def compaction_rows(accepted_nodes: Sequence[int]) -> list[int]:
    """The forward rows whose KV is kept after acceptance: the pending token's row and the
    accepted path's rows, in order (they move right after the committed prefix)."""
    return [0] + [node + 1 for node in accepted_nodes]


def _check_rows(tokens: Sequence[int], parents: Sequence[int], rows: int) -> None:
    check_tree(tokens, parents)
    if rows != len(tokens) + 1:
        raise ValueError(f"a tree of {len(tokens)} nodes needs {len(tokens) + 1} target rows, got {rows}")


# -- greedy --------------------------------------------------------------------------------


def greedy_accept_tree(
    tokens: Sequence[int], parents: Sequence[int], target_logits: torch.Tensor
) -> tuple[list[int], list[int]]:
    """Greedy verification of a tree; ``target_logits`` [N + 1, V].

    Returns ``(accepted_nodes, committed)``: the accepted root-to-node path and its tokens
    followed by the target's argmax at the path's last row.
    """
    _check_rows(tokens, parents, target_logits.shape[0])
    choice = target_logits.argmax(dim=-1).tolist()  # one transfer from the device
    children = _children_by_row(tokens, parents)
    accepted: list[int] = []
    row = 0
    while (node := children[row].get(choice[row])) is not None:
        accepted.append(node)
        row = node + 1
    return accepted, [tokens[node] for node in accepted] + [choice[row]]


# -- sampling ------------------------------------------------------------------------------
#
# Whether a child is accepted when tried depends only on p at its parent's row and on the
# siblings before it (reaching it means they were all rejected, so their mass is known), so
# every node gets its acceptance probability and its own uniform up front, and a walk takes
# at each row the first child that would be accepted if tried. Each tried node uses a fresh
# uniform, so the law is that of the sequential rule.


def sample_accept_tree(
    tokens: Sequence[int],
    parents: Sequence[int],
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[list[int], list[int]]:
    """Sampling verification of a tree of deterministic drafts; ``target_probs`` [N + 1, V]
    already transformed (temperature, top-k, top-p, grammar mask) and normalised.

    Returns ``(accepted_nodes, committed)`` as ``greedy_accept_tree`` does. Draws as
    ``sample_accept_tree_batch`` with B = 1 (the same generator gives the same outcome), with
    the walk in Python: one transfer from the device instead of a vectorised walk's kernels.
    """
    _check_rows(tokens, parents, target_probs.shape[0])
    probs = _working_precision(target_probs)
    accepted: list[int] = []
    if tokens:
        accepted_if_tried = _accepted_if_tried(tokens, parents, probs[None], generator)[0].tolist()
        children = _children_by_row(tokens, parents)
        row = 0
        while (node := next((c for c in children[row].values() if accepted_if_tried[c]), None)) is not None:
            accepted.append(node)
            row = node + 1
    stop_row = accepted[-1] + 1 if accepted else 0
    removed = _child_token_mask(tokens, parents, probs.shape[-1], probs.device)[stop_row]
    stop_dist = _fallback_distribution(probs[stop_row][None], removed[None])
    next_token = torch.multinomial(on_generator_device(stop_dist, generator), 1, generator=generator)
    return accepted, [tokens[node] for node in accepted] + [int(next_token)]


def sample_accept_tree_batch(
    tokens: Sequence[int],
    parents: Sequence[int],
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One tree judged against B sets of rows ``target_probs`` [B, N + 1, V] (the statistical
    tests; sequences sharing a draft). Returns ``(last_node [B], next_token [B])``: the last
    accepted node (-1: none) and the token drawn after it; the committed tokens of b are
    ``path_to(parents, last_node[b])``'s tokens then ``next_token[b]``.
    """
    batch, rows, vocab = target_probs.shape
    _check_rows(tokens, parents, rows)
    probs = _working_precision(target_probs)
    device = probs.device
    row = torch.zeros(batch, dtype=torch.long, device=device)
    if tokens:
        row = _walk(parents, _accepted_if_tried(tokens, parents, probs, generator))
    removed = _child_token_mask(tokens, parents, vocab, device)[row]
    stop_dist = _fallback_distribution(probs[torch.arange(batch, device=device), row], removed)
    next_token = torch.multinomial(on_generator_device(stop_dist, generator), 1, generator=generator)
    return row - 1, next_token.to(device).squeeze(-1)


def _working_precision(target_probs: torch.Tensor) -> torch.Tensor:
    """float64 stays float64; half precisions are raised to float32 for the ratios."""
    return target_probs.to(torch.promote_types(target_probs.dtype, torch.float32))


def _accepted_if_tried(
    tokens: Sequence[int], parents: Sequence[int], probs: torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    """[B, N] bool: whether each node would be accepted were it tried, from ``probs``
    [B, N + 1, V] and one uniform per node."""
    device = probs.device
    token_ids = torch.tensor(list(tokens), dtype=torch.long, device=device)
    parent_rows = torch.tensor([parent + 1 for parent in parents], dtype=torch.long, device=device)
    p_child = probs[:, parent_rows, token_ids]  # [B, N]: p(node's token) at its parent's row
    row_mass = probs.sum(dim=-1)[:, parent_rows]
    tried_mass = p_child @ _earlier_siblings(parents, probs.dtype, device)
    accept_prob = _sibling_acceptance(p_child, tried_mass, row_mass)
    draw_device = device if generator is None else generator.device
    uniforms = torch.rand(accept_prob.shape, generator=generator, dtype=probs.dtype, device=draw_device)
    return uniforms.to(device) < accept_prob


def _sibling_acceptance(p_child: torch.Tensor, tried_mass: torch.Tensor, row_mass: torch.Tensor) -> torch.Tensor:
    """P(accept a child | its earlier siblings were rejected) = p(x) / (1 - tried mass).

    The 1 is the row's own mass, so a row that sums to 1 only up to rounding is not biased.
    Where almost nothing remains (the tried siblings held nearly all the mass) the ratio can
    leave [0, 1] by rounding; it is clamped, as reaching that state had about that probability.
    """
    remaining = (row_mass - tried_mass).clamp_min(torch.finfo(p_child.dtype).tiny)
    return (p_child / remaining).clamp(0.0, 1.0)


def _fallback_distribution(p: torch.Tensor, removed: torch.Tensor) -> torch.Tensor:
    """p without the rejected children's tokens (``removed`` [B, V]), renormalised; p itself
    where nothing measurable remains (as ``acceptance._residual_distribution``: the rejections
    that led here had about that probability)."""
    kept = p.masked_fill(removed, 0.0)
    mass = kept.sum(dim=-1, keepdim=True)
    return torch.where(mass <= RESIDUAL_MASS_EPS, p, kept / mass.clamp_min(RESIDUAL_MASS_EPS))


def _earlier_siblings(parents: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[N, N] with 1 at (j, i) when j is a sibling tried before i, so ``p @ it`` is each
    node's tried mass."""
    parent_ids = torch.tensor(list(parents), device=device)
    order = torch.arange(len(parents), device=device)
    earlier = order[:, None] < order[None, :]  # (not torch.triu: slow on bool on the CPU)
    return ((parent_ids[:, None] == parent_ids[None, :]) & earlier).to(dtype)


def _walk(parents: Sequence[int], accepted_if_tried: torch.Tensor) -> torch.Tensor:
    """The row each sequence stops at ([B]): from row 0, move to the first child accepted if
    tried, until a row has none."""
    batch, nodes = accepted_if_tried.shape
    children: list[list[int]] = [[] for _ in range(nodes + 1)]
    for node, parent in enumerate(parents):
        children[parent + 1].append(node)
    width = max(len(kids) for kids in children)
    # Child slots per row, padded with ``nodes``: a column that is never accepted.
    slots = torch.tensor([kids + [nodes] * (width - len(kids)) for kids in children], device=accepted_if_tried.device)
    padded = torch.cat([accepted_if_tried, accepted_if_tried.new_zeros(batch, 1)], dim=1)
    accepted_slots = padded[:, slots]  # [B, N + 1, width]
    first = accepted_slots.to(torch.int8).argmax(dim=-1)  # the first True (argmax takes the first maximum)
    next_row = torch.where(
        accepted_slots.any(dim=-1), slots[torch.arange(nodes + 1, device=slots.device), first] + 1, -1
    )
    row = torch.zeros(batch, dtype=torch.long, device=accepted_if_tried.device)
    batch_index = torch.arange(batch, device=row.device)
    for _ in range(max(node_depths(parents))):
        step = next_row[batch_index, row]
        row = torch.where(step >= 0, step, row)
    return row


def _child_token_mask(tokens: Sequence[int], parents: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[N + 1, V]: True at the tokens of each row's children (all tried when a walk stops)."""
    mask = torch.zeros(len(tokens) + 1, vocab, dtype=torch.bool)
    for token, parent in zip(tokens, parents, strict=True):
        mask[parent + 1, token] = True
    return mask.to(device)
