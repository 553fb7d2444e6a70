"""Parts of a run's result: citations resolved to the passages shown, speculation summed over steps."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from specrag.agent.trace import SpeculationCycle, Trace
from specrag.decoding.stats import GenerationStats
from specrag.tools import ToolCall, ToolResult

_CITATION = re.compile(r"\[P(\d+)\]")


@dataclass(frozen=True)
class ShownPassage:
    label: str  # "P3"
    id: str
    source: str
    text: str


def resolve_citations(answer: str, shown: Sequence[ShownPassage]) -> tuple[list[dict[str, str]], int]:
    """``[Pn]`` markers in order of first use, resolved to shown passages; unknown ones dropped."""
    by_label = {passage.label: passage for passage in shown}
    citations, seen, dropped = [], set(), 0
    for match in _CITATION.finditer(answer):
        label = f"P{match.group(1)}"
        if label not in by_label:
            dropped += 1
        elif label not in seen:
            seen.add(label)
            passage = by_label[label]
            citations.append({"label": label, "passage_id": passage.id, "source": passage.source, "text": passage.text})
    return citations, dropped


def speculation_summary(all_stats: Sequence[GenerationStats]) -> dict[str, Any]:
    """Speculation counters summed over steps: did it run, why not, and what it bought."""
    drafted = sum(stats.drafted_tokens for stats in all_stats)
    accepted = sum(stats.accepted_tokens for stats in all_stats)
    calls = sum(stats.target_calls for stats in all_stats)
    output = sum(stats.output_tokens for stats in all_stats)
    reasons: dict[str, int] = {}
    by_source: dict[str, int] = {}
    for stats in all_stats:
        for reason, count in stats.speculation_off_reasons.items():
            reasons[reason] = reasons.get(reason, 0) + count
        for source, count in stats.accepted_by_source.items():
            by_source[source] = by_source.get(source, 0) + count
    return {
        "ran": drafted > 0,
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "target_calls": calls,
        "committed_per_call": output / calls if calls else 0.0,
        "off_reasons": reasons,
        "accepted_by_source": by_source,
        "tree_cycles": sum(stats.tree_cycles for stats in all_stats),
        "branch_accepted_tokens": sum(stats.branch_accepted_tokens for stats in all_stats),
    }


def tool_result_dict(result: ToolResult) -> dict[str, Any]:
    """A tool result as the API shows it (``tool_result`` events and step records)."""
    return {
        "name": result.name,
        "ok": result.ok,
        "content": result.content,
        "error": asdict(result.error) if result.error else None,
    }


def step_record(
    step: int, kind: str, stats: GenerationStats, call: ToolCall | None = None, result: ToolResult | None = None
) -> dict[str, Any]:
    """One entry of a run's ``steps``: what the step did and what speculation bought it."""
    record: dict[str, Any] = {"index": step, "kind": kind, "speculation": speculation_summary([stats])}
    if call is not None:
        record["tool_call"] = {"name": call.name, "arguments": call.arguments}
    if result is not None:
        record["tool_result"] = tool_result_dict(result)
    return record


def record_chat(trace: Trace, chat: Any, cycles: list[tuple[Any, int]], stats: GenerationStats) -> None:
    """A generation's usage on its ``chat`` span, and its prefill and decode spans with every cycle."""
    chat.set_attributes(
        {
            "gen_ai.usage.input_tokens": stats.prompt_tokens,
            "gen_ai.usage.output_tokens": stats.output_tokens,
            "cached_prompt_tokens": stats.cached_prompt_tokens,
            "uncached_prompt_tokens": stats.prompt_tokens - stats.cached_prompt_tokens,
            "target_calls": stats.target_calls,
            "finish_reason": stats.finish_reason or "",
        }
    )
    if not cycles:
        return
    prefill = cycles[0][0]
    trace.add_completed_span("prefill", prefill.start_ns, prefill.end_ns, {"tokens": stats.prompt_tokens}, chat)
    if len(cycles) > 1:
        decode = trace.add_completed_span(
            "decode", cycles[1][0].start_ns, cycles[-1][0].end_ns, {"cycles": len(cycles) - 1}, chat
        )
        for info, committed in cycles[1:]:
            decode.add_cycle(SpeculationCycle.from_engine(info, committed))
