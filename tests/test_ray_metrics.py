"""Merging the replicas' Prometheus expositions (agent/ray_metrics.py), without Ray."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specrag.agent import ray_metrics
from specrag.agent.ray_metrics import MetricsBoard, merge_expositions


def exposition(requests: int, latency_s: float, in_flight: int) -> bytes:
    registry = CollectorRegistry()
    counter = Counter("specrag:http_requests", "requests", ["route"], registry=registry)
    counter.labels("/v1/chat/completions").inc(requests)
    Histogram("specrag:ttft_seconds", "ttft", buckets=(0.1, 1.0), registry=registry).observe(latency_s)
    Gauge("specrag:num_requests_in_flight", "in flight", registry=registry).set(in_flight)
    return generate_latest(registry)


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


def test_every_replicas_samples_are_kept_and_labelled_with_it() -> None:
    by_replica = {"a": exposition(3, 0.05, 1), "b": exposition(5, 0.5, 2)}
    merged = merge_expositions(by_replica)
    expected = {
        (name, tuple(sorted((*labels, ("replica", replica))))): value
        for replica, text in by_replica.items()
        for (name, labels), value in samples(text).items()
    }
    assert samples(merged) == expected
    assert expected[("specrag:http_requests_total", (("replica", "b"), ("route", "/v1/chat/completions")))] == 5


def test_each_family_is_declared_once() -> None:
    """The text format allows one ``# TYPE`` per family: concatenated texts would repeat it."""
    merged = merge_expositions({"a": exposition(1, 0.05, 0), "b": exposition(1, 0.05, 0)}).decode()
    types = [line for line in merged.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types)) and "# TYPE specrag:ttft_seconds histogram" in types


def test_a_replica_that_stopped_pushing_drops_out(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(ray_metrics.time, "monotonic", lambda: now[0])
    board = MetricsBoard()
    board.put("a", b"a")
    now[0] += ray_metrics.STALE_AFTER_S / 2
    board.put("b", b"b")
    assert board.fresh() == {"a": b"a", "b": b"b"}
    now[0] += ray_metrics.STALE_AFTER_S * 0.75
    assert board.fresh() == {"b": b"b"}
    board.drop("b")
    assert board.fresh() == {}
