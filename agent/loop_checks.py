"""The checks on a run's final answer, after it is written: post-hoc citations
(``agent/attribution.py``) and the groundedness check (``agent/grounding/check.py``). A mixin
of ``AgentLoop``, as ``loop_probes`` holds the checks before the first step."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

from specrag.agent.answerability import ABSTENTION
from specrag.agent.attribution import Attributor, attribution_record
from specrag.agent.grounding.check import check_answer, evidence_texts, tool_evidence
from specrag.agent.grounding.support_judge import SupportJudge
from specrag.agent.run_state import RunState
from specrag.decoding.request import GenerationEvent, GenerationRequest


class AnswerChecks:
    tokenizer: Any
    generate: Callable[[GenerationRequest], Iterator[GenerationEvent]]
    retriever: Any
    _attributor: Attributor | None

    def _attribute(self, run: RunState, answer: str) -> str:
        """The answer citing by post-hoc attribution; the model's own text is kept in the result."""
        threshold = run.options.citation_min_similarity
        with run.trace.span("attribute", {"min_similarity": threshold}) as span:
            if self._attributor is None:
                self._attributor = Attributor(self.retriever.embedder)
            attributed, choices = self._attributor.attribute(answer, run.shown, threshold)
            run.attribution = attribution_record(threshold, answer, choices)
            span.set_attribute("cited_sentences", sum(choice.label is not None for choice in choices))
        return attributed

    def _ground(self, run: RunState, answer: str) -> str:
        """The answer checked against the run's evidence; ABSTENTION in its place when
        ``grounding="abstain"`` and it is not grounded (``agent/grounding/check.py``)."""
        options = run.options
        with run.trace.span("grounding", {"mode": options.grounding, "min_supported": options.min_supported}) as span:
            evidence = evidence_texts([p.text for p in run.shown], _tool_evidence(run))
            judge = SupportJudge(self.tokenizer, self.generate) if options.grounding_judge else None
            embedder = self.retriever.embedder
            run.grounding = check_answer(answer, run.question, evidence, embedder, options.min_supported, judge)
            span.set_attribute("grounded", run.grounding["grounded"])
        if options.grounding == "abstain" and not run.grounding["grounded"]:
            run.grounding["withheld_answer"] = answer
            return ABSTENTION
        return answer


def _tool_evidence(run: RunState) -> list[str]:
    """Each tool call the run made that succeeded, with its result, as evidence."""
    evidence = []
    for key, result in run.executed.items():
        if result.ok:
            call = json.loads(key)  # canonical_call's JSON: {"name", "arguments"}
            evidence.append(tool_evidence(call["name"], call["arguments"], result.content))
    return evidence
