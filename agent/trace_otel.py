"""OpenTelemetry export of a finished specrag trace (the optional extra ``otel``).

specrag records traces itself (``agent/trace.py``: monotonic clock, served by id without an
exporter); this module re-creates one as real OTel SDK spans with the recorded times, and,
where ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set, as
the OpenTelemetry convention has it, sends every finished trace over OTLP/HTTP (protobuf) to
that collector (Jaeger, Tempo, Phoenix, an OTel Collector). Spans keep the GenAI semantic
conventions' names (``invoke_agent``, ``chat {model}``, ``execute_tool {name}``) and
``gen_ai.*`` attributes. The SDK's batch processor sends from its own thread, so a slow or
absent collector never delays a request; ``OTEL_SERVICE_NAME`` names the service
(default ``specrag``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def _otel_value(value: Any) -> str | bool | int | float | list[Any] | None:
    # OTel attributes are primitives or homogeneous lists of primitives; anything else goes as JSON.
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, list) and value and all(isinstance(v, str | bool | int | float) for v in value):
        kinds = {type(v) for v in value}
        if len(kinds) == 1:
            return value
    return json.dumps(value, default=str)


def _otel_attributes(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in ((k, _otel_value(v)) for k, v in attributes.items()) if v is not None}


def export_to_otel(trace_dict: Mapping[str, Any], tracer_provider: Any = None) -> int:
    """Re-create a finished trace as OpenTelemetry spans with its recorded times; returns the span count.

    ``tracer_provider`` defaults to the global one. Times are converted from monotonic to
    epoch ns with the trace's anchor pair. OTel assigns its own ids: ours are kept as the
    attributes ``specrag.trace_id`` / ``specrag.span_id``. The SDK keeps at most 128 events
    per span by default (``OTEL_SPAN_EVENT_COUNT_LIMIT``), so a long decode's cycles may be cut.
    """
    try:
        from opentelemetry import context as otel_context
        from opentelemetry import trace as otel_trace
        from opentelemetry.trace import Status as OtelStatus
        from opentelemetry.trace import StatusCode
    except ImportError as exc:
        raise ImportError(
            "OpenTelemetry export needs the optional extra 'otel': pip install 'specrag[otel]' (opentelemetry-sdk)"
        ) from exc

    provider = tracer_provider if tracer_provider is not None else otel_trace.get_tracer_provider()
    tracer = provider.get_tracer("specrag")
    anchor = trace_dict["anchor"]
    offset = anchor["epoch_ns"] - anchor["monotonic_ns"]
    spans = list(trace_dict["spans"])
    fallback_end = max((s["end_ns"] or s["start_ns"]) for s in spans)

    created: dict[str, Any] = {}
    # Spans are recorded parents first (a parent must exist before a child can name it).
    for s in spans:
        parent_id = s["parent_id"]
        if parent_id is not None and parent_id not in created:
            raise ValueError(f"span {s['name']!r} comes before its parent {parent_id}")
        ctx = otel_trace.set_span_in_context(created[parent_id]) if parent_id else otel_context.Context()
        attributes = _otel_attributes(s["attributes"]) | {"specrag.span_id": s["span_id"]}
        if parent_id is None:
            attributes["specrag.trace_id"] = trace_dict["trace_id"]
        span = tracer.start_span(s["name"], context=ctx, attributes=attributes, start_time=s["start_ns"] + offset)
        for event in s["events"]:
            span.add_event(
                event["name"], _otel_attributes(event["attributes"]), timestamp=event["timestamp_ns"] + offset
            )
        if s["status"] == "error":
            span.set_status(OtelStatus(StatusCode.ERROR, s.get("status_message")))
        elif s["status"] == "ok":
            span.set_status(OtelStatus(StatusCode.OK))
        created[s["span_id"]] = span

    # End children before parents, as a live tracer would.
    for s in reversed(spans):
        end_ns = s["end_ns"] if s["end_ns"] is not None else fallback_end
        created[s["span_id"]].end(end_time=end_ns + offset)
    return len(created)


class OtlpExport:
    """Finished traces to an OTLP/HTTP collector; call it with a trace dict (``TraceStore(export=)``)."""

    def __init__(self, endpoint: str | None = None, service_name: str | None = None) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise ImportError(
                "OTLP export needs the optional extra 'otel': pip install 'specrag[otel]' "
                "(opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http)"
            ) from exc
        name = service_name or os.environ.get("OTEL_SERVICE_NAME") or "specrag"
        self.provider = TracerProvider(resource=Resource.create({"service.name": name}))
        # With no endpoint the exporter reads the OTEL_EXPORTER_OTLP_* variables itself.
        exporter = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
        self.provider.add_span_processor(BatchSpanProcessor(exporter))

    def __call__(self, trace_dict: Mapping[str, Any]) -> None:
        export_to_otel(trace_dict, self.provider)

    def flush(self, timeout_s: float = 10.0) -> bool:
        return bool(self.provider.force_flush(int(timeout_s * 1000)))

    def shutdown(self) -> None:
        self.provider.shutdown()


def export_from_env() -> OtlpExport | None:
    """An ``OtlpExport`` where an OTLP endpoint variable is set, else None."""
    if not any(os.environ.get(variable) for variable in ENDPOINT_VARIABLES):
        return None
    return OtlpExport()
