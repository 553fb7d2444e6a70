"""Running the engine's cycles one after another, or with their target forwards packed.

A cycle (``Engine._advance``) is a generator: it decides what to forward (a prefill runs
on its own and yields nothing), yields the one target forward it needs as a
``ForwardNeed``, is sent that forward's logits, and returns the tokens it committed.
``run_alone`` answers a cycle with its own forward, as the batch-1 engine always did;
``run_packed`` starts every cycle of a step, answers all their needs with one
``packed_forward`` (``decoding/packed.py``), and finishes each on its own rows. Keeping
the cycle's code the same for both is what makes a packed step the same maths as B
steps one after another: only the model call is shared.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
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


Cycle = Generator[ForwardNeed, torch.Tensor, list[int]]


def run_alone(target: CausalLM, cycle: Cycle) -> list[int]:
    """One cycle to its end, with its own forward."""
    try:
        need = next(cycle)
    except StopIteration as done:
        return done.value
    return _finish(cycle, target.forward(need.kv, need.token_ids, last_only=need.last_only))


def run_packed(target: CausalLM, cycles: Sequence[Cycle]) -> list[list[int]]:
    """Every cycle to its end; the forwards they need are one packed forward."""
    committed: dict[int, list[int]] = {}
    needs: list[tuple[int, ForwardNeed]] = []
    for index, cycle in enumerate(cycles):
        try:
            needs.append((index, next(cycle)))
        except StopIteration as done:  # a prefill: it ran on its own
            committed[index] = done.value
    if needs:
        rows = packed_forward(target, [Chunk(need.kv, need.token_ids) for _, need in needs])
        for (index, need), logits in zip(needs, rows, strict=True):
            committed[index] = _finish(cycles[index], logits[-1:] if need.last_only else logits)
    return [committed[index] for index in range(len(cycles))]


def _finish(cycle: Cycle, logits: torch.Tensor) -> list[int]:
    try:
        cycle.send(logits)
    except StopIteration as done:
        return done.value
    raise RuntimeError("a cycle needs at most one target forward")
