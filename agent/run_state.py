"""A run's options and its state: what the agent loop gathers step by step, and the
result document it becomes (the shape of ``POST /v1/agent/runs``)."""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from specrag.agent.attribution import DEFAULT_MIN_SIMILARITY
from specrag.agent.grounding.check import DEFAULT_MIN_SUPPORTED, GROUNDING_MODES
from specrag.agent.results import ShownPassage, resolve_citations, speculation_summary
from specrag.agent.tool_gate import DEFAULT_MIN_CALL_PROBABILITY, DEFAULT_MIN_TOOL_SIMILARITY, GateVerdict
from specrag.agent.trace import Trace
from specrag.decoding.stats import GenerationStats
from specrag.tools import ToolResult

CITATION_MODES = ("model", "attribute")


@dataclass(frozen=True)
class RunOptions:
    max_steps: int = 4
    max_tokens: int = 256
    k: int = 5  # passages shown in the prompt
    lookup_k: int = 10  # passages retrieved for prompt lookup (the k shown among them)
    speculation: str = "auto"
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    tools: Sequence[str] | None = None  # names the model may call; None: default_tools(registered)
    # Reply ABSTENTION without generating when the answerability probe's P(no) reaches this
    # (agent/answerability.py); None: no gate. measure_answerability runs the probe ungated.
    abstain_threshold: float | None = None
    measure_answerability: bool = False
    # "attribute": the final answer's [Pn] markers are replaced by post-hoc ones, each sentence
    # citing the shown passage closest in meaning when the cosine reaches citation_min_similarity
    # (agent/attribution.py); "model": the markers the model wrote.
    citations: str = "attribute"
    citation_min_similarity: float = DEFAULT_MIN_SIMILARITY
    # The answer checked against the run's passages and tool results (agent/grounding/check.py):
    # "mark" records grounded or not with the unsupported sentences; "abstain" also replies
    # ABSTENTION when the supported share of its claims is below min_supported; "off": no check.
    # grounding_judge: the model itself also judges each claim the rules let through.
    grounding: str = "mark"
    min_supported: float = DEFAULT_MIN_SUPPORTED
    grounding_judge: bool = False
    # The irrelevance gate (agent/tool_gate.py): the first step may only answer in text when
    # no offered tool is this close to the question, or when the model's P(opening a call)
    # is below this. None: that signal is off. Applies where the loop has the gate's parts.
    min_tool_similarity: float | None = DEFAULT_MIN_TOOL_SIMILARITY
    min_call_probability: float | None = DEFAULT_MIN_CALL_PROBABILITY
    # A step after tool results whose every call was made before is generated again with
    # the written token banned where it led the grammar's best alternative by the least
    # (agent/repeat_deviation.py), at positions whose margin (logits) is at most this; when
    # no try makes a new grounded call, the next step answers. 0: ties only.
    max_deviation_margin: float = math.inf
    # Whose earlier outputs decoding may draft from (``GenerationRequest.tenant``); None: none.
    tenant: str | None = None

    def __post_init__(self) -> None:
        if not self.max_deviation_margin >= 0.0:
            raise ValueError(f"max_deviation_margin must be >= 0, not {self.max_deviation_margin}")
        if self.abstain_threshold is not None and not 0.0 <= self.abstain_threshold <= 1.0:
            raise ValueError(f"abstain_threshold must be within [0, 1], not {self.abstain_threshold}")
        if self.citations not in CITATION_MODES:
            raise ValueError(f"citations must be one of {', '.join(CITATION_MODES)}, not {self.citations!r}")
        if self.grounding not in GROUNDING_MODES:
            raise ValueError(f"grounding must be one of {', '.join(GROUNDING_MODES)}, not {self.grounding!r}")
        if not 0.0 <= self.min_supported <= 1.0:
            raise ValueError(f"min_supported must be within [0, 1], not {self.min_supported}")
        if not 0.0 <= self.citation_min_similarity <= 1.0:
            raise ValueError(f"citation_min_similarity must be within [0, 1], not {self.citation_min_similarity}")


@dataclass
class RunState:
    """What one run has gathered so far; ``result`` is the document the API returns."""

    question: str
    options: RunOptions
    trace: Trace
    run_id: str = field(default_factory=lambda: secrets.token_hex(8))
    shown: list[ShownPassage] = field(default_factory=list)  # every passage given a label
    prompt_passages: list[ShownPassage] = field(default_factory=list)  # the first retrieval's, in the prompt
    lookup: list[tuple[str, list[int]]] = field(default_factory=list)  # (passage id, token ids)
    steps: list[dict[str, Any]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)  # this turn's tool calls and results
    executed: dict[str, ToolResult] = field(default_factory=dict)  # canonical call -> its result
    answer_now: bool = False  # every call of a turn was a repeat: the next step may only answer
    deviations: list[dict[str, Any]] = field(default_factory=list)  # tries to change a repeated call
    tools_offered: bool = False
    gate: GateVerdict | None = None
    stats: list[GenerationStats] = field(default_factory=list)
    answerability: dict[str, Any] | None = None
    attribution: dict[str, Any] | None = None
    grounding: dict[str, Any] | None = None

    @property
    def held(self) -> bool:
        """The irrelevance gate held the run to a text answer."""
        return self.gate is not None and self.gate.held

    def result(self, answer: str) -> dict[str, Any]:
        citations, dropped = resolve_citations(answer, self.shown)
        prompt_tokens = sum(stats.prompt_tokens for stats in self.stats)
        completion_tokens = sum(stats.output_tokens for stats in self.stats)
        return {
            "run_id": self.run_id,
            "answer": answer,
            "citations": citations,
            "dropped_citations": dropped,
            "passages": [asdict(passage) for passage in self.shown],
            "steps": self.steps,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "cached_prompt_tokens": sum(stats.cached_prompt_tokens for stats in self.stats),
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
            "speculation": speculation_summary(self.stats),
            "answerability": self.answerability,
            "tool_gate": self.gate.record() if self.gate is not None else None,
            "attribution": self.attribution,
            "grounding": self.grounding,
            "deviations": self.deviations,
            "trace_id": self.trace.trace_id,
        }
