"""Drafting with a small model that shares the target's vocabulary.

The drafter keeps its own KV cache. Each proposal first feeds the committed tokens it
has not seen (the corrected or bonus token of the last cycle, or the whole prompt the
first time), then decodes γ tokens one at a time, keeping the distribution q each was
drawn from. On commit, its cache is cropped back to the committed prefix.

With ``branches`` > 0 a greedy proposal also carries the draft model's runner-up tokens as
alternatives for a draft tree (``Draft.alternatives``, ``decoding/tree_sizing.py``): at the
positions where the second-best token is likeliest under q, the chain up to there plus that
token. They cost no forward (the logits are at hand) and, one token each, no draft KV.
Sampled drafts stay chains: the tree's sampling rule is for deterministic drafts.
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
        branches: int = 0,
    ) -> None:
        self.model = model
        self.sampling = sampling
        self.generator = generator
        # Applied to q exactly as the engine applies it to p, each with its own prefix.
        self.logits_processor = logits_processor
        self.prefix_cache = prefix_cache
        self.kv = kv if kv is not None else model.new_kv()  # the engine's are paged in its draft pool
        self.branches = branches if sampling.greedy else 0
        self._proposed: list[int] = []
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
        runners_up: list[tuple[float, int, int]] = []  # (q of the second-best token, position, token)
        for position in range(max_tokens):
            if self.logits_processor is not None:
                logits = self.logits_processor([*context, *tokens], logits)
            if self.sampling.greedy:
                token = int(logits.argmax())
                if self.branches:
                    runners_up.append(_runner_up(logits, position))
            else:
                q = probs_from_logits(logits, self.sampling)
                token = int(sample(q, self.generator))
                rows.append(q)
            tokens.append(token)
            if position + 1 < max_tokens:
                logits = yield self.kv, [token]
                self._fed_drafts += 1
        self._proposed = tokens
        return Draft(
            tokens, torch.stack(rows) if rows else None, SOURCE, alternatives=self._alternatives(tokens, runners_up)
        )

    def _alternatives(self, tokens: list[int], runners_up: list[tuple[float, int, int]]) -> list[Draft]:
        """The chain to each of the likeliest runner-up tokens, plus that token."""
        best = sorted((entry for entry in runners_up if entry[0] > 0.0), reverse=True)[: self.branches]
        return [Draft([*tokens[:position], token], None, SOURCE) for _, position, token in best]

    def on_commit(self, committed: Sequence[int], accepted_len: int) -> None:
        if not self._proposal_open:
            return  # a plain step: the cache still holds a prefix of the committed tokens
        # Keep the context and the drafts the accepted path shares with this proposal (a
        # tree's path may leave it at a branch); later drafts were not committed.
        shared = 0
        while shared < min(accepted_len, len(self._proposed)) and committed[shared] == self._proposed[shared]:
            shared += 1
        self.kv.crop(self._context_len + min(shared, self._fed_drafts))
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


def _runner_up(logits: torch.Tensor, position: int) -> tuple[float, int, int]:
    """(q of the second-best token, ``position``, that token); q 0 where it is masked out."""
    top = torch.topk(logits.float(), 2)
    if not torch.isfinite(top.values[1]):
        return 0.0, position, int(top.indices[1])
    q = torch.softmax(logits.float(), dim=-1)[top.indices[1]]
    return float(q), position, int(top.indices[1])
