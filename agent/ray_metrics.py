"""``GET /metrics`` through Ray Serve: every replica's registry, each series labelled ``replica``.

Ray's router sends a scrape to one replica, whose registry alone would be a fraction of the
deployment. So each replica pushes its exposition to one named actor, ``MetricsBoard``, every
``PUSH_INTERVAL_S``; the ingress forwards the scrape as any request (the replica checks its
key as in one process) and, when it is answered 200, returns the board's expositions merged
(``merge_expositions``): one family per name, every sample with a ``replica`` label, as
Prometheus would store separate scrapes of each replica. A replica that stopped pushing
(dead; Ray restarts it under a new id) drops out after ``STALE_AFTER_S``; its successor's
counters start from zero as a restarted pod's do.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping

import ray
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from ray.actor import ActorHandle

PUSH_INTERVAL_S = 1.0
STALE_AFTER_S = 10.0
REPLICA_LABEL = "replica"
BOARD_NAMESPACE = "specrag"


class MetricsBoard:
    """The replicas' latest expositions (a Ray actor: one per application, found by name)."""

    def __init__(self) -> None:
        self._latest: dict[str, tuple[float, bytes]] = {}

    def put(self, replica: str, exposition: bytes) -> None:
        self._latest[replica] = (time.monotonic(), exposition)

    def drop(self, replica: str) -> None:
        self._latest.pop(replica, None)

    def fresh(self) -> dict[str, bytes]:
        """Each replica's exposition, those not pushed for ``STALE_AFTER_S`` left out."""
        now = time.monotonic()
        self._latest = {replica: pushed for replica, pushed in self._latest.items() if now - pushed[0] <= STALE_AFTER_S}
        return {replica: text for replica, (_, text) in self._latest.items()}


def board(app_name: str) -> ActorHandle:
    """The application's board, started by whichever replica or ingress asks first.

    Detached: owned by no replica, so a replica's death does not take it down (a redeploy
    under the same name reuses it; ``ray.shutdown`` of a local instance ends it)."""
    actor = ray.remote(num_cpus=0)(MetricsBoard)
    name = f"specrag-metrics:{app_name}"
    return actor.options(name=name, namespace=BOARD_NAMESPACE, get_if_exists=True, lifetime="detached").remote()


class MetricsPusher:
    """A replica's thread that pushes ``render()`` to the board until ``stop``."""

    def __init__(self, board_handle: ActorHandle, replica: str, render: Callable[[], bytes]) -> None:
        self._board = board_handle
        self._replica = replica
        self._render = render
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specrag-metrics-push", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._board.put.remote(self._replica, self._render())  # fire and forget: a scrape may lag a push
            self._stopped.wait(PUSH_INTERVAL_S)

    def stop(self) -> None:
        self._stopped.set()
        self._board.drop.remote(self._replica)


def merge_expositions(by_replica: Mapping[str, bytes]) -> bytes:
    """One exposition of every replica's families, each sample labelled with its replica.

    The text format allows a family's ``# TYPE`` once, so families are merged by name rather
    than the texts concatenated."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(by_replica.items()):
        for family in text_string_to_metric_families(text.decode()):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                labels = {**sample.labels, REPLICA_LABEL: replica}
                merged.add_sample(sample.name, labels, sample.value, sample.timestamp)
    registry = CollectorRegistry()
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
