"""A repeated call replaced by the model's cheapest deviation (agent/repeat_deviation.py):
the margins, the grammar's say in them, the ban's exactness under speculation, and the loop."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import xgrammar as xgr

from specrag.agent.call_rules import canonical_call, grounded, grounding_sources, made_before
from specrag.agent.loop import AgentLoop
from specrag.agent.repeat_deviation import BanAt, MarginRecorder, deviations
from specrag.agent.run_state import RunOptions
from specrag.agent.trace import Tracer, TraceStore
from specrag.decoding.engine import Engine
from specrag.decoding.grammar_compile import GrammarCompiler
from specrag.decoding.request import GenerationEvent, GenerationRequest, apply_processors
from specrag.decoding.stats import CycleInfo, GenerationStats
from specrag.tools import ToolCall, ToolError, ToolRegistry, ToolResult, tool
from tests.agent_helpers import add
from tests.conftest import tiny_causal_lm
from tests.test_grammar import EOS, VOCAB, encode
from tests.test_tool_formats import hermes_tokenizer, tagged  # noqa: F401  (a fixture)


def row(vocab: int, **logits: float) -> torch.Tensor:
    """A logits row: zero everywhere but the given ``t<id>=value`` entries."""
    values = torch.zeros(vocab)
    for name, value in logits.items():
        values[int(name[1:])] = value
    return values


def record(recorder: MarginRecorder, prompt: list[int], output: list[int], rows: list[torch.Tensor]) -> None:
    for position, logits in enumerate(rows):
        recorder([*prompt, *output[:position]], logits)


def test_the_least_sure_position_after_the_first_is_the_one_to_change() -> None:
    recorder = MarginRecorder(prompt_length=2)
    output = [5, 7, 9]
    record(recorder, [1, 1], output, [row(12, t5=3.0, t6=2.9), row(12, t7=4.0, t3=3.0), row(12, t9=2.0, t4=1.5)])
    found = deviations(recorder, output, grammar=None)
    assert [(found.position, found.written, found.alternative) for found in found] == [(2, 9, 4), (1, 7, 3)]
    assert [found.margin for found in found] == pytest.approx([0.5, 1.0])
    first = deviations(recorder, output, grammar=None, first_position=0)[0]
    assert (first.position, first.alternative) == (0, 6)  # call or answer: excluded by default
    recorder.rows.clear()
    assert deviations(recorder, output, grammar=None) == []  # nothing scored: nothing to change


def test_only_a_change_of_a_name_or_a_value_counts() -> None:
    texts = {0: "<tool_call>", 1: "{\n", 2: '{"', 3: '  "a": ', 4: "1", 5: "3", 6: "}", 7: "json", 8: "python"}
    output = [0, 7, 1, 3, 4, 6]  # the fence's language before the JSON, then its layout

    def spell(ids: Any) -> str:
        return "".join(texts[token] for token in ids)

    recorder = MarginRecorder(prompt_length=0)
    rows = [
        row(9, t0=9.0),
        row(9, t7=5.0, t8=4.95),
        row(9, t1=5.0, t2=4.9, t5=1.0),
        row(9, t3=9.0),
        row(9, t4=5.0, t2=4.5, t5=3.0),  # the closest alternative is no value
        row(9, t6=9.0),
    ]
    record(recorder, [], output, rows)
    assert [found.position for found in deviations(recorder, output, grammar=None)][:3] == [1, 2, 4]  # unspelt
    spelt = deviations(recorder, output, grammar=None, spell=spell)
    best = spelt[0]
    assert {found.position for found in spelt} <= {3, 4, 5}
    assert (best.position, best.written, best.alternative) == (4, 4, 5)
    assert best.margin == pytest.approx(2.0) and best.banned == (4, 2)  # so that "3" comes first


def test_only_tokens_the_grammar_allows_count_as_alternatives() -> None:
    compiler = GrammarCompiler(xgr.TokenizerInfo(VOCAB, vocab_size=len(VOCAB), stop_token_ids=[EOS]))
    grammar = compiler.json_schema({"enum": ["ab", "cd"]})
    output = [*encode('"ab"'), EOS]
    quote, a, b, c, z = (VOCAB.index(char) for char in '"abcz')
    vocab = len(VOCAB)
    rows = [
        row(vocab, **{f"t{quote}": 5.0}),  # forced: no alternative however close
        row(vocab, **{f"t{a}": 5.0, f"t{z}": 4.9, f"t{c}": 3.0}),  # z is closer, but only c is allowed
        row(vocab, **{f"t{b}": 5.0, f"t{c}": 4.99}),  # "a" can only go on with "b"
        row(vocab, **{f"t{quote}": 5.0}),
        row(vocab, **{f"t{EOS}": 5.0}),
    ]
    recorder = MarginRecorder(prompt_length=0)
    record(recorder, [], output, rows)
    [only] = deviations(recorder, output, grammar, first_position=0)
    assert (only.position, only.written, only.alternative) == (1, a, c)
    assert only.margin == pytest.approx(2.0)


@pytest.mark.parametrize("speculation", ["off", "on"])
def test_a_ban_changes_the_one_position_and_speculation_stays_exact(speculation: str) -> None:
    engine = Engine(tiny_causal_lm(48, seed=3))
    prompt = [3, 17, 5, 22, 9, 31, 4]

    def greedy(processors: list[Any], sources: list[list[int]]) -> list[int]:
        request = GenerationRequest(
            prompt, max_tokens=16, stop_token_ids=[], speculation=speculation, lookup_sources=sources,
            logits_processors=processors,
        )  # fmt: skip
        return [token for event in engine.generate(request) for token in event.token_ids]

    recorder = MarginRecorder(len(prompt))
    plain = greedy([recorder], [])
    position = 6
    banned = greedy([BanAt(len(prompt), plain[:position], [plain[position]])], [plain])  # lookup proposes the banned
    assert banned[:position] == plain[:position] and banned[position] != plain[position]
    values, ids = recorder.rows[tuple(plain[:position])]
    assert banned[position] == int(ids[1]) and float(values[0]) >= float(values[1])  # the model's second choice
    again = Engine(tiny_causal_lm(48, seed=3))
    off = GenerationRequest(
        prompt, max_tokens=16, stop_token_ids=[], speculation="off",
        logits_processors=[BanAt(len(prompt), plain[:position], [plain[position]])],
    )  # fmt: skip
    assert banned == [token for event in again.generate(off) for token in event.token_ids]


class Choosing:
    """Scripted replies that honour the logits processors: a reply may be a pair (written,
    second choice), scored so that the second choice is closest where they first differ; a
    ban of the written token there switches to the second choice."""

    def __init__(self, tokenizer: Any, replies: list[str | tuple[str, str]]) -> None:
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.vocab = len(tokenizer)

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def __call__(self, request: GenerationRequest) -> Iterator[GenerationEvent]:
        reply = self.replies.pop(0)
        written, second = (reply, reply) if isinstance(reply, str) else reply
        tokens, other = self.ids(written), self.ids(second)
        split = next((i for i, (x, y) in enumerate(zip(tokens, other, strict=False)) if x != y), len(tokens))
        prompt = list(request.prompt_tokens)
        for position in range(len(tokens)):
            logits = torch.zeros(self.vocab)
            logits[tokens[position]] = 10.0
            logits[other[position] if position == split else 0] = 9.5 if position == split else 5.0
            scored = apply_processors(request.logits_processors, [*prompt, *tokens[:position]], logits)
            if scored[tokens[position]] == -math.inf:
                tokens = [*tokens[:position], *other[position:]]
                break
        stats = GenerationStats(prompt_tokens=len(prompt), output_tokens=len(tokens))
        now = time.monotonic_ns()
        cycle = CycleInfo("plain", now, now + 1000, 0, 0, None, {})
        yield GenerationEvent(0, tokens, True, "stop", stats, cycle)


@tool
def capital(country: str) -> str:
    """The capital of a country.

    Args:
        country: Its name.
    """
    return {"kenya": "Nairobi", "chile": "Santiago"}[country.strip().lower()]


def choosing_loop(
    tokenizer: Any, replies: list[str | tuple[str, str]], tools: tuple[Any, ...] = (add,)
) -> tuple[AgentLoop, list[list[str]]]:
    grammars: list[list[str]] = []

    def grammar_for(registry: ToolRegistry, names: list[str], call_format: Any) -> None:
        grammars.append(list(names))

    script = Choosing(tokenizer, replies)
    registry = ToolRegistry(list(tools))
    return AgentLoop(tokenizer, script, registry, grammar_for, tracer=Tracer(store=TraceStore())), grammars


def test_a_repeat_is_generated_again_with_the_cheapest_change_and_the_new_call_runs(
    hermes_tokenizer: Any,  # noqa: F811
) -> None:
    first, second = tagged(("add", {"a": 1, "b": 2})), tagged(("add", {"a": 3, "b": 2}))
    pair = (first, second)
    loop, grammars = choosing_loop(hermes_tokenizer, [first, pair, pair, "3 and 5."])  # one per generation
    result = loop.run("Add 1 and 2, and 3 and 2.")
    calls = [step for step in result["steps"] if step["kind"] == "tool_call"]
    assert [step["tool_result"]["content"] for step in calls] == ["3", "5"]
    assert not any(step["repeated"] for step in calls) and result["answer"] == "3 and 5."
    [deviation] = result["deviations"]
    assert deviation["outcome"] == "ran" and deviation["step"] == 1 and deviation["margin"] == pytest.approx(0.5)
    assert grammars == [["add"], ["add"], ["add"], ["add"]]  # the second try of step 1 offers the tools too


def test_a_repeat_whose_cheapest_change_costs_too_much_is_answered_instead(hermes_tokenizer: Any) -> None:  # noqa: F811
    first, second = tagged(("add", {"a": 1, "b": 2})), tagged(("add", {"a": 3, "b": 2}))
    loop, grammars = choosing_loop(hermes_tokenizer, [first, (first, second), "It is 3."])
    result = loop.run("What is 1 + 2?", RunOptions(max_deviation_margin=0.25))
    calls = [step for step in result["steps"] if step["kind"] == "tool_call"]
    assert [step["repeated"] for step in calls] == [False, True] and result["answer"] == "It is 3."
    assert result["deviations"] == []
    assert grammars == [["add"], ["add"], []]  # text only after the repeat, as before


def test_a_changed_call_with_a_value_from_nowhere_is_not_run(hermes_tokenizer: Any) -> None:  # noqa: F811
    first, invented = tagged(("add", {"a": 1, "b": 2})), tagged(("add", {"a": 9, "b": 2}))
    pair = (first, invented)
    loop, grammars = choosing_loop(hermes_tokenizer, [first, pair, pair, "It is 3."])
    result = loop.run("What is 1 + 2?", RunOptions(max_deviation_margin=1.0))
    calls = [step for step in result["steps"] if step["kind"] == "tool_call"]
    assert [step["repeated"] for step in calls] == [False, True] and result["answer"] == "It is 3."
    assert [deviation["outcome"] for deviation in result["deviations"]] == ["ungrounded"]
    assert grammars == [["add"], ["add"], ["add"], []]


def test_a_call_differing_only_in_case_or_spaces_was_made_before_loosely() -> None:
    executed = {canonical_call(ToolCall("country_fact", {"country": "Kenya", "fact": "capital"})): ToolResult("x", "")}
    variant = ToolCall("country_fact", {"country": " kenya", "fact": "capital"})
    assert made_before(variant, executed, loosely=True) and not made_before(variant, executed)
    assert not made_before(ToolCall("country_fact", {"country": "Chile", "fact": "capital"}), executed, loosely=True)


def test_a_call_is_grounded_when_every_value_is_written_somewhere() -> None:
    sources = ["What are the capitals of France and Japan?", '{"arguments": {"fact": "capital"}}', "-3.9 celsius"]
    assert grounded(ToolCall("country_fact", {"country": "japan", "fact": "capital"}), sources)
    assert grounded(ToolCall("convert", {"value": -3.9, "unit": "Celsius", "exact": True}), sources)
    assert not grounded(ToolCall("convert", {"value": 25, "unit": "celsius"}), sources)
    assert not grounded(ToolCall("country_fact", {"country": "Kenya", "fact": "capital"}), sources)
    assert grounded(ToolCall("noop", {"nested": {"items": ["France", 3.9]}}), sources)


def test_an_error_message_is_no_value_a_changed_call_may_take() -> None:
    asked = ToolCall("stock_price", {"symbol": "ZZZZ"})
    error = "KeyError: \"unknown ticker symbol 'ZZZZ'\""
    executed = {canonical_call(asked): ToolResult("stock_price", error, ToolError("exception", error))}
    sources = grounding_sources("What is the price of ZZZZ stock?", executed)
    assert grounded(asked, sources)  # the question's own value
    assert not grounded(ToolCall("stock_price", {"symbol": "unknown ticker symbol 'ZZZZ'"}), sources)
    executed[canonical_call(ToolCall("stock_price", {"symbol": "ACME"}))] = ToolResult("stock_price", "GLOBEX 87.8")
    sources = grounding_sources("What is the price of ZZZZ stock?", executed)
    assert grounded(ToolCall("stock_price", {"symbol": "GLOBEX"}), sources)  # a result that succeeded


def test_a_change_that_turns_the_call_into_text_is_not_the_answer(hermes_tokenizer: Any) -> None:  # noqa: F811
    first = tagged(("add", {"a": 1, "b": 2}))
    pair = (first, '<tool_call>\n{"name": "sum it up yourself')  # not a call: text
    loop, grammars = choosing_loop(hermes_tokenizer, [first, pair, pair, "It is 3."])
    result = loop.run("What is 1 + 2?", RunOptions(max_deviation_margin=1.0))
    assert [deviation["outcome"] for deviation in result["deviations"]] == ["text"]
    assert result["answer"] == "It is 3." and grammars == [["add"], ["add"], ["add"], []]


def test_a_change_keeps_its_new_call_and_drops_a_spelling_variant_of_an_old_one(
    hermes_tokenizer: Any,  # noqa: F811
) -> None:
    first = tagged(("capital", {"country": "Kenya"}))
    changed = tagged(("capital", {"country": "Chile"}), ("capital", {"country": " kenya"}))
    pair = (first, changed)
    loop, _ = choosing_loop(hermes_tokenizer, [first, pair, pair, "Nairobi and Santiago."], tools=(capital,))
    result = loop.run("What are the capitals of Kenya and Chile?", RunOptions(max_deviation_margin=1.0))
    calls = [step for step in result["steps"] if step["kind"] == "tool_call"]
    assert [step["tool_call"]["arguments"]["country"] for step in calls] == ["Kenya", "Chile"]
    assert [deviation["outcome"] for deviation in result["deviations"]] == ["ran"]
