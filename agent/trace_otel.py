"""OpenTelemetry export of a finished specrag trace (the optional extra ``otel``).

specrag records traces itself (``agent/trace.py``: monotonic clock, served by id without an
exporter); this module re-creates one as real OTel SDK spans with the recorded times.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


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
