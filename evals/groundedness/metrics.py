"""Per-question records of a groundedness eval and their summary (evals/groundedness/run.py writes them).

A record holds what one agent run produced and how it scores: groundedness of each sentence
against the passages shown, citations, answer correctness against the reference, retrieval
recall of the supporting passages, tool calls, stage seconds read from the run's trace, and
the accepted length of every speculation cycle.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from specrag.agent.grounding import GroundednessScorer, citation_scores
from specrag.agent.grounding import text_match as tm
from specrag.evals.groundedness.abstention import auroc

DECODE_STAGES = ("draft", "verify", "accept", "grammar", "rollback")
INVALID_CALL_ERRORS = frozenset({"invalid_arguments", "unknown_tool"})


def trace_stages(trace: Mapping[str, Any] | None) -> dict[str, float]:
    """Seconds per stage of one run: retrieve, answerability (the probe), prompt, prefill, decode,
    tool, attribute (post-hoc citations), grounding (the answer's check), and the decode cycles'
    draft/verify/accept/grammar/rollback,
    plus the run's wall time."""
    stages = (
        "retrieve",
        "answerability",
        "prompt",
        "prefill",
        "decode",
        "tool",
        "attribute",
        "grounding",
        *DECODE_STAGES,
        "wall",
    )
    out = dict.fromkeys(stages, 0.0)
    if trace is None:
        return out
    for span in trace["spans"]:
        seconds = (span["end_ns"] - span["start_ns"]) / 1e9 if span["end_ns"] is not None else 0.0
        stage = _stage_of(span["name"], span["parent_id"] is None)
        if stage:
            out[stage] += seconds
        for event in span["events"]:
            if event["name"] == "speculation_cycle":
                for name in DECODE_STAGES:
                    out[name] += float(event["attributes"].get(f"{name}_s", 0.0))
    return out


def _stage_of(name: str, is_root: bool) -> str | None:
    if is_root:
        return "wall"
    if name.startswith("retrieval"):
        return "retrieve"
    if name.startswith("execute_tool"):
        return "tool"
    named = {"prompt_build": "prompt", "prefill": "prefill", "decode": "decode"}
    return named.get(name) or (name if name in ("answerability", "attribute", "grounding") else None)


def accepted_lengths(trace: Mapping[str, Any] | None) -> list[int]:
    """Accepted draft length of every speculative cycle (γ > 0) of the run."""
    if trace is None:
        return []
    return [
        int(event["attributes"]["accepted_len"])
        for span in trace["spans"]
        for event in span["events"]
        if event["name"] == "speculation_cycle" and event["attributes"].get("gamma", 0) > 0
    ]


def retrieval_recall(item: Mapping[str, Any], passages: Sequence[Mapping[str, Any]]) -> float | None:
    """Share of the item's supporting quotes found in the passages shown (chunking-independent)."""
    supporting = item.get("supporting") or []
    if not supporting:
        return None
    shown = [tm.whitespace_normalized(p["text"]) for p in passages]
    found = sum(1 for s in supporting if any(tm.whitespace_normalized(s["quote"]) in text for text in shown))
    return found / len(supporting)


def tool_calls(steps: Sequence[Mapping[str, Any]]) -> tuple[int, int]:
    """(calls, valid calls): a call is invalid when it names no tool or its arguments fail validation."""
    calls = valid = 0
    for step in steps:
        if "tool_call" not in step:
            continue
        calls += 1
        error = (step.get("tool_result") or {}).get("error") or {}
        valid += error.get("type") not in INVALID_CALL_ERRORS
    return calls, valid


def record(
    item: Mapping[str, Any],
    result: Mapping[str, Any],
    trace: Mapping[str, Any] | None,
    scorer: GroundednessScorer | None = None,
) -> dict[str, Any]:
    """Everything the report needs about one question's run."""
    calls, valid_calls = tool_calls(result["steps"])
    speculation = result["speculation"]
    base = {
        "id": item["id"],
        "kind": item["kind"],
        "question": item["question"],
        "answerable": bool(item["answerable"]),
        "answer": result["answer"],
        # the model's own text when the run re-cited it (RunOptions.citations="attribute")
        "model_answer": (result.get("attribution") or {}).get("model_answer", result["answer"]),
        "reference": item["reference"],
        "passages": [{"label": p["label"], "id": p["id"], "text": p["text"]} for p in result["passages"]],
        "cited_passage_ids": [c["passage_id"] for c in result["citations"]],
        "retrieval_recall": retrieval_recall(item, result["passages"]),
        "tool_calls": calls,
        "valid_tool_calls": valid_calls,
        "stages": trace_stages(trace),
        "accepted_lengths": accepted_lengths(trace),
        "output_tokens": result["usage"]["completion_tokens"],
        "target_calls": speculation["target_calls"],
        "speculation_ran": speculation["ran"],
        "off_reasons": speculation["off_reasons"],
        "p_unanswerable": (result.get("answerability") or {}).get("p_unanswerable"),
        "gated_abstention": bool((result.get("answerability") or {}).get("abstained")),
        "grounding": result.get("grounding"),  # the run's own check (agent/grounding/check.py)
    }
    return {**base, **answer_scores(base, scorer)}


def answer_scores(run: Mapping[str, Any], scorer: GroundednessScorer | None = None) -> dict[str, Any]:
    """The scored fields of a record, from its answer, reference and passages alone (so a saved
    report can be rescored when the scorer changes: ``python -m specrag.evals.groundedness.run --rescore``)."""
    answer = run["answer"]
    shown = {p["label"]: p["text"] for p in run["passages"]}
    question = run.get("question")
    citations = citation_scores(answer, shown, scorer, question)
    model_answer = run.get("model_answer", answer)
    model = citations if model_answer == answer else citation_scores(model_answer, shown, scorer, question)
    grounded = citations["groundedness"]
    answerable = run["answerable"]
    return {
        "abstained": tm.is_abstention(answer),
        "token_f1": tm.token_f1(answer, run["reference"]) if answerable else None,
        "exact_match": tm.exact_match(answer, run["reference"]) if answerable else None,
        "groundedness": grounded.score,
        "scorable_sentences": grounded.scorable,
        "supported_sentences": grounded.supported,
        "sentences": [s.as_dict() for s in grounded.sentences],
        "citation_pairs": citations["citations"],
        "citation_precision": citations["precision"],
        "citation_recall": citations["recall"],
        "unresolved_citations": citations["unresolved"],
        "model_citation_pairs": model["citations"],
        "model_citation_precision": model["precision"],
    }


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def summarize(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Headline metrics over all records (means per answer unless named micro)."""
    answerable = [r for r in records if r["answerable"]]
    unanswerable = [r for r in records if not r["answerable"]]
    pairs = sum(r["citation_pairs"] for r in records)
    precise = sum((r["citation_precision"] or 0.0) * r["citation_pairs"] for r in records)
    model_pairs = sum(r.get("model_citation_pairs", r["citation_pairs"]) for r in records)
    model_precise = sum(
        (r.get("model_citation_precision", r["citation_precision"]) or 0.0)
        * r.get("model_citation_pairs", r["citation_pairs"])
        for r in records
    )
    supported = sum(r["supported_sentences"] for r in records)
    cited_supported = sum((r["citation_recall"] or 0.0) * r["supported_sentences"] for r in records)
    calls = sum(r["tool_calls"] for r in records)
    output_tokens = sum(r["output_tokens"] for r in records)
    target_calls = sum(r["target_calls"] for r in records)
    lengths = [length for r in records for length in r["accepted_lengths"]]
    return {
        "questions": len(records),
        "groundedness": _mean([r["groundedness"] for r in records]),
        "groundedness_micro": _ratio(supported, sum(r["scorable_sentences"] for r in records)),
        "answers_with_claims": sum(1 for r in records if r["scorable_sentences"]),
        # the run's check: answers it marked not grounded (or withheld, under "abstain")
        "not_grounded": _mean([float(not r["grounding"]["grounded"]) for r in records if r.get("grounding")]),
        "citation_precision": _ratio(precise, pairs),
        "citation_recall": _ratio(cited_supported, supported),
        "citations": pairs,
        "unresolved_citations": sum(r["unresolved_citations"] for r in records),
        # the markers the model wrote itself; equal to the above unless the run re-cited them
        "model_citation_precision": _ratio(model_precise, model_pairs),
        "model_citations": model_pairs,
        "token_f1": _mean([r["token_f1"] for r in answerable]),
        "exact_match": _mean([float(r["exact_match"]) for r in answerable]),
        "unanswerable_abstained": _mean([float(r["abstained"]) for r in unanswerable]),
        "answerable_abstained": _mean([float(r["abstained"]) for r in answerable]),
        "gated_abstentions": sum(1 for r in records if r.get("gated_abstention")),
        "answerability_auroc": auroc(records),  # of the probe's P(no), when it ran
        "retrieval_recall": _mean([r["retrieval_recall"] for r in answerable]),
        "tool_calls": calls,
        "tool_call_validity": _ratio(sum(r["valid_tool_calls"] for r in records), calls),
        "stage_median_s": {
            stage: statistics.median(r["stages"][stage] for r in records)
            for stage in (records[0]["stages"] if records else {})
        },
        "committed_per_target_call": _ratio(output_tokens, target_calls),
        "speculation_ran": sum(1 for r in records if r["speculation_ran"]),
        "mean_accepted_length": _mean(lengths),
        "speculative_cycles": len(lengths),
        "by_kind": _by_kind(records),
    }


def _by_kind(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    kinds: dict[str, list[Mapping[str, Any]]] = {}
    for r in records:
        kinds.setdefault(r["kind"], []).append(r)
    return {
        kind: {
            "questions": len(rs),
            "groundedness": _mean([r["groundedness"] for r in rs]),
            "token_f1": _mean([r["token_f1"] for r in rs]),
            "abstained": _mean([float(r["abstained"]) for r in rs]),
            "retrieval_recall": _mean([r["retrieval_recall"] for r in rs]),
        }
        for kind, rs in sorted(kinds.items())
    }


def compare_passes(on: Sequence[Mapping[str, Any]], off: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Speculation on vs off over the same questions: identical answers and the decode speed-up."""
    different = [a["id"] for a, b in zip(on, off, strict=True) if a["answer"] != b["answer"]]
    # Decode only: the off pass re-reads the prompt the on pass just left in the prefix cache,
    # so prefill would favour it; speculation changes decode, not prefill.
    decode_on = sum(r["stages"]["decode"] for r in on)
    decode_off = sum(r["stages"]["decode"] for r in off)
    wall_on = sum(r["stages"]["wall"] for r in on)
    wall_off = sum(r["stages"]["wall"] for r in off)
    return {
        "identical_answers": len(on) - len(different),
        "questions": len(on),
        "different_ids": different,
        "decode_speedup": _ratio(decode_off, decode_on),
        "wall_speedup": _ratio(wall_off, wall_on),
        "decode_s_on": decode_on,
        "decode_s_off": decode_off,
    }
