"""Why dtype "auto" picks float32 on CPUs without native bf16: GEMM throughput by dtype.

    python -m specrag.evals.bench.matmul

Times [k x 576] @ [576 x 1536] (a SmolLM2-135M MLP projection) for k new tokens, the
shapes of a one-token decode step (k=1) and of verify forwards (k=2..17).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from specrag.decoding.dtype_choice import cpu_has_native_bf16

TOKENS = (1, 2, 4, 9, 17)


def gflops(dtype: torch.dtype, tokens: int, repeats: int) -> float:
    weight = torch.randn(1536, 576).to(dtype)
    activations = torch.randn(tokens, 576).to(dtype)
    for _ in range(10):
        torch.nn.functional.linear(activations, weight)
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.nn.functional.linear(activations, weight)
        timings.append(time.perf_counter() - start)
    return 2 * tokens * weight.numel() / statistics.median(timings) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    print(
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}, native bf16: {cpu_has_native_bf16()}, "
        f"threads {torch.get_num_threads()}"
    )
    print("| tokens | float32 GFLOP/s | bfloat16 GFLOP/s |")
    print("| ---: | ---: | ---: |")
    for tokens in TOKENS:
        fp32, bf16 = (gflops(dtype, tokens, args.repeats) for dtype in (torch.float32, torch.bfloat16))
        print(f"| {tokens} | {fp32:.1f} | {bf16:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
