"""The cycles of one engine step: each with its own forward, or all in one packed forward.

A cycle (``Engine._advance``, ``Engine._prefill_chunk``) is a generator: it decides what
to forward, yields the one target forward it needs as a ``ForwardNeed``, is sent that
forward's logits, and returns the tokens it committed. A ``StepBatch`` collects the cycles
the scheduler admits to a step. Unpacked, it runs each cycle to its end as it is added,
with its own forward, as the batch-1 engine always did; packed, it starts every cycle as
it is added and answers all their needs with one ``packed_forward``
(``decoding/packed.py``) in ``run``. Keeping the cycle's code the same for both is what
makes a packed step the same maths as B steps one after another: only the model call is
shared.

A cycle that raises (its grammar, a logits processor, its drafter, its stop handling)
fails alone: its result carries the error and the other cycles of the step go on. So does
a sequence whose forward raises: when the packed forward raises, every cache drops the
rows it half-appended and each need is answered by its own forward, so only the sequence
whose forward fails again is failed.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass

import torch

from decoding.kv import SequenceKV
from decoding.model import CausalLM
from decoding.packed import Chunk, packed_forward


@dataclass(frozen=True)
class ForwardNeed:
    kv: SequenceKV
    token_ids: list[int]
    last_only: bool = False  # only the last row's logits are read
    prompt: bool = False  # prompt rows (a prefill chunk), attended in aligned blocks


Cycle = Generator[ForwardNeed, torch.Tensor, list[int]]


@dataclass
class CycleResult:
    tokens: list[int]  # committed by the cycle, in order
    error: Exception | None = None  # the cycle raised: its sequence fails alone


def forward_alone(target: CausalLM, need: ForwardNeed) -> torch.Tensor:
    """A need's own forward. Prompt rows go through the packed call (``forward_prompt``),
    so a prefill chunk gets the same attention alone as beside other sequences."""
    if need.prompt:
        return target.forward_prompt(need.kv, need.token_ids)
    return target.forward(need.kv, need.token_ids, last_only=need.last_only)


class StepBatch:
    """The cycles of one step, in the order added; ``tokens`` counts what they forward."""

    def __init__(self, target: CausalLM, pack: bool) -> None:
        self.target = target
        self.pack = pack
        self.tokens = 0
        self.packed_seconds: float | None = None  # the shared forward's wall time, once run
        self.packed_tokens = 0  # ... and the tokens it carried
        self._cycles: list[Cycle] = []
        self._results: dict[int, CycleResult] = {}
        self._needs: list[tuple[int, ForwardNeed]] = []

    def add(self, cycle: Cycle) -> None:
        index = len(self._cycles)
        self._cycles.append(cycle)
        try:
            need = next(cycle)
        except StopIteration as done:  # decided without a forward (e.g. a finished grammar)
            self._results[index] = CycleResult(done.value)
            return
        except Exception as error:  # a failing cycle is reported, not raised
            self._results[index] = CycleResult([], error)
            return
        self.tokens += len(need.token_ids)
        if self.pack:
            self._needs.append((index, need))
        else:
            self._results[index] = self._answer_alone(cycle, need)

    def run(self) -> list[CycleResult]:
        """Answer the packed needs with one forward; every cycle's result, in order."""
        if self._needs:
            chunks = [Chunk(need.kv, need.token_ids, need.prompt, need.last_only) for _, need in self._needs]
            try:
                start = time.perf_counter()
                rows = packed_forward(self.target, chunks)
                self.packed_seconds = time.perf_counter() - start
                self.packed_tokens = sum(len(chunk.token_ids) for chunk in chunks)
            except Exception:  # find whose forward fails: each need alone, on clean caches
                for _, need in self._needs:
                    need.kv.discard_unrecorded()
                for index, need in self._needs:
                    self._results[index] = self._answer_alone(self._cycles[index], need)
            else:
                for (index, _), logits in zip(self._needs, rows, strict=True):
                    self._results[index] = _finish(self._cycles[index], logits)
            self._needs = []
        return [self._results[index] for index in range(len(self._cycles))]

    def _answer_alone(self, cycle: Cycle, need: ForwardNeed) -> CycleResult:
        try:
            logits = forward_alone(self.target, need)
        except Exception as error:  # this sequence's forward fails: it fails alone
            need.kv.discard_unrecorded()
            cycle.close()
            return CycleResult([], error)
        return _finish(cycle, logits)


def _finish(cycle: Cycle, logits: torch.Tensor) -> CycleResult:
    try:
        cycle.send(logits)
    except StopIteration as done:
        return CycleResult(done.value)
    except Exception as error:  # a failing cycle is reported, not raised
        return CycleResult([], error)
    raise RuntimeError("a cycle needs at most one target forward")
