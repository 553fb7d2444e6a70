"""The tool-use eval: its task set has the promised shape, its tools behave as described
(one raises, one times out), and its scoring catches each failure it claims to count."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from specrag.evals.tool_use.run import answer_matches, is_call_syntax, load_tasks, main, score_task, summarise
from specrag.evals.tool_use.suite import eval_tools
from specrag.tools import ToolRegistry
from specrag.tools.execute import run_tool_sync

CATEGORIES = {"simple", "multiple", "multi_step", "parallel", "irrelevance", "documents"}


def test_the_task_set_covers_every_category_in_two_halves() -> None:
    tasks = load_tasks()
    assert len(tasks) >= 60 and len({task["id"] for task in tasks}) == len(tasks)
    assert {task["category"] for task in tasks} == CATEGORIES
    halves = Counter((task["category"], task["split"]) for task in tasks)
    for category in CATEGORIES:  # half of each category held out, give or take one
        assert abs(halves[category, "dev"] - halves[category, "held_out"]) <= 1
    registry = ToolRegistry(eval_tools())
    assert len(registry.names) >= 8
    for task in tasks:
        for call in task["expected_calls"]:
            if call["name"] != "search_documents":
                registry.get(call["name"])  # every expected tool exists
        assert task["category"] != "irrelevance" or not task["expected_calls"]


def test_the_suite_has_a_tool_that_raises_and_one_that_times_out() -> None:
    registry = ToolRegistry(eval_tools())
    raised = run_tool_sync(registry, "stock_price", {"symbol": "ZZZZ"})
    assert raised.error is not None and raised.error.type != "timeout"
    timed_out = run_tool_sync(registry, "live_weather", {"city": "Oslo"})
    assert timed_out.error is not None and timed_out.error.type == "timeout"
    booked = run_tool_sync(
        registry, "book_meeting", {"room": "red", "start": "16:00", "attendees": [{"name": "Dee", "email": "d@x.io"}]}
    )
    assert booked.ok and "red" in booked.content
    refused = run_tool_sync(registry, "book_meeting", {"room": "purple", "start": "16:00", "attendees": []})
    assert refused.error is not None and refused.error.type == "invalid_arguments"


def step(name: str, arguments: dict[str, Any], content: str = "ok", repeated: bool = False) -> dict[str, Any]:
    return {
        "kind": "tool_call",
        "tool_call": {"name": name, "arguments": arguments},
        "tool_result": {"name": name, "content": content, "error": None},
        "repeated": repeated,
    }


TASK = {
    "id": "t001",
    "category": "simple",
    "split": "dev",
    "question": "What is 21 degrees celsius in fahrenheit?",
    "expected_calls": [{"name": "convert_temperature", "arguments": {"value": 21, "unit": "celsius"}}],
    "optional_tools": [],
    "expected": ["69.8"],
    "match": "all",
    "index": False,
}


def test_a_right_run_scores_right_and_a_repeat_that_was_not_run_is_not_a_double_execution() -> None:
    call = ("convert_temperature", {"value": 21.0, "unit": "celsius"})
    steps = [step(*call, "69.8 fahrenheit"), step(*call, "69.8 fahrenheit", repeated=True), {"kind": "answer"}]
    score = score_task(TASK, {"steps": steps, "answer": "It is 69.8 °F."}, 1.0)
    assert score.answer_correct and score.selection_correct and score.arguments_correct and score.arguments_valid
    assert score.repeated_calls == 1 and score.executed_twice == 0 and not score.call_syntax_answer
    assert summarise([score])["all"]["tasks_with_a_changed_repeat"] == 0
    changed = score_task(TASK, {"steps": steps, "answer": "69.8", "deviations": [{"outcome": "ran"}]}, 1.0)
    tried = score_task(TASK, {"steps": steps, "answer": "69.8", "deviations": [{"outcome": "ungrounded"}]}, 1.0)
    assert summarise([changed, tried, score])["all"]["tasks_with_a_changed_repeat"] == 1


@pytest.mark.parametrize(
    ("steps", "answer", "failed"),
    [
        ([step("convert_temperature", {"value": 21, "unit": "celsius"})] * 2, "69.8", "executed_twice"),
        ([step("convert_length", {"value": 21, "from_unit": "m", "to_unit": "km"})], "69.8", "selection"),
        ([step("convert_temperature", {"value": 12, "unit": "celsius"})], "69.8", "arguments"),
        ([step("convert_temperature", {"value": 21, "unit": "celsius"})], "It is 70.", "answer"),
        ([], '```json\n{"name": "convert_temperature", "arguments\': {}}\n```', "call_syntax"),
        ([], '```json\n{"name" : "convert_temperature", " arguments": {}}\n```', "call_syntax"),
        ([], "Use <tool_call> with it.", "call_syntax"),
    ],
)
def test_each_planted_failure_is_counted(steps: list[dict[str, Any]], answer: str, failed: str) -> None:
    score = score_task(TASK, {"steps": steps, "answer": answer}, 1.0)
    verdicts = {
        "executed_twice": score.executed_twice > 0,
        "selection": not score.selection_correct,
        "arguments": not score.arguments_correct,
        "answer": not score.answer_correct,
        "call_syntax": score.call_syntax_answer,
    }
    assert verdicts[failed], (failed, score)
    summary = summarise([score])
    assert summary["all"]["tasks"] == 1
    if failed == "executed_twice":
        assert summary["all"]["tasks_with_a_call_executed_twice"] == 1


def test_answers_match_numbers_without_separators_and_alternatives() -> None:
    assert answer_matches("About 1,609.34 metres.", ["1609.34"])
    assert answer_matches("It is Nairobi.", ["nairobi|nbo"]) and not answer_matches("It is Lagos.", ["nairobi"])
    assert answer_matches("Paris and Tokyo", ["paris", "tokyo"]) and not answer_matches("Paris", ["paris", "tokyo"])
    assert answer_matches("Tokyo", ["paris", "tokyo"], match="any")
    assert is_call_syntax(json.dumps({"name": "x", "arguments": {}})) and not is_call_syntax("The sum is 3.")


def test_the_eval_runs_end_to_end_and_writes_its_report(tmp_path: Any) -> None:
    from specrag.agent.cli import main as cli_main

    out = tmp_path / "tools"
    args = ["eval", "tools", "--model", "smollm2-135m", "--dtype", "float32", "--only", "t001,t052"]
    assert cli_main([*args, "--max-tokens", "24", "--max-steps", "2", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert [task["id"] for task in report["tasks"]] == ["t001", "t052"]
    assert report["config"]["call_format"] == "bare_json"  # smollm2's template renders no tools
    markdown = (out / "report.md").read_text(encoding="utf-8")
    assert "| dev | 2 |" in markdown and "tasks with a call run twice" in markdown


def test_rescoring_a_report_applies_the_current_rules_without_a_model(tmp_path: Any) -> None:
    fenced = '```json\n{"name": "convert_temperature", " arguments": {"value": 21}}\n```'
    right = score_task(TASK, {"steps": [], "answer": "69.8"}, 1.0)
    missed = {**vars(score_task(TASK, {"steps": [], "answer": fenced}, 1.0)), "call_syntax_answer": False}
    report = {
        "config": {
            "model": "m",
            "command": "c",
            "dtype": "d",
            "cpu": "c",
            "call_format": "hermes",
            "max_tokens": 1,
            "max_steps": 1,
        },
        "tasks": [vars(right), missed],
    }
    (tmp_path / "report.json").write_text(json.dumps(report), encoding="utf-8")
    assert main(["--rescore", str(tmp_path)]) == 0
    rescored = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))
    assert [task["call_syntax_answer"] for task in rescored["tasks"]] == [False, True]
    assert rescored["summary"]["all"]["call_syntax_answers"] == 1
    assert "| dev | 2 |" in (tmp_path / "report.md").read_text(encoding="utf-8")
