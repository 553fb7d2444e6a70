"""Where finished traces are kept: a bounded LRU in memory, optionally a JSONL log, an
OpenTelemetry exporter, and a directory shared by replicas.

Behind Ray Serve (``agent/ray_serve.py``) a run's trace is finished on the replica that ran it,
and ``GET /v1/traces/{trace_id}`` may reach another. With ``shared_dir`` every finished trace
is also written there as ``<trace_id>.json`` (to a temporary name, then renamed, so a reader
never sees half a file), a trace this replica does not hold is read from there, and the list
of recent traces is drawn from there: any replica answers for all of them. The directory
keeps the newest ``max_traces`` files (``prune``), the same bound as memory.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_TRACE_ID = re.compile(r"[0-9a-f]{8,64}")  # what Trace ids look like; any other name is not read
_PRUNE_EVERY = 64  # finished traces between two prunes of the shared directory


class TraceStore:
    """The last ``max_traces`` finished traces as dicts (LRU), optionally appended to a JSONL file."""

    def __init__(
        self,
        max_traces: int = 1000,
        jsonl_path: Path | None = None,
        export: Callable[[dict[str, Any]], None] | None = None,
        shared_dir: Path | None = None,
    ) -> None:
        if max_traces < 1:
            raise ValueError("max_traces must be at least 1")
        self.max_traces = max_traces
        self.jsonl_path = jsonl_path
        self.export = export  # e.g. agent/trace_otel.py's OtlpExport, given every finished trace
        self.shared = SharedTraceDir(shared_dir, max_traces) if shared_dir is not None else None
        self._traces: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, trace: Any) -> None:
        """A finished ``Trace`` (or its dict): kept, logged, exported and shared."""
        data = trace.to_dict() if hasattr(trace, "to_dict") else dict(trace)
        with self._lock:
            self._traces[data["trace_id"]] = data
            self._traces.move_to_end(data["trace_id"])
            while len(self._traces) > self.max_traces:
                self._traces.popitem(last=False)
        if self.jsonl_path is not None:
            self._append(self.jsonl_path, data)
        if self.shared is not None:
            self.shared.write(data)
        if self.export is not None:
            try:
                self.export(data)
            except Exception as exc:  # an exporter's failure must never fail the run it traces
                logger.warning("could not export trace %s: %s", data.get("trace_id"), exc)

    def _append(self, path: Path, data: Mapping[str, Any]) -> None:
        # Losing a trace line must never fail the request that produced it.
        try:
            line = json.dumps(data, separators=(",", ":"), default=str)
            with self._lock, path.open("a", encoding="utf-8") as f:
                f.write(line + "\n")
                f.flush()
        except (OSError, TypeError, ValueError) as exc:
            logger.warning("could not append trace %s to %s: %s", data.get("trace_id"), path, exc)

    def get(self, trace_id: str) -> dict[str, Any] | None:
        with self._lock:
            data = self._traces.get(trace_id)
            if data is not None:
                self._traces.move_to_end(trace_id)
                return data
        return self.shared.read(trace_id) if self.shared is not None else None

    def snapshot(self) -> list[dict[str, Any]]:
        """Every kept trace (every replica's, with a shared directory), without touching recency."""
        with self._lock:
            kept = list(self._traces.values())
        if self.shared is None:
            return kept
        return kept + self.shared.newest(skip={data["trace_id"] for data in kept})

    def __len__(self) -> int:
        return len(self._traces)

    def __contains__(self, trace_id: object) -> bool:
        return trace_id in self._traces


class SharedTraceDir:
    """Finished traces as one JSON file each, in a directory every replica reads and writes."""

    def __init__(self, root: Path, max_traces: int) -> None:
        self.root = Path(root)
        self.max_traces = max_traces
        self.root.mkdir(parents=True, exist_ok=True)
        self._written = 0

    def write(self, data: Mapping[str, Any]) -> None:
        trace_id = str(data["trace_id"])
        temporary = self.root / f".{trace_id}.{os.getpid()}.tmp"
        try:
            temporary.write_text(json.dumps(data, separators=(",", ":"), default=str), encoding="utf-8")
            temporary.replace(self.root / f"{trace_id}.json")
        except (OSError, TypeError, ValueError) as exc:  # never fail the run it traces
            logger.warning("could not share trace %s in %s: %s", trace_id, self.root, exc)
            temporary.unlink(missing_ok=True)
            return
        self._written += 1
        if self._written % _PRUNE_EVERY == 0:
            self.prune()

    def read(self, trace_id: str) -> dict[str, Any] | None:
        if not _TRACE_ID.fullmatch(trace_id):
            return None  # never a path outside the directory
        try:
            return json.loads((self.root / f"{trace_id}.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def newest(self, skip: Collection[str] = ()) -> list[dict[str, Any]]:
        """Up to ``max_traces`` shared traces but those in ``skip`` (held in memory already, so
        not read again), oldest first (the order the memory LRU lists)."""
        traces = []
        for path in reversed(self._files_newest_first()[: self.max_traces]):
            if path.stem in skip:
                continue
            data = self.read(path.stem)
            if data is not None:
                traces.append(data)
        return traces

    def prune(self) -> None:
        """Remove all but the newest ``max_traces`` files (another replica may race: both fine)."""
        for path in self._files_newest_first()[self.max_traces :]:
            path.unlink(missing_ok=True)

    def _files_newest_first(self) -> list[Path]:
        stamped = []
        for path in self.root.glob("*.json"):
            try:
                stamped.append((path.stat().st_mtime_ns, path))
            except OSError:  # pruned meanwhile
                continue
        return [path for _, path in sorted(stamped, reverse=True)]
