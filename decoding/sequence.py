"""One sequence's state between engine cycles, its drafters, how committed tokens end
it, and the invariants debug mode checks after every cycle.

Between cycles the target cache holds every committed token but the newest (the
*pending* token), whose KV the next forward computes together with that cycle's
candidates; a model drafter's cache holds a prefix of the committed tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specrag.decoding.drafters import Drafter, ModelDrafter, PromptLookupDrafter
from specrag.decoding.drafters.history import HistoryIndex
from specrag.decoding.drafters.prompt_lookup import history_drafts
from specrag.decoding.grammar import GrammarForcedDrafter, GrammarState
from specrag.decoding.kv import SequenceKV
from specrag.decoding.model import CausalLM
from specrag.decoding.policy import RequestPolicy
from specrag.decoding.prefix_cache import PrefixCache
from specrag.decoding.request import DrafterKind, GenerationRequest, apply_processors
from specrag.decoding.stats import GenerationStats


@dataclass
class SequenceState:
    seq_id: int
    request: GenerationRequest
    tokens: list[int]  # the prompt, then every committed token
    kv: SequenceKV
    drafters: list[Drafter]  # in order of preference: free ones (prompt lookup) first
    policy: RequestPolicy
    generator: torch.Generator
    stop_ids: frozenset[int]
    stats: GenerationStats
    grammar: GrammarState | None = None
    prefilled: bool = False  # the whole prompt is in the cache and the first token committed
    admitted: bool = False  # the KV pool promised its blocks (and the prefix cache was asked)
    finish_reason: str | None = None

    @property
    def output_len(self) -> int:
        return len(self.tokens) - self.stats.prompt_tokens

    def draft_kvs(self) -> list[SequenceKV]:
        """The caches of its drafters that keep one (model drafters)."""
        return [drafter.kv for drafter in self.drafters if drafter.kv is not None]

    def release_kv(self) -> None:
        """Give the KV blocks back (finished, failed or cancelled)."""
        for kv in [self.kv, *self.draft_kvs()]:
            kv.release()

    def commit(self, committed: list[int]) -> list[int]:
        """Append tokens one by one; a stop or the length limit truncates the rest."""
        emitted = []
        for token in committed:
            self.tokens.append(token)
            emitted.append(token)
            if token in self.stop_ids:
                self.finish_reason = "stop"
            elif self._ends_with_stop_sequence():
                self.finish_reason = "stop"
                if self.grammar is not None:  # judged at the stop, not after the whole commit
                    self.grammar.rewind_to(self.output_len)
                    if not self.grammar.is_completed():  # an unfinished document is not complete
                        self.finish_reason = "length"
            elif self.output_len >= self.request.max_tokens:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        return emitted

    def _ends_with_stop_sequence(self) -> bool:
        output_len = self.output_len
        for stop in self.request.stop_sequences:
            if len(stop) <= output_len and self.tokens[-len(stop) :] == list(stop):
                return True
        return False

    def check_invariants(self) -> None:
        """Target cache == committed tokens minus the pending one; draft caches are prefixes."""
        committed_but_pending = self.tokens[:-1]
        if self.kv.token_ids != committed_but_pending or self.kv.cached_length() != len(committed_but_pending):
            raise AssertionError(
                f"seq {self.seq_id}: target cache holds {len(self.kv)} ids / {self.kv.cached_length()} positions, "
                f"expected the {len(committed_but_pending)} committed tokens before the pending one"
            )
        for drafter in self.drafters:
            if not drafter.cache_matches(self.tokens):
                raise AssertionError(f"seq {self.seq_id}: draft cache is not a prefix of the committed tokens")


def make_drafters(
    request: GenerationRequest,
    kind: DrafterKind,
    generator: torch.Generator,
    grammar: GrammarState | None,
    *,
    ngram: tuple[int, int],
    branches: int = 0,
    history: HistoryIndex | None = None,
    draft: CausalLM | None,
    draft_kv: Callable[[], SequenceKV | None],
    draft_prefix_cache: PrefixCache | None,
) -> list[Drafter]:
    """A new sequence's drafters, in order of preference: the grammar's forced tokens, prompt
    lookup (free), then the draft model; none when speculation is off."""
    if request.speculation == "off":
        return []
    drafters: list[Drafter] = [GrammarForcedDrafter(grammar)] if grammar is not None else []
    if kind in ("lookup", "both"):
        drafters.append(
            PromptLookupDrafter(
                request.prompt_tokens,
                request.lookup_sources,
                passage_names=request.lookup_source_names,
                min_ngram=ngram[0],
                max_ngram=ngram[1],
                branches=branches,
                # The tenant's earlier outputs as drafts, none without a tenant.
                history=functools.partial(history_drafts, history, request.tenant)
                if history is not None and request.tenant is not None
                else None,
            )
        )
    if kind in ("model", "both"):
        if draft is None:
            raise ValueError(f"drafter={kind!r} needs an engine built with a draft model")
        processors = list(request.logits_processors)
        if grammar is not None:  # q is masked along the draft exactly as p is along the chain
            processors.append(grammar.draft_processor(len(request.prompt_tokens)))
        processor = functools.partial(apply_processors, processors) if processors else None
        drafters.append(
            ModelDrafter(draft, request.sampling, generator, processor, draft_prefix_cache, draft_kv(), branches)
        )
    return drafters
