"""What one decode cycle does to a sequence: verify a draft, accept a prefix, commit.

A plain step is the γ = 0 case of the same cycle: the forward over the pending token
alone, the acceptance rule reduced to choosing from the target's row, nothing to roll back.

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

from specrag.decoding import policy as policies
from specrag.decoding.acceptance import accept_draft
from specrag.decoding.drafters import Draft
from specrag.decoding.request import apply_processors
from specrag.decoding.sequence import SequenceState
from specrag.decoding.step_driver import Cycle, ForwardNeed, RowProcessor

ForwardObserver = Callable[[int, float], None]  # (tokens forwarded, perf_counter at the start)


def no_draft() -> Draft:
    """The draft of a plain step."""
    return Draft([], None, policies.NO_PROPOSAL)


def decode_cycle(seq: SequenceState, observe: ForwardObserver, draft: Draft, off_reason: str | None = None) -> Cycle:
    """Verify ``draft`` in one target forward over the pending token and its γ tokens,
    accept a prefix, roll the rest back, commit. γ = 0 is a plain step; ``off_reason``
    says why nothing was drafted."""
    bitmask = None
    if seq.grammar is not None:  # candidates after the first ungrammatical one are never verified
        with seq.stats.timed("grammar"):
            valid_len, bitmask = seq.grammar.advance_chain(draft.tokens)
        if draft.tokens and not valid_len:
            off_reason = policies.GRAMMAR_REJECTED
        draft = draft.truncated(valid_len)
    gamma = len(draft.tokens)
    kept_before = len(seq.kv)
    with seq.stats.timed("verify" if gamma else "decode"):
        start = time.perf_counter()
        rows = [seq.tokens[-1], *draft.tokens]
        need = ForwardNeed(seq.kv, rows, prepare=row_processor(seq, draft.tokens), bitmask=bitmask)
        target_logits = yield need
        observe(gamma + 1, start)
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
    if gamma:  # a plain step says nothing about any drafter's acceptance
        seq.policy.observe(draft.source, gamma, accepted_len, draft.match_ngram)
        seq.stats.record_verify(gamma, accepted_len, draft.source)
    else:
        seq.stats.record_plain(off_reason)
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
