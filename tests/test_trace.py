"""Per-run traces: span tree, clocks, content capture, the store, stage coverage, OTel export."""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from specrag.agent.trace import (
    CYCLE_EVENT,
    ROOT_SPAN_NAME,
    SpeculationCycle,
    Trace,
    Tracer,
    TraceStore,
    is_content_attribute,
    stage_coverage,
    stages_cover_run,
)
from specrag.agent.trace_otel import export_to_otel

MS = 1_000_000


def timed_trace(stages: list[tuple[str, float, float]], run_ms: float) -> Trace:
    """A finished trace whose top-level stages span the given [start, end) ms of a ``run_ms`` run."""
    trace = Tracer().start_trace()
    t0 = trace.root.start_ns
    for name, start, end in stages:
        trace.add_completed_span(name, t0 + int(start * MS), t0 + int(end * MS))
    trace.finish(end_ns=t0 + int(run_ms * MS))
    return trace


def by_name(trace_dict: dict) -> dict[str, dict]:
    return {s["name"]: s for s in trace_dict["spans"]}


def test_ids_nesting_and_parent_ids() -> None:
    trace = Tracer().start_trace(attributes={"gen_ai.operation.name": "invoke_agent"})
    assert re.fullmatch(r"[0-9a-f]{32}", trace.trace_id)
    with trace.span("retrieval docs", {"top_k": 4}) as retrieval, trace.span("embed") as embed:
        pass
    with trace.span("chat smollm2") as chat:
        decode = trace.add_completed_span("decode", chat.start_ns, chat.start_ns + 5)
    explicit = trace.add_completed_span("late", trace.root.start_ns, trace.root.start_ns + 1, parent=retrieval)
    trace.finish()

    data = trace.to_dict()
    spans = by_name(data)
    root = spans[ROOT_SPAN_NAME]
    assert data["name"] == ROOT_SPAN_NAME and root["parent_id"] is None
    assert spans["retrieval docs"]["parent_id"] == root["span_id"]
    assert spans["embed"]["parent_id"] == retrieval.span_id == embed.parent_id
    assert spans["chat smollm2"]["parent_id"] == root["span_id"]
    assert decode.parent_id == chat.span_id  # default parent: the innermost open span
    assert explicit.parent_id == retrieval.span_id
    assert all(re.fullmatch(r"[0-9a-f]{16}", s["span_id"]) for s in data["spans"])
    assert len({s["span_id"] for s in data["spans"]}) == len(data["spans"])
    assert spans["retrieval docs"]["attributes"] == {"top_k": 4}
    assert root["attributes"] == {"gen_ai.operation.name": "invoke_agent"}


def test_timestamps_are_monotonic_and_children_inside_parents() -> None:
    before = time.monotonic_ns()
    trace = Tracer().start_trace()
    for name in ("retrieval docs", "prompt_build", "chat m"):
        with trace.span(name), trace.span(f"{name} inner"):
            time.sleep(0.001)
    trace.finish()
    after = time.monotonic_ns()

    data = trace.to_dict()
    assert data["clock"] == "monotonic_ns"
    assert before <= data["start_ns"] <= data["end_ns"] <= after
    spans = {s["span_id"]: s for s in data["spans"]}
    for span in data["spans"]:
        assert span["start_ns"] <= span["end_ns"]
        assert span["duration_ms"] == pytest.approx((span["end_ns"] - span["start_ns"]) / 1e6)
        if span["parent_id"]:
            parent = spans[span["parent_id"]]
            assert parent["start_ns"] <= span["start_ns"] <= span["end_ns"] <= parent["end_ns"]
    top = [s for s in data["spans"] if s["parent_id"] == data["spans"][0]["span_id"]]
    assert [s["name"] for s in top] == ["retrieval docs", "prompt_build", "chat m"]
    assert all(a["end_ns"] <= b["start_ns"] for a, b in itertools.pairwise(top))
    assert data["duration_ms"] >= 3.0


def test_events_and_speculation_cycles() -> None:
    trace = Tracer().start_trace()
    with trace.span("decode") as decode:
        decode.add_event("first_token", {"token_index": 0})
        decode.add_event("explicit", timestamp_ns=decode.start_ns + 7)
        decode.add_cycle(SpeculationCycle(decode.start_ns + 10, gamma=4, accepted_len=3, committed=4, verify_s=0.002))
    trace.finish()
    events = by_name(trace.to_dict())["decode"]["events"]
    assert [e["name"] for e in events] == ["first_token", "explicit", CYCLE_EVENT]
    assert events[0]["attributes"] == {"token_index": 0}
    assert decode.start_ns <= events[0]["timestamp_ns"] <= decode.end_ns
    assert events[1]["timestamp_ns"] == decode.start_ns + 7
    cycle = events[2]["attributes"]
    assert events[2]["timestamp_ns"] == decode.start_ns + 10
    assert {k: cycle[k] for k in ("gamma", "accepted_len", "committed")} == {
        "gamma": 4,
        "accepted_len": 3,
        "committed": 4,
    }
    assert cycle["duration_s"] == pytest.approx(0.002)  # no wall time given: the sum of the stage seconds
    assert {"draft_s", "verify_s", "accept_s", "grammar_s", "rollback_s"} <= cycle.keys()


def test_cycle_from_engine_cycle_info() -> None:
    info = SimpleNamespace(
        kind="speculative",
        start_ns=1_000,
        end_ns=1_000 + 3 * MS,
        gamma=5,
        accepted_len=2,
        source="prompt",
        stage_seconds={"draft": 0.0005, "verify": 0.002, "accept": 0.0001, "grammar": 0.0, "rollback": 0.0002},
    )
    cycle = SpeculationCycle.from_engine(info, committed=3)
    attrs = cycle.attributes()
    assert (cycle.start_ns, attrs["gamma"], attrs["accepted_len"], attrs["committed"]) == (1_000, 5, 2, 3)
    assert attrs["duration_s"] == pytest.approx(0.003)
    assert attrs["verify_s"] == 0.002 and attrs["source"] == "prompt"


def test_exception_recorded_without_stack_trace() -> None:
    trace = Tracer().start_trace()
    with pytest.raises(ValueError, match="bad query"), trace.span("execute_tool search_documents"):
        raise ValueError("bad query")
    trace.finish()
    data = trace.to_dict()
    span = by_name(data)["execute_tool search_documents"]
    assert span["status"] == "error"
    assert span["attributes"]["error.type"] == "ValueError"
    assert span["status_message"] == "ValueError: bad query"
    exc_event = next(e for e in span["events"] if e["name"] == "exception")
    assert exc_event["attributes"] == {"exception.type": "ValueError", "exception.message": "bad query"}
    text = json.dumps(data)
    assert "Traceback" not in text and "test_trace.py" not in text and "stacktrace" not in text
    assert by_name(data)[ROOT_SPAN_NAME]["status"] == "unset"  # the run went on after the tool failed


CONTENT = {
    "specrag.prompt": "SECRET prompt",
    "specrag.passages": ["SECRET passage"],
    "gen_ai.tool.call.arguments": {"q": "SECRET"},
    "gen_ai.input.messages": "SECRET",
    "specrag.question": "SECRET question",
}
NOT_CONTENT = {"gen_ai.usage.input_tokens": 12, "specrag.passage_ids": ["a#0"], "gen_ai.tool.name": "search"}


def record_with_content(tracer: Tracer) -> dict:
    trace = tracer.start_trace(attributes={"specrag.question": "SECRET question"})
    with trace.span("execute_tool search", {**CONTENT, **NOT_CONTENT}) as span:
        span.set_attribute("gen_ai.tool.call.result", "SECRET result")
        span.add_event("tool_call", {"gen_ai.tool.call.arguments": "SECRET", "bytes": 10})
    trace.finish()
    return trace.to_dict()


def test_content_capture_off_by_default() -> None:
    assert Tracer().capture_content is False
    data = record_with_content(Tracer())
    span = by_name(data)["execute_tool search"]
    assert span["attributes"] == NOT_CONTENT
    assert span["events"][0]["attributes"] == {"bytes": 10}
    assert by_name(data)[ROOT_SPAN_NAME]["attributes"] == {}
    assert "SECRET" not in json.dumps(data)


def test_content_capture_on_when_asked() -> None:
    data = record_with_content(Tracer(capture_content=True))
    span = by_name(data)["execute_tool search"]
    assert span["attributes"]["specrag.prompt"] == "SECRET prompt"
    assert span["attributes"]["gen_ai.tool.call.arguments"] == {"q": "SECRET"}
    assert span["attributes"]["gen_ai.tool.call.result"] == "SECRET result"
    assert span["events"][0]["attributes"]["gen_ai.tool.call.arguments"] == "SECRET"
    assert by_name(data)[ROOT_SPAN_NAME]["attributes"] == {"specrag.question": "SECRET question"}


def test_content_attribute_names() -> None:
    assert all(is_content_attribute(k) for k in CONTENT)
    assert not any(is_content_attribute(k) for k in NOT_CONTENT)
    assert not is_content_attribute("gen_ai.usage.prompt_tokens")


def test_store_is_a_bounded_lru() -> None:
    store = TraceStore(max_traces=2)
    tracer = Tracer(store=store)
    traces = [tracer.start_trace() for _ in range(3)]
    traces[0].finish()
    traces[1].finish()
    assert store.get(traces[0].trace_id) is not None  # touching the oldest makes it the newest
    traces[2].finish()
    assert len(store) == 2
    assert store.get(traces[1].trace_id) is None
    assert store.get(traces[0].trace_id)["trace_id"] == traces[0].trace_id
    assert store.get(traces[2].trace_id) is not None
    assert store.get("0" * 32) is None
    traces[2].finish()  # idempotent: not stored twice
    assert len(store) == 2


def test_store_appends_one_json_line_per_trace(tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    tracer = Tracer(store=TraceStore(jsonl_path=path))
    ids = []
    for i in range(3):
        trace = tracer.start_trace()
        with trace.span("retrieval docs", {"i": i}):
            pass
        trace.finish()
        ids.append(trace.trace_id)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 3
    parsed = [json.loads(line) for line in lines]
    assert [p["trace_id"] for p in parsed] == ids
    assert [p["spans"][1]["attributes"]["i"] for p in parsed] == [0, 1, 2]


def test_store_write_error_is_logged_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = TraceStore(jsonl_path=tmp_path)  # a directory: open() fails
    trace = Tracer(store=store).start_trace()
    with caplog.at_level(logging.WARNING, logger="specrag.agent.trace"):
        trace.finish()
    assert store.get(trace.trace_id) is not None
    assert any("could not append trace" in r.getMessage() for r in caplog.records)


def test_stage_durations_sum_per_top_level_stage() -> None:
    stages = [("retrieval docs", 0, 10), ("prompt_build", 10, 12), ("chat m", 12, 60), ("execute_tool t", 60, 70)]
    trace = timed_trace([*stages, ("chat m", 70, 100)], run_ms=100)
    chat = next(s for s in trace.spans if s.name == "chat m")
    trace.add_completed_span("prefill", chat.start_ns, chat.start_ns + 5 * MS, parent=chat)  # not top level
    durations = trace.stage_durations()
    assert list(durations) == ["retrieval docs", "prompt_build", "chat m", "execute_tool t"]
    assert durations["chat m"] == pytest.approx(0.078)  # both chat calls of the run
    assert durations["retrieval docs"] == pytest.approx(0.010)
    assert sum(durations.values()) == pytest.approx(0.100)
    assert trace.stages_cover_run()


def test_coverage_check_fails_on_a_planted_gap() -> None:
    covered = timed_trace([("retrieval docs", 0, 10), ("chat m", 10, 97)], run_ms=100)
    gap = timed_trace([("retrieval docs", 0, 10), ("chat m", 20, 100)], run_ms=100)  # 10 ms untraced
    assert stage_coverage(covered.to_dict()) == pytest.approx(0.97)
    assert covered.stages_cover_run(tolerance=0.05)
    assert stage_coverage(gap.to_dict()) == pytest.approx(0.90)
    assert not gap.stages_cover_run(tolerance=0.05)
    assert stages_cover_run(gap.to_dict(), tolerance=0.11)
    with pytest.raises(ValueError, match="not finished"):
        stage_coverage(Tracer().start_trace().to_dict())


def test_to_dict_is_json_serialisable_and_complete() -> None:
    trace = Tracer().start_trace()
    with trace.span("odd", {"tuple": (1, 2), "set": {3}, "obj": object(), "path": Path("/x"), "nested": {"a": (1,)}}):
        pass
    open_span = trace._new_span("left open", None, time.monotonic_ns(), None)
    trace.finish()
    data = json.loads(json.dumps(trace.to_dict()))
    assert set(data) >= {"trace_id", "name", "start_ns", "end_ns", "duration_ms", "spans"}
    for span in data["spans"]:
        assert set(span) >= {"span_id", "parent_id", "name", "start_ns", "end_ns", "duration_ms", "attributes"}
        assert set(span) >= {"events", "status"}
    odd = by_name(data)["odd"]["attributes"]
    assert odd["tuple"] == [1, 2] and odd["set"] == [3] and odd["path"] == "/x" and odd["nested"] == {"a": [1]}
    left = by_name(data)["left open"]
    assert left["end_ns"] == data["end_ns"] and left["attributes"]["specrag.unfinished"] is True
    assert open_span.end_ns == data["end_ns"]


def test_completed_span_validation() -> None:
    trace, other = Tracer().start_trace(), Tracer().start_trace()
    with pytest.raises(ValueError, match="ends before it starts"):
        trace.add_completed_span("decode", 10, 5)
    with pytest.raises(ValueError, match="another trace"):
        trace.add_completed_span("decode", 1, 2, parent=other.root)


def test_one_run_per_thread_keeps_its_own_nesting() -> None:
    tracer = Tracer()
    results: dict[int, dict] = {}
    barrier = threading.Barrier(4)

    def run(i: int) -> None:
        trace = tracer.start_trace()
        with trace.span(f"outer {i}"):
            barrier.wait()
            with trace.span(f"inner {i}"):
                barrier.wait()
        trace.finish()
        results[i] = trace.to_dict()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    for i, data in results.items():
        spans = by_name(data)
        assert set(spans) == {ROOT_SPAN_NAME, f"outer {i}", f"inner {i}"}
        assert spans[f"inner {i}"]["parent_id"] == spans[f"outer {i}"]["span_id"]
    assert len(results) == 4


def realistic_trace() -> Trace:
    trace = Tracer().start_trace()
    t0 = trace.root.start_ns
    trace.add_completed_span("retrieval docs", t0, t0 + 3 * MS, {"specrag.passage_ids": ["a#0", "b#1"], "top_k": 2})
    chat = trace.add_completed_span("chat smollm2", t0 + 3 * MS, t0 + 40 * MS, {"gen_ai.usage.input_tokens": 50})
    trace.add_completed_span("prefill", t0 + 3 * MS, t0 + 10 * MS, parent=chat)
    decode = trace.add_completed_span("decode", t0 + 10 * MS, t0 + 40 * MS, parent=chat)
    for k in range(5):
        decode.add_cycle(SpeculationCycle(t0 + (10 + 6 * k) * MS, gamma=4, accepted_len=k % 5, committed=k % 5 + 1))
    tool = trace.add_completed_span("execute_tool calc", t0 + 40 * MS, t0 + 45 * MS, {"gen_ai.tool.name": "calc"})
    tool.record_exception(TimeoutError("took too long"))
    trace.finish(end_ns=t0 + 45 * MS)
    return trace


def test_otel_export_recreates_spans_times_and_links() -> None:
    pytest.importorskip("opentelemetry.sdk", reason="opentelemetry-sdk not installed (extra 'otel')")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    data = realistic_trace().to_dict()
    assert export_to_otel(data, tracer_provider=provider) == len(data["spans"])

    exported = exporter.get_finished_spans()
    ours = by_name(data)
    theirs = {s.name: s for s in exported}
    assert set(theirs) == set(ours)
    otel_names = {s.context.span_id: s.name for s in exported}
    ours_by_id = {s["span_id"]: s["name"] for s in data["spans"]}
    assert len({s.context.trace_id for s in exported}) == 1
    for name, span in theirs.items():
        parent = otel_names[span.parent.span_id] if span.parent is not None else None
        assert parent == ours_by_id.get(ours[name]["parent_id"])
        assert span.end_time - span.start_time == ours[name]["end_ns"] - ours[name]["start_ns"]
        assert span.attributes["specrag.span_id"] == ours[name]["span_id"]
    root = theirs[ROOT_SPAN_NAME]
    assert root.parent is None and root.attributes["specrag.trace_id"] == data["trace_id"]
    assert abs(root.start_time - time.time_ns()) < 60 * 1_000_000_000  # epoch time, not monotonic
    assert theirs["decode"].start_time - root.start_time == ours["decode"]["start_ns"] - data["start_ns"]
    assert len(theirs["decode"].events) == 5
    assert theirs["decode"].events[0].attributes["gamma"] == 4
    assert theirs["execute_tool calc"].status.status_code is StatusCode.ERROR
    assert list(theirs["retrieval docs"].attributes["specrag.passage_ids"]) == ["a#0", "b#1"]


def test_otel_export_without_the_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("opentelemetry", "opentelemetry.trace", "opentelemetry.context"):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import` raise ImportError
    with pytest.raises(ImportError, match=r"specrag\[otel\]"):
        export_to_otel(realistic_trace().to_dict())


def test_a_cycle_records_every_engine_cycle_stage_and_nothing_else() -> None:
    from dataclasses import fields

    from specrag.decoding.stats import CYCLE_STAGES

    stage_fields = [field.name for field in fields(SpeculationCycle) if field.name.endswith("_s")]
    assert stage_fields == ["duration_s", *(f"{name}_s" for name in CYCLE_STAGES)]


def test_replicas_sharing_a_trace_directory_answer_for_each_other(tmp_path: Path) -> None:
    first, second = TraceStore(shared_dir=tmp_path), TraceStore(shared_dir=tmp_path)
    trace = finished_trace(first)
    assert second.get(trace["trace_id"]) == trace and trace["trace_id"] not in second
    assert [data["trace_id"] for data in second.snapshot()] == [trace["trace_id"]]
    assert second.get("../" + trace["trace_id"]) is None and second.get("0" * 32) is None


def test_the_shared_trace_directory_keeps_the_newest(tmp_path: Path) -> None:
    store = TraceStore(max_traces=2, shared_dir=tmp_path)
    ids = [finished_trace(store)["trace_id"] for _ in range(3)]
    for age, trace_id in enumerate(ids):  # written within one clock tick, maybe: order them
        os.utime(tmp_path / f"{trace_id}.json", ns=(age * 10**9, age * 10**9))
    store.shared.prune()  # type: ignore[union-attr]
    assert sorted(path.stem for path in tmp_path.glob("*.json")) == sorted(ids[1:])
    assert not list(tmp_path.glob(".*.tmp"))


def finished_trace(store: TraceStore) -> dict[str, Any]:
    trace = Tracer(store=store).start_trace()
    trace.finish()
    data = store.get(trace.trace_id)
    assert data is not None
    return data
