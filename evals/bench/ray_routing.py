"""Prefix-cache hits across Ray Serve replicas, with Ray's prefix-aware routing and without.

    python -m specrag.evals.bench.ray_routing                   # 2 smollm2 replicas, 8 conversations x 4 turns
    python -m specrag.evals.bench.ray_routing --conversations 4 --turns 2 --json out.json

A local Ray instance serves ``specrag`` twice over (``agent/ray_serve.py``), once per router:
``prefix`` (Ray's ``PrefixCacheAffinityRouter``, the default) and ``pow2`` (Ray's default
router, power of two choices, which ignores the prompt). The same multi-turn chats run
through each, turn by turn with ``--concurrency`` requests at a time: each chat shares one
system prompt and opens on its own question; every later turn resends the conversation with
the answer and a follow-up. A replica answering a turn whose earlier turns it served finds
them in its prefix cache; ``usage.prompt_tokens_details.cached_tokens`` says how many
prompt tokens it reused. Reported per router: the hit rate over later turns (cached / prompt
tokens), over all turns, how many replicas each conversation touched, and the median
request time. Each router gets a fresh deployment, so the caches start empty.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

SYSTEM = "You are a concise assistant. Answer in one or two sentences, plainly, without lists."
OPENINGS = (
    "Why do rivers meander across flat plains?",
    "How is green tea different from black tea?",
    "What makes a chess opening sound?",
    "Why does bread go stale?",
    "How do bees find their way home?",
    "What causes the seasons on Earth?",
    "Why is the sky blue during the day?",
    "How does a violin make its sound?",
    "What is the point of a sourdough starter?",
    "Why do cats purr?",
    "How do glaciers carve valleys?",
    "What keeps a bicycle upright?",
)
FOLLOW_UPS = ("Can you say more?", "Why is that?", "Give an example.", "What else matters?", "Summarise it.")
ROUTERS = ("prefix", "pow2")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_router(router: str, args: argparse.Namespace, index: str | None) -> dict[str, Any]:
    from ray import serve

    from specrag.agent.ray_serve import APP_NAME, ReplicaSpec, Scaling, application

    spec = ReplicaSpec(model=args.model, index=index, dtype=args.dtype, calibrate=False, max_in_flight=8)
    scaling = Scaling(replicas=args.replicas, replica_cpus=args.replica_cpus, prefix_routing=router == "prefix")
    serve.run(application(spec, scaling), name=APP_NAME, route_prefix="/")
    try:
        return converse(args, router)
    finally:
        serve.delete(APP_NAME)


def converse(args: argparse.Namespace, router: str) -> dict[str, Any]:
    chats = [[{"role": "system", "content": SYSTEM}] for _ in range(args.conversations)]
    replicas: list[set[str]] = [set() for _ in chats]
    turns: list[dict[str, Any]] = []
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        for turn in range(args.turns):
            for n, chat in enumerate(chats):
                asked = OPENINGS[n % len(OPENINGS)] if turn == 0 else FOLLOW_UPS[(turn + n) % len(FOLLOW_UPS)]
                chat.append({"role": "user", "content": asked})
            answers = list(pool.map(lambda chat: ask(args, chat), chats))
            for n, (chat, answer) in enumerate(zip(chats, answers, strict=True)):
                chat.append({"role": "assistant", "content": answer["text"]})
                replicas[n].add(answer["replica"])
                turns.append({"turn": turn, **{key: answer[key] for key in ("prompt", "cached", "seconds")}})
    later = [turn for turn in turns if turn["turn"] > 0]
    return {
        "router": router,
        "hit_rate_later_turns": _rate(later),
        "hit_rate_all_turns": _rate(turns),
        "replicas_per_conversation": statistics.mean(len(seen) for seen in replicas),
        "median_request_s": statistics.median(turn["seconds"] for turn in turns),
        "requests": len(turns),
        "turns": turns,
    }


def ask(args: argparse.Namespace, chat: list[dict[str, str]]) -> dict[str, Any]:
    body = {"model": args.model, "messages": chat, "max_tokens": args.max_tokens, "temperature": 0}
    started = time.perf_counter()
    response = httpx.post(f"{args.url}/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    data = response.json()
    usage = data["usage"]
    return {
        "text": data["choices"][0]["message"]["content"],
        "replica": response.headers["x-specrag-replica"],
        "prompt": usage["prompt_tokens"],
        "cached": usage["prompt_tokens_details"]["cached_tokens"],
        "seconds": time.perf_counter() - started,
    }


def _rate(turns: list[dict[str, Any]]) -> float:
    prompt = sum(turn["prompt"] for turn in turns)
    return sum(turn["cached"] for turn in turns) / prompt if prompt else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--replica-cpus", type=float, default=1.0)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=2, help="requests in flight at once")
    parser.add_argument("--router", action="append", choices=ROUTERS, help="repeatable (default: both)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)

    import ray
    from ray import serve

    ray.init(num_cpus=max(2, int(args.replicas * args.replica_cpus)), include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args.url = f"http://127.0.0.1:{port}"
    results = []
    try:
        for router in args.router or ROUTERS:
            result = run_router(router, args, index=None)
            results.append(result)
            print(
                f"{router:>6}: hit rate {result['hit_rate_later_turns']:.1%} of later turns' prompt tokens "
                f"({result['hit_rate_all_turns']:.1%} of all), {result['replicas_per_conversation']:.2f} replicas "
                f"per conversation, median request {result['median_request_s']:.2f} s over {result['requests']}",
                flush=True,
            )
    finally:
        serve.shutdown()
        ray.shutdown()
    if args.json is not None:
        settings = {key: value for key, value in vars(args).items() if key not in ("json", "url")}
        args.json.write_text(json.dumps({"settings": settings, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
