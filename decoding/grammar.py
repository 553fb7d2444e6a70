"""Grammar state of one sequence inside the speculative loop (xgrammar).

The rule that keeps constrained speculation exact: the mask at a candidate position is
the grammar's mask after the committed tokens *and the earlier candidates*, and it is
applied identically to the target's p and the draft's q before acceptance (so residual
sampling runs on the masked, renormalised distributions). A chain is advanced through
the matcher until the first candidate the grammar rejects; that candidate and the rest
are never verified. After acceptance the matcher is rolled back by exactly the number
of candidates it accepted but the target did not, then it accepts the corrected or bonus
token, which the mask has made grammatical.

Cutting the chain at the first ungrammatical candidate is exact only because that
candidate had q = 0 under the masked q (a model drafter's q is masked along its own
proposal) or q was one-hot (prompt lookup): either way the full rule would have rejected
it with certainty and drawn the next token from p itself. With an unmasked q the cut
would bias sampling; tests/test_engine_sampling.py plants exactly that and catches it.

Grammar-forced continuations (keys, braces, quotes; the stop token once the grammar is
complete) are proposed as free drafts with q = 1 by ``GrammarForcedDrafter``; the target
verifies them in the same forward as any other draft.

xgrammar 0.2.9 facts this relies on: a rejected ``accept_token`` returns False and
changes nothing; ``fork()`` (not ``copy``) gives an independent matcher; the matcher
terminates when it accepts a stop token and then accepts nothing more.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch
import xgrammar as xgr

from specrag.decoding.cut_words import pour_cut_words
from specrag.decoding.drafters.base import Draft, FreeDrafter

FORCED_SOURCE = "grammar"
_BITS = torch.arange(32, dtype=torch.int32)


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar and the canonical key it was compiled from (for caching).

    ``encode`` is the vocabulary's own tokenizer (text to ids, no special tokens): forced
    text is proposed as the model itself would spell it, which xgrammar's greedy
    longest-token split often is not (``{"`` is one token to the model, two to the split).
    """

    compiled: xgr.CompiledGrammar
    key: str
    encode: Callable[[str], list[int]] | None = field(default=None, compare=False, repr=False)
    # The vocabulary's word-prefix table: a cut word's probability goes to its allowed part
    # (decoding/cut_words.py); None masks alone.
    word_prefixes: torch.Tensor | None = field(default=None, compare=False, repr=False)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpack xgrammar's int32 bitmask rows [R, ceil(V/32)] to booleans [R, V]."""
    bits = (bitmask.unsqueeze(-1) >> _BITS.to(bitmask.device)) & 1
    return bits.flatten(-2)[..., :vocab_size].bool()


def pack_allowed(allowed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``allowed_tokens``: booleans [R, V] to an int32 bitmask [R, ceil(V/32)]."""
    rows, vocab_size = allowed.shape
    padded = torch.zeros(rows, -(-vocab_size // 32) * 32, dtype=torch.int64)
    padded[:, :vocab_size] = allowed.long()
    words = (padded.reshape(rows, padded.shape[1] // 32, 32) << _BITS.long()).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Logits with every token the grammar forbids set to -inf (any float dtype).

    Masking logits before the sampling transform is masking p and renormalising, and it
    is done the same way for the target's rows and the draft's rows.
    """
    allowed = allowed_tokens(bitmask.to(logits.device), logits.shape[-1])  # xgrammar fills a CPU mask
    return logits.masked_fill(~allowed.reshape(logits.shape), float("-inf"))


class GrammarState:
    """One xgrammar matcher following one sequence's committed output tokens."""

    def __init__(self, grammar: Grammar, stop_ids: Collection[int], vocab_size: int) -> None:
        self.grammar = grammar
        self.vocab_size = vocab_size
        # No stop ids (a request that never stops early): keep the vocabulary's own, if any.
        self._matcher = xgr.GrammarMatcher(grammar.compiled, override_stop_tokens=sorted(stop_ids) or None)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.committed_len = 0  # output tokens the matcher has accepted for good

    # -- queries ------------------------------------------------------------------------

    def is_completed(self) -> bool:
        return self._matcher.is_completed()

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def next_bitmask(self) -> torch.Tensor:
        """The mask [1, ceil(V/32)] for the next token after the committed ones."""
        return self._fill(self._matcher, 0, rows=1)[:1].clone()

    def forced_tokens(self, max_tokens: int) -> list[int]:
        """Tokens the grammar alone determines from here: the jump-forward tokens, or the
        single token the mask allows (the stop token of a complete JSON value)."""
        if self._matcher.is_terminated() or max_tokens <= 0:
            return []
        if self.grammar.encode is not None:
            text = self._matcher.find_jump_forward_string()
            # The last token may merge with what follows the forced text: leave it out.
            spelled = self.grammar.encode(text)[:-1] if text else []
            if spelled:
                return spelled[:max_tokens]
        forced = self._matcher.find_jump_forward_tokens()[:max_tokens]
        if forced:
            return forced
        allowed = allowed_tokens(self.next_bitmask(), self.vocab_size)[0].nonzero().flatten()
        return [int(allowed[0])] if len(allowed) == 1 else []

    # -- the speculative cycle ----------------------------------------------------------

    def advance_chain(self, candidates: Sequence[int]) -> tuple[int, torch.Tensor]:
        """Advance through the candidates until the grammar rejects one.

        Returns (valid_len, bitmask[valid_len + 1]): row i is the mask before candidate i,
        row valid_len the mask for the bonus position. The matcher is left ``valid_len``
        tokens ahead; ``settle`` brings it back to the committed tokens.
        """
        bitmask = self._ensure_rows(len(candidates) + 1)
        valid_len = 0
        for position, token in enumerate(candidates):
            if self._matcher.is_terminated():  # check first: a terminated matcher has no mask
                break
            self._fill(self._matcher, position, rows=len(candidates) + 1)
            if not self._matcher.accept_token(int(token)):
                break
            valid_len += 1
        if self._matcher.is_terminated():
            # A stop candidate ends the chain; nothing after it is ever committed, so the
            # bonus row only has to stay a valid distribution: allow everything.
            bitmask[valid_len].fill_(-1)
        else:
            self._fill(self._matcher, valid_len, rows=len(candidates) + 1)
        return valid_len, bitmask[: valid_len + 1].clone()

    def advance_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> tuple[list[int], torch.Tensor]:
        """A draft tree's nodes the grammar allows on their own paths, and their rows' masks.

        Each node is tried on a fork of its parent's matcher (the committed matcher for a
        root), so siblings never see each other; a node the grammar rejects, or one after a
        stop token, is dropped with its subtree. Returns (kept: the surviving nodes in
        preorder, bitmask[len(kept) + 1]: row 0 the mask after the committed tokens, row
        j + 1 the mask after kept node j's path). The committed matcher is not advanced:
        ``follow`` does that once the path is accepted.
        """
        bitmask = self._ensure_rows(len(tokens) + 1)
        if self._matcher.is_terminated():  # the output has ended: nothing to verify
            bitmask[0].fill_(-1)
            return [], bitmask[:1].clone()
        self._fill(self._matcher, 0, rows=len(tokens) + 1)
        forks: dict[int, xgr.GrammarMatcher] = {}
        kept: list[int] = []
        for node, (token, parent) in enumerate(zip(tokens, parents, strict=True)):
            base = self._matcher if parent < 0 else forks.get(parent)
            if base is None or base.is_terminated():  # its parent was dropped, or ended the output
                continue
            fork = base.fork()
            if not fork.accept_token(int(token)):
                continue
            forks[node] = fork
            kept.append(node)
            if fork.is_terminated():  # as for a chain: nothing after a stop is committed
                bitmask[len(kept)].fill_(-1)
            else:
                self._fill(fork, len(kept), rows=len(tokens) + 1)
        return kept, bitmask[: len(kept) + 1].clone()

    def follow(self, committed: Sequence[int]) -> None:
        """After a tree's acceptance (only forks were advanced): accept the committed
        tokens, the accepted path and the target's token, up to a stop token."""
        for token in committed:
            if self._matcher.is_terminated():
                break
            self.accept(token)

    def settle(self, advanced: int, committed: Sequence[int]) -> None:
        """After acceptance: undo the candidates that were not committed, then accept the
        corrected or bonus token (the last of ``committed``)."""
        accepted_len = len(committed) - 1
        if advanced - accepted_len:
            self._matcher.rollback(advanced - accepted_len)
        self.committed_len += accepted_len
        if not self._matcher.is_terminated():  # else a stop token ended the output already
            self.accept(committed[-1])

    def accept(self, token: int) -> None:
        """Commit one token chosen under this grammar's mask."""
        if not self._matcher.accept_token(int(token)):
            raise AssertionError(f"grammar {self.grammar.key[:60]!r} rejected committed token {token}")
        self.committed_len += 1

    def rewind_to(self, output_len: int) -> None:
        """Forget the tokens after the first ``output_len`` (a stop cut the commit short)."""
        ahead = self.committed_len - output_len
        if ahead > 0:
            self._matcher.rollback(ahead)
            self.committed_len = output_len

    def draft_processor(self, prompt_len: int) -> _DraftMask:
        """A logits processor that masks a draft model's q along its own proposal."""
        return _DraftMask(self, prompt_len)

    # -- internals ----------------------------------------------------------------------

    def _ensure_rows(self, rows: int) -> torch.Tensor:
        if self._bitmask.shape[0] < rows:
            self._bitmask = xgr.allocate_token_bitmask(rows, self.vocab_size)
        return self._bitmask

    def _fill(self, matcher: xgr.GrammarMatcher, row: int, rows: int) -> torch.Tensor:
        bitmask = self._ensure_rows(rows)
        matcher.fill_next_token_bitmask(bitmask, row)
        return bitmask


class _DraftMask:
    """Masks a draft model's logits position by position during one proposal.

    The draft model calls it with the committed tokens plus the drafts so far; at the
    first position of a proposal it forks the sequence's matcher, and it advances the
    fork by each draft token, so q is masked exactly as the target's row will be.
    """

    def __init__(self, state: GrammarState, prompt_len: int) -> None:
        self._state = state
        self._prompt_len = prompt_len
        self._fork: xgr.GrammarMatcher | None = None
        self._bitmask = xgr.allocate_token_bitmask(1, state.vocab_size)

    def __call__(self, prefix: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        drafted = len(prefix) - self._prompt_len - self._state.committed_len
        if drafted == 0 or self._fork is None:
            self._fork = self._state._matcher.fork()
        elif not self._fork.is_terminated() and not self._fork.accept_token(int(prefix[-1])):
            raise AssertionError("a masked draft token was rejected by the grammar")
        if self._fork.is_terminated():
            # The draft proposed a stop token; later drafts are cut before verification.
            return logits
        self._fork.fill_next_token_bitmask(self._bitmask, 0)
        table = self._state.grammar.word_prefixes
        if table is not None:  # q is transformed as the target's rows are (step_driver.prepared)
            logits = pour_cut_words(logits.unsqueeze(0), self._bitmask, table)[0]
        return mask_logits(logits, self._bitmask[0])


class GrammarForcedDrafter(FreeDrafter):
    """Proposes what the grammar forces (q = 1): free drafts the target verifies."""

    def __init__(self, state: GrammarState) -> None:
        self.state = state

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft:
        return Draft(self.state.forced_tokens(max_tokens), None, FORCED_SOURCE)

    def on_commit(self, committed: Sequence[int], accepted_len: int) -> None:
        pass  # the engine advances the grammar state itself
