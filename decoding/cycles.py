"""What one decode cycle does to a sequence: verify a draft, accept a prefix, commit.

A plain step is the γ = 0 case of the same cycle: the forward over the pending token
alone, the acceptance rule reduced to choosing from the target's row, nothing to roll back.

The engine (``decoding/engine.py``) decides which cycle a sequence runs and with which
draft; these generators do it. Each yields the one target forward it needs
(``ForwardNeed``, answered alone or packed by ``decoding/step_driver.py``) with its rows'
grammar mask and logits processors, is sent its rows processed and masked, and returns the
tokens it committed. ``observe`` hears each forward's token count, start time and number
of paths (the engine's cost model, around the maths, never inside it).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from specrag.decoding import policy as policies
from specrag.decoding.acceptance import accept_draft
from specrag.decoding.drafters import Draft
from specrag.decoding.request import apply_processors
from specrag.decoding.sampling import SamplingParams, probs_from_logits
from specrag.decoding.sequence import SequenceState
from specrag.decoding.step_driver import Cycle, ForwardNeed, RowProcessor
from specrag.decoding.tree import compaction_rows, greedy_accept_tree, path_to, sample_accept_tree
from specrag.decoding.tree_attention import TreeRows
from specrag.decoding.tree_sizing import observe_tree

# (tokens forwarded, perf_counter at the start, root-to-leaf paths: 1 for a chain)
ForwardObserver = Callable[[int, float, int], None]


def no_draft() -> Draft:
    """The draft of a plain step."""
    return Draft([], None, policies.NO_PROPOSAL)


def decode_cycle(seq: SequenceState, observe: ForwardObserver, draft: Draft, off_reason: str | None = None) -> Cycle:
    """Verify ``draft`` in one target forward over the pending token and its γ tokens (a
    chain, or a tree's nodes), accept a prefix (a path), roll the rest back, commit. γ = 0
    is a plain step; ``off_reason`` says why nothing was drafted."""
    bitmask = None
    if seq.grammar is not None:  # ungrammatical candidates (and what follows them) are never verified
        with seq.stats.timed("grammar"):
            if draft.parents is None:
                valid_len, bitmask = seq.grammar.advance_chain(draft.tokens)
                kept_draft = draft.truncated(valid_len)
            else:
                kept, bitmask = seq.grammar.advance_tree(draft.tokens, draft.parents)
                kept_draft = draft.subtree(kept)
        if draft.tokens and not kept_draft.tokens:
            off_reason = policies.GRAMMAR_REJECTED
        draft = kept_draft
    gamma = len(draft.tokens)
    kept_before = len(seq.kv)
    tree = TreeRows.of(draft.parents) if draft.parents is not None else None
    with seq.stats.timed("verify" if gamma else "decode"):
        start = time.perf_counter()
        rows = [seq.tokens[-1], *draft.tokens]
        need = ForwardNeed(
            seq.kv,
            rows,
            prepare=row_processor(seq, draft),
            bitmask=bitmask,
            word_prefixes=word_prefixes(seq),
            tree=tree,
        )
        target_logits = yield need
        observe(gamma + 1, start, len(tree.segments) if tree is not None else 1)
    seq.stats.target_calls += 1
    with seq.stats.timed("accept"):
        accepted_nodes, committed = _accept(draft, target_logits, seq.request.sampling, seq.generator)
    accepted_len = len(accepted_nodes)
    if seq.grammar is not None:
        with seq.stats.timed("grammar"):
            if draft.parents is None:
                seq.grammar.settle(len(draft.tokens), committed)
            else:
                seq.grammar.follow(committed)
    with seq.stats.timed("rollback"):
        # Keep the pending token and the accepted drafts; drop the rejected ones.
        seq.kv.compact(kept_before, compaction_rows(accepted_nodes))
        for drafter in seq.drafters:  # a drafter that did not propose has nothing to undo
            drafter.on_commit(committed, accepted_len)
    if draft.parents is not None:
        observe_tree(seq.policy, draft, accepted_nodes)
        sources = draft.node_sources or [draft.source] * gamma
        seq.stats.record_verify(gamma, accepted_len, draft.source, [sources[node] for node in accepted_nodes])
        seq.stats.tree_cycles += 1
        seq.stats.branch_accepted_tokens += sum(node >= len(draft.first_path().tokens) for node in accepted_nodes)
    elif gamma:  # a plain step says nothing about any drafter's acceptance
        seq.policy.observe(draft.source, gamma, accepted_len, draft.match_ngram)
        seq.stats.record_verify(gamma, accepted_len, draft.source)
    else:
        seq.stats.record_plain(off_reason)
    return seq.commit(committed)


def _accept(
    draft: Draft, target_logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator
) -> tuple[list[int], list[int]]:
    """The accepted drafts (their indices: a chain's prefix, a tree's path) and the
    committed tokens, by the rule the sampling parameters call for."""
    if draft.parents is None:
        accepted_len, committed = accept_draft(draft, target_logits, sampling, generator)
        return list(range(accepted_len)), committed
    if sampling.greedy:
        return greedy_accept_tree(draft.tokens, draft.parents, target_logits)
    return sample_accept_tree(draft.tokens, draft.parents, probs_from_logits(target_logits, sampling), generator)


def row_processor(seq: SequenceState, draft: Draft | None = None) -> RowProcessor | None:
    """The request's logits processors over a forward's rows: row i follows the committed
    tokens and the drafts on its path (a chain's first i; None: the request has none)."""
    processors = seq.request.logits_processors
    if not processors:
        return None
    paths = _row_paths(draft) if draft is not None else [[]]

    def process(rows: torch.Tensor) -> torch.Tensor:
        return torch.stack([apply_processors(processors, [*seq.tokens, *paths[i]], row) for i, row in enumerate(rows)])

    return process


def _row_paths(draft: Draft) -> list[list[int]]:
    """The draft tokens each verify row follows: row 0 none, row i + 1 node i's path."""
    if draft.parents is None:
        return [draft.tokens[:row] for row in range(len(draft.tokens) + 1)]
    return [[], *([draft.tokens[node] for node in path_to(draft.parents, index)] for index in range(len(draft.tokens)))]


def next_mask(seq: SequenceState) -> torch.Tensor | None:
    """The grammar's mask [1, ceil(V/32)] for the token after the committed ones, if any."""
    if seq.grammar is None:
        return None
    with seq.stats.timed("grammar"):
        return seq.grammar.next_bitmask()


def word_prefixes(seq: SequenceState) -> torch.Tensor | None:
    """The table that pours a cut word into its allowed part, where the grammar has one."""
    return seq.grammar.grammar.word_prefixes if seq.grammar is not None else None


def grammar_accept(seq: SequenceState, token: int) -> None:
    if seq.grammar is not None:
        with seq.stats.timed("grammar"):
            seq.grammar.accept(token)
