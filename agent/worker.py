"""The engine worker: one thread owns the engine and steps every in-flight request together.

The engine is single-threaded by design (vLLM's EngineCore is too); HTTP handlers and agent
runs live on other threads. They ``submit`` a ``GenerationRequest`` and read its events from
a queue of their own. Each ``Engine.step()`` advances every active sequence by one cycle,
so concurrent requests make progress together (fair interleaving per cycle). The number
of requests waiting or running is bounded: beyond it ``submit`` raises ``QueueFull`` (the
server answers 503 with Retry-After). Closing the event iterator early, as a disconnected
client does, cancels the sequence and frees its KV at once.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from specrag.decoding.engine import Engine
from specrag.decoding.request import GenerationEvent, GenerationRequest


class QueueFull(RuntimeError):
    """Too many requests are waiting or running; retry later."""


class WorkerStopped(RuntimeError):
    """The worker is not running."""


@dataclass
class _Handle:
    request: GenerationRequest
    events: queue.Queue[GenerationEvent | BaseException] = field(default_factory=queue.Queue)
    seq_id: int | None = None
    cancelled: bool = False
    released: bool = False  # its in-flight slot was given back (exactly once)


class EngineWorker:
    def __init__(self, engine: Engine, max_in_flight: int = 32) -> None:
        self.engine = engine
        self.max_in_flight = max_in_flight
        self._lock = threading.Lock()  # guards the counters and the mailbox below
        self._wake = threading.Condition(self._lock)
        self._incoming: list[_Handle] = []
        self._cancelled: list[_Handle] = []
        self._running: dict[int, _Handle] = {}
        self._in_flight = 0
        self._stopping = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._serve, name="specrag-engine", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def alive(self) -> bool:
        """Whether the engine thread still runs (Ray Serve's health check asks)."""
        return self._thread.is_alive()

    def generate(self, request: GenerationRequest) -> Iterator[GenerationEvent]:
        """Submit and stream the request's events; leaving early cancels it."""
        handle = self._submit(request)
        finished = False
        try:
            while not finished:
                item = handle.events.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._cancel(handle)

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=30)

    def _submit(self, request: GenerationRequest) -> _Handle:
        handle = _Handle(request)
        with self._wake:
            if self._stopping:
                raise WorkerStopped("the engine worker has stopped")
            if self._in_flight >= self.max_in_flight:
                raise QueueFull(f"{self._in_flight} requests in flight (limit {self.max_in_flight})")
            self._in_flight += 1
            self._incoming.append(handle)
            self._wake.notify()
        return handle

    def _cancel(self, handle: _Handle) -> None:
        with self._wake:
            handle.cancelled = True
            self._cancelled.append(handle)
            self._wake.notify()

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not (self._incoming or self._cancelled or self._running or self._stopping):
                    self._wake.wait()
                if self._stopping:
                    break
                incoming, self._incoming = self._incoming, []
                cancelled, self._cancelled = self._cancelled, []
            for handle in cancelled:
                self._drop(handle)
            for handle in incoming:
                if not handle.cancelled:
                    self._admit(handle)
            if self._running:
                self._step()
        for handle in list(self._running.values()):
            handle.events.put(WorkerStopped("the engine worker has stopped"))

    def _admit(self, handle: _Handle) -> None:
        try:
            handle.seq_id = self.engine.add(handle.request)
        except Exception as error:  # a bad request fails alone
            handle.events.put(error)
            self._release(handle)
            return
        self._running[handle.seq_id] = handle

    def _step(self) -> None:
        try:
            events = self.engine.step()  # a sequence that fails alone comes back as its event's error
        except Exception as error:  # the step itself failed: never leave a caller waiting forever
            for handle in list(self._running.values()):
                handle.events.put(error)
                self._drop(handle)
            return
        for event in events:
            handle = self._running.get(event.seq_id)
            if handle is None:
                continue
            handle.events.put(event.error if event.error is not None else event)
            if event.finished:
                del self._running[event.seq_id]
                self._release(handle)

    def _drop(self, handle: _Handle) -> None:
        if handle.seq_id is not None and self._running.pop(handle.seq_id, None) is not None:
            self.engine.cancel(handle.seq_id)
        self._release(handle)

    def _release(self, handle: _Handle) -> None:
        with self._lock:
            if not handle.released:
                handle.released = True
                self._in_flight -= 1
