"""Constrained output on real-world schemas is never invalid, and a broken grammar path is loud.

The corpus is 120 SchemaStore schemas (tests/data/schemastore/SOURCES.md); the full run
with qwen2.5-coder-0.5b is ``python -m specrag.evals.studies.schema_corpus`` (figures in the README). Here:
every schema normalises or is refused by keyword, every normalised schema compiles, a
sample runs end to end with smollm2, and a planted loose grammar is answered 500 (an
``error`` event when streaming), never returned as an answer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import xgrammar as xgr

from specrag.agent.errors import logger
from specrag.agent.runtime import Agent
from specrag.agent.server import create_app
from specrag.decoding.grammar_compile import UnsupportedSchemaError, enforceable_schema
from specrag.decoding.model import CausalLM
from specrag.evals.studies.schema_corpus import load_corpus, run_one, summarise
from tests.server_helpers import LiveServer, assert_error

pytestmark = pytest.mark.slow

MARKED = {
    "type": "object",
    "properties": {"marker": {"const": "never-written"}},
    "required": ["marker"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def agent(smollm2: CausalLM) -> Iterator[Agent]:
    agent = Agent(model=smollm2, concurrent=True)
    yield agent
    agent.close()


def test_every_corpus_schema_compiles_or_is_refused_by_keyword_and_pointer() -> None:
    corpus = load_corpus()
    assert len(corpus) >= 100
    compiled = 0
    for entry, schema in corpus:
        try:
            normalized = enforceable_schema(schema)
        except UnsupportedSchemaError as error:
            assert error.feature and error.path.startswith("#"), (entry["file"], error)
            continue
        xgr.Grammar.from_json_schema(json.dumps(normalized), any_whitespace=False, strict_mode=True)
        compiled += 1
    assert compiled >= 0.8 * len(corpus)


def test_a_sample_runs_end_to_end_and_nothing_finished_is_invalid(agent: Agent) -> None:
    outcomes = [run_one(agent, entry, schema, max_tokens=64) for entry, schema in load_corpus(limit=8)]
    summary = summarise(outcomes)
    print("schema corpus sample:", summary)
    assert summary["invalid"] == 0, [outcome for outcome in outcomes if outcome.outcome == "invalid"]
    assert summary["compiled"] >= 4 and summary["valid"] + summary["truncated"] == summary["compiled"]
    assert all(o.keyword and o.pointer for o in outcomes if o.outcome == "refused")


@pytest.fixture
def loose_grammar(agent: Agent, monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted bug on the constrained path: the schema's grammar admits only ``{}``."""
    compiler = agent.model.grammar_compiler
    monkeypatch.setattr(compiler, "json_schema", lambda schema: compiler.ebnf('root ::= "{}"'))


def _request(stream: bool) -> dict[str, Any]:
    return {
        "model": "specrag",
        "messages": [{"role": "user", "content": "Give me the marker."}],
        "max_tokens": 16,
        "stream": stream,
        "response_format": {"type": "json_schema", "json_schema": {"name": "marked", "schema": MARKED}},
    }


@pytest.mark.usefixtures("loose_grammar")
def test_an_invalid_finished_answer_is_a_500_and_a_logged_bug(agent: Agent) -> None:
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        with LiveServer(create_app(agent)) as url:
            events = _answers_with_a_loose_grammar(url)
    finally:
        logger.removeHandler(handler)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["type"] == "internal_error" and "failed validation" in last["error"]["message"]
    assert not any("finish_reason" in event and '"stop"' in event for event in events)  # never claimed complete
    bugs = [record.getMessage() for record in records if "BUG: a constrained answer failed" in record.getMessage()]
    assert len(bugs) == 2 and "never-written" in bugs[0] and "answer: '{}'" in bugs[0]  # what a report needs


def _answers_with_a_loose_grammar(url: str) -> list[str]:
    """The unstreamed request must be a 500; returns the streamed one's events."""
    response = httpx.post(f"{url}/v1/chat/completions", json=_request(stream=False), timeout=120)
    error = assert_error(response, 500)
    assert "failed validation against its schema" in error["message"] and "marker" in error["message"]
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=_request(stream=True), timeout=120) as stream:
        return [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]


def test_validation_fetches_nothing_and_reads_a_remote_reference_as_unsatisfiable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import socket

    from specrag.tools.schema_check import SchemaViolation, validate_value

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("the validator tried to reach the network")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    schema = {
        "anyOf": [{"$ref": "https://json.schemastore.org/grunt-task#/definitions/fileFormat"}, {"type": "string"}]
    }
    validate_value("written by the grammar", schema)
    with pytest.raises(SchemaViolation, match="not valid under any"):
        validate_value(3, schema)  # only the remote branch could have accepted it


def test_show_schema_puts_the_compact_schema_in_the_prompt_and_the_default_does_not() -> None:
    from specrag.evals.studies.schema_corpus import prompt_for

    entry = {"name": "marker", "description": "a marked file"}
    assert "schema" not in prompt_for(entry, MARKED)
    shown = prompt_for(entry, MARKED, show_schema=True)
    assert shown.startswith(prompt_for(entry, MARKED))
    assert shown.endswith(json.dumps(MARKED, separators=(",", ":")))
