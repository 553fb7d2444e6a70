"""Cost of one target forward over k new tokens, the term that decides whether a verify pays.

    python -m specrag.evals.bench.forward --model smollm2-135m --context 512 --context 4096
    python -m specrag.evals.bench.forward --model qwen2.5-coder-1.5b --dtype float32 --dtype bfloat16 --context 512

For k in {1, 2, 4, 8, 9, 16}, each dtype and each context length, median milliseconds of
a forward with the stock transformers paths (``F.linear``, repeated KV heads,
``torch.cat`` cache), with specrag's CPU fast paths (``decoding/fast_paths.py``,
``decoding/kv.py``), and with the fast paths in row-exact mode (``decoding/
batch_invariance.py``; only where its probes pass on this machine; in float32 the
linears alone are row-exact, with oneDNN's weights packed once and, for comparison,
reordered on every call, and as loaded with ``few_rows``). The configurations
alternate within each repeat, so machine drift hits all alike. The ``k=9 / k=1`` column
is what one verify of γ = 8 costs in plain steps.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch

from specrag.decoding.batch_invariance import skinny_linears, unpack_onednn_weights
from specrag.decoding.model import CausalLM, load_model

TOKEN_COUNTS = (1, 2, 4, 8, 9, 16)


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
    parser.add_argument("--dtype", action="append", help="dtypes to measure (default: auto)")
    parser.add_argument("--context", type=int, action="append", help="context lengths (default 512 and 4096)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    print(f"model {args.model}, threads {torch.get_num_threads()}, median ms per forward")
    print("| dtype | context | paths | " + " | ".join(f"k={count}" for count in TOKEN_COUNTS) + " | k=9 / k=1 |")
    print("| --- | ---: | --- |" + " ---: |" * (len(TOKEN_COUNTS) + 1))
    for dtype in args.dtype or ["auto"]:
        configurations = _configurations(args.model, dtype)
        for context_len in args.context or [512, 4096]:
            _measure(configurations, context_len, args.repeats)
        # Three 1.5B models in float32 take 18 GiB: free them before loading the next dtype,
        # or the next ones are measured under memory pressure (bf16 ran 8x slower so).
        del configurations
        gc.collect()
    return 0


def _configurations(model: str, dtype: str) -> dict[str, CausalLM]:
    configurations = {
        "stock": load_model(model, dtype=dtype, fast_paths=False, progress=False),
        "fast": load_model(model, dtype=dtype, row_exact=False, progress=False),
    }
    exact = load_model(model, dtype=dtype, progress=False)
    if exact.row_exact:
        configurations["row-exact"] = exact
    elif exact.linears_row_exact:
        configurations["exact linears"] = exact
    if any(layer.packed_weight is not None for layer in skinny_linears(exact.model)):
        # The same kernels with oneDNN reordering the weight on every call, as before
        # linears.pack_for_onednn: row-exact alike, so only the time differs.
        unpacked = load_model(model, dtype=dtype, progress=False)
        unpack_onednn_weights(unpacked.model)
        configurations["exact linears, unpacked"] = unpacked
    few_rows = load_model(model, dtype=dtype, progress=False, few_rows=True)
    if any(layer.activation_major for layer in skinny_linears(few_rows.model)):
        configurations["exact linears, few rows"] = few_rows  # MKL's row blocks (load_model)
    return configurations


def _measure(configurations: dict[str, CausalLM], context_len: int, repeats: int) -> None:
    any_model = next(iter(configurations.values()))
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, any_model.vocab_size, (context_len + max(TOKEN_COUNTS),), generator=generator).tolist()
    context, new_tokens = tokens[:context_len], tokens[context_len:]
    results: dict[str, list[dict[int, float]]] = {name: [] for name in configurations}
    for _ in range(2):  # alternate the configurations
        for name, model in configurations.items():
            results[name].append(forward_ms(model, context, new_tokens, repeats))
    dtype = str(any_model.dtype).removeprefix("torch.")
    for name, runs in results.items():
        medians = {count: statistics.median(run[count] for run in runs) for count in TOKEN_COUNTS}
        cells = " | ".join(f"{medians[count]:.0f}" for count in TOKEN_COUNTS)
        print(f"| {dtype} | {context_len} | {name} | {cells} | {medians[9] / medians[1]:.2f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
