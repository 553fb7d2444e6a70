"""Per-request generation statistics (the ``GenerationStats`` contract of docs/design.md)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

# A speculation cycle's stages; with a prompt's prefill and plain decode steps, every stage
# a generation's seconds are booked to. The trace's SpeculationCycle has one field per cycle stage.
CYCLE_STAGES = ("draft", "verify", "accept", "grammar", "rollback")
STAGES = ("prefill", "decode", *CYCLE_STAGES)


@dataclass(frozen=True)
class CycleInfo:
    """What one cycle of one sequence did, for traces: read off the stats around the cycle."""

    kind: Literal["prefill", "plain", "speculative"]
    start_ns: int  # time.monotonic_ns()
    end_ns: int
    gamma: int  # tokens verified (0 for prefill and plain steps)
    accepted_len: int
    source: str | None  # the drafter that proposed, for speculative cycles
    stage_seconds: dict[str, float]  # prefill / decode / draft / verify / accept / grammar / rollback


@dataclass(frozen=True)
class StatsMark:
    seconds: dict[str, float]
    cycles: int
    accepted: int
    start_ns: int


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0
    target_calls: int = 0  # every target forward, the prefill included
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # index i: draft tokens accepted / drafted at candidate position i
    acceptance_by_position: list[int] = field(default_factory=list)
    drafted_by_position: list[int] = field(default_factory=list)
    # index a: verify cycles whose accepted prefix had length a
    accepted_len_hist: list[int] = field(default_factory=list)
    bonus_count: int = 0  # cycles where every draft was accepted and the bonus committed
    wasted_verify_tokens: int = 0  # drafted tokens the target verified and rejected
    gamma_per_cycle: list[int] = field(default_factory=list)  # 0 = a plain decode step
    speculation_off_reasons: Counter[str] = field(default_factory=Counter)
    probe_cycles: int = 0  # speculative cycles run to re-measure acceptance after a back-off
    accepted_by_source: Counter[str] = field(default_factory=Counter)
    tree_cycles: int = 0  # verify cycles over a draft tree (decoding/tree_sizing.py)
    branch_accepted_tokens: int = 0  # accepted tokens a tree's branches gave, off its chain
    finish_reason: str | None = None
    last_source: str | None = None  # drafter of the latest verify cycle
    prefill_s: float = 0.0
    decode_s: float = 0.0  # plain (non-speculative) steps
    draft_s: float = 0.0
    verify_s: float = 0.0
    accept_s: float = 0.0
    grammar_s: float = 0.0
    rollback_s: float = 0.0

    @property
    def committed_per_call(self) -> float:
        """Output tokens per target forward: 1.0 for plain decoding."""
        return self.output_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def record_verify(
        self, gamma: int, accepted_len: int, source: str, accepted_sources: Sequence[str] | None = None
    ) -> None:
        """A verify cycle; ``accepted_sources`` (a tree's): each accepted token's source."""
        self.gamma_per_cycle.append(gamma)
        self.drafted_tokens += gamma
        self.accepted_tokens += accepted_len
        self.wasted_verify_tokens += gamma - accepted_len
        self.bonus_count += accepted_len == gamma
        if accepted_sources is None:
            self.accepted_by_source[source] += accepted_len
        else:
            self.accepted_by_source.update(accepted_sources)
        self.last_source = source
        _grow(self.drafted_by_position, gamma)
        _grow(self.acceptance_by_position, gamma)
        _grow(self.accepted_len_hist, accepted_len + 1)
        for position in range(gamma):
            self.drafted_by_position[position] += 1
        for position in range(accepted_len):
            self.acceptance_by_position[position] += 1
        self.accepted_len_hist[accepted_len] += 1

    def stage_seconds(self) -> dict[str, float]:
        return {stage: getattr(self, f"{stage}_s") for stage in STAGES}

    def mark(self) -> StatsMark:
        """Where the counters stand before a cycle (see ``cycle_since``)."""
        return StatsMark(self.stage_seconds(), len(self.gamma_per_cycle), self.accepted_tokens, time.monotonic_ns())

    def cycle_since(self, mark: StatsMark, was_prefilled: bool) -> CycleInfo:
        """The cycle run since ``mark``: its kind, γ, accepted length and stage seconds."""
        gamma = self.gamma_per_cycle[-1] if len(self.gamma_per_cycle) > mark.cycles else 0
        kind: Literal["prefill", "plain", "speculative"] = (
            "speculative" if gamma else "plain" if was_prefilled else "prefill"
        )
        seconds = self.stage_seconds()
        return CycleInfo(
            kind,
            mark.start_ns,
            time.monotonic_ns(),
            gamma,
            self.accepted_tokens - mark.accepted,
            self.last_source if gamma else None,
            {stage: seconds[stage] - mark.seconds[stage] for stage in STAGES},
        )

    def record_plain(self, off_reason: str | None) -> None:
        self.gamma_per_cycle.append(0)
        if off_reason:
            self.speculation_off_reasons[off_reason] += 1

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        """Add the wall time of the block to ``<stage>_s`` (monotonic clock)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            attribute = f"{stage}_s"
            setattr(self, attribute, getattr(self, attribute) + time.perf_counter() - start)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["speculation_off_reasons"] = dict(self.speculation_off_reasons)
        data["accepted_by_source"] = dict(self.accepted_by_source)
        data["uncached_prompt_tokens"] = self.prompt_tokens - self.cached_prompt_tokens
        data["committed_per_call"] = self.committed_per_call
        data["acceptance_rate"] = self.acceptance_rate
        return data


def _grow(counts: list[int], length: int) -> None:
    if len(counts) < length:
        counts.extend([0] * (length - len(counts)))
