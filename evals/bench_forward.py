"""Cost of one target forward over k new tokens, the term that decides whether a verify pays.

    python -m evals.bench_forward --model smollm2-135m --context 512 --context 4096

For k in {1, 2, 4, 8, 16} and each context length, median milliseconds of a forward with
the stock transformers paths (``F.linear``, repeated KV heads, ``torch.cat`` cache) and
with specrag's CPU fast paths (``decoding/fast_paths.py``, ``decoding/kv.py``). The two
configurations alternate within each repeat, so machine drift hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from decoding.model import CausalLM, load_model

TOKEN_COUNTS = (1, 2, 4, 8, 16)


def forward_ms(model: CausalLM, context: list[int], new_tokens: list[int], repeats: int) -> dict[int, float]:
    kv = model.new_kv()
    model.prefill(kv, context)
    timings: dict[int, list[float]] = {count: [] for count in TOKEN_COUNTS}
    for _ in range(repeats):
        for count in TOKEN_COUNTS:
            start = time.perf_counter()
            model.forward(kv, new_tokens[:count])
            timings[count].append((time.perf_counter() - start) * 1e3)
            kv.crop(len(context))
    return {count: statistics.median(values) for count, values in timings.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--context", type=int, action="append", help="context lengths (default 512 and 4096)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    stock = load_model(args.model, dtype=args.dtype, fast_paths=False, progress=False)
    fast = load_model(args.model, dtype=args.dtype, progress=False)
    generator = torch.Generator().manual_seed(0)
    print(f"model {args.model} ({fast.dtype}), threads {torch.get_num_threads()}, median ms per forward")
    print("| context | paths | " + " | ".join(f"k={count}" for count in TOKEN_COUNTS) + " |")
    print("| ---: | --- |" + " ---: |" * len(TOKEN_COUNTS))
    for context_len in args.context or [512, 4096]:
        tokens = torch.randint(0, fast.vocab_size, (context_len + max(TOKEN_COUNTS),), generator=generator).tolist()
        context, new_tokens = tokens[:context_len], tokens[context_len:]
        results: dict[str, list[dict[int, float]]] = {"stock": [], "fast": []}
        for _ in range(2):  # alternate the two configurations
            for name, model in (("stock", stock), ("fast", fast)):
                results[name].append(forward_ms(model, context, new_tokens, args.repeats))
        for name, runs in results.items():
            cells = " | ".join(f"{statistics.median(run[count] for run in runs):.0f}" for count in TOKEN_COUNTS)
            print(f"| {context_len} | {name} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
