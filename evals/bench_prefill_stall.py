"""How much a long prompt arriving mid-flight slows the requests already decoding.

``python -m evals.bench_prefill_stall --model qwen2.5-coder-0.5b --prompt-tokens 4096``:
``--decoders`` requests (64-token prompts, speculation off) decode through
``Engine.step()``; after ``--warm-steps`` steps a request with a long prompt arrives. Printed:
the decoders' inter-token latency (p50, p99, max) over the steps until the long request's
first token, and that request's time to first token. Before chunked prefill the whole
prompt ran inside one step, so the decoders' worst gap was the whole prefill; now it is
one prefill chunk (``decoding.model.PREFILL_CHUNK_TOKENS``) beside their own tokens.
Speed is measured here, never asserted in a test.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from decoding import Engine, GenerationRequest, load_model


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def run(model: str, dtype: str, decoders: int, prompt_tokens: int, warm_steps: int) -> dict[str, object]:
    lm = load_model(model, dtype=dtype, progress=False)
    generator = torch.Generator().manual_seed(0)
    vocab = min(lm.vocab_size, 30_000)

    def prompt(length: int) -> list[int]:
        return torch.randint(100, vocab, (length,), generator=generator).tolist()

    engine = Engine(lm)
    for _ in range(decoders):
        engine.add(GenerationRequest(prompt(64), max_tokens=10_000, speculation="off", stop_token_ids=[]))
    for _ in range(warm_steps):
        engine.step()
    arrived = time.perf_counter()
    long_id = engine.add(GenerationRequest(prompt(prompt_tokens), max_tokens=1, speculation="off"))
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
    return {
        "model": model,
        "dtype": str(lm.dtype),
        "decoders": decoders,
        "prompt_tokens": prompt_tokens,
        "steps_to_first_token": len(gaps),
        "itl_p50_s": round(statistics.median(gaps), 3),
        "itl_p99_s": round(percentile(gaps, 0.99), 3),
        "itl_max_s": round(max(gaps), 3),
        "long_prompt_ttft_s": round(ttft, 3),
        "cpu": platform.processor() or platform.machine(),
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
