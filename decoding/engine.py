"""The decoding engine: many sequences, one ``step()`` that advances each by one cycle.

A cycle is a prefill (the first), a plain decode step, or a draft-verify-accept cycle.
State of a sequence between cycles: its target KV cache holds every committed token but
the newest (the *pending* token), whose KV is computed by the next forward together
with that cycle's candidates. So a verify forward is ``[pending, d1..dγ]`` and yields
the γ+1 rows the acceptance rule needs, and a plain step is ``[pending]``: both paths
run the same model calls, and ``speculation="off"`` is the baseline through this code.

Invariant checked after every cycle in debug mode: target cache == committed tokens
minus the pending one; a model drafter's cache holds a prefix of the committed tokens,
and it ingests the rest (the corrected or bonus token) before its next proposal.
"""

from __future__ import annotations

import itertools
import os
import secrets
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from decoding import policy
from decoding.acceptance import greedy_accept, speculative_accept
from decoding.drafters import Draft, Drafter, ModelDrafter, PromptLookupDrafter
from decoding.kv import SequenceKV
from decoding.model import CausalLM
from decoding.policy import Speculation
from decoding.sampling import SamplingParams, probs_from_logits, select_token
from decoding.stats import GenerationStats

DrafterKind = Literal["lookup", "model"]


@dataclass
class GenerationRequest:
    prompt_tokens: Sequence[int]
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    speculation: Speculation = "auto"
    num_speculative_tokens: int = 8  # γ, the most candidates drafted per cycle
    drafter: DrafterKind | None = None  # None: the engine's default
    lookup_sources: Sequence[Sequence[int]] = ()  # passages for prompt lookup, as token ids
    lookup_source_names: Sequence[str] | None = None
    stop_token_ids: Collection[int] | None = None  # None: the target's EOS ids
    stop_sequences: Sequence[Sequence[int]] = ()  # token-id sequences that end generation


@dataclass
class GenerationEvent:
    seq_id: int
    token_ids: list[int]  # tokens committed by this cycle, in order
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length" or "cancelled"
    stats: GenerationStats | None = None  # on the final event


@dataclass
class _Sequence:
    seq_id: int
    request: GenerationRequest
    tokens: list[int]
    kv: SequenceKV
    drafter: Drafter | None
    generator: torch.Generator
    stop_ids: frozenset[int]
    stats: GenerationStats
    prefilled: bool = False
    finish_reason: str | None = None

    @property
    def output_len(self) -> int:
        return len(self.tokens) - self.stats.prompt_tokens


class Engine:
    def __init__(
        self,
        target: CausalLM,
        draft: CausalLM | None = None,
        *,
        default_drafter: DrafterKind | None = None,
        min_ngram: int = 2,
        max_ngram: int = 4,
        debug: bool | None = None,
    ) -> None:
        if draft is not None and draft.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft {draft.name!r} has vocabulary {draft.vocab_size}, target {target.name!r} has "
                f"{target.vocab_size}: a model drafter must share the target's vocabulary"
            )
        self.target = target
        self.draft = draft
        self.default_drafter: DrafterKind = default_drafter or ("model" if draft is not None else "lookup")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.debug = debug if debug is not None else os.environ.get("SPECRAG_DEBUG") == "1"
        self._eos_ids = frozenset(target.eos_token_ids())
        self._active: dict[int, _Sequence] = {}
        self._ids = itertools.count()

    # -- public API ---------------------------------------------------------------------

    def add(self, request: GenerationRequest) -> int:
        """Queue a request; returns its sequence id. Raises ValueError on bad input."""
        drafter_kind = self._validate(request)
        seq_id = next(self._ids)
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(63)
        generator = torch.Generator().manual_seed(seed)
        stop_ids = self._eos_ids if request.stop_token_ids is None else frozenset(request.stop_token_ids)
        self._active[seq_id] = _Sequence(
            seq_id=seq_id,
            request=request,
            tokens=list(request.prompt_tokens),
            kv=self.target.new_kv(),
            drafter=self._make_drafter(request, drafter_kind, generator),
            generator=generator,
            stop_ids=stop_ids,
            stats=GenerationStats(prompt_tokens=len(request.prompt_tokens)),
        )
        return seq_id

    def step(self) -> list[GenerationEvent]:
        """Advance every active sequence by one cycle (round-robin)."""
        return self._step_sequences(list(self._active.values()))

    def cancel(self, seq_id: int) -> None:
        """Stop a sequence and free its KV now."""
        self._active.pop(seq_id, None)

    def has_unfinished(self) -> bool:
        return bool(self._active)

    def generate(self, request: GenerationRequest) -> Iterator[GenerationEvent]:
        """Run one request to the end, streaming an event per cycle."""
        seq_id = self.add(request)
        try:
            while seq_id in self._active:
                yield from self._step_sequences([self._active[seq_id]])
        finally:
            self.cancel(seq_id)

    # -- one cycle ------------------------------------------------------------------------

    def _step_sequences(self, sequences: list[_Sequence]) -> list[GenerationEvent]:
        events = []
        for seq in sequences:
            committed = self._advance(seq)
            finished = seq.finish_reason is not None
            if finished:
                seq.stats.finish_reason = seq.finish_reason
                seq.stats.output_tokens = seq.output_len
                del self._active[seq.seq_id]
            elif self.debug:
                self._check_invariants(seq)
            events.append(
                GenerationEvent(seq.seq_id, committed, finished, seq.finish_reason, seq.stats if finished else None)
            )
        return events

    def _advance(self, seq: _Sequence) -> list[int]:
        if not seq.prefilled:
            return self._prefill(seq)
        request = seq.request
        gamma, off_reason = policy.choose_gamma(
            request.speculation, request.num_speculative_tokens, request.max_tokens - seq.output_len
        )
        if gamma > 0 and seq.drafter is not None:
            with seq.stats.timed("draft"):
                draft = seq.drafter.propose(seq.tokens, gamma)
            if draft.tokens:
                return self._speculative_step(seq, draft)
            off_reason = policy.NO_PROPOSAL
        return self._plain_step(seq, off_reason)

    def _prefill(self, seq: _Sequence) -> list[int]:
        with seq.stats.timed("prefill"):
            logits = self.target.prefill(seq.kv, seq.tokens)
        seq.stats.target_calls += 1
        seq.prefilled = True
        return self._commit(seq, [select_token(logits, seq.request.sampling, seq.generator)])

    def _plain_step(self, seq: _Sequence, off_reason: str | None) -> list[int]:
        with seq.stats.timed("decode"):
            logits = self.target.forward(seq.kv, seq.tokens[-1:], last_only=True)[-1]
            token = select_token(logits, seq.request.sampling, seq.generator)
        seq.stats.target_calls += 1
        seq.stats.record_plain(off_reason)
        if seq.drafter is not None:
            seq.drafter.on_commit([token], 0)
        return self._commit(seq, [token])

    def _speculative_step(self, seq: _Sequence, draft: Draft) -> list[int]:
        kept_before = len(seq.kv)
        with seq.stats.timed("verify"):
            target_logits = self.target.forward(seq.kv, [seq.tokens[-1], *draft.tokens])
        seq.stats.target_calls += 1
        with seq.stats.timed("accept"):
            accepted_len, committed = self._accept(seq, draft, target_logits)
        with seq.stats.timed("rollback"):
            # Keep the pending token and the accepted drafts; drop the rejected suffix.
            seq.kv.crop(kept_before + 1 + accepted_len)
            assert seq.drafter is not None
            seq.drafter.on_commit(committed, accepted_len)
        seq.stats.record_verify(len(draft.tokens), accepted_len, draft.source)
        return self._commit(seq, committed)

    def _accept(self, seq: _Sequence, draft: Draft, target_logits: torch.Tensor) -> tuple[int, list[int]]:
        draft_tokens = torch.tensor(draft.tokens, dtype=torch.long)
        sampling = seq.request.sampling
        if sampling.greedy:
            accepted_len, committed = greedy_accept(draft_tokens, target_logits)
        else:
            target_probs = probs_from_logits(target_logits, sampling)
            draft_probs = draft.probs
            if draft_probs is None:  # a deterministic drafter: q is one-hot on its token
                draft_probs = torch.zeros(len(draft.tokens), target_probs.shape[-1])
                draft_probs.scatter_(1, draft_tokens[:, None], 1.0)
            accepted_len, committed = speculative_accept(draft_tokens, draft_probs, target_probs, seq.generator)
        return accepted_len, committed.tolist()

    def _commit(self, seq: _Sequence, committed: list[int]) -> list[int]:
        """Append tokens one by one; a stop or the length limit truncates the rest."""
        emitted = []
        request = seq.request
        for token in committed:
            seq.tokens.append(token)
            emitted.append(token)
            if token in seq.stop_ids or self._ends_with_stop_sequence(seq):
                seq.finish_reason = "stop"
            elif seq.output_len >= request.max_tokens:
                seq.finish_reason = "length"
            if seq.finish_reason:
                break
        return emitted

    def _ends_with_stop_sequence(self, seq: _Sequence) -> bool:
        output_len = seq.output_len
        for stop in seq.request.stop_sequences:
            if len(stop) <= output_len and seq.tokens[-len(stop) :] == list(stop):
                return True
        return False

    # -- set-up and checks --------------------------------------------------------------

    def _validate(self, request: GenerationRequest) -> DrafterKind:
        if not request.prompt_tokens:
            raise ValueError("prompt_tokens must not be empty")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")
        if request.speculation not in policy.SPECULATION_MODES:
            raise ValueError(f"speculation must be one of {policy.SPECULATION_MODES}, got {request.speculation!r}")
        if request.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {request.num_speculative_tokens}")
        if any(not stop for stop in request.stop_sequences):
            raise ValueError("stop_sequences must not contain an empty sequence")
        kind = request.drafter or self.default_drafter
        if kind not in ("lookup", "model"):
            raise ValueError(f"drafter must be 'lookup' or 'model', got {kind!r}")
        if kind == "model" and self.draft is None:
            raise ValueError("drafter='model' needs an engine built with a draft model")
        return kind

    def _make_drafter(
        self, request: GenerationRequest, kind: DrafterKind, generator: torch.Generator
    ) -> Drafter | None:
        if request.speculation == "off":
            return None
        if kind == "model":
            assert self.draft is not None
            return ModelDrafter(self.draft, request.sampling, generator)
        return PromptLookupDrafter(
            request.prompt_tokens,
            request.lookup_sources,
            passage_names=request.lookup_source_names,
            min_ngram=self.min_ngram,
            max_ngram=self.max_ngram,
        )

    def _check_invariants(self, seq: _Sequence) -> None:
        committed_but_pending = seq.tokens[:-1]
        if seq.kv.token_ids != committed_but_pending or seq.kv.cached_length() != len(committed_but_pending):
            raise AssertionError(
                f"seq {seq.seq_id}: target cache holds {len(seq.kv)} ids / {seq.kv.cached_length()} positions, "
                f"expected the {len(committed_but_pending)} committed tokens before the pending one"
            )
        if isinstance(seq.drafter, ModelDrafter) and not seq.drafter.cache_matches(seq.tokens):
            raise AssertionError(f"seq {seq.seq_id}: draft cache is not a prefix of the committed tokens")
