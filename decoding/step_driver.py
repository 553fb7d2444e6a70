"""The cycles of one engine step: each with its own forwards, or all in packed forwards.

A cycle (``CyclePlanner.decode``, ``Engine._prefill_chunk``) is a generator: it decides what
to forward, yields each forward it needs as a ``ForwardNeed``, is sent that forward's
logits, and returns the tokens it committed. A cycle needs at most one *target* forward,
its last; before it, a cycle whose draft model won yields that model's forwards, one per
draft token. A ``StepBatch`` collects the cycles the scheduler admits to a step.
Unpacked, it runs each cycle to its end as it is added, with forwards of its own, as the
batch-1 engine always did; packed, it starts every cycle as it is added and answers their
needs in rounds: while some cycle waits on the draft model, one packed draft forward for
all of them (the drafters run in lockstep), then one packed target forward for all
(``decoding/packed.py``). Keeping the cycle's code the same for both is what makes a
packed step the same maths as B steps one after another: only the model calls are shared.

A cycle that raises (its grammar, a logits processor, its drafter, its stop handling)
fails alone: its result carries the error and the other cycles of the step go on. So does
a sequence whose forward raises: when a packed forward raises, every cache drops the rows
it half-appended and each need is answered by its own forward, so only the sequence whose
forward fails again is failed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from specrag.decoding.cut_words import pour_cut_words
from specrag.decoding.grammar import mask_logits
from specrag.decoding.kv import SequenceKV
from specrag.decoding.model import CausalLM
from specrag.decoding.packed import Chunk, packed_forward
from specrag.decoding.tree_attention import TreeRows

RowProcessor = Callable[[torch.Tensor], torch.Tensor]  # a sequence's logits processors over its rows


@dataclass(frozen=True)
class ForwardNeed:
    kv: SequenceKV
    token_ids: list[int]
    last_only: bool = False  # only the last row's logits are read
    prompt: bool = False  # prompt rows (a prefill chunk), attended in aligned blocks
    draft: bool = False  # a forward of the draft model (its cache), not the target
    target_tokens: int = 0  # a draft forward: what the cycle's verify will forward (the budget counts it)
    prepare: RowProcessor | None = None  # the request's logits processors, run on its rows first
    bitmask: torch.Tensor | None = None  # then the grammar's mask, one int32 row per logits row
    word_prefixes: torch.Tensor | None = None  # before the mask, cut words pour into their allowed part
    tree: TreeRows | None = None  # the rows after the first are a draft tree's nodes, not a chain

    def chunk(self) -> Chunk:
        return Chunk(self.kv, self.token_ids, self.prompt, self.last_only, self.tree)


Cycle = Generator[ForwardNeed, torch.Tensor, list[int]]


@dataclass
class CycleResult:
    tokens: list[int]  # committed by the cycle, in order
    error: Exception | None = None  # the cycle raised: its sequence fails alone


def forward_alone(model: CausalLM, need: ForwardNeed) -> torch.Tensor:
    """A need's own forward. Prompt rows go through the packed call (``forward_prompt``),
    so a prefill chunk gets the same attention alone as beside other sequences."""
    if need.prompt:
        return model.forward_prompt(need.kv, need.token_ids)
    if need.tree is not None:  # only the packed attention knows trees
        return packed_forward(model, [need.chunk()])[0]
    return model.forward(need.kv, need.token_ids, last_only=need.last_only)


class StepBatch:
    """The cycles of one step, in the order added; ``tokens`` counts the target tokens they
    forward (a cycle still drafting counts the verify it plans)."""

    def __init__(self, target: CausalLM, pack: bool, draft: CausalLM | None = None) -> None:
        self.target, self.draft = target, draft
        self.pack = pack
        self.tokens = 0
        self.packed_seconds: float | None = None  # the shared target forward's wall time, once run
        self.packed_tokens = 0  # ... and the tokens it carried
        self.packed_paths = 1  # ... and its root-to-leaf paths: 1 + each tree's paths beyond its first
        self._cycles: list[Cycle] = []
        self._results: dict[int, CycleResult] = {}
        self._pending: dict[int, ForwardNeed] = {}  # packed: each started cycle's next need

    def add(self, cycle: Cycle) -> None:
        index = len(self._cycles)
        self._cycles.append(cycle)
        step = _advance(cycle, None)
        if isinstance(step, CycleResult):  # decided without a forward, or failed
            self._results[index] = step
            return
        self.tokens += step.target_tokens if step.draft else len(step.token_ids)
        if self.pack:
            self._pending[index] = step
        else:
            self._results[index] = self._run_alone(cycle, step)

    def run(self) -> list[CycleResult]:
        """Answer the pending needs in packed rounds; every cycle's result, in order."""
        while any(need.draft for need in self._pending.values()):
            self._round(draft=True)
        if self._pending:
            self._round(draft=False)
        return [self._results[index] for index in range(len(self._cycles))]

    def _round(self, draft: bool) -> None:
        """One forward over the pending needs of one model (packed where that changes no
        logit, ``CausalLM.batch_invariant``, else one by one); each cycle is sent its rows and either finishes or,
        while drafting, names its next need."""
        model = self._model(draft)
        round_needs = [(index, need) for index, need in self._pending.items() if need.draft == draft]
        answers: list[torch.Tensor | Exception] | None = None
        if model.batch_invariant:
            chunks = [need.chunk() for _, need in round_needs]
            try:
                start = time.perf_counter()
                answers = list(packed_forward(model, chunks))
                if not draft:
                    self.packed_seconds = time.perf_counter() - start
                    self.packed_tokens = sum(len(chunk.token_ids) for chunk in chunks)
                    trees = [need.tree for _, need in round_needs if need.tree is not None]
                    self.packed_paths = 1 + sum(len(tree.segments) - 1 for tree in trees)
            except Exception:  # find whose forward fails: each need alone, on clean caches
                for _, need in round_needs:
                    need.kv.discard_unrecorded()
        if answers is None:
            answers = [_forward_or_error(model, need) for _, need in round_needs]
        answers = prepared([need for _, need in round_needs], answers)
        for (index, _), answer in zip(round_needs, answers, strict=True):
            if isinstance(answer, Exception):
                self._cycles[index].close()
                step: ForwardNeed | CycleResult = CycleResult([], answer)
            else:
                step = _advance(self._cycles[index], answer, after_target=not draft)
            if isinstance(step, CycleResult):
                del self._pending[index]
                self._results[index] = step
            else:
                self._pending[index] = step

    def _run_alone(self, cycle: Cycle, need: ForwardNeed) -> CycleResult:
        """A cycle to its end, each need answered by its own forward."""
        while True:
            answer = prepared([need], [_forward_or_error(self._model(need.draft), need)])[0]
            if isinstance(answer, Exception):  # this sequence's forward fails: it fails alone
                cycle.close()
                return CycleResult([], answer)
            step = _advance(cycle, answer, after_target=not need.draft)
            if isinstance(step, CycleResult):
                return step
            need = step

    def _model(self, draft: bool) -> CausalLM:
        if draft and self.draft is None:
            raise RuntimeError("a cycle asked for a draft forward in an engine without a draft model")
        return self.draft if draft and self.draft is not None else self.target


def prepared(needs: list[ForwardNeed], answers: list[torch.Tensor | Exception]) -> list[torch.Tensor | Exception]:
    """Each need's rows through its logits processors, then one grammar mask over the rows
    of every constrained need (one bitmask for all rows, one matcher per sequence filled
    it). Processors go first, on the plain path and the verify alike, then each
    constrained need's cut words pour into their allowed parts (decoding/cut_words.py), so
    the grammar has the last word; a processor that raises fails its own sequence."""
    answers = list(answers)
    for index, (need, answer) in enumerate(zip(needs, answers, strict=True)):
        if need.prepare is not None and not isinstance(answer, Exception):
            try:
                answers[index] = need.prepare(answer)
            except Exception as error:
                answers[index] = error
    masked = [
        index
        for index, (need, answer) in enumerate(zip(needs, answers, strict=True))
        if need.bitmask is not None and not isinstance(answer, Exception)
    ]
    for index in masked:
        table = needs[index].word_prefixes
        if table is not None:
            try:
                answers[index] = pour_cut_words(answers[index], needs[index].bitmask, table)  # type: ignore[arg-type]
            except Exception as error:  # a mask that does not fit its rows fails its own sequence
                answers[index] = error
    masked = [index for index in masked if not isinstance(answers[index], Exception)]
    if not masked:
        return answers
    rows = [answers[index] for index in masked]
    try:
        step_bitmask = torch.cat([needs[index].bitmask for index in masked])  # type: ignore[misc]
        all_rows = mask_logits(torch.cat(rows), step_bitmask)  # type: ignore[arg-type]
        for index, part in zip(masked, all_rows.split([len(row) for row in rows]), strict=True):
            answers[index] = part
    except Exception:  # some need's mask does not fit its rows: find whose, each alone
        for index in masked:
            answers[index] = _masked_or_error(answers[index], needs[index].bitmask)  # type: ignore[arg-type]
    return answers


def _masked_or_error(rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor | Exception:
    try:
        return mask_logits(rows, bitmask)
    except Exception as error:
        return error


def _forward_or_error(model: CausalLM, need: ForwardNeed) -> torch.Tensor | Exception:
    """A need's own forward, or the exception it raised (its cache then holds its tokens again)."""
    try:
        return forward_alone(model, need)
    except Exception as error:
        need.kv.discard_unrecorded()
        return error


def _advance(cycle: Cycle, logits: torch.Tensor | None, after_target: bool = False) -> ForwardNeed | CycleResult:
    """Send ``logits`` (None: start the cycle); its next need, or its result."""
    try:
        need = next(cycle) if logits is None else cycle.send(logits)
    except StopIteration as done:
        return CycleResult(done.value)
    except Exception as error:  # a failing cycle is reported, not raised
        return CycleResult([], error)
    if after_target:
        cycle.close()
        return CycleResult([], RuntimeError("a cycle needs at most one target forward, its last"))
    return need
