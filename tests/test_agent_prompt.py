"""The agent prompt puts what changes least first, so the prefix cache can serve it."""

from __future__ import annotations

from dataclasses import dataclass

from specrag.agent.prompt import PromptParts, build_messages, encode_messages
from specrag.decoding.model import CausalLM
from specrag.decoding.prefix_cache import PrefixCache, prefill_cached


@dataclass(frozen=True)
class Passage:
    id: str
    source: str
    text: str


PASSAGES = (
    Passage("a.md#0", "a.md", "The pass statement is a null operation."),
    Passage("b.md#3", "b.md", "The break statement ends the nearest enclosing loop."),
)
TOOL = {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}


def shared_prefix(first: list[int], second: list[int]) -> int:
    length = 0
    while length < min(len(first), len(second)) and first[length] == second[length]:
        length += 1
    return length


def test_order_is_system_and_tools_then_history_then_passages_and_question() -> None:
    history = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"})
    messages = build_messages(PromptParts("Why?", tool_schemas=[TOOL], passages=PASSAGES, history=history))
    assert [message["role"] for message in messages] == ["system", "user", "assistant", "user"]
    assert "- lookup(q: string)" in messages[0]["content"]
    last = messages[-1]["content"]
    assert last.index("[P1] (a.md)") < last.index("[P2] (b.md)") < last.index("Question: Why?")


def test_tool_schemas_render_the_same_whatever_their_key_order() -> None:
    reordered = {"parameters": TOOL["parameters"], "name": "lookup"}
    first = build_messages(PromptParts("q", tool_schemas=[TOOL]))
    second = build_messages(PromptParts("q", tool_schemas=[reordered]))
    assert first == second


def test_a_new_question_over_the_same_passages_reuses_all_but_the_question(smollm2: CausalLM) -> None:
    def ids(parts: PromptParts) -> list[int]:
        return encode_messages(smollm2.tokenizer, build_messages(parts))

    first_turn = PromptParts("What does pass do?", tool_schemas=[TOOL], passages=PASSAGES)
    first = ids(first_turn)
    second = ids(PromptParts("Where can break occur?", tool_schemas=[TOOL], passages=PASSAGES))
    question_tokens = len(smollm2.tokenizer("Where can break occur?", add_special_tokens=False)["input_ids"])
    assert shared_prefix(first, second) >= len(second) - question_tokens - 8
    cache = PrefixCache.for_model(smollm2, 1 << 28, block_tokens=16)
    prefill_cached(smollm2, cache.new_kv(), first, cache)
    assert prefill_cached(smollm2, cache.new_kv(), second, cache)[1] >= shared_prefix(first, second) - 16


def test_a_follow_up_turn_extends_the_first_turns_prompt(smollm2: CausalLM) -> None:
    first_turn = PromptParts("What does pass do?", tool_schemas=[TOOL], passages=PASSAGES)
    first = encode_messages(smollm2.tokenizer, build_messages(first_turn))
    history = (build_messages(first_turn)[-1], {"role": "assistant", "content": "Nothing [P1]."})
    follow_up = PromptParts("And break?", tool_schemas=[TOOL], passages=PASSAGES[1:], history=history)
    assert encode_messages(smollm2.tokenizer, build_messages(follow_up))[: len(first)] == first
