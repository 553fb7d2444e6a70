"""Serving under load: open-loop Poisson arrivals through the real HTTP server.

    python -m specrag.evals.bench.serve --model smollm2-135m --rate 0.5 --rate 1 --rate 2 --duration 30
    specrag bench serve -- --help

The app (``agent/server.py``) is served by uvicorn on a local port in this process; requests
are streamed chat completions (``/v1/chat/completions``, ``stream_options.include_usage``)
from a mix of the decoding workloads (passages shown in the prompt, so prompt lookup has
something to copy). For each rate one arrival trace is drawn (seeded exponential gaps for
``--duration`` seconds, each arrival's workload drawn from the mix) and replayed for every
speculation mode (``off``, ``on``, ``auto``, and ``tree``: auto with draft trees of up
to 16 nodes, the request's ``draft_tree_nodes``), modes interleaved rate by rate. A
workload with earlier questions (``agent_repeat``) is one end user's traffic: each rate and
mode gets a user of its own (OpenAI's ``user``, the drafting tenant), whose earlier
questions are answered first, untimed; its timed arrivals may then copy those answers and
each other's, as one user's repeated agent runs do. Reported per
rate and mode: output tok/s and requests/s over the makespan, TTFT p50/p99, TPOT (a
request's time per output token after its first) p50/p99, ITL (gaps between streamed
chunks, as vLLM's benchmark counts them) p50/p99, SLO goodput (requests/s that met both
``--slo-ttft`` and ``--slo-tpot``), from the server's own metrics draft acceptance and
committed tokens per target call (per sequence), and the most requests running at once and
the highest KV pool usage, polled every half second. JSON with ``--json``, a PNG with ``--plot``, a table on
stdout. Speed is measured here, never asserted in a test.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from specrag.evals import workloads
from specrag.evals.bench.runs import TREE_NODES, machine, write_outputs

MODES = ("off", "on", "auto", "tree")
MIX = ("rag_quote", "rag_explain", "code_edit", "chat_open")


@dataclass
class Outcome:
    workload: str
    sent: float
    first: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.tokens < 2:
            return None
        return (self.chunk_times[-1] - self.first) / (self.tokens - 1)


def arrival_trace(rate: float, duration: float, mix: list[str], seed: int) -> list[tuple[float, str]]:
    """(offset in seconds, workload) of each arrival: a Poisson process of ``rate`` per second."""
    rng = random.Random(seed)
    trace, at = [], rng.expovariate(rate)
    while at < duration:
        trace.append((at, rng.choice(mix)))
        at += rng.expovariate(rate)
    return trace


async def _one_request(client: httpx.AsyncClient, body: dict[str, Any], outcome: Outcome) -> None:
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                outcome.error = f"HTTP {response.status_code}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    outcome.tokens = chunk["usage"]["completion_tokens"]
                elif any(choice["delta"].get("content") for choice in chunk.get("choices", [])):
                    now = time.perf_counter()
                    outcome.first = outcome.first or now
                    outcome.chunk_times.append(now)
    except httpx.HTTPError as error:
        outcome.error = type(error).__name__


async def replay(url: str, trace: list[tuple[float, str]], bodies: dict[str, dict[str, Any]]) -> list[Outcome]:
    """Send each request at its offset (open loop: never waiting for earlier ones)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        start = time.perf_counter()
        outcomes, tasks = [], []
        for offset, name in trace:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            outcome = Outcome(name, time.perf_counter())
            outcomes.append(outcome)
            tasks.append(asyncio.create_task(_one_request(client, bodies[name], outcome)))
        await asyncio.gather(*tasks)
    return outcomes


def percentile(values: list[float], fraction: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def summarise(outcomes: list[Outcome], slo_ttft: float, slo_tpot: float) -> dict[str, Any]:
    done = [o for o in outcomes if o.error is None and o.first is not None]
    makespan = max(o.chunk_times[-1] for o in done) - min(o.sent for o in outcomes) if done else 0.0
    ttfts = [o.ttft for o in done if o.ttft is not None]
    tpots = [o.tpot for o in done if o.tpot is not None]
    gaps = [later - earlier for o in done for earlier, later in zip(o.chunk_times, o.chunk_times[1:], strict=False)]
    good = [o for o in done if o.ttft is not None and o.ttft <= slo_ttft and (o.tpot or 0.0) <= slo_tpot]

    def rounded(value: float | None) -> float | None:
        return None if value is None else round(value, 4)

    return {
        "requests": len(outcomes),
        "failed": len(outcomes) - len(done),
        "output_tokens_per_s": round(sum(o.tokens for o in done) / makespan, 2) if makespan else None,
        "requests_per_s": round(len(done) / makespan, 3) if makespan else None,
        "ttft_p50_s": rounded(percentile(ttfts, 0.5)),
        "ttft_p99_s": rounded(percentile(ttfts, 0.99)),
        "tpot_p50_s": rounded(percentile(tpots, 0.5)),
        "tpot_p99_s": rounded(percentile(tpots, 0.99)),
        "itl_p50_s": rounded(percentile(gaps, 0.5)),
        "itl_p99_s": rounded(percentile(gaps, 0.99)),
        "goodput_requests_per_s": round(len(good) / makespan, 3) if makespan else None,
    }


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {sample.name: sample.value for family in text_string_to_metric_families(text) for sample in family.samples}


class GaugePeaks:
    """The most requests running and the highest KV pool usage seen, polled while a replay runs."""

    GAUGES = ("specrag:num_requests_running", "specrag:kv_cache_usage_perc")

    def __init__(self, url: str) -> None:
        self.url, self.peaks, self._stop = url, dict.fromkeys(self.GAUGES, 0.0), asyncio.Event()

    async def poll(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as client:
            while not self._stop.is_set():
                text = (await client.get("/metrics")).text
                for family in text_string_to_metric_families(text):
                    if family.name in self.peaks:
                        self.peaks[family.name] = max(self.peaks[family.name], family.samples[0].value)
                await asyncio.sleep(0.5)

    def stop(self) -> None:
        self._stop.set()


async def _measure(url: str, trace: list[tuple[float, str]], bodies: dict[str, dict[str, Any]]) -> tuple:
    peaks = GaugePeaks(url)
    poller = asyncio.create_task(peaks.poll())
    outcomes = await replay(url, trace, bodies)
    peaks.stop()
    await poller
    return outcomes, peaks.peaks


def request_bodies(mix: list[str], max_tokens: int, mode: str, user: str | None = None) -> dict[str, dict[str, Any]]:
    """The request of each workload in ``mix`` under ``mode``; a workload with earlier
    questions is sent as ``user``."""
    bodies = {}
    for name in mix:
        workload = workloads.load(name)
        bodies[name] = _body(workload, max_tokens, mode, user if workload.earlier_questions else None)
    return bodies


def earlier_bodies(mix: list[str], max_tokens: int, mode: str, user: str) -> list[dict[str, Any]]:
    """The earlier questions of the workloads in ``mix``, in order, each as ``user``."""
    bodies = []
    for name in mix:
        workload = workloads.load(name)
        for question in workload.earlier_questions:
            earlier = dataclasses.replace(workload, question=question, earlier_questions=())
            bodies.append(_body(earlier, max_tokens, mode, user))
    return bodies


def _body(workload: workloads.Workload, max_tokens: int, mode: str, user: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": workload.messages(workload.passages()),
        "max_tokens": min(max_tokens, workload.max_tokens),
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "speculation": "auto" if mode == "tree" else mode,
        "draft_tree_nodes": TREE_NODES if mode == "tree" else 0,
    }
    if user is not None:
        body["user"] = user
    return body


async def answer_in_order(url: str, bodies: list[dict[str, Any]]) -> None:
    """Send ``bodies`` one after another (a user's earlier requests), untimed."""
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        for body in bodies:
            await _one_request(client, body, Outcome("earlier", time.perf_counter()))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from specrag.agent.live_server import LiveServer
    from specrag.agent.runtime import Agent
    from specrag.agent.server import create_app

    agent = Agent(model=args.model, dtype=args.dtype, concurrent=True, search_tool=False)
    results = []
    with LiveServer(create_app(agent, max_tokens_limit=4096)) as url:
        warm = request_bodies(args.mix, 4, "auto")
        asyncio.run(replay(url, [(0.0, name) for name in args.mix], warm))  # first calls allocate
        for rate in args.rate:
            trace = arrival_trace(rate, args.duration, args.mix, args.seed)
            for mode in args.mode:
                user = f"bench:{mode}:{rate:g}"  # one end user per rate and mode: no history shared
                asyncio.run(answer_in_order(url, earlier_bodies(args.mix, args.max_tokens, mode, user)))
                before = scrape(url)
                bodies = request_bodies(args.mix, args.max_tokens, mode, user)
                outcomes, peaks = asyncio.run(_measure(url, trace, bodies))
                after = scrape(url)
                delta = {name: after.get(name, 0) - before.get(name, 0) for name in after}
                drafted = delta.get("specrag:spec_decode_num_draft_tokens_total", 0)
                accepted = delta.get("specrag:spec_decode_num_accepted_tokens_total", 0)
                calls = delta.get("specrag:target_calls_total", 0)
                row = {"rate": rate, "speculation": mode, **summarise(outcomes, args.slo_ttft, args.slo_tpot)}
                row["draft_acceptance"] = round(accepted / drafted, 3) if drafted else None
                generated = delta.get("specrag:generation_tokens_total", 0)
                row["committed_per_target_call"] = round(generated / calls, 2) if calls else None
                row["max_running"] = peaks["specrag:num_requests_running"]
                row["max_kv_cache_usage"] = round(peaks["specrag:kv_cache_usage_perc"], 4)
                results.append(row)
                print(f"rate {rate}/s, speculation {mode}: done", file=sys.stderr, flush=True)
    return {
        "machine": machine(),
        "model": args.model,
        "dtype": str(agent.model.dtype),
        "mix": args.mix,
        "duration_s": args.duration,
        "max_tokens": args.max_tokens,
        "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
        "results": results,
    }


def print_table(report: dict[str, Any]) -> None:
    columns = [
        ("rate", "rate/s"),
        ("speculation", "speculation"),
        ("requests", "requests"),
        ("output_tokens_per_s", "out tok/s"),
        ("ttft_p50_s", "TTFT p50"),
        ("ttft_p99_s", "TTFT p99"),
        ("tpot_p50_s", "TPOT p50"),
        ("tpot_p99_s", "TPOT p99"),
        ("itl_p99_s", "ITL p99"),
        ("goodput_requests_per_s", "goodput req/s"),
        ("draft_acceptance", "acceptance"),
        ("committed_per_target_call", "committed / call"),
        ("max_running", "max running"),
        ("max_kv_cache_usage", "max KV use"),
    ]
    print("| " + " | ".join(title for _, title in columns) + " |")
    print("| " + " | ".join("---" for _ in columns) + " |")
    for row in report["results"]:
        print("| " + " | ".join("-" if row[key] is None else f"{row[key]}" for key, _ in columns) + " |")


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(14, 4))
    for mode in MODES:
        rows = [row for row in report["results"] if row["speculation"] == mode]
        if not rows:
            continue
        rates = [row["rate"] for row in rows]
        for axis, key, title in zip(
            axes,
            ("output_tokens_per_s", "goodput_requests_per_s", "tpot_p50_s"),
            ("output tok/s", f"goodput req/s (TTFT ≤ {report['slo']['ttft_s']} s, TPOT ≤ {report['slo']['tpot_s']} s)",
             "TPOT p50 (s)"),
            strict=True,
        ):  # fmt: skip
            axis.plot(rates, [row[key] or 0 for row in rows], marker="o", label=f"speculation {mode}")
            axis.set_xlabel("arrival rate (requests/s)")
            axis.set_title(title, fontsize=9)
    axes[0].legend()
    figure.suptitle(f"{report['model']} ({report['dtype']}), open-loop Poisson arrivals")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rate", type=float, action="append", help="arrivals per second; repeatable")
    parser.add_argument("--mode", action="append", choices=MODES, help="speculation modes; default all three")
    parser.add_argument("--mix", action="append", choices=workloads.names(), help=f"workloads; default {MIX}")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="goodput: TTFT bound in seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.1, help="goodput: time per output token bound")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--plot", dest="plot_path")
    args = parser.parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the table
    args.rate = args.rate or [0.25, 0.5, 1.0, 2.0]
    args.mode = args.mode or list(MODES)
    args.mix = args.mix or list(MIX)
    report = run(args)
    print(f"model {report['model']} ({report['dtype']}), {args.duration:g} s of arrivals per rate, medians per request")
    print_table(report)
    write_outputs(report, args.json_path, args.plot_path, lambda path: plot(report, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
