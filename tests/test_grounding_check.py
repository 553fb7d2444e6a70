"""The run's groundedness check (agent/grounding/check.py): answers the passages hold are
grounded, invented ones are marked or withheld, and a withheld answer is never streamed."""

from __future__ import annotations

import pytest

from specrag.agent.answerability import ABSTENTION
from specrag.agent.events import TokenEvent
from specrag.agent.grounding import GroundednessResult, SentenceVerdict
from specrag.agent.grounding.check import evidence_texts, grounding_record, is_grounded
from specrag.agent.loop import AgentLoop, RunOptions
from specrag.agent.trace import Tracer, TraceStore
from specrag.decoding.model import CausalLM
from specrag.retrieval import Retriever
from specrag.tools import ToolRegistry
from tests.agent_helpers import Scripted, add, call
from tests.retrieval_helpers import sample_index, shared_embedder

QUESTION = "What does the assert statement do?"
INVENTED = "The assert statement was added in Python 3.11 by the Steering Council after 42 votes."


@pytest.fixture(scope="module")
def retriever(tmp_path_factory: pytest.TempPathFactory) -> Retriever:
    root, _ = sample_index(tmp_path_factory.getbasetemp())
    return Retriever.open(root, shared_embedder())


def verdict(supported: bool | None, text: str = "A claim about things.") -> SentenceVerdict:
    return SentenceVerdict(text, supported, None, "", "reason")


def test_an_answer_is_grounded_when_enough_of_its_claims_are_supported() -> None:
    half = GroundednessResult(0.5, [verdict(True), verdict(False, "An invented claim here.")])
    assert is_grounded(half, 0.5) and not is_grounded(half, 0.6)
    assert is_grounded(GroundednessResult(None, [verdict(None)]), 1.0)  # nothing scorable: nothing wrong
    assert not is_grounded(GroundednessResult(None, [verdict(None, "[P1]")]), 0.0)  # but saying nothing is no answer
    record = grounding_record(half, 0.6)
    assert record["grounded"] is False and record["scorable"] == 2
    assert record["unsupported"] == [{"text": "An invented claim here.", "reason": "reason"}]


def test_tool_results_are_evidence_too() -> None:
    assert evidence_texts(["passage"], ["5", "  "]) == ["passage", "5"]


def loop_over(smollm2: CausalLM, retriever: Retriever, replies: list[str]) -> AgentLoop:
    return AgentLoop(
        smollm2.tokenizer,
        Scripted(smollm2.tokenizer, replies),
        ToolRegistry([add]),
        lambda registry, names, call_format: None,
        retriever,
        tracer=Tracer(store=TraceStore()),
    )


def first_sentence(retriever: Retriever) -> str:
    """A sentence the first shown passage states word for word."""
    text = retriever.search(QUESTION, 5)[0].text
    return " ".join(text.split(". ")[0].split()) + "."


def test_an_answer_copied_from_a_passage_is_grounded(smollm2: CausalLM, retriever: Retriever) -> None:
    answer = first_sentence(retriever)
    result = loop_over(smollm2, retriever, [answer]).run(QUESTION, RunOptions(max_steps=1, citations="model"))
    assert result["answer"] == answer
    assert result["grounding"]["grounded"] is True and result["grounding"]["unsupported"] == []


def test_mark_keeps_an_invented_answer_and_names_its_unsupported_sentence(
    smollm2: CausalLM, retriever: Retriever
) -> None:
    events = list(loop_over(smollm2, retriever, [INVENTED]).events(QUESTION, RunOptions(max_steps=1)))
    result = events[-1].data()
    assert result["answer"].startswith("The assert statement was added in Python 3.11")
    assert result["grounding"]["grounded"] is False
    unsupported = result["grounding"]["unsupported"]
    assert unsupported and unsupported[0]["text"].startswith("The assert statement was added")
    assert "".join(e.text for e in events if isinstance(e, TokenEvent)) == INVENTED  # streamed as written


def test_abstain_withholds_an_invented_answer_and_never_streams_it(smollm2: CausalLM, retriever: Retriever) -> None:
    events = list(
        loop_over(smollm2, retriever, [INVENTED]).events(QUESTION, RunOptions(max_steps=1, grounding="abstain"))
    )
    result = events[-1].data()
    assert result["answer"] == ABSTENTION
    assert result["grounding"]["withheld_answer"].startswith("The assert statement was added")
    assert [e.text for e in events if isinstance(e, TokenEvent)] == [ABSTENTION]


def test_abstain_sends_a_grounded_answer_whole_once_checked(smollm2: CausalLM, retriever: Retriever) -> None:
    answer = first_sentence(retriever)
    options = RunOptions(max_steps=1, grounding="abstain", citations="model")
    events = list(loop_over(smollm2, retriever, [answer]).events(QUESTION, options))
    assert [e.text for e in events if isinstance(e, TokenEvent)] == [answer]
    assert events[-1].data()["answer"] == answer


def test_a_claim_resting_on_a_tool_result_is_grounded(smollm2: CausalLM, retriever: Retriever) -> None:
    replies = [call("add", a=1234, b=4321), "Adding 1234 and 4321 with the add tool gives 5555."]
    result = loop_over(smollm2, retriever, replies).run("What is 1234 + 4321?", RunOptions(tools=["add"]))
    assert result["steps"][0]["tool_result"]["content"] == "5555"
    assert result["grounding"]["grounded"] is True, result["grounding"]


def test_off_runs_no_check(smollm2: CausalLM, retriever: Retriever) -> None:
    result = loop_over(smollm2, retriever, [INVENTED]).run(QUESTION, RunOptions(max_steps=1, grounding="off"))
    assert result["grounding"] is None and result["answer"] == INVENTED


def test_run_options_validate_the_grounding_mode_and_share() -> None:
    with pytest.raises(ValueError, match="grounding must be one of off, mark, abstain"):
        RunOptions(grounding="strict")
    with pytest.raises(ValueError, match="min_supported"):
        RunOptions(min_supported=1.5)
    assert RunOptions().grounding == "mark" and RunOptions().citations == "attribute"
