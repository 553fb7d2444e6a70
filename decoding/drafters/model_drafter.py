"""Drafting with a small model that shares the target's vocabulary.

The drafter keeps its own KV cache. Each proposal first feeds the committed tokens it
has not seen (the corrected or bonus token of the last cycle, or the whole prompt the
first time), then decodes γ tokens one at a time, keeping the distribution q each was
drawn from. On commit, its cache is cropped back to the committed prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

import torch

from specrag.decoding.drafters.base import Draft
from specrag.decoding.kv import SequenceKV
from specrag.decoding.model import CausalLM
from specrag.decoding.prefix_cache import PrefixCache, prefill_cached
from specrag.decoding.sampling import SamplingParams, probs_from_logits, sample

SOURCE = "draft_model"


class ModelDrafter:
    costly = True  # a forward of the draft model per proposed token

    def __init__(
        self,
        model: CausalLM,
        sampling: SamplingParams,
        generator: torch.Generator | None = None,
        logits_processor: Callable[[Sequence[int], torch.Tensor], torch.Tensor] | None = None,
        prefix_cache: PrefixCache | None = None,
        kv: SequenceKV | None = None,
    ) -> None:
        self.model = model
        self.sampling = sampling
        self.generator = generator
        # Applied to q exactly as the engine applies it to p, each with its own prefix.
        self.logits_processor = logits_processor
        self.prefix_cache = prefix_cache
        self.kv = kv if kv is not None else model.new_kv()  # the engine's are paged in its draft pool
        self._context_len = 0
        self._fed_drafts = 0
        self._proposal_open = False

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft:
        """Up to ``max_tokens`` draft tokens, each draft-model forward run here."""
        steps = self.drafting(context, max_tokens)
        try:
            kv, token_ids = next(steps)
            while True:
                kv, token_ids = steps.send(self.model.forward(kv, token_ids, last_only=True)[-1])
        except StopIteration as done:
            return done.value

    def drafting(
        self, context: Sequence[int], max_tokens: int
    ) -> Generator[tuple[SequenceKV, list[int]], torch.Tensor, Draft]:
        """``propose`` as a generator: it yields each forward it needs (its cache and the
        new tokens) and is sent that forward's last-row logits [V]. The engine answers the
        forwards of every sequence drafting in a step with one packed forward (lockstep)."""
        if max_tokens <= 0:
            return Draft([], None, SOURCE)
        logits = yield from self._catch_up(context)
        self._context_len = len(context)
        self._fed_drafts = 0
        self._proposal_open = True
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for position in range(max_tokens):
            if self.logits_processor is not None:
                logits = self.logits_processor([*context, *tokens], logits)
            if self.sampling.greedy:
                token = int(logits.argmax())
            else:
                q = probs_from_logits(logits, self.sampling)
                token = int(sample(q, self.generator))
                rows.append(q)
            tokens.append(token)
            if position + 1 < max_tokens:
                logits = yield self.kv, [token]
                self._fed_drafts += 1
        return Draft(tokens, torch.stack(rows) if rows else None, SOURCE)

    def on_commit(self, committed: Sequence[int], accepted_len: int) -> None:
        if not self._proposal_open:
            return  # a plain step: the cache still holds a prefix of the committed tokens
        # Keep the context and the drafts that were accepted; later drafts were rejected.
        self.kv.crop(self._context_len + min(accepted_len, self._fed_drafts))
        self._proposal_open = False

    def _catch_up(self, context: Sequence[int]) -> Generator[tuple[SequenceKV, list[int]], torch.Tensor, torch.Tensor]:
        """Feed the committed tokens the cache lacks; return the next-token logits. The
        first proposal's prompt prefill runs here, once, through the prefix cache."""
        if len(self.kv) >= len(context):
            # Every token is cached already but its logits are gone: recompute the last.
            self.kv.crop(len(context) - 1)
        missing = list(context[len(self.kv) :])
        if len(self.kv) == 0:
            return prefill_cached(self.model, self.kv, missing, self.prefix_cache)[0]
        return (yield self.kv, missing)

    def cache_matches(self, context: Sequence[int]) -> bool:
        """Debug check: the cache holds a prefix of ``context`` and nothing else."""
        held = self.kv.token_ids
        return held == list(context[: len(held)]) and self.kv.cached_length() == len(held)
