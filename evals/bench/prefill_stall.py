"""How much a long prompt arriving mid-flight slows the requests already decoding.

``python -m specrag.evals.bench.prefill_stall --model qwen2.5-coder-0.5b --prompt-tokens 4096``:
``--decoders`` requests (64-token prompts, speculation off) decode through
``Engine.step()``. First they decode alone for as many steps as the long prompt has chunks
(their baseline inter-token latency); then a request with a long prompt arrives, and the
decoders' inter-token latency (p50, p99, max) is taken over the steps until its first token,
with that request's time to first token. Last, the long prompt is prefilled alone by a
fresh engine, one step per chunk, which gives one prefill chunk's time (the slowest chunk,
the last, attends over the whole prompt). The issue's target: the decoders' p99 rises by
no more than one chunk's time. Before chunked prefill the whole prompt ran inside one
step, so the decoders' worst gap was the whole prefill. Speed is measured here, never
asserted in a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specrag.decoding import Engine, GenerationRequest, load_model
from specrag.decoding.dtype_choice import cpu_has_native_bf16, cpu_model_name
from specrag.decoding.model import PREFILL_CHUNK_TOKENS


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def step_times(engine: Engine, steps: int) -> list[float]:
    """Wall time of each of ``steps`` engine steps."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def run(model: str, dtype: str, decoders: int, prompt_tokens: int, warm_steps: int) -> dict[str, object]:
    lm = load_model(model, dtype=dtype, progress=False)
    generator = torch.Generator().manual_seed(0)
    vocab = min(lm.vocab_size, 30_000)

    def prompt(length: int) -> list[int]:
        return torch.randint(100, vocab, (length,), generator=generator).tolist()

    long_prompt = prompt(prompt_tokens)
    engine = Engine(lm)
    for _ in range(decoders):
        engine.add(GenerationRequest(prompt(64), max_tokens=10_000, speculation="off", stop_token_ids=[]))
    for _ in range(warm_steps):
        engine.step()
    chunks = -(-prompt_tokens // PREFILL_CHUNK_TOKENS)
    alone = step_times(engine, chunks)
    arrived = time.perf_counter()
    long_id = engine.add(GenerationRequest(long_prompt, max_tokens=1, speculation="off"))
    gaps: list[float] = []
    last = arrived
    ttft = None
    while ttft is None:
        events = engine.step()
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        if any(event.seq_id == long_id for event in events):
            ttft = now - arrived
    prefill_only = Engine(lm, prefix_cache=False)
    prefill_only.add(GenerationRequest(long_prompt, max_tokens=1, speculation="off"))
    chunk_times = step_times(prefill_only, chunks)
    p99_rise = percentile(gaps, 0.99) - percentile(alone, 0.99)
    return {
        "model": model,
        "dtype": str(lm.dtype),
        "decoders": decoders,
        "prompt_tokens": prompt_tokens,
        "steps_to_first_token": len(gaps),
        "itl_alone_p50_s": round(statistics.median(alone), 3),
        "itl_alone_p99_s": round(percentile(alone, 0.99), 3),
        "itl_p50_s": round(statistics.median(gaps), 3),
        "itl_p99_s": round(percentile(gaps, 0.99), 3),
        "itl_max_s": round(max(gaps), 3),
        "long_prompt_ttft_s": round(ttft, 3),
        "chunk_alone_p50_s": round(statistics.median(chunk_times), 3),
        "chunk_alone_max_s": round(max(chunk_times), 3),
        "itl_p99_rise_s": round(p99_rise, 3),
        "rise_within_one_chunk": p99_rise <= max(chunk_times),
        "cpu": cpu_model_name() + (" (AVX512-BF16)" if cpu_has_native_bf16() else ""),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--decoders", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--warm-steps", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    result = run(args.model, args.dtype, args.decoders, args.prompt_tokens, args.warm_steps)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
