"""Tool use, in the spirit of the Berkeley Function-Calling Leaderboard: does the agent call
the right tools with the right arguments, and answer with what they returned?

    specrag eval tools --model qwen2.5-coder-1.5b --out docs/reports/tools_qwen1.5b
    python -m specrag.evals.tool_use.run --model qwen2.5-coder-0.5b --split dev --out /tmp/tools_dev

67 tasks (``evals/datasets/tool_tasks.jsonl``) over the ten tools of ``evals/tool_use/suite.py``
and the built-in document search, in six categories: simple (one call), multiple (the right
one among similar tools), multi_step (a result feeds the next call), parallel (independent
calls in one turn), irrelevance (no tool should be called) and documents (the sample
corpus; searching is optional). Half the tasks of each category are ``dev`` (prompts and
loop rules may be tuned on them), half ``held_out`` (never looked at while tuning).

Scores per task: tool selection (every expected tool called, nothing outside expected and
optional ones; no call at all for irrelevance), arguments (each expected call made with
the expected arguments: numbers to 1e-6, strings case-insensitive), argument validity (no
call refused for its arguments), the final answer (every expected value in it, ``a|b``
alternatives), calls per task, repeated calls and answers that are call syntax.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DATASET = Path(__file__).resolve().parent.parent / "datasets" / "tool_tasks.jsonl"
CATEGORIES = ("simple", "multiple", "multi_step", "parallel", "irrelevance", "documents")
SPLITS = ("dev", "held_out")


@dataclass
class TaskScore:
    id: str
    category: str
    split: str
    question: str
    answer: str
    calls: list[dict[str, Any]]
    answer_correct: bool
    selection_correct: bool
    arguments_correct: bool
    arguments_valid: bool
    repeated_calls: int  # the model asked again for a call it had made (not run again)
    executed_twice: int  # calls run although an identical one had run (must be 0)
    call_syntax_answer: bool
    seconds: float
    errors: list[str] = field(default_factory=list)
    tool_gate: dict[str, Any] | None = None  # the irrelevance gate's verdict (agent/tool_gate.py)
    deviations: list[dict[str, Any]] | None = None  # repeated calls and the way out (agent/repeat_deviation.py)


def load_tasks(path: Path = DATASET, split: str = "all") -> list[dict[str, Any]]:
    tasks = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [task for task in tasks if split == "all" or task["split"] == split]


def score_task(task: dict[str, Any], result: dict[str, Any], seconds: float) -> TaskScore:
    steps = [step for step in result["steps"] if step["kind"] == "tool_call"]
    calls = [step["tool_call"] for step in steps]
    called = {call["name"] for call in calls}
    expected = task["expected_calls"]
    needed = {call["name"] for call in expected}
    allowed = needed | set(task["optional_tools"])
    answer = result["answer"]
    return TaskScore(
        id=task["id"],
        category=task["category"],
        split=task["split"],
        question=task["question"],
        answer=answer,
        calls=calls,
        answer_correct=answer_matches(answer, task["expected"], task["match"]),
        selection_correct=needed <= called <= allowed,
        arguments_correct=all(any(_call_matches(call, want) for call in calls) for want in expected),
        arguments_valid=all((step["tool_result"]["error"] or {}).get("type") != "invalid_arguments" for step in steps),
        repeated_calls=sum(bool(step.get("repeated")) for step in steps),
        executed_twice=_executed_twice(steps),
        call_syntax_answer=is_call_syntax(answer),
        seconds=seconds,
        tool_gate=result.get("tool_gate"),
        deviations=result.get("deviations"),
    )


def _executed_twice(steps: list[dict[str, Any]]) -> int:
    """Calls that ran (a result was computed, not reused) though an identical one ran before."""
    ran = [json.dumps(step["tool_call"], sort_keys=True) for step in steps if not step.get("repeated")]
    return len(ran) - len(set(ran))


def answer_matches(answer: str, expected: list[str], match: str = "all") -> bool:
    """Every expected value (``a|b``: either) appears in the answer, numbers as written
    with thousands separators removed, text case-insensitively. No expectation: any answer
    that is not empty."""
    text = re.sub(r"(?<=\d),(?=\d{3})", "", answer).lower()
    if not expected:
        return bool(text.strip())
    hits = [any(option.lower() in text for option in item.split("|")) for item in expected]
    return all(hits) if match == "all" else any(hits)


# A call written as text, however its quotes and spaces came out: the arguments key in
# quotes ('"arguments"', "'arguments'", '" arguments"' were all seen from the 0.5B) or a
# "name" key holding a string, as a JSON call has it.
_CALL_KEYS = re.compile(r"""["']\s*arguments\s*["']\s*:|["']\s*name\s*["']\s*:\s*["']""")


def is_call_syntax(answer: str) -> bool:
    """Whether an answer is (or contains) a tool call written as text instead of made."""
    stripped = answer.strip()
    return stripped.startswith("{") or "<tool_call>" in stripped or _CALL_KEYS.search(stripped) is not None


def rescore(report: dict[str, Any]) -> dict[str, Any]:
    """``report`` with the answer-only scores recomputed by this version's rules."""
    scores = []
    for task in report["tasks"]:
        fields = {**task, "call_syntax_answer": is_call_syntax(task["answer"])}
        fields.setdefault("executed_twice", 0)
        scores.append(TaskScore(**fields))
    return {**report, "summary": summarise(scores), "tasks": [asdict(score) for score in scores]}


def _call_matches(call: dict[str, Any], want: dict[str, Any]) -> bool:
    if call["name"] != want["name"]:
        return False
    arguments = call.get("arguments") or {}
    return all(_same(arguments.get(key), value) for key, value in (want.get("arguments") or {}).items())


def _same(actual: Any, expected: Any) -> bool:
    if isinstance(expected, int | float) and not isinstance(expected, bool):
        return isinstance(actual, int | float) and math.isclose(actual, expected, rel_tol=1e-6, abs_tol=1e-6)
    if isinstance(expected, str):
        return isinstance(actual, str) and actual.strip().lower() == expected.lower()
    return actual == expected


def summarise(scores: list[TaskScore]) -> dict[str, Any]:
    def block(items: list[TaskScore]) -> dict[str, Any]:
        if not items:
            return {"tasks": 0}
        irrelevant = [score for score in items if score.category == "irrelevance"]
        return {
            "tasks": len(items),
            "answer_correct": _share(items, lambda s: s.answer_correct),
            "selection_correct": _share(items, lambda s: s.selection_correct),
            "arguments_correct": _share(items, lambda s: s.arguments_correct),
            "arguments_valid": _share(items, lambda s: s.arguments_valid),
            "calls_per_task": sum(len(s.calls) for s in items) / len(items),
            "tasks_with_repeated_calls": sum(s.repeated_calls > 0 for s in items),
            "tasks_with_a_call_executed_twice": sum(s.executed_twice > 0 for s in items),
            "tasks_with_a_changed_repeat": sum(_changed_repeat(s) for s in items),
            "call_syntax_answers": sum(s.call_syntax_answer for s in items),
            "irrelevance_no_call": _share(irrelevant, lambda s: not s.calls) if irrelevant else None,
            "median_seconds": sorted(s.seconds for s in items)[len(items) // 2],
        }

    return {
        "all": block(scores),
        **{split: block([s for s in scores if s.split == split]) for split in SPLITS},
        "by_category": {
            category: {
                split: block([s for s in scores if s.category == category and s.split == split]) for split in SPLITS
            }
            for category in CATEGORIES
        },
    }


def _share(items: list[TaskScore], test: Any) -> float:
    return sum(bool(test(item)) for item in items) / len(items)


def _changed_repeat(score: TaskScore) -> bool:
    """Whether a repeated call was changed into a new one that ran (agent/repeat_deviation.py)."""
    return any(deviation["outcome"] == "ran" for deviation in score.deviations or [])


def markdown(summary: dict[str, Any], config: dict[str, Any]) -> str:
    rows = [
        f"# Tool use: {config['model']}",
        "",
        f"`{config['command']}` ({config['dtype']}, {config['cpu']}, call format `{config['call_format']}`, "
        f"max_tokens {config['max_tokens']}, max_steps {config['max_steps']})",
        "",
        "| split | tasks | answer correct | tool selection | arguments | valid arguments | calls/task "
        "| tasks with a repeated call (not run) | tasks with a repeat changed into a new call "
        "| tasks with a call run twice | call-syntax answers | irrelevance: no call |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for split in ("held_out", "dev", "all"):
        block = summary[split]
        if not block["tasks"]:
            continue
        irrelevance = "-" if block["irrelevance_no_call"] is None else f"{block['irrelevance_no_call']:.0%}"
        rows.append(
            f"| {split} | {block['tasks']} | {block['answer_correct']:.0%} | {block['selection_correct']:.0%} "
            f"| {block['arguments_correct']:.0%} | {block['arguments_valid']:.0%} | {block['calls_per_task']:.2f} "
            f"| {block['tasks_with_repeated_calls']} | {block.get('tasks_with_a_changed_repeat', '-')} "
            f"| {block['tasks_with_a_call_executed_twice']} "
            f"| {block['call_syntax_answers']} | {irrelevance} |"
        )
    rows += ["", "| category | held-out answer correct | dev answer correct |", "| --- | ---: | ---: |"]
    for category, splits in summary["by_category"].items():
        cells = [f"{b['answer_correct']:.0%} of {b['tasks']}" if b["tasks"] else "-" for b in splits.values()]
        rows.append(f"| {category} | {cells[1]} | {cells[0]} |")
    return "\n".join(rows) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--split", choices=("dev", "held_out", "all"), default="all")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument(
        "--call-format", default="auto", help="auto (the chat template's), hermes, bare_json or tagged_json"
    )
    parser.add_argument("--index", help="index for the documents tasks (default: the bundled sample)")
    parser.add_argument("--only", help="comma-separated task ids")
    parser.add_argument("--out", type=Path, help="folder for report.json and report.md")
    parser.add_argument("--rescore", type=Path, help="a report folder: score its answers again, rewrite it, no model")
    parser.add_argument(
        "--no-cut-words", action="store_true", help="grammars mask alone (decoding/cut_words.py off), for comparison"
    )


def run(args: argparse.Namespace, command: str) -> int:
    if args.rescore:
        return _rescore_folder(args.rescore)
    from specrag.agent.runtime import Agent
    from specrag.agent.sample_index import ensure_sample_index
    from specrag.decoding.dtype_choice import cpu_model_name
    from specrag.decoding.model import load_model
    from specrag.evals.tool_use.suite import eval_tools

    tasks = load_tasks(split=args.split)
    if args.only:
        wanted = set(args.only.split(","))
        tasks = [task for task in tasks if task["id"] in wanted]
    model = load_model(args.model, dtype=args.dtype)
    model.grammar_compiler.cut_words = not args.no_cut_words  # read when each grammar is built
    call_format = None if args.call_format == "auto" else args.call_format
    plain = Agent(tools=eval_tools(), model=model, call_format=call_format)
    documents = None
    if any(task["index"] for task in tasks):
        index = args.index or str(ensure_sample_index(args.model))
        documents = Agent(tools=eval_tools(), model=model, index=index, call_format=call_format)
    scores = []
    try:
        for task in tasks:
            agent = documents if task["index"] and documents is not None else plain
            tools = [*agent.registry.names] if task["index"] else None
            start = time.perf_counter()
            result = agent.run(task["question"], max_tokens=args.max_tokens, max_steps=args.max_steps, tools=tools)
            score = score_task(task, result, time.perf_counter() - start)
            scores.append(score)
            mark = "ok " if score.answer_correct else "BAD"
            print(f"{mark} {task['id']} {task['category']:11s} {json.dumps(score.answer)[:100]}", file=sys.stderr)
    finally:
        plain.close()
        if documents is not None:
            documents.close()
    summary = summarise(scores)
    config = {
        "model": args.model,
        "dtype": str(model.dtype).removeprefix("torch."),
        "call_format": plain.loop.call_format.name,
        "split": args.split,
        "max_tokens": args.max_tokens,
        "max_steps": args.max_steps,
        "cut_words": not args.no_cut_words,
        "cpu": cpu_model_name(),
        "command": command,
    }
    print(json.dumps(summary["all"], indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {"config": config, "summary": summary, "tasks": [asdict(score) for score in scores]}
        (args.out / "report.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
        (args.out / "report.md").write_text(markdown(summary, config), encoding="utf-8")
    return 0


def _rescore_folder(folder: Path) -> int:
    report = rescore(json.loads((folder / "report.json").read_text(encoding="utf-8")))
    (folder / "report.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    (folder / "report.md").write_text(markdown(report["summary"], report["config"]), encoding="utf-8")
    print(json.dumps(report["summary"]["all"], indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run(args, "python -m specrag.evals.tool_use.run " + " ".join(argv if argv is not None else sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
