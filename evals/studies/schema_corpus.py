"""Structured output on real-world schemas nobody here wrote: compiled, refused, valid, invalid.

    python -m specrag.evals.studies.schema_corpus --model qwen2.5-coder-0.5b --max-tokens 512 \\
        --out docs/reports/schema_corpus_qwen0.5b
    python -m specrag.evals.studies.schema_corpus --model smollm2-135m --limit 8 --max-tokens 96   # minutes

Each schema of ``tests/data/schemastore`` (120 SchemaStore schemas, see its SOURCES.md) is
sent through the OpenAI-compatible chat path (``agent/openai_compat.py``: the same
``plan_chat`` and ``ChatRun`` the server runs, without the HTTP framing) with
``response_format: json_schema``, greedy, and one fixed prompt asking for an example
document. Outcomes: ``refused`` (400, by keyword; the schema cannot be enforced),
``valid`` (finished and valid under the original schema, checked again here with
``jsonschema``), ``invalid`` (finished but not valid: must be 0; the server itself answers
500 then), ``truncated`` (cut at ``--max-tokens``). Writes ``report.json`` and ``report.md``.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec

CORPUS = Path(__file__).resolve().parent.parent.parent / "tests" / "data" / "schemastore"
PROMPT = "Write a short example {name} file. Reply with the JSON document only.\n\nWhat the file is: {description}"
# --show-schema: the schema in the prompt as well as in the grammar, as Ollama's structured
# output docs advise for grounding a model (vLLM and OpenAI's API leave the prompt to the user).
SCHEMA_IN_PROMPT = "\n\nThe document must follow this JSON schema:\n{schema}"


def prompt_for(entry: dict[str, Any], schema: dict[str, Any], show_schema: bool = False) -> str:
    content = PROMPT.format(name=entry["name"], description=entry.get("description") or entry["name"])
    if show_schema:
        content += SCHEMA_IN_PROMPT.format(schema=json.dumps(schema, separators=(",", ":"), ensure_ascii=False))
    return content


@dataclass
class Outcome:
    file: str
    outcome: str  # refused | valid | invalid | truncated | error (an exception: a bug)
    keyword: str | None = None  # refused: the keyword; invalid: the validation message
    pointer: str | None = None
    completion_tokens: int = 0
    seconds: float = 0.0
    text: str = ""


def load_corpus(limit: int | None = None) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(manifest entry, schema) pairs, in manifest order; ``limit``: every n-th, spread evenly."""
    manifest = json.loads((CORPUS / "manifest.json").read_text(encoding="utf-8"))
    if limit is not None and limit < len(manifest):
        step = len(manifest) / limit
        manifest = [manifest[int(index * step)] for index in range(limit)]
    return [(entry, json.loads((CORPUS / entry["file"]).read_text(encoding="utf-8"))) for entry in manifest]


def request_body(content: str, schema: dict[str, Any], max_tokens: int, penalties: dict[str, float] | None) -> Any:
    """The chat request the eval sends for one schema: greedy, ``response_format`` json_schema."""
    from specrag.agent.api_models import ChatCompletionRequest

    return msgspec.convert(
        {
            "model": "specrag",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "document", "schema": schema}},
            **(penalties or {}),
        },
        ChatCompletionRequest,
    )


def run_one(
    agent: Any,
    entry: dict[str, Any],
    schema: dict[str, Any],
    max_tokens: int,
    penalties: dict[str, float] | None = None,
    show_schema: bool = False,
) -> Outcome:
    from specrag.agent.api_models import ServerLimits
    from specrag.agent.errors import ApiError
    from specrag.agent.openai_compat import ChatRun, plan_chat
    from specrag.tools.schema_check import SchemaViolation, validate_json_text

    body = request_body(prompt_for(entry, schema, show_schema), schema, max_tokens, penalties)
    start = time.perf_counter()
    try:
        plan = plan_chat(agent, body, ServerLimits(max_prompt_tokens=8192, max_tokens_limit=max_tokens))
    except ApiError as error:
        keyword, pointer = _refusal(error.message)
        return Outcome(entry["file"], "refused", keyword, pointer)
    run = ChatRun(agent, plan, _metrics(agent), start)
    try:
        completion = run.completion()
    except ApiError as error:  # the server's own validation failed: a bug, counted as invalid
        return Outcome(entry["file"], "invalid", error.message, None, run.completion_tokens, _since(start), run.text)
    choice = completion["choices"][0]
    text, tokens = choice["message"]["content"], completion["usage"]["completion_tokens"]
    if choice["finish_reason"] == "length":
        return Outcome(entry["file"], "truncated", None, None, tokens, _since(start), text)
    try:
        validate_json_text(text, schema)
    except SchemaViolation as violation:
        return Outcome(entry["file"], "invalid", violation.message, violation.pointer, tokens, _since(start), text)
    return Outcome(entry["file"], "valid", None, None, tokens, _since(start), text)


_METRICS: dict[int, Any] = {}


def _metrics(agent: Any) -> Any:
    from specrag.agent.metrics import ServerMetrics

    return _METRICS.setdefault(id(agent), ServerMetrics(agent))


def _since(start: float) -> float:
    return time.perf_counter() - start


def _refusal(message: str) -> tuple[str | None, str | None]:
    """The keyword and pointer of "unsupported JSON schema feature 'K' at P: ..."."""
    marker = "unsupported JSON schema feature '"
    if marker not in message:
        return None, None
    keyword, _, rest = message.split(marker, 1)[1].partition("' at ")
    return keyword, rest.split(":", 1)[0]


def summarise(outcomes: list[Outcome]) -> dict[str, Any]:
    counts = collections.Counter(outcome.outcome for outcome in outcomes)
    compiled = len(outcomes) - counts["refused"]
    return {
        "schemas": len(outcomes),
        "compiled": compiled,
        "refused": counts["refused"],
        "refused_by_keyword": dict(collections.Counter(o.keyword for o in outcomes if o.outcome == "refused")),
        "valid": counts["valid"],
        "invalid": counts["invalid"],
        "truncated": counts["truncated"],
        "errors": counts["error"],
        "refused_share": counts["refused"] / len(outcomes) if outcomes else 0.0,
        "valid_share_of_compiled": counts["valid"] / compiled if compiled else 0.0,
    }


def markdown(summary: dict[str, Any], config: dict[str, Any]) -> str:
    keywords = ", ".join(f"`{k}` {v}" for k, v in sorted(summary["refused_by_keyword"].items(), key=lambda kv: -kv[1]))
    return "\n".join(
        [
            f"# Structured output on {summary['schemas']} SchemaStore schemas",
            "",
            f"Model `{config['model']}` ({config['dtype']}), greedy, max_tokens {config['max_tokens']}, "
            f"repetition_penalty {config.get('repetition_penalty', 1.0)}, "
            f"frequency_penalty {config.get('frequency_penalty', 0.0)}, "
            f"schema in the prompt: {'yes' if config.get('show_schema') else 'no'}, "
            f"{config['cpu']}; `{config['command']}`",
            "",
            "| schemas | compiled | refused | valid | invalid | truncated | errors |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            f"| {summary['schemas']} | {summary['compiled']} | {summary['refused']} "
            f"({summary['refused_share']:.0%}) | {summary['valid']} ({summary['valid_share_of_compiled']:.0%} of "
            f"compiled) | {summary['invalid']} | {summary['truncated']} | {summary['errors']} |",
            "",
            f"Refused by keyword: {keywords or 'none'}.",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--limit", type=int, help="run N schemas spread over the corpus")
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        help="vLLM's rule, as the request field (default: not sent, so the server's default applies)",
    )
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's rule, as the request field")
    parser.add_argument("--show-schema", action="store_true", help="put the schema in the prompt too")
    parser.add_argument("--out", type=Path, help="folder for report.json and report.md")
    args = parser.parse_args(argv)

    from specrag.agent.openai_compat import repetition_penalty_for
    from specrag.agent.runtime import Agent
    from specrag.decoding.dtype_choice import cpu_model_name

    agent = Agent(model=args.model, dtype=args.dtype)
    penalties: dict[str, float] = {"frequency_penalty": args.frequency_penalty}
    if args.repetition_penalty is not None:
        penalties["repetition_penalty"] = args.repetition_penalty
    outcomes = []
    try:
        for entry, schema in load_corpus(args.limit):
            try:
                outcome = run_one(agent, entry, schema, args.max_tokens, penalties, args.show_schema)
            except Exception as error:  # counted and reported, never hidden; the run goes on
                outcome = Outcome(entry["file"], "error", f"{type(error).__name__}: {error}"[:500])
            outcomes.append(outcome)
            print(f"{outcome.outcome:9s} {entry['file']} {outcome.keyword or ''}", file=sys.stderr, flush=True)
    finally:
        agent.close()
    summary = summarise(outcomes)
    config = {
        "model": args.model,
        "dtype": str(agent.model.dtype).removeprefix("torch."),
        "max_tokens": args.max_tokens,
        "limit": args.limit,
        **penalties,
        # what the server applied: the request's value, else its structured-output default
        "repetition_penalty": repetition_penalty_for(request_body("", {}, args.max_tokens, penalties)),
        "repetition_penalty_sent": args.repetition_penalty is not None,
        "show_schema": args.show_schema,
        "cpu": cpu_model_name(),
        "command": "python -m specrag.evals.studies.schema_corpus "
        + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {"config": config, "summary": summary, "outcomes": [asdict(outcome) for outcome in outcomes]}
        (args.out / "report.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
        (args.out / "report.md").write_text(markdown(summary, config), encoding="utf-8")
    return 1 if summary["invalid"] or summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
