"""The decoding engine: many sequences, one ``step()`` that advances each by one cycle.

A cycle is a prefill chunk, a plain decode step, or a draft-verify-accept cycle.
State of a sequence between cycles: its target KV cache holds every committed token but
the newest (the *pending* token), whose KV is computed by the next forward together
with that cycle's candidates. So a verify forward is ``[pending, d1..dγ]`` and yields
the γ+1 rows the acceptance rule needs, and a plain step is ``[pending]``: both paths
run the same model calls, and ``speculation="off"`` is the baseline through this code.

Invariant checked after every cycle in debug mode (``decoding/sequence.py``): target
cache == committed tokens minus the pending one; a model drafter's cache holds a prefix of
the committed tokens, and it ingests the rest (the corrected or bonus token) before its
next proposal.

A ``step()`` schedules under a token budget (``max_num_batched_tokens``): every running
sequence's decode or verify cycle first, then prefill chunks of waiting sequences (the
oldest always gets one, more while the budget lasts), so a long prompt is spread over
steps and never stalls the others for more than one chunk. Prefill chunks end on fixed
positions (``model.prompt_chunk_end``) and prompt rows are attended in aligned blocks, so
how a prompt is cut never changes its bits in row-exact mode. The step's cycles share one
packed target forward (``decoding/step_driver.py``) where that changes no logit (row-exact
linears, ``CausalLM.batch_invariant``); otherwise each cycle has its own forward. A cycle
that raises finishes its own sequence with an error event; the others go on.

The policy (``decoding/policy.py``) decides each cycle's γ; every forward's wall time is
fed back into its cost model, around the maths, never inside it.

KV lives in a bounded pool of blocks (``decoding/kv_manager.py``): a waiting sequence
starts its prefill only once the pool has promised it every block it may need, so a
running one never runs out. With ``prefix_cache`` a prefill starts from the longest cached
block-aligned prefix of the prompt, shared by reference (target and draft model alike),
and a finished sequence leaves its blocks behind for follow-up turns.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import secrets
import time
from collections.abc import Iterator

import torch

from specrag.decoding import policy as policies
from specrag.decoding.cycle_plan import CyclePlanner
from specrag.decoding.cycles import grammar_accept, next_mask, row_processor, word_prefixes
from specrag.decoding.drafters.history import HistoryIndex
from specrag.decoding.forward_timer import ForwardTimer, prompt_costs
from specrag.decoding.grammar import GrammarState
from specrag.decoding.kv_manager import KVManager
from specrag.decoding.model import PREFILL_CHUNK_TOKENS, CausalLM, prompt_chunk_end
from specrag.decoding.policy import CostModel, PolicyConfig, RequestPolicy
from specrag.decoding.prefix_cache import PrefixCache
from specrag.decoding.request import (
    DrafterKind,
    GenerationEvent,
    GenerationRequest,
    speculation_supported,
    validate,
)
from specrag.decoding.sampling import select_token
from specrag.decoding.sequence import SequenceState, make_drafters
from specrag.decoding.stats import CycleInfo, GenerationStats, StatsMark
from specrag.decoding.step_driver import Cycle, CycleResult, ForwardNeed, StepBatch

__all__ = ["Engine", "GenerationEvent", "GenerationRequest"]

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2 * PREFILL_CHUNK_TOKENS  # until the cost model is measured
TREE_BRANCHES = 4  # alternative chains prompt lookup offers a tree, when trees are on
# The cross-request index's bounds: about 5 index entries per token, so at most ~3M entries.
HISTORY_TOKENS_PER_TENANT = 20_000
HISTORY_TENANTS = 32


class Engine:
    def __init__(
        self,
        target: CausalLM,
        draft: CausalLM | None = None,
        *,
        default_drafter: DrafterKind | None = None,
        min_ngram: int = 1,
        max_ngram: int = 4,
        policy: PolicyConfig | None = None,
        cost_model: CostModel | None = None,
        prefix_cache: PrefixCache | bool = False,
        debug: bool | None = None,
        pack: bool = True,
        max_num_batched_tokens: int | None = None,
        kv_cache_bytes: int | None = None,
    ) -> None:
        if draft is not None and draft.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft {draft.name!r} has vocabulary {draft.vocab_size}, target {target.name!r} has "
                f"{target.vocab_size}: a model drafter must share the target's vocabulary"
            )
        self.target = target
        self.draft = draft
        self.default_drafter: DrafterKind = default_drafter or ("both" if draft is not None else "lookup")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.policy_config = policy or PolicyConfig()
        # Earlier outputs per tenant (requests that name one): bounded, a tenant's own only.
        self.history = HistoryIndex(max_tokens_per_tenant=HISTORY_TOKENS_PER_TENANT, max_tenants=HISTORY_TENANTS)
        self.cost_model = cost_model
        self.debug = debug if debug is not None else os.environ.get("SPECRAG_DEBUG") == "1"
        self.kv = KVManager(target, draft, prefix_cache, kv_cache_bytes)
        self.prefix_cache, self.draft_prefix_cache = self.kv.prefix_cache, self.kv.draft_prefix_cache
        self._eos_ids = frozenset(target.eos_token_ids())
        self._active: dict[int, SequenceState] = {}
        self._ids = itertools.count()
        self._shared_acceptance: dict[str, policies.AcceptanceEstimate] = {}
        # A step over several sequences packs their forwards into one (decoding/step_driver.py)
        # where that changes no logit (``CausalLM.batch_invariant``): with row-exact linears
        # the packed rows are bit-identical to the forwards alone (bf16 and float32 on the
        # CPUs measured). Where the probe failed, a product rounds differently with the row
        # count, and the text must not depend on which requests share a step, so there they
        # run one by one.
        self.pack = pack
        self._packing = False
        # Tokens one step forwards beyond which no further prefill chunk is admitted (vLLM's
        # max_num_batched_tokens); decode and verify tokens are scheduled first and never cut.
        # Unless given, the cost model's knee once it is measured (``_budget_from``).
        self._budget_given = max_num_batched_tokens is not None
        self.max_num_batched_tokens = (
            DEFAULT_MAX_NUM_BATCHED_TOKENS if max_num_batched_tokens is None else max_num_batched_tokens
        )
        self._budget_from(cost_model)

    # -- public API ---------------------------------------------------------------------

    def add(self, request: GenerationRequest) -> int:
        """Queue a request; returns its sequence id. Raises ValueError on bad input."""
        drafter_kind = validate(request, self.default_drafter, self.draft is not None)
        self.kv.check_fits(request)
        if request.speculation == "auto" and self.cost_model is None:
            self.calibrate()
        seq_id = next(self._ids)
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(63)
        generator = torch.Generator().manual_seed(seed)
        stop_ids = self._eos_ids if request.stop_token_ids is None else frozenset(request.stop_token_ids)
        config = self.policy_config
        if request.tree_nodes is not None:
            config = dataclasses.replace(config, tree_nodes=request.tree_nodes)
        request_policy = RequestPolicy(
            request.speculation,
            request.num_speculative_tokens,
            config,
            self.cost_model,
            supported=speculation_supported(request),
            shared=self._shared_acceptance,
        )
        grammar = GrammarState(request.grammar, stop_ids, self.target.vocab_size) if request.grammar else None
        self._active[seq_id] = SequenceState(
            seq_id=seq_id,
            request=request,
            tokens=list(request.prompt_tokens),
            kv=self.kv.new_kv(),
            drafters=make_drafters(
                request,
                drafter_kind,
                generator,
                grammar,
                ngram=(self.min_ngram, self.max_ngram),
                # Trees need the packed attention that verifies them.
                branches=TREE_BRANCHES if config.tree_nodes and self.target.packs_prompts else 0,
                history=self.history,
                draft=self.draft,
                draft_kv=self.kv.new_draft_kv,
                draft_prefix_cache=self.draft_prefix_cache,
            ),
            policy=request_policy,
            generator=generator,
            stop_ids=stop_ids,
            stats=GenerationStats(prompt_tokens=len(request.prompt_tokens)),
            grammar=grammar,
        )
        return seq_id

    def step(self) -> list[GenerationEvent]:
        """Advance every active sequence by one cycle (round-robin)."""
        return self._step_sequences(list(self._active.values()))

    def cancel(self, seq_id: int) -> None:
        """Stop a sequence and free its KV now."""
        seq = self._active.pop(seq_id, None)
        if seq is not None:
            seq.release_kv()

    def has_unfinished(self) -> bool:
        return bool(self._active)

    def num_running(self) -> int:
        """Sequences past their prefill (vLLM's num_requests_running counts these)."""
        return sum(seq.prefilled for seq in list(self._active.values()))  # list(): read from other threads

    def kv_cache_usage(self) -> float:
        """Fraction of the KV pool held by sequences, 0..1."""
        return self.kv.usage()

    def num_waiting(self) -> int:
        """Sequences whose prompt is not all in the cache yet (waiting for prefill chunks)."""
        return len(self._active) - self.num_running()

    def generate(self, request: GenerationRequest) -> Iterator[GenerationEvent]:
        """Run one request to the end, streaming an event per cycle."""
        seq_id = self.add(request)
        try:
            while seq_id in self._active:
                yield from self._step_sequences([self._active[seq_id]])
        finally:
            self.cancel(seq_id)

    def calibrate(self) -> CostModel:
        """Measure the cost model: target forwards over 1..64 tokens, prompt chunks of
        128..512 (the step budget), draft token costs."""
        draft_timer = ForwardTimer(self.draft) if self.draft is not None else None
        prompt = prompt_costs(self.target)
        timer = ForwardTimer(self.target)
        tree = timer.tree if self.target.packs_prompts else None  # only the packed forward verifies trees
        self.cost_model = CostModel.measure(timer, draft_timer, prompt_seconds=prompt, tree_forward=tree)
        self._budget_from(self.cost_model)
        return self.cost_model

    def _budget_from(self, cost_model: CostModel | None) -> None:
        """Unless one was given, the budget the cost model suggests (``CostModel.budget_tokens``)."""
        budget = cost_model.budget_tokens(PREFILL_CHUNK_TOKENS) if cost_model is not None else None
        if budget is not None and not self._budget_given:
            self.max_num_batched_tokens = budget

    # -- one cycle ------------------------------------------------------------------------

    def _step_sequences(self, sequences: list[SequenceState]) -> list[GenerationEvent]:
        pack = self.pack and self.target.batch_invariant and len(sequences) > 1
        batch = StepBatch(self.target, pack, self.draft)
        scheduled: list[tuple[SequenceState, StatsMark, bool]] = []
        self._packing = pack  # one forward's time is no single sequence's cost
        try:
            # The oldest waiting prompt's chunk always runs: the decode cycles decide their γ
            # knowing it shares the forward (StepLoad), and so does every cycle before them.
            waiting = next((seq for seq in sequences if not seq.prefilled), None)
            waiting_end = self._next_prompt_chunk_end(waiting) if waiting is not None else None
            reserved = waiting_end - len(waiting.kv) if waiting is not None and waiting_end is not None else 0
            planner = CyclePlanner(
                self.cost_model,
                running=len(self._active),
                budget_tokens=self.max_num_batched_tokens,
                load=policies.StepLoad() if pack else None,
                observe_forward=self._observe_forward,
                packing=pack,
            )
            for seq in sequences:  # decode and verify tokens first
                if seq.prefilled:
                    scheduled.append((seq, seq.stats.mark(), True))
                    if planner.load is not None:
                        planner.load.tokens = batch.tokens + reserved
                    batch.add(planner.decode(seq))
            planner.load = None  # the decisions are made: prompt chunks are scheduled after them
            admitted_prefill = False
            for seq in sequences:  # then prompt chunks, the oldest waiting always
                if seq.prefilled:
                    continue
                end = self._next_prompt_chunk_end(seq)
                if end is None:  # the pool cannot promise its blocks yet: it and later ones wait
                    break
                if admitted_prefill and batch.tokens + end - len(seq.kv) > self.max_num_batched_tokens:
                    break
                admitted_prefill = True
                scheduled.append((seq, seq.stats.mark(), False))
                batch.add(self._prefill_chunk(seq, end))
            results = batch.run()
        finally:
            self._packing = False
        if self.cost_model is not None and batch.packed_seconds is not None:
            # A forward over T tokens, whoever's they were: the curve StepLoad reads C(T) from;
            # the trees' extra paths teach the cost per path, never that curve.
            self.cost_model.observe(batch.packed_tokens, batch.packed_seconds, batch.packed_paths)
        events = []
        for (seq, mark, was_prefilled), result in zip(scheduled, results, strict=True):
            cycle = seq.stats.cycle_since(mark, was_prefilled)
            if result.error is not None or result.tokens or seq.finish_reason is not None:
                events.append(self._event(seq, result, cycle))
        if self.debug:  # no KV block leaked, double-owned or taken beyond a promise
            active = list(self._active.values())
            self.kv.check([seq.kv for seq in active], [kv for seq in active for kv in seq.draft_kvs()])
        return events

    def _event(self, seq: SequenceState, result: CycleResult, cycle: CycleInfo) -> GenerationEvent:
        if result.error is not None:
            seq.finish_reason = "error"
        finished = seq.finish_reason is not None
        if finished:
            seq.stats.finish_reason = seq.finish_reason
            seq.stats.output_tokens = seq.output_len
            del self._active[seq.seq_id]
            if result.error is None:
                self.kv.cache_finished(seq.kv, seq.draft_kvs())
                if seq.request.tenant is not None:  # with the prompt's last n-gram: a key to its start
                    start = max(0, seq.stats.prompt_tokens - self.history.max_ngram)
                    self.history.add(seq.request.tenant, seq.tokens[start:])
            seq.release_kv()
        elif self.debug:
            seq.check_invariants()
        return GenerationEvent(
            seq.seq_id,
            result.tokens,
            finished,
            seq.finish_reason,
            seq.stats if finished else None,
            cycle,
            result.error,
        )

    def _next_prompt_chunk_end(self, seq: SequenceState) -> int | None:
        """Where ``seq``'s next prefill chunk ends, or None while the KV pool cannot admit it.
        Admission starts the cache from the longest cached prefix of the prompt (a hit ends
        on a block boundary, so on a chunk's) and reserves the blocks the rest may need."""
        if not seq.admitted:
            with seq.stats.timed("prefill"):
                cached_len = self.kv.admit(seq.request, seq.kv, seq.draft_kvs())
            if cached_len is None:
                return None
            seq.admitted = True
            seq.stats.cached_prompt_tokens = cached_len
        return prompt_chunk_end(len(seq.kv), len(seq.tokens))

    def _prefill_chunk(self, seq: SequenceState, end: int) -> Cycle:
        """Prompt rows up to ``end``; the last chunk's logits give the first token."""
        last = end == len(seq.tokens)  # its row gives the first token: processed and masked
        bitmask = next_mask(seq) if last else None
        with seq.stats.timed("prefill"):
            chunk = seq.tokens[len(seq.kv) : end]
            prepare = row_processor(seq) if last else None
            need = ForwardNeed(
                seq.kv,
                chunk,
                last_only=True,
                prompt=True,
                prepare=prepare,
                bitmask=bitmask,
                word_prefixes=word_prefixes(seq) if last else None,
            )
            logits = (yield need)[-1]
            seq.stats.target_calls += 1
            if not last:
                return []
            if self.prefix_cache is not None:
                self.prefix_cache.insert(seq.kv)  # the next request sharing the prompt hits
        seq.prefilled = True
        token = select_token(logits, seq.request.sampling, seq.generator)
        grammar_accept(seq, token)
        return seq.commit([token])

    def _observe_forward(self, tokens: int, start: float, paths: int = 1) -> None:
        if self.cost_model is None or self._packing:
            return
        self.cost_model.observe(tokens, time.perf_counter() - start, paths)
