"""Prometheus metrics of the HTTP server (``GET /metrics``), with ``prometheus-client``.

Each app gets its own ``CollectorRegistry`` (never the process-global one), so a process
can build many apps (the tests do) without duplicate-metric errors. Names follow vLLM's
where a vLLM metric exists (``vllm:spec_decode_num_drafts`` becomes
``specrag:spec_decode_num_drafts``; counters are exported with the ``_total`` suffix):

- ``specrag:http_requests_total{route,method,status}`` and
  ``specrag:http_request_duration_seconds{route,method}`` (a stream counts until its last byte),
  recorded by ``MetricsMiddleware`` around every matched route;
- ``specrag:time_to_first_token_seconds{endpoint}``, ``specrag:inter_token_latency_seconds``,
  ``specrag:request_queue_time_seconds`` (submit to the start of prefill in the engine worker);
- ``specrag:prompt_tokens_total``, ``specrag:generation_tokens_total``,
  ``specrag:target_calls_total`` (chat completions: generation tokens over target calls is
  the committed tokens per target call);
- ``specrag:spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``,
  ``..._num_accepted_tokens_total``, ``..._num_accepted_tokens_per_pos_total{position}``:
  from a chat completion's ``GenerationStats``, or from an agent run's trace (its
  ``speculation_cycle`` events), since the agent loop does not hand out per-step stats;
- ``specrag:prefix_cache_queries_total`` / ``specrag:prefix_cache_hits_total`` (tokens) and
  ``specrag:num_requests_in_flight``, ``specrag:num_requests_running`` (past their prefill) and
  ``specrag:num_requests_waiting`` (queued, or waiting for prefill chunks; vLLM's names),
  ``specrag:kv_cache_usage_perc`` (the fraction of the KV block pool held, 0..1 as vLLM's),
  read from the engine at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from litestar.types import ASGIApp, Message, Receive, Scope, Send
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from specrag.decoding.stats import GenerationStats

CONTENT_TYPE = CONTENT_TYPE_LATEST  # the exposition format generate_latest writes
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
CYCLE_EVENT = "speculation_cycle"


class ServerMetrics:
    def __init__(self, agent: Any) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "specrag:http_requests", "HTTP requests by route, method and status", ["route", "method", "status"],
            registry=registry,
        )  # fmt: skip
        self.request_latency = Histogram(
            "specrag:http_request_duration_seconds", "HTTP request latency (streams: until the last byte)",
            ["route", "method"], buckets=_LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.ttft = Histogram(
            "specrag:time_to_first_token_seconds", "Request received to first output token", ["endpoint"],
            buckets=_LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.itl = Histogram(
            "specrag:inter_token_latency_seconds", "Time between output tokens (a cycle's time split over its tokens)",
            buckets=_TOKEN_BUCKETS, registry=registry,
        )  # fmt: skip
        self.queue_time = Histogram(
            "specrag:request_queue_time_seconds", "Submitted to the engine worker until its prefill started",
            buckets=_LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.prompt_tokens = Counter("specrag:prompt_tokens", "Prompt tokens processed", registry=registry)
        self.generation_tokens = Counter("specrag:generation_tokens", "Tokens generated", registry=registry)
        self.target_calls = Counter(
            "specrag:target_calls", "Target forwards per sequence (a packed forward counts for each it serves)",
            registry=registry,
        )  # fmt: skip
        self.drafts = Counter("specrag:spec_decode_num_drafts", "Draft-verify cycles", registry=registry)
        self.draft_tokens = Counter("specrag:spec_decode_num_draft_tokens", "Tokens drafted", registry=registry)
        self.accepted = Counter("specrag:spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=registry)
        self.accepted_per_pos = Counter(
            "specrag:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each draft position",
            ["position"], registry=registry,
        )  # fmt: skip
        registry.register(_EngineCollector(agent))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.request_latency.labels(route, method).observe(seconds)

    def observe_stats(self, stats: GenerationStats) -> None:
        """Token and speculation counters of one finished generation."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.output_tokens)
        self.target_calls.inc(stats.target_calls)
        self._speculation(
            sum(1 for gamma in stats.gamma_per_cycle if gamma), stats.drafted_tokens, stats.acceptance_by_position
        )

    def observe_run(self, result: Mapping[str, Any], trace: Mapping[str, Any] | None) -> None:
        """Token counters from an agent run's usage; speculation counters from its trace's cycles."""
        usage = result.get("usage", {})
        self.prompt_tokens.inc(usage.get("prompt_tokens", 0))
        self.generation_tokens.inc(usage.get("completion_tokens", 0))
        drafts, drafted, by_position = 0, 0, []
        for cycle in _cycles(trace):
            gamma, accepted = int(cycle.get("gamma", 0)), int(cycle.get("accepted_len", 0))
            if gamma:
                drafts += 1
                drafted += gamma
                by_position.extend([0] * (accepted - len(by_position)))
                for position in range(accepted):
                    by_position[position] += 1
        self._speculation(drafts, drafted, by_position)

    def _speculation(self, drafts: int, drafted: int, accepted_by_position: Sequence[int]) -> None:
        self.drafts.inc(drafts)
        self.draft_tokens.inc(drafted)
        self.accepted.inc(sum(accepted_by_position))
        for position, count in enumerate(accepted_by_position):
            self.accepted_per_pos.labels(str(position)).inc(count)


def _cycles(trace: Mapping[str, Any] | None) -> Iterator[Mapping[str, Any]]:
    for span in (trace or {}).get("spans", []):
        for event in span.get("events", []):
            if event.get("name") == CYCLE_EVENT:
                yield event.get("attributes", {})


class _EngineCollector(Collector):
    """Prefix-cache counters and the worker's request counts, read when scraped."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        cache = getattr(self.agent.engine, "prefix_cache", None)
        stats = getattr(cache, "stats", None)
        queries = CounterMetricFamily("specrag:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        hits = CounterMetricFamily("specrag:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        queries.add_metric([], float(getattr(stats, "queried_tokens", 0)))
        hits.add_metric([], float(getattr(stats, "hit_tokens", 0)))
        worker = getattr(self.agent, "worker", None)
        in_flight = GaugeMetricFamily("specrag:num_requests_in_flight", "Generations waiting or running")
        in_flight.add_metric([], float(worker.in_flight if worker is not None else 0))
        engine = self.agent.engine
        running = engine.num_running() if hasattr(engine, "num_running") else 0
        waiting = max(0, (worker.in_flight if worker is not None else 0) - running)
        running_gauge = GaugeMetricFamily("specrag:num_requests_running", "Generations past their prefill")
        running_gauge.add_metric([], float(running))
        waiting_gauge = GaugeMetricFamily(
            "specrag:num_requests_waiting", "Generations queued or waiting for their prompt's prefill chunks"
        )
        waiting_gauge.add_metric([], float(waiting))
        usage = GaugeMetricFamily(
            "specrag:kv_cache_usage_perc", "Fraction of the KV block pool held by sequences (1 = full)"
        )
        usage.add_metric([], float(engine.kv_cache_usage()) if hasattr(engine, "kv_cache_usage") else 0.0)
        yield from (queries, hits, in_flight, running_gauge, waiting_gauge, usage)


class MetricsMiddleware:
    """Counts and times every request to a matched route (litestar sets ``path_template``)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_and_watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            route = scope.get("path_template") or scope.get("path", "")
            self.metrics.observe_request(route, scope.get("method", ""), status, time.perf_counter() - start)
