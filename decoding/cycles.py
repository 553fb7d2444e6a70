"""What one decode cycle does to a sequence: a plain step or a draft-verify-accept step.

The engine (``decoding/engine.py``) decides which cycle a sequence runs and with which
draft; these generators do it. Each yields the one target forward it needs
(``ForwardNeed``, answered alone or packed by ``decoding/step_driver.py``) with its rows'
grammar mask and logits processors, is sent its rows processed and masked, and returns the
tokens it committed. ``observe`` hears each forward's token count
and start time (the engine's cost model, around the maths, never inside it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from decoding import policy as policies
from decoding.acceptance import accept_draft
from decoding.drafters import Draft
from decoding.request import apply_processors
from decoding.sampling import select_token
from decoding.sequence import SequenceState
from decoding.step_driver import Cycle, ForwardNeed, RowProcessor

ForwardObserver = Callable[[int, float], None]  # (tokens forwarded, perf_counter at the start)


def plain_step(seq: SequenceState, observe: ForwardObserver, off_reason: str | None) -> Cycle:
    """One token: forward the pending token (its row processed and masked by the step), select, commit."""
    bitmask = next_mask(seq)
    with seq.stats.timed("decode"):
        start = time.perf_counter()
        need = ForwardNeed(seq.kv, seq.tokens[-1:], last_only=True, prepare=row_processor(seq), bitmask=bitmask)
        logits = (yield need)[-1]
        observe(1, start)
    token = select_token(logits, seq.request.sampling, seq.generator)
    grammar_accept(seq, token)
    seq.stats.target_calls += 1
    seq.stats.record_plain(off_reason)
    for drafter in seq.drafters:
        drafter.on_commit([token], 0)
    return seq.commit([token])


def speculative_step(seq: SequenceState, observe: ForwardObserver, draft: Draft) -> Cycle:
    """Verify ``draft`` in one target forward, accept a prefix, roll the rest back."""
    bitmask = None
    if seq.grammar is not None:  # candidates after the first ungrammatical one are never verified
        with seq.stats.timed("grammar"):
            valid_len, bitmask = seq.grammar.advance_chain(draft.tokens)
        draft = draft.truncated(valid_len)
        if not draft.tokens:
            return (yield from plain_step(seq, observe, policies.GRAMMAR_REJECTED))
    kept_before = len(seq.kv)
    with seq.stats.timed("verify"):
        start = time.perf_counter()
        need = ForwardNeed(
            seq.kv, [seq.tokens[-1], *draft.tokens], prepare=row_processor(seq, draft.tokens), bitmask=bitmask
        )
        target_logits = yield need
        observe(len(draft.tokens) + 1, start)
    seq.stats.target_calls += 1
    with seq.stats.timed("accept"):
        accepted_len, committed = accept_draft(draft, target_logits, seq.request.sampling, seq.generator)
    if seq.grammar is not None:
        with seq.stats.timed("grammar"):
            seq.grammar.settle(len(draft.tokens), committed)
    with seq.stats.timed("rollback"):
        # Keep the pending token and the accepted drafts; drop the rejected suffix.
        seq.kv.crop(kept_before + 1 + accepted_len)
        for drafter in seq.drafters:  # a drafter that did not propose has nothing to undo
            drafter.on_commit(committed, accepted_len)
    seq.policy.observe(draft.source, len(draft.tokens), accepted_len, draft.match_ngram)
    seq.stats.record_verify(len(draft.tokens), accepted_len, draft.source)
    return seq.commit(committed)


def row_processor(seq: SequenceState, drafts: Sequence[int] = ()) -> RowProcessor | None:
    """The request's logits processors over a forward's rows: row i follows the committed
    tokens and the first i drafts (None: the request has none)."""
    processors = seq.request.logits_processors
    if not processors:
        return None

    def process(rows: torch.Tensor) -> torch.Tensor:
        return torch.stack(
            [apply_processors(processors, [*seq.tokens, *drafts[:i]], row) for i, row in enumerate(rows)]
        )

    return process


def next_mask(seq: SequenceState) -> torch.Tensor | None:
    """The grammar's mask [1, ceil(V/32)] for the token after the committed ones, if any."""
    if seq.grammar is None:
        return None
    with seq.stats.timed("grammar"):
        return seq.grammar.next_bitmask()


def grammar_accept(seq: SequenceState, token: int) -> None:
    if seq.grammar is not None:
        with seq.stats.timed("grammar"):
            seq.grammar.accept(token)
