"""Why dtype "auto" picks float32 on CPUs without native bf16: GEMM throughput by dtype.

    python -m specrag.evals.bench.matmul
    python -m specrag.evals.bench.matmul --kernels --shape 576x1536 --shape 896x4864

Times [k x 576] @ [576 x 1536] (a SmolLM2-135M MLP projection) for k new tokens, the
shapes of a one-token decode step (k=1) and of verify forwards (k=2..17).

``--kernels``: the float32 kernels a row-exact linear can use (``decoding/linears.py``),
per shape (in x out features): MKL's ``x @ W.T``, oneDNN reordering the weight on every
call, oneDNN with the weight reordered once (``pack_for_onednn``); median µs by row count,
and the row counts from 2 to 40 at which some row of the product differs from that row
computed alone (padded to two rows; "-" where none does).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable

import torch

from specrag.decoding.dtype_choice import cpu_has_native_bf16
from specrag.decoding.linears import pack_for_onednn

TOKENS = (1, 2, 4, 9, 17)
KERNEL_ROWS = (1, 2, 4, 9, 17, 32)
EXACT_ROWS = range(2, 41)
Product = Callable[[torch.Tensor], torch.Tensor]


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
    parser.add_argument("--kernels", action="store_true", help="float32 kernels of row-exact linears")
    parser.add_argument("--shape", action="append", help="IN x OUT features, e.g. 576x1536 (with --kernels)")
    args = parser.parse_args(argv)
    print(
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}, native bf16: {cpu_has_native_bf16()}, "
        f"threads {torch.get_num_threads()}"
    )
    if args.kernels:
        shapes = [tuple(int(part) for part in shape.split("x")) for shape in args.shape or ["576x1536", "1536x576"]]
        _kernel_table(shapes, min(args.repeats, 30))
        return 0
    print("| tokens | float32 GFLOP/s | bfloat16 GFLOP/s |")
    print("| ---: | ---: | ---: |")
    for tokens in TOKENS:
        fp32, bf16 = (gflops(dtype, tokens, args.repeats) for dtype in (torch.float32, torch.bfloat16))
        print(f"| {tokens} | {fp32:.1f} | {bf16:.1f} |")
    return 0


def _kernel_table(shapes: list[tuple[int, ...]], repeats: int) -> None:
    print("| shape | kernel | " + " | ".join(f"{rows} rows µs" for rows in KERNEL_ROWS) + " | rounds apart at |")
    print("| --- | --- |" + " ---: |" * len(KERNEL_ROWS) + " --- |")
    generator = torch.Generator().manual_seed(0)
    for in_features, out_features in shapes:
        weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
        x = torch.randn(max(EXACT_ROWS), in_features, generator=generator)
        packed = pack_for_onednn(weight)
        kernels: dict[str, Product] = {
            "mkl": functools.partial(_mkl, weight=weight),
            "onednn": functools.partial(_onednn, weight=weight),
            "onednn packed": functools.partial(_onednn, weight=packed),
        }
        for name, product in kernels.items():
            micros = " | ".join(f"{_median_seconds(product, x[:rows], repeats) * 1e6:.0f}" for rows in KERNEL_ROWS)
            print(f"| {in_features}x{out_features} | {name} | {micros} | {_rounds_apart(product, x)} |", flush=True)


def _mkl(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(rows, weight)


def _onednn(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(rows, weight, None, "none", [], "")


def _median_seconds(product: Product, rows: torch.Tensor, repeats: int) -> float:
    for _ in range(3):
        product(rows)
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        product(rows)
        timings.append(time.perf_counter() - start)
    return statistics.median(timings)


def _rounds_apart(product: Product, x: torch.Tensor) -> str:
    alone = torch.cat([product(x[row : row + 1].expand(2, -1).contiguous())[:1] for row in range(x.shape[0])])
    counts = [count for count in EXACT_ROWS if not torch.equal(product(x[:count]), alone[:count])]
    if not counts:
        return "-"
    return ", ".join(str(count) for count in counts[:6]) + (" ..." if len(counts) > 6 else "")


if __name__ == "__main__":
    sys.exit(main())
