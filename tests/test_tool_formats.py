"""Native tool-call formats: parsing, the grammars that constrain them, and the loop with them.

The Qwen packs' chat templates write calls in ``<tool_call>`` tags; no Qwen model runs in
CI, so the tagged path runs here on smollm2's tokenizer given a Hermes-style template (the
real Qwen models are measured by ``specrag eval tools``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from specrag.agent.events import FinalEvent, TokenEvent
from specrag.agent.loop import AgentLoop, canonical_call, uses_results
from specrag.agent.prompt import (
    ANSWER_REQUEST,
    PASSAGES_AND_TOOLS_SYSTEM,
    TOOLS_SYSTEM,
    PromptParts,
    default_system,
    system_message,
)
from specrag.agent.trace import Tracer, TraceStore
from specrag.decoding.grammar_compile import JSON_OBJECT_OPENINGS, text_without_ebnf
from specrag.decoding.model import CausalLM
from specrag.tools import ToolCall, ToolError, ToolRegistry, ToolResult
from specrag.tools.formats import BARE_JSON, HERMES, TAGGED_JSON, format_for
from tests.agent_helpers import Scripted, add

HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{{ messages[0]['content'] if messages[0]['role'] == 'system' else '' }}"
    "\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\nFor each function call, "
    'return <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and tools %}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{%- for call in message.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@pytest.fixture(scope="module")
def hermes_tokenizer(smollm2: CausalLM) -> Any:
    tokenizer = AutoTokenizer.from_pretrained(smollm2.tokenizer.name_or_path)
    tokenizer.chat_template = HERMES_TEMPLATE
    return tokenizer


def test_the_format_follows_the_chat_template(smollm2: CausalLM, hermes_tokenizer: Any) -> None:
    assert format_for(smollm2.tokenizer) is BARE_JSON  # smollm2's template knows nothing of tools
    assert format_for(hermes_tokenizer) is HERMES


def test_hermes_calls_are_read_tagged_bare_or_fenced() -> None:
    one = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert HERMES.parse(one) == [ToolCall("add", {"a": 1, "b": 2})]
    two = one + '\n<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
    assert [call.arguments for call in HERMES.parse(two) or []] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    assert HERMES.parse('{"name": "add", "arguments": {"a": 1, "b": 2}}') == [ToolCall("add", {"a": 1, "b": 2})]
    fenced = '```json\n{\n  "name": "add",\n  "arguments": {"a": 1, "b": 2}\n}\n```'
    assert HERMES.parse(fenced) == [ToolCall("add", {"a": 1, "b": 2})]
    assert HERMES.parse("The sum is 3.") is None
    schema_as_text = '```json\n{\n  "name": "function",\n  "parameters": {"type": "object"}\n}\n```'
    assert HERMES.parse(schema_as_text) is None  # text by the grammar, so text here (seen from the 1.5B)
    for broken in ('<tool_call>\n{"name": "add", "argu', "<tool_call>\n{}\n</tool_call> trailing text"):
        with pytest.raises(ValueError):
            HERMES.parse(broken)


def test_the_assistant_turn_goes_back_in_the_templates_own_shape() -> None:
    calls = [ToolCall("add", {"a": 1, "b": 2})]
    assert HERMES.assistant_message("ignored", calls) == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}],
    }
    assert BARE_JSON.assistant_message(' {"name": "add"} ', calls) == {
        "role": "assistant",
        "content": '{"name": "add"}',
    }


@pytest.fixture(scope="module")
def text_grammar(smollm2: CausalLM) -> xgr.CompiledGrammar:
    grammar = xgr.Grammar.from_ebnf(text_without_ebnf(["<tool_call>", '"arguments"'], first_not="{"))
    return xgr.GrammarCompiler(smollm2.grammar_compiler.tokenizer_info).compile_grammar(grammar)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet='<tool_cal>{}"rgumens x', min_size=1, max_size=24))
def test_text_answers_never_contain_call_syntax(text_grammar: xgr.CompiledGrammar, text: str) -> None:
    matcher = xgr.GrammarMatcher(text_grammar)
    accepted = matcher.accept_string(text) and matcher.is_completed()
    expected = not text.startswith("{") and "<tool_call>" not in text and '"arguments"' not in text
    assert accepted == expected


@pytest.fixture(scope="module")
def no_json_object_grammar(smollm2: CausalLM) -> xgr.CompiledGrammar:
    grammar = xgr.Grammar.from_ebnf(text_without_ebnf(list(JSON_OBJECT_OPENINGS)))
    return xgr.GrammarCompiler(smollm2.grammar_compiler.tokenizer_info).compile_grammar(grammar)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet='{"\n \ta', min_size=1, max_size=16))
def test_text_answers_never_open_a_json_object_whatever_the_layout(
    no_json_object_grammar: xgr.CompiledGrammar, text: str
) -> None:
    matcher = xgr.GrammarMatcher(no_json_object_grammar)
    accepted = matcher.accept_string(text) and matcher.is_completed()
    assert accepted == (not any(opening in text for opening in JSON_OBJECT_OPENINGS))


def test_the_hermes_grammar_takes_every_written_form_and_text_but_no_broken_call(smollm2: CausalLM) -> None:
    compiler = smollm2.grammar_compiler
    grammar = ToolRegistry([add]).grammar(compiler, allow_text=True, syntax=HERMES.syntax)

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammar.compiled)
        return matcher.accept_string(text) and matcher.is_completed()

    call = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    assert accepts(f"<tool_call>\n{call}\n</tool_call>")
    assert accepts(f"<tool_call>\n{call}\n</tool_call>\n<tool_call>\n{call}\n</tool_call>")  # parallel
    assert accepts(call) and accepts('```json\n{\n  "name": "add", "arguments": {"a": 1, "b": 2}\n}\n```')
    assert accepts("The sum is 3.") and accepts("Its name is add; its arguments are two numbers.")
    assert accepts("In Python: d = {'a': 1}") and accepts("The set {1, 2} has two elements.")
    assert not accepts('{"name": "add", "arguments": {"a": "one"}}')  # b missing, a not an integer
    assert not accepts(f"Sure: {call}")  # call syntax inside a text answer
    text_only = compiler.text_answer(HERMES.syntax)
    matcher = xgr.GrammarMatcher(text_only.compiled)
    assert not (matcher.accept_string(f"<tool_call>\n{call}") and matcher.is_completed())
    evasions = ('```json\n{"name": "add", "arguments\': {"a": 1}}\n```', "Call add with 'arguments': 1")
    spaced = ('<tools>\n{"name": "add", " arguments ": {"a": 1}}', "<tools>\n{' name ': 'add'}")  # the 1.5B
    spaced += ('```json\n{\n  "function": "add",\n  "parameters": {"a": 1}\n}\n```', 'Use {"a": 1}.')
    for evasion in (*evasions, '<tools>\n{"name": "add", " arguments": {"a": 1}}', *spaced):
        matcher = xgr.GrammarMatcher(text_only.compiled)
        assert not (matcher.accept_string(evasion) and matcher.is_completed())  # seen from the 0.5B


def test_the_system_prompt_follows_what_is_offered() -> None:
    assert default_system(has_passages=False, has_tools=True) == TOOLS_SYSTEM
    assert default_system(has_passages=True, has_tools=True) == PASSAGES_AND_TOOLS_SYSTEM
    assert "not in the documents" not in TOOLS_SYSTEM
    schema = ToolRegistry([add]).openai_schemas()
    native = PromptParts("q", tool_schemas=schema, call_format=HERMES)
    assert system_message(native) == TOOLS_SYSTEM and native.template_tools == schema  # the template lists them
    bare = PromptParts("q", tool_schemas=schema, call_format=BARE_JSON)
    assert "- add(" in system_message(bare) and bare.template_tools is None
    assert "<tool_call>" not in system_message(bare)
    tags = PromptParts("q", tool_schemas=schema, call_format=TAGGED_JSON)
    assert '<tool_call>{"name": "<tool>"' in system_message(tags) and "- add(" in system_message(tags)
    assert tags.template_tools is None


def test_tagged_json_reads_calls_between_tags_for_templates_without_tools() -> None:
    one = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    two = one + "\n" + one.replace("1", "3").replace("2", "4")
    assert [call.arguments for call in TAGGED_JSON.parse(two) or []] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    assert TAGGED_JSON.parse("It is 3.") is None
    assert TAGGED_JSON.assistant_message("<tool_call>{}</tool_call>", [])["content"] == "<tool_call>{}</tool_call>"


def tagged(*calls: tuple[str, dict[str, Any]]) -> str:
    return "\n".join(
        f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>" for name, arguments in calls
    )


def hermes_loop(tokenizer: Any, replies: list[str]) -> tuple[AgentLoop, Scripted, list[tuple[list[str], str]]]:
    script = Scripted(tokenizer, replies)
    grammars: list[tuple[list[str], str]] = []

    def grammar_for(registry: ToolRegistry, names: list[str], call_format: Any) -> None:
        grammars.append((list(names), call_format.name))

    loop = AgentLoop(tokenizer, script, ToolRegistry([add]), grammar_for, tracer=Tracer(store=TraceStore()))
    return loop, script, grammars


def test_parallel_calls_run_and_come_back_as_tool_messages(hermes_tokenizer: Any) -> None:
    loop, script, _ = hermes_loop(
        hermes_tokenizer, [tagged(("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})), "3 and 7."]
    )
    result = loop.run("Add 1 and 2, and 3 and 4.")
    assert [step["tool_result"]["content"] for step in result["steps"][:2]] == ["3", "7"]
    assert [step["index"] for step in result["steps"]] == [0, 0, 1] and result["answer"] == "3 and 7."
    second = hermes_tokenizer.decode(script.requests[1].prompt_tokens)
    assert second.count("<tool_response>") == 2 and second.count("<tool_call>") == 3  # 1 in the system prompt


def test_a_repeated_call_is_not_run_again_nor_written_and_the_next_step_may_only_answer(
    hermes_tokenizer: Any,
) -> None:
    same = tagged(("add", {"a": 1, "b": 2}))
    loop, script, grammars = hermes_loop(hermes_tokenizer, [same, same, "It is 3."])
    result = loop.run("What is 1 + 2?")
    calls = [step for step in result["steps"] if step["kind"] == "tool_call"]
    assert [step["repeated"] for step in calls] == [False, True]
    assert [step["tool_result"]["content"] for step in calls] == ["3", "3"]  # the earlier result
    assert grammars == [(["add"], "hermes"), (["add"], "hermes"), ([], "hermes")]  # text only after the repeat
    # asked again from where it stood (the repeat is not in the conversation), for an answer
    second, third = (hermes_tokenizer.decode(request.prompt_tokens) for request in script.requests[1:])
    opening = "<|im_start|>assistant"
    schema = "Add two integers."
    assert schema in second and schema not in third  # an answer step shows no tools to write
    assert third.count("<tool_response>") == 1 and third.count(opening) == second.count(opening)
    assert ANSWER_REQUEST.format(question="What is 1 + 2?") in third
    assert result["answer"] == "It is 3." and canonical_call(ToolCall("add", {"b": 2, "a": 1})) == canonical_call(
        ToolCall("add", {"a": 1, "b": 2})
    )


def test_a_turn_mixing_new_and_repeated_calls_runs_and_keeps_only_the_new_ones(hermes_tokenizer: Any) -> None:
    first = tagged(("add", {"a": 1, "b": 2}))
    mixed = tagged(("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4}), ("add", {"a": 3, "b": 4}))
    loop, script, grammars = hermes_loop(hermes_tokenizer, [first, mixed, "3 and 7."])
    result = loop.run("Add 1 and 2, then 3 and 4.")
    calls = [step for step in result["steps"] if step["kind"] == "tool_call"]
    assert [step["repeated"] for step in calls] == [False, True, False, True]
    assert [step["tool_result"]["content"] for step in calls] == ["3", "3", "7", "7"]
    third = hermes_tokenizer.decode(script.requests[2].prompt_tokens)
    assert third.count('"a": 3') == 1 and third.count("<tool_response>") == 2
    assert grammars[2] == (["add"], "hermes") and result["answer"] == "3 and 7."


def test_an_answer_that_ignores_the_results_is_asked_for_again_and_only_the_kept_one_is_streamed(
    hermes_tokenizer: Any,
) -> None:
    loop, script, grammars = hermes_loop(
        hermes_tokenizer, [tagged(("add", {"a": 20, "b": 17})), "The latest price of a stock.", "It is 37."]
    )
    events = list(loop.events("What is 20 + 17?"))
    result = next(event.result for event in events if isinstance(event, FinalEvent))
    assert result["answer"] == "It is 37." and grammars[2] == ([], "hermes")  # the re-ask: text only
    assert [step.get("ignored_results", False) for step in result["steps"]] == [False, True, False]
    third = hermes_tokenizer.decode(script.requests[2].prompt_tokens)
    assert ANSWER_REQUEST.format(question="What is 20 + 17?") in third and "latest price" not in third
    streamed = "".join(event.text for event in events if isinstance(event, TokenEvent))
    assert streamed == "It is 37."


def test_an_answer_that_uses_a_result_is_kept_first_time(hermes_tokenizer: Any) -> None:
    loop, script, _ = hermes_loop(hermes_tokenizer, [tagged(("add", {"a": 2, "b": 2})), "Four, that is 4."])
    assert loop.run("2 + 2?")["answer"] == "Four, that is 4." and len(script.requests) == 2


@pytest.mark.parametrize(
    ("answer", "results", "uses"),
    [
        ("It is about 4828 metres.", ["4828.03 m"], True),  # rounded
        ("It is 37,200.", ["37200"], True),
        ("The latest price of a stock.", ["37200"], False),
        ("It is 372.", ["37200"], False),
        ("The meeting is booked.", ["Booked the green room at 14:00 for Ana."], False),
        ("Your green room is booked.", ["Booked the green room for Ana."], True),
        ("Done.", [""], True),  # nothing to use
    ],
)
def test_uses_results_reads_numbers_first_then_words(answer: str, results: list[str], uses: bool) -> None:
    assert uses_results(answer, [ToolResult("tool", content) for content in results]) is uses


def test_an_answer_after_failed_tools_only_is_kept() -> None:
    failed = ToolResult("explode", "RuntimeError: boom 42", ToolError("exception", "boom 42"))
    assert uses_results("Sorry, that failed.", [failed])
    assert not uses_results("Sorry, that failed.", [failed, ToolResult("add", "5")])


def test_the_last_step_may_only_answer_in_text_with_no_tools_in_view(hermes_tokenizer: Any) -> None:
    loop, script, grammars = hermes_loop(hermes_tokenizer, [tagged(("add", {"a": 1, "b": 1})), "Two."])
    loop.run("1 + 1?", loop_options(max_steps=2))
    assert grammars == [(["add"], "hermes"), ([], "hermes")]  # the text branch of the tool grammar
    first, last = (hermes_tokenizer.decode(request.prompt_tokens) for request in script.requests)
    assert "Add two integers." in first and "Add two integers." not in last
    assert TOOLS_SYSTEM in last and "<tool_response>\n2\n</tool_response>" in last  # still told of tool results


def loop_options(**values: Any) -> Any:
    from specrag.agent.loop import RunOptions

    return RunOptions(**values)


class _TemplateAgent:
    """What plan_chat reads of an agent: the model's tokenizer and grammar compiler, and the
    call format (here smollm2's vocabulary under a Hermes-style template)."""

    def __init__(self, smollm2: CausalLM, tokenizer: Any) -> None:
        self.model = type("Model", (), {"tokenizer": tokenizer, "grammar_compiler": smollm2.grammar_compiler})()
        self.call_format = HERMES


def test_the_openai_endpoint_renders_native_tools_and_reads_parallel_calls(
    smollm2: CausalLM, hermes_tokenizer: Any
) -> None:
    import msgspec

    from specrag.agent.api_models import ChatCompletionRequest, ServerLimits
    from specrag.agent.openai_compat import ChatRun, plan_chat

    add_tool = ToolRegistry([add]).openai_schemas()[0]
    earlier_call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}}
    body = msgspec.convert(
        {
            "messages": [
                {"role": "user", "content": "Add 1 and 1, then 2 and 2 and 3 and 3."},
                {"role": "assistant", "content": None, "tool_calls": [earlier_call]},
                {"role": "tool", "tool_call_id": "c1", "content": "2"},
            ],
            "tools": [add_tool],
        },
        ChatCompletionRequest,
    )
    plan = plan_chat(_TemplateAgent(smollm2, hermes_tokenizer), body, ServerLimits(max_prompt_tokens=4096))
    prompt = hermes_tokenizer.decode(plan.prompt)
    assert "<tools>" in prompt and '"name": "add"' in prompt  # the template rendered the tool
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}' in prompt  # the earlier call, natively
    assert "<tool_response>\n2\n</tool_response>" in prompt
    run = ChatRun(None, plan, None, 0.0)
    run.text = tagged(("add", {"a": 2, "b": 2}), ("add", {"a": 3, "b": 3}))
    message, finish_reason = run.message()
    assert finish_reason == "tool_calls"
    assert [json.loads(call["function"]["arguments"]) for call in message["tool_calls"]] == [
        {"a": 2, "b": 2},
        {"a": 3, "b": 3},
    ]
