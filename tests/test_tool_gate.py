"""The irrelevance gate: a question no tool fits is answered in text, with no tools in view;
a question a tool fits goes through as before. Generation is scripted (the loop's decisions
are under test); the gate's signals are real functions over stand-in vectors and logits."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from specrag.agent.loop import AgentLoop, RunOptions
from specrag.agent.tool_gate import ToolRelevance, call_opening_ids, call_probability, tool_text
from specrag.agent.trace import Tracer, TraceStore
from specrag.decoding.model import CausalLM
from specrag.decoding.request import GenerationEvent, GenerationRequest
from specrag.decoding.stats import GenerationStats
from specrag.tools import ToolRegistry
from tests.agent_helpers import Scripted, add
from tests.test_tool_formats import hermes_tokenizer, tagged  # noqa: F401 (a fixture)


class ArithmeticEmbedder:
    """Unit vectors: one axis for arithmetic words, another for everything else."""

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        arithmetic = ("add", "sum", "integer", "plus")
        return np.array([[1.0, 0.0] if any(w in t.lower() for w in arithmetic) else [0.0, 1.0] for t in texts])


class ProbeThenScripted:
    """The intent probe (a one-token request with a logits processor) sees ``first_logits``;
    every other request gets the next scripted reply."""

    def __init__(self, tokenizer: Any, replies: list[str], first_logits: torch.Tensor) -> None:
        self.scripted = Scripted(tokenizer, replies)
        self.first_logits = first_logits
        self.probes: list[GenerationRequest] = []

    def __call__(self, request: GenerationRequest) -> Iterator[GenerationEvent]:
        if not request.logits_processors:
            yield from self.scripted(request)
            return
        self.probes.append(request)
        for processor in request.logits_processors:
            processor(list(request.prompt_tokens), self.first_logits.clone())
        stats = GenerationStats(prompt_tokens=len(request.prompt_tokens), output_tokens=1)
        yield GenerationEvent(0, [0], True, "length", stats, None)


def gated_loop(tokenizer: Any, generate: Any, intent: bool = False) -> tuple[AgentLoop, list[list[str]]]:
    grammars: list[list[str]] = []

    def grammar_for(registry: ToolRegistry, names: list[str], call_format: Any) -> None:
        grammars.append(list(names))

    loop = AgentLoop(
        tokenizer,
        generate,
        ToolRegistry([add]),
        grammar_for,
        tracer=Tracer(store=TraceStore()),
        relevance=ToolRelevance(ArithmeticEmbedder()),
        intent_gate=intent,
    )
    return loop, grammars


def test_a_question_no_tool_fits_is_answered_in_text_without_the_tools_in_view(hermes_tokenizer: Any) -> None:  # noqa: F811
    script = Scripted(hermes_tokenizer, ["Leaves drift down."])
    loop, grammars = gated_loop(hermes_tokenizer, script)
    result = loop.run("Write a haiku about autumn.")
    assert result["answer"] == "Leaves drift down." and grammars == [[]]  # the text-only grammar
    assert result["tool_gate"] == {"similarity": 0.0, "call_probability": None, "held": True}
    prompt = hermes_tokenizer.decode(script.requests[0].prompt_tokens)
    assert '"add"' not in prompt and "<tools>" not in prompt  # the model is shown no tool to write
    assert any(span["name"] == "tool_gate" for span in loop.tracer.store.get(result["trace_id"])["spans"])


def test_a_question_a_tool_fits_calls_it_and_the_gate_can_be_turned_off(hermes_tokenizer: Any) -> None:  # noqa: F811
    replies = [tagged(("add", {"a": 2, "b": 3})), "It is 5."]
    loop, grammars = gated_loop(hermes_tokenizer, Scripted(hermes_tokenizer, replies))
    result = loop.run("What is the sum of 2 and 3?")
    assert result["answer"] == "It is 5." and grammars[0] == ["add"] and not result["tool_gate"]["held"]
    loop, grammars = gated_loop(hermes_tokenizer, Scripted(hermes_tokenizer, list(replies)))
    ungated = loop.run("Write a haiku about autumn.", RunOptions(min_tool_similarity=None))
    assert grammars[0] == ["add"] and ungated["tool_gate"]["similarity"] is None


@pytest.mark.parametrize(("favoured", "held"), [("{", False), ("The", True)])
def test_the_intent_probe_holds_the_step_when_the_model_would_not_open_a_call(
    hermes_tokenizer: Any,  # noqa: F811
    favoured: str,
    held: bool,
) -> None:
    logits = torch.zeros(len(hermes_tokenizer))
    logits[hermes_tokenizer(favoured, add_special_tokens=False)["input_ids"][0]] = 30.0
    replies = ["It is 5."] if held else [tagged(("add", {"a": 2, "b": 3})), "It is 5."]
    generate = ProbeThenScripted(hermes_tokenizer, replies, logits)
    loop, grammars = gated_loop(hermes_tokenizer, generate, intent=True)
    result = loop.run("What is the sum of 2 and 3?")
    assert result["tool_gate"]["held"] is held and result["answer"] == "It is 5."
    assert grammars[0] == ([] if held else ["add"])
    probe, first_step = generate.probes[0], generate.scripted.requests[0]
    assert probe.max_tokens == 1 and probe.speculation == "off"
    if not held:  # the probe's prompt is the first step's own, so the prefix cache serves the step
        assert list(probe.prompt_tokens) == list(first_step.prompt_tokens)


def test_call_openings_are_braces_fences_and_the_tag(smollm2: CausalLM) -> None:
    tokenizer = smollm2.tokenizer
    ids = set(call_opening_ids(tokenizer, "<tool_call>"))
    first = [tokenizer(text, add_special_tokens=False)["input_ids"][0] for text in ("{", " {", "```", "The", "Sure")]
    assert first[0] in ids and first[1] in ids and first[2] in ids
    assert first[3] not in ids and first[4] not in ids
    logits = torch.full((smollm2.vocab_size,), -30.0)
    logits[first[0]] = logits[first[3]] = 0.0
    assert call_probability(logits, sorted(ids)) == pytest.approx(0.5, abs=1e-3)


def test_tool_text_reads_name_description_and_parameters() -> None:
    text = tool_text(ToolRegistry([add]).get("add").openai_schema())
    assert text.startswith("add: Add two integers.") and "a: First." in text and "b: Second." in text


def test_the_http_request_can_turn_the_gate_off() -> None:
    import msgspec

    from specrag.agent.api_models import AgentRunRequest, ServerLimits
    from specrag.agent.routes_runs import run_options as _run_options

    class _Agent:
        registry = ToolRegistry([add])
        model = type("Model", (), {"tokenizer": staticmethod(lambda text, **_: {"input_ids": [0]})})()

    off = msgspec.convert({"question": "q", "tool_gate": False}, AgentRunRequest)
    on = msgspec.convert({"question": "q"}, AgentRunRequest)
    options_off, options_on = (_run_options(_Agent(), body, ServerLimits(max_prompt_tokens=4096)) for body in (off, on))
    assert options_off.min_tool_similarity is None and options_off.min_call_probability is None
    assert options_on.min_tool_similarity == 0.18 and options_on.min_call_probability == 0.75
