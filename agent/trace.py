"""Per-run traces: a span tree with monotonic timestamps, a bounded store, and OTel export.

This module owns the trace of one agent run: the span tree the agent loop builds (OTel GenAI
names: ``invoke_agent specrag`` at the root, ``retrieval {index}``, ``prompt_build``,
``chat {model}`` with ``prefill`` and ``decode`` children, ``execute_tool {name}``), its JSON
form (``GET /v1/traces/{trace_id}``, drawn by ``agent/trace_view.py``), the LRU of recent
traces (``agent/trace_store.py``), and the re-creation of a trace as OpenTelemetry spans (``agent/trace_otel.py``).

Clock: every timestamp is ``time.monotonic_ns()`` (the engine's clock too; never wall time,
so NTP steps cannot make durations negative); durations are derived from start/end. Each
trace keeps one (monotonic, epoch) anchor pair, taken together at its start, so that the OTel
export can convert to the epoch nanoseconds OTel wants.

Speculation cycles are *events* named ``speculation_cycle`` on the ``decode`` span (timestamp
= the cycle's start, ``duration_s`` = its wall time), not child spans: a run has hundreds of
cycles and an event is a fraction of a span's size.

Content capture (prompts, passages, tool arguments and results, answers) is off by default:
unless ``Tracer(capture_content=True)``, every attribute whose name marks it as content (see
``is_content_attribute``) is dropped when set, so a caller cannot leak user text by accident.

Why not record with the OpenTelemetry SDK directly: it is an optional extra here, the engine
reports stages after the fact in monotonic time, and the server must serve a finished trace
by id without an exporter. The recorder is small; the export goes through the real SDK.
"""

from __future__ import annotations

import contextvars
import logging
import secrets
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Literal

from specrag.agent.trace_store import TraceStore
from specrag.decoding.stats import CYCLE_STAGES

logger = logging.getLogger(__name__)

ROOT_SPAN_NAME = "invoke_agent specrag"
CYCLE_EVENT = "speculation_cycle"
MAX_EXCEPTION_MESSAGE = 500

# Name components that mark an attribute as user content (OTel GenAI: gen_ai.input.messages,
# gen_ai.tool.call.arguments, ...; ours: specrag.prompt, specrag.passages, ...). A word list reads best here.
CONTENT_NAME_PARTS = frozenset(
    "prompt passages documents arguments question answer completion messages system_instructions content result".split()  # noqa: SIM905
)
Status = Literal["unset", "ok", "error"]

_current_span: contextvars.ContextVar[Span | None] = contextvars.ContextVar("specrag_current_span", default=None)


def is_content_attribute(key: str) -> bool:
    """True when ``key`` names user content (any dotted part is in ``CONTENT_NAME_PARTS``)."""
    return any(part in CONTENT_NAME_PARTS for part in key.lower().split("."))


def _clean_value(value: Any) -> Any:
    # Keep the exported dict JSON-serialisable whatever a caller passes.
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, list | tuple | set | frozenset):
        return [_clean_value(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _clean_value(v) for k, v in value.items()}
    return str(value)


@dataclass(frozen=True)
class SpeculationCycle:
    """One decode cycle as recorded on the decode span: γ = 0 is a plain step. Seconds and tokens."""

    start_ns: int
    gamma: int
    accepted_len: int
    committed: int
    duration_s: float | None = None  # None: the sum of the stage seconds below
    source: str | None = None  # the drafter that proposed
    # One field per specrag.decoding.stats.CYCLE_STAGES, in its order (tests/test_trace.py holds them equal).
    draft_s: float = 0.0
    verify_s: float = 0.0
    accept_s: float = 0.0
    grammar_s: float = 0.0
    rollback_s: float = 0.0

    @classmethod
    def from_engine(cls, info: Any, committed: int) -> SpeculationCycle:
        """From the engine's ``specrag.decoding.stats.CycleInfo`` and the number of tokens the cycle committed."""
        stage = info.stage_seconds
        return cls(
            info.start_ns,
            info.gamma,
            info.accepted_len,
            committed,
            (info.end_ns - info.start_ns) / 1e9,
            info.source,
            *(float(stage.get(name, 0.0)) for name in CYCLE_STAGES),
        )

    def attributes(self) -> dict[str, Any]:
        attrs = {k: v for k, v in asdict(self).items() if k != "start_ns" and v is not None}
        if self.duration_s is None:
            attrs["duration_s"] = sum(getattr(self, f"{name}_s") for name in CYCLE_STAGES)
        return attrs


class Span:
    """One timed operation in a trace. Create through ``Trace.span`` or ``Trace.add_completed_span``."""

    def __init__(
        self, trace: Trace, name: str, parent_id: str | None, start_ns: int, attributes: Mapping[str, Any] | None
    ) -> None:
        self.trace = trace
        self.name = name
        self.span_id = secrets.token_hex(8)
        self.parent_id = parent_id
        self.start_ns = start_ns
        self.end_ns: int | None = None
        self.status: Status = "unset"
        self.status_message: str | None = None
        self.attributes: dict[str, Any] = {}
        self.events: list[dict[str, Any]] = []  # {"name", "timestamp_ns", "attributes"}
        self.set_attributes(attributes or {})

    def set_attribute(self, key: str, value: Any) -> None:
        """Set one attribute; content attributes are dropped unless the tracer captures content."""
        if not self.trace.capture_content and is_content_attribute(key):
            return
        self.attributes[key] = _clean_value(value)

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def add_event(
        self, name: str, attributes: Mapping[str, Any] | None = None, timestamp_ns: int | None = None
    ) -> None:
        clean = {
            k: _clean_value(v)
            for k, v in (attributes or {}).items()
            if self.trace.capture_content or not is_content_attribute(k)
        }
        ts = time.monotonic_ns() if timestamp_ns is None else timestamp_ns
        with self.trace._lock:
            self.events.append({"name": name, "timestamp_ns": ts, "attributes": clean})

    def add_cycle(self, cycle: SpeculationCycle) -> None:
        """Record one speculation cycle as a ``speculation_cycle`` event (see module docstring)."""
        self.add_event(CYCLE_EVENT, cycle.attributes(), timestamp_ns=cycle.start_ns)

    def set_status(self, status: Status, message: str | None = None) -> None:
        self.status = status
        self.status_message = message

    def record_exception(self, exc: BaseException) -> None:
        """Mark the span failed with the exception's type and message; never its stack trace."""
        message = str(exc)[:MAX_EXCEPTION_MESSAGE]
        exc_type = type(exc).__qualname__
        self.set_status("error", f"{exc_type}: {message}" if message else exc_type)
        self.attributes["error.type"] = exc_type
        # The message may quote user input, but an operator needs it; the traceback is never kept.
        self.add_event("exception", {"exception.type": exc_type, "exception.message": message})

    def end(self, end_ns: int | None = None) -> None:
        if self.end_ns is None:
            self.end_ns = time.monotonic_ns() if end_ns is None else end_ns

    @property
    def duration_ns(self) -> int | None:
        return None if self.end_ns is None else self.end_ns - self.start_ns

    def to_dict(self) -> dict[str, Any]:
        duration = self.duration_ns
        out: dict[str, Any] = {
            "span_id": self.span_id,
            "parent_id": self.parent_id,
            "name": self.name,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "duration_ms": None if duration is None else duration / 1e6,
            "attributes": dict(self.attributes),
            "events": [{**e, "attributes": dict(e["attributes"])} for e in self.events],
            "status": self.status,
        }
        if self.status_message is not None:
            out["status_message"] = self.status_message
        return out


class Trace:
    """The span tree of one run. Its root span is open from ``start_trace`` until ``finish``."""

    def __init__(
        self,
        name: str = ROOT_SPAN_NAME,
        attributes: Mapping[str, Any] | None = None,
        capture_content: bool = False,
        store: TraceStore | None = None,
    ) -> None:
        self.trace_id = secrets.token_hex(16)
        self.capture_content = capture_content
        self._store = store
        self._lock = threading.Lock()
        # Taken back to back so the OTel export can map monotonic to epoch time.
        self.anchor_monotonic_ns = time.monotonic_ns()
        self.anchor_epoch_ns = time.time_ns()
        self.root = Span(self, name, None, self.anchor_monotonic_ns, attributes)
        self.spans: list[Span] = [self.root]
        self.finished = False

    @property
    def name(self) -> str:
        return self.root.name

    def _default_parent(self) -> Span:
        current = _current_span.get()
        return current if current is not None and current.trace is self else self.root

    def _new_span(self, name: str, parent: Span | None, start_ns: int, attributes: Mapping[str, Any] | None) -> Span:
        parent = parent if parent is not None else self._default_parent()
        if parent.trace is not self:
            raise ValueError("parent span belongs to another trace")
        span = Span(self, name, parent.span_id, start_ns, attributes)
        with self._lock:
            self.spans.append(span)
        return span

    @contextmanager
    def span(
        self, name: str, attributes: Mapping[str, Any] | None = None, parent: Span | None = None
    ) -> Iterator[Span]:
        """Time a block as a span, a child of the innermost open span of this trace by default.

        An exception leaving the block is recorded on the span and re-raised.
        """
        span = self._new_span(name, parent, time.monotonic_ns(), attributes)
        token = _current_span.set(span)
        try:
            yield span
        except GeneratorExit:  # an abandoned generator around the block, not a failure of the stage
            raise
        except BaseException as exc:
            span.record_exception(exc)
            raise
        finally:
            span.end()
            _current_span.reset(token)

    def add_completed_span(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, Any] | None = None,
        parent: Span | None = None,
    ) -> Span:
        """Add a span timed elsewhere (e.g. the engine's prefill/decode seconds), in monotonic ns."""
        if end_ns < start_ns:
            raise ValueError(f"span {name!r} ends before it starts ({end_ns} < {start_ns})")
        span = self._new_span(name, parent, start_ns, attributes)
        span.end(end_ns)
        return span

    def finish(self, end_ns: int | None = None) -> None:
        """End the root (and any span left open) and hand the trace to the store. Idempotent."""
        if self.finished:
            return
        root_end = time.monotonic_ns() if end_ns is None else end_ns
        self.root.end(root_end)
        for span in self.spans:
            if span.end_ns is None:
                span.set_attribute("specrag.unfinished", True)
                span.end(max(root_end, span.start_ns))
        self.finished = True
        if self._store is not None:
            self._store.add(self)

    def to_dict(self) -> dict[str, Any]:
        with self._lock:
            spans = [s.to_dict() for s in self.spans]
        root = spans[0]
        return {
            "trace_id": self.trace_id,
            "name": self.root.name,
            "start_ns": root["start_ns"],
            "end_ns": root["end_ns"],
            "duration_ms": root["duration_ms"],
            "clock": "monotonic_ns",
            "anchor": {"monotonic_ns": self.anchor_monotonic_ns, "epoch_ns": self.anchor_epoch_ns},
            "spans": spans,
        }

    def stage_durations(self) -> dict[str, float]:
        return stage_durations(self.to_dict())

    def stages_cover_run(self, tolerance: float = 0.05) -> bool:
        return stages_cover_run(self.to_dict(), tolerance)


def _root_of(trace_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    for span in trace_dict["spans"]:
        if span["parent_id"] is None:
            return span
    raise ValueError("trace has no root span")


def stage_durations(trace_dict: Mapping[str, Any]) -> dict[str, float]:
    """Seconds per top-level stage (direct children of the root), summed over same-named spans.

    Keys keep the order of first appearance; open spans count as zero.
    """
    root_id = _root_of(trace_dict)["span_id"]
    out: dict[str, float] = {}
    for span in trace_dict["spans"]:
        if span["parent_id"] == root_id:
            seconds = 0.0 if span["end_ns"] is None else (span["end_ns"] - span["start_ns"]) / 1e9
            out[span["name"]] = out.get(span["name"], 0.0) + seconds
    return out


def stage_coverage(trace_dict: Mapping[str, Any]) -> float:
    """Sum of top-level stage durations over the run's wall time (1.0 = stages cover the run)."""
    root = _root_of(trace_dict)
    if root["end_ns"] is None:
        raise ValueError("trace is not finished")
    wall_s = (root["end_ns"] - root["start_ns"]) / 1e9
    total = sum(stage_durations(trace_dict).values())
    return total / wall_s if wall_s > 0 else 1.0


def stages_cover_run(trace_dict: Mapping[str, Any], tolerance: float = 0.05) -> bool:
    """True when the top-level stages sum to within ``tolerance`` (a fraction) of the run's wall time."""
    return abs(stage_coverage(trace_dict) - 1.0) <= tolerance


class Tracer:
    """Starts traces; one per server. ``capture_content=True`` records prompts, passages, arguments."""

    def __init__(self, capture_content: bool = False, store: TraceStore | None = None) -> None:
        self.capture_content = capture_content
        self.store = store

    def start_trace(self, name: str = ROOT_SPAN_NAME, attributes: Mapping[str, Any] | None = None) -> Trace:
        return Trace(name, attributes, capture_content=self.capture_content, store=self.store)
