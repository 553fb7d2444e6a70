"""What one running sequence does this cycle: which drafter drafts, how far, and as a
chain or a tree. The engine builds a ``CyclePlanner`` per step (its cost model, the
step's shared load and token budget) and asks it for each decode cycle.

Choice, per cycle: the policy's plan gives a cap on γ (0: a plain step). Each drafter
is then considered: a free one (prompt lookup) proposes right away and is judged on its
proposal, or on a rival of another kind of source it offers (``Draft.rivals``: lookup's
chain against a tenant's history), whichever the estimates favour; a costly one (a
model) is judged on its estimates and drafts only once it has won, in lockstep with the
step's other model drafters. In "auto" the best expected rate wins; in "on" the first
drafter with a proposal. A winning draft with alternatives (prompt lookup's other
matches, the draft model's runner-ups) grows into a tree where the cache can compact its
accepted path.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Generator

import torch

from specrag.decoding import policy as policies
from specrag.decoding.cycles import decode_cycle, no_draft
from specrag.decoding.drafters import Draft, Drafter, ModelDrafter
from specrag.decoding.drafters.model_drafter import SOURCE as MODEL_SOURCE
from specrag.decoding.policy import CostModel, Decision
from specrag.decoding.sequence import SequenceState
from specrag.decoding.step_driver import Cycle, ForwardNeed
from specrag.decoding.tree_sizing import grow_tree

__all__ = ["CyclePlanner"]


@dataclasses.dataclass
class CyclePlanner:
    """The engine's view of one step, as the cycles deciding in it need it."""

    cost_model: CostModel | None
    running: int  # sequences active in the engine (the policy's batch-size input)
    budget_tokens: int  # the step's max_num_batched_tokens
    load: policies.StepLoad | None  # set while a packed step's cycles decide, else None
    observe_forward: Callable[[int, float, int], None]  # a forward's cost (tokens, start, paths)
    packing: bool  # one forward's time is no single sequence's cost

    def decode(self, seq: SequenceState) -> Cycle:
        """One decode cycle of ``seq``: a generator yielding the target forward it needs."""
        remaining = seq.request.max_tokens - seq.output_len
        plan = seq.policy.plan(remaining, self.running)
        if plan.gamma and self.load is not None:  # verify tokens count against the step's budget
            room = self.budget_tokens - self.load.tokens - 1
            plan = plan if room >= plan.gamma else Decision(max(room, 0), policies.BATCH_SATURATED)
        if plan.gamma == 0:
            return (yield from self._plain(seq, plan.reason))
        off_reason: str | None = policies.NO_PROPOSAL
        best: tuple[Decision, Drafter, Draft | None] | None = None
        for drafter in seq.drafters:
            choice, draft = self._consider(seq, drafter, plan.gamma, remaining)
            if choice.gamma == 0:
                off_reason = choice.reason
            elif best is None or choice.rate > best[0].rate:
                best = (choice, drafter, draft)
            if best is not None and seq.policy.mode != "auto":
                break  # "on": the first drafter with a proposal, in order of preference
        if best is None:
            return (yield from self._plain(seq, off_reason))
        choice, drafter, draft = best
        self._expect(choice.expected)
        if draft is None:  # a costly drafter (a model) is only asked once it has won
            draft = yield from self._draft_with_model(seq, drafter, choice.gamma)
            if not draft.tokens:
                return (yield from decode_cycle(seq, self.observe_forward, no_draft(), policies.NO_PROPOSAL))
        seq.stats.probe_cycles += choice.reason == "probe"
        chain = draft.truncated(choice.gamma)
        if draft.alternatives and seq.kv.compacts:
            # Its rows are written past the cache like a chain's: within the reserved positions.
            nodes = min(seq.policy.config.tree_nodes, remaining - 1)
            if self.load is not None:  # a tree's nodes count against the step's budget
                nodes = min(nodes, max(self.budget_tokens - self.load.tokens - 1, choice.gamma))
            chain = grow_tree(seq.policy, chain, draft.alternatives, nodes, self.load)
        return (yield from decode_cycle(seq, self.observe_forward, chain))

    def _plain(self, seq: SequenceState, reason: str | None) -> Cycle:
        self._expect(1.0)
        return (yield from decode_cycle(seq, self.observe_forward, no_draft(), reason))

    def _consider(
        self, seq: SequenceState, drafter: Drafter, cap: int, remaining: int
    ) -> tuple[Decision, Draft | None]:
        """What one drafter would verify this cycle. A free drafter (prompt lookup) proposes
        right away; a costly one (a model) is judged on its estimates before drafting."""
        if drafter.costly:
            choice = seq.policy.for_costly_drafter(
                MODEL_SOURCE,
                cap,
                self.cost_model.draft_token_seconds if self.cost_model else 0.0,
                setup_tokens=0 if len(drafter.kv) else len(seq.tokens),
                remaining_tokens=remaining,
                min_output_tokens=seq.request.min_tokens_for_speculation,
                load=self.load,
            )
            return choice, None
        with seq.stats.timed("draft"):
            draft = drafter.propose(seq.tokens, cap)
        if not draft.tokens:
            return Decision(0, policies.NO_PROPOSAL), None
        best: tuple[Decision, Draft] | None = None
        for candidate in (draft, *draft.rivals):  # the first in "on"; else the best expected rate
            choice = seq.policy.for_draft(candidate.source, len(candidate.tokens), candidate.match_ngram, self.load)
            if best is None or _better(choice, best[0]):
                best = (choice, candidate)
        assert best is not None
        return best

    def _expect(self, committed: float) -> None:
        """Note what the cycle deciding now is expected to commit, for the cycles after it."""
        if self.load is not None:
            self.load.committed += committed

    def _draft_with_model(
        self, seq: SequenceState, drafter: Drafter, gamma: int
    ) -> Generator[ForwardNeed, torch.Tensor, Draft]:
        """A model drafter's proposal, each of its forwards yielded to the step, which
        answers those of all sequences drafting at once (``StepBatch``: lockstep)."""
        assert isinstance(drafter, ModelDrafter)  # the one costly drafter: it drafts in lockstep
        with seq.stats.timed("draft"):
            start = time.perf_counter()
            steps = drafter.drafting(seq.tokens, gamma)
            try:
                kv, token_ids = next(steps)
                while True:
                    logits = yield ForwardNeed(kv, token_ids, last_only=True, draft=True, target_tokens=gamma + 1)
                    kv, token_ids = steps.send(logits[-1])
            except StopIteration as done:
                draft: Draft = done.value
            if draft.tokens and self.cost_model is not None and not self.packing:
                self.cost_model.observe_draft_token((time.perf_counter() - start) / len(draft.tokens))
        return draft


def _better(choice: Decision, than: Decision) -> bool:
    """Whether ``choice`` should be verified rather than ``than``: drafting beats declining,
    and between two drafts the higher expected rate (a probe, rate 0, loses to a draft the
    estimates favour)."""
    if (choice.gamma > 0) != (than.gamma > 0):
        return choice.gamma > 0
    return choice.rate > than.rate
