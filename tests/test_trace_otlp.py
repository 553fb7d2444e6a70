"""Traces exported over OTLP/HTTP to a collector on loopback, as ``OTEL_EXPORTER_OTLP_ENDPOINT`` asks.

The receiver is a plain HTTP server that decodes each POST to ``/v1/traces`` with the
OTLP protobuf schema (``opentelemetry-proto``), as a collector would.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from specrag.agent.trace import Tracer, TraceStore
from specrag.agent.trace_otel import export_from_env
from tests.test_trace import realistic_trace

pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="extra 'otel' not installed")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


class Collector:
    """Spans received on loopback: (service name, span name, attributes, status code)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, dict[str, Any], int]] = []
        self.paths: list[str] = []
        self.arrived = threading.Condition()

    def receive(self, path: str, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        with self.arrived:
            self.paths.append(path)
            for resource_spans in request.resource_spans:
                resource = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        attributes = {kv.key: attribute_value(kv.value) for kv in span.attributes}
                        self.spans.append((resource["service.name"], span.name, attributes, span.status.code))
            self.arrived.notify_all()

    def wait_for(self, count: int, timeout: float = 20.0) -> bool:
        with self.arrived:
            return self.arrived.wait_for(lambda: len(self.spans) >= count, timeout)


def attribute_value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [attribute_value(item) for item in value.array_value.values]
    return getattr(value, kind) if kind else None


@pytest.fixture
def collector(monkeypatch: pytest.MonkeyPatch) -> Iterator[Collector]:
    received = Collector()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.receive(self.path, body)
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "specrag-test")
    yield received
    server.shutdown()
    server.server_close()


def test_every_finished_trace_reaches_the_collector(collector: Collector) -> None:
    export = export_from_env()
    assert export is not None
    store = TraceStore(export=export)
    trace = realistic_trace()
    store.add(trace)
    second = Tracer(store=store).start_trace(attributes={"gen_ai.operation.name": "invoke_agent"})
    second.finish()
    assert export.flush() and collector.wait_for(len(trace.spans) + 1), collector.spans
    export.shutdown()

    assert set(collector.paths) == {"/v1/traces"}
    assert {service for service, *_ in collector.spans} == {"specrag-test"}
    by_name = {name: (attributes, status) for _, name, attributes, status in collector.spans}
    assert {"invoke_agent specrag", "chat smollm2", "prefill", "decode", "execute_tool calc"} <= set(by_name)
    assert by_name["chat smollm2"][0]["gen_ai.usage.input_tokens"] == 50
    assert by_name["execute_tool calc"][0]["gen_ai.tool.name"] == "calc"
    assert by_name["execute_tool calc"][1] == 2  # STATUS_CODE_ERROR
    roots = [attributes for _, name, attributes, _ in collector.spans if name == "invoke_agent specrag"]
    assert {root["specrag.trace_id"] for root in roots} == {trace.trace_id, second.trace_id}


def test_no_endpoint_no_export(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(variable, raising=False)
    assert export_from_env() is None


def test_a_failing_exporter_never_fails_the_run() -> None:
    def broken(trace: dict[str, Any]) -> None:
        raise ConnectionError("collector down")

    store = TraceStore(export=broken)
    trace = Tracer(store=store).start_trace()
    trace.finish()  # logged, not raised
    assert store.get(trace.trace_id) is not None
