"""The one-forward probes before a run's first step: the irrelevance gate's verdict
(``agent/tool_gate.py``) and the answerability probe (``agent/answerability.py``). A mixin
of ``AgentLoop``: each reads the first step's own prompt and asks ``generate`` for one
next-token distribution."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from specrag.agent.answerability import AnswerTokens, NextTokenLogits, p_unanswerable, probe_messages
from specrag.agent.prompt import PromptParts, encode_messages, prompt_ids
from specrag.agent.run_state import RunOptions, RunState
from specrag.agent.tool_gate import GateVerdict, ToolRelevance, call_opening_ids, call_probability
from specrag.decoding.request import GenerationEvent, GenerationRequest
from specrag.tools import ToolRegistry
from specrag.tools.formats import CallFormat


class FirstStepProbes:
    tokenizer: Any
    generate: Callable[[GenerationRequest], Iterator[GenerationEvent]]
    registry: ToolRegistry
    call_format: CallFormat
    relevance: ToolRelevance | None
    intent_gate: bool
    _answer_tokens: AnswerTokens | None
    # AgentLoop's own methods, which the probes build their prompts with
    _parts: Callable[[RunState, list[str]], PromptParts]
    _allowed_tools: Callable[[RunOptions], list[str]]

    def _gate(self, run: RunState, offered: list[str]) -> GateVerdict:
        """The irrelevance gate's verdict on the first step (``agent/tool_gate.py``)."""
        options = run.options
        similarity = probability = None
        held = False
        with run.trace.span("tool_gate") as span:
            if self.relevance is not None and options.min_tool_similarity is not None:
                schemas = [self.registry.get(name).openai_schema() for name in offered]
                similarity = self.relevance.similarity(run.question, schemas)
                held = similarity < options.min_tool_similarity
            if not held and self.intent_gate and options.min_call_probability is not None:
                probability = self._call_probability(run, offered)
                held = probability < options.min_call_probability
            verdict = GateVerdict(similarity, probability, held)
            span.set_attributes({key: value for key, value in verdict.record().items() if value is not None})
        return verdict

    def _call_probability(self, run: RunState, offered: list[str]) -> float:
        """P(the first step opens a call), from one forward over the first step's own prompt."""
        prompt = prompt_ids(self.tokenizer, self._parts(run, offered))
        capture = NextTokenLogits()
        request = GenerationRequest(prompt, max_tokens=1, speculation="off", logits_processors=[capture])
        for _ in self.generate(request):
            pass
        assert capture.logits is not None
        return call_probability(capture.logits, call_opening_ids(self.tokenizer, self.call_format.syntax.open.strip()))

    def _probe(self, run: RunState) -> dict[str, Any]:
        """P(no) of the answerability probe over the first step's prompt, and the gate's verdict."""
        options = run.options
        tool_names = self._allowed_tools(options) if options.max_steps > 1 else []
        with run.trace.span("answerability") as span:
            parts = self._parts(run, tool_names)
            prompt = encode_messages(self.tokenizer, probe_messages(parts), tools=parts.template_tools)
            capture = NextTokenLogits()
            request = GenerationRequest(prompt, max_tokens=1, speculation="off", logits_processors=[capture])
            stats = None
            for event in self.generate(request):
                stats = event.stats or stats
            assert capture.logits is not None
            if self._answer_tokens is None:
                self._answer_tokens = AnswerTokens.of(self.tokenizer)
            probability = p_unanswerable(capture.logits, self._answer_tokens)
            threshold = options.abstain_threshold
            record = {
                "p_unanswerable": probability,
                "threshold": threshold,
                "abstained": threshold is not None and probability >= threshold,
                "prompt_tokens": len(prompt),
                "cached_prompt_tokens": stats.cached_prompt_tokens if stats is not None else 0,
            }
            span.set_attributes(record)
        return record
