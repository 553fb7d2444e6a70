"""The list of recent runs behind ``GET /v1/traces``: one summary line per kept trace.

A summary is read off the trace dict (``Trace.to_dict``), never kept beside it, so the
list cannot disagree with the traces it links to: status from the root span, the model
and token counts from the ``chat`` spans (GenAI semantic-convention attributes), tool
calls from the ``execute_tool`` spans. Newest first by wall-clock start.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

MAX_PAGE = 200
STATUSES = ("ok", "error")


@dataclass(frozen=True)
class TraceSummary:
    trace_id: str
    operation: str  # gen_ai.operation.name of the root: invoke_agent (a run) or chat
    status: str  # "ok" or "error"
    error: str | None  # the root's status message when it failed
    started_at: str  # ISO 8601, UTC
    duration_ms: float
    model: str | None
    input_tokens: int  # summed over the run's generations
    output_tokens: int
    tool_calls: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(trace: Mapping[str, Any]) -> TraceSummary:
    spans = trace["spans"]
    root = spans[0]
    chats = [span for span in spans if "gen_ai.request.model" in span["attributes"]]
    return TraceSummary(
        trace_id=trace["trace_id"],
        operation=str(root["attributes"].get("gen_ai.operation.name", trace.get("name", ""))),
        status="error" if root["status"] == "error" else "ok",
        error=root.get("status_message") if root["status"] == "error" else None,
        started_at=datetime.fromtimestamp(start_epoch_ns(trace) / 1e9, tz=UTC).isoformat(timespec="milliseconds"),
        duration_ms=round(float(trace["duration_ms"] or 0.0), 3),
        model=str(chats[0]["attributes"]["gen_ai.request.model"]) if chats else None,
        input_tokens=sum(int(span["attributes"].get("gen_ai.usage.input_tokens", 0)) for span in chats),
        output_tokens=sum(int(span["attributes"].get("gen_ai.usage.output_tokens", 0)) for span in chats),
        tool_calls=sum(span["name"].startswith("execute_tool ") for span in spans),
    )


def start_epoch_ns(trace: Mapping[str, Any]) -> int:
    """The trace's start on the wall clock (spans are timed on the monotonic clock)."""
    anchor = trace["anchor"]
    return int(anchor["epoch_ns"] + (trace["start_ns"] - anchor["monotonic_ns"]))


def recent(
    traces: Iterable[Mapping[str, Any]],
    *,
    status: str | None = None,
    min_duration_ms: float = 0.0,
    limit: int = 50,
    offset: int = 0,
) -> tuple[list[TraceSummary], int]:
    """One page of summaries, newest first, after the filters; and how many passed them."""
    if status is not None and status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {status!r}")
    if not 1 <= limit <= MAX_PAGE or offset < 0 or min_duration_ms < 0:
        raise ValueError(f"limit must be within 1..{MAX_PAGE}; offset and min_duration_ms at least 0")
    ordered = sorted(traces, key=start_epoch_ns, reverse=True)
    chosen = [
        summary
        for summary in map(summarize, ordered)
        if (status is None or summary.status == status) and summary.duration_ms >= min_duration_ms
    ]
    return chosen[offset : offset + limit], len(chosen)


def render_index(summaries: list[TraceSummary], total: int, base: str = "/v1/traces") -> str:
    """An HTML table of the summaries, each linking to its waterfall (``/v1/traces/{id}/view``)."""
    rows = "\n".join(
        "<tr>"
        f'<td><a href="{base}/{html.escape(item.trace_id)}/view">{html.escape(item.trace_id[:16])}</a></td>'
        f"<td>{html.escape(item.started_at)}</td><td>{html.escape(item.operation)}</td>"
        f'<td class="{item.status}">{item.status}</td><td>{item.duration_ms:.1f}</td>'
        f"<td>{html.escape(item.model or '')}</td><td>{item.input_tokens}</td><td>{item.output_tokens}</td>"
        f"<td>{item.tool_calls}</td></tr>"
        for item in summaries
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>specrag traces</title>"
        "<style>body{font-family:sans-serif}td,th{padding:2px 8px;text-align:left}.error{color:#c00}</style>"
        f"</head><body><h1>Recent runs</h1><p>{len(summaries)} of {total}, newest first</p>"
        "<table><tr><th>trace</th><th>started (UTC)</th><th>operation</th><th>status</th><th>ms</th>"
        "<th>model</th><th>input tokens</th><th>output tokens</th><th>tool calls</th></tr>"
        f"{rows}</table></body></html>"
    )
