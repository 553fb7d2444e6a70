"""Decoding benchmark: plain vs ours vs the transformers reference, side by side.

    python -m evals.bench_decode                 # or: specrag bench decode
    python -m evals.bench_decode --repeats 5 --max-tokens 128 --json bench.json

For each workload every method runs once per repeat, interleaved in the same order,
so drift of the machine hits all methods alike; the table reports medians. Methods:

- ``plain``            our engine, speculation off (the baseline of every ratio)
- ``hf``               transformers ``generate``, greedy
- ``hf_prompt_lookup`` transformers ``generate(prompt_lookup_num_tokens=10)``
- ``ours``             our engine, prompt-lookup speculation over prompt and passages

Every run is greedy, so every output should equal plain's; the table says whether it did.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from decoding import Engine, GenerationRequest
from decoding.model import CausalLM, load_model
from evals.prompts import BENCH_CASES, encode_case

METHODS = ("plain", "hf", "hf_prompt_lookup", "ours")


@dataclass
class Run:
    output: list[int]
    seconds: float
    target_calls: int | None = None


@dataclass
class Row:
    workload: str
    method: str
    runs: list[Run] = field(default_factory=list)

    @property
    def median_seconds(self) -> float:
        return statistics.median(run.seconds for run in self.runs)

    @property
    def tokens_per_s(self) -> float:
        return statistics.median(len(run.output) / run.seconds for run in self.runs)


def run_engine(
    engine: Engine, prompt: list[int], passages: list[list[int]], max_tokens: int, speculation: str, gamma: int
) -> Run:
    request = GenerationRequest(
        prompt,
        max_tokens=max_tokens,
        speculation=speculation,  # type: ignore[arg-type]
        num_speculative_tokens=gamma,
        lookup_sources=passages,
    )
    start = time.perf_counter()
    events = list(engine.generate(request))
    seconds = time.perf_counter() - start
    stats = events[-1].stats
    assert stats is not None
    return Run([token for event in events for token in event.token_ids], seconds, stats.target_calls)


def run_hf(target: CausalLM, prompt: list[int], max_tokens: int, lookup: bool) -> Run:
    input_ids = torch.tensor([prompt], device=target.device)
    extra = {"prompt_lookup_num_tokens": 10} if lookup else {}
    start = time.perf_counter()
    with torch.inference_mode():
        output = target.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=sorted(target.eos_token_ids()),
            pad_token_id=sorted(target.eos_token_ids())[0],
            **extra,
        )
    seconds = time.perf_counter() - start
    return Run(output[0, len(prompt) :].tolist(), seconds)


def machine() -> dict[str, object]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def benchmark(
    target: CausalLM, workloads: list[str], methods: list[str], repeats: int, max_tokens: int, gamma: int
) -> list[Row]:
    engine = Engine(target)
    rows = {(workload, method): Row(workload, method) for workload in workloads for method in methods}
    encoded = {workload: encode_case(BENCH_CASES[workload], target.tokenizer) for workload in workloads}
    runners: dict[str, Callable[[list[int], list[list[int]]], Run]] = {
        "plain": lambda prompt, passages: run_engine(engine, prompt, passages, max_tokens, "off", gamma),
        "ours": lambda prompt, passages: run_engine(engine, prompt, passages, max_tokens, "on", gamma),
        "hf": lambda prompt, passages: run_hf(target, prompt, max_tokens, lookup=False),
        "hf_prompt_lookup": lambda prompt, passages: run_hf(target, prompt, max_tokens, lookup=True),
    }
    for workload in workloads:  # one warm-up run each, untimed: first calls allocate
        runners["plain"](*encoded[workload])
    for repeat in range(repeats):
        for workload in workloads:
            for method in methods:
                rows[workload, method].runs.append(runners[method](*encoded[workload]))
        print(f"repeat {repeat + 1}/{repeats} done", file=sys.stderr)
    return list(rows.values())


def report(rows: list[Row]) -> list[dict[str, object]]:
    plain = {row.workload: row for row in rows if row.method == "plain"}
    results = []
    for row in rows:
        reference = plain.get(row.workload)
        calls = [run.target_calls for run in row.runs if run.target_calls]
        results.append(
            {
                "workload": row.workload,
                "method": row.method,
                "tokens_per_s": round(row.tokens_per_s, 2),
                "speedup_vs_plain": round(row.tokens_per_s / reference.tokens_per_s, 3) if reference else None,
                "output_tokens": len(row.runs[0].output),
                "target_calls": statistics.median(calls) if calls else None,
                "identical_to_plain": all(run.output == reference.runs[0].output for run in row.runs)
                if reference
                else None,
            }
        )
    return results


def print_table(results: list[dict[str, object]]) -> None:
    print("| workload | method | tokens/s | vs plain | output tokens | target calls | identical to plain |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for result in results:
        calls = result["target_calls"] if result["target_calls"] is not None else "-"
        print(
            f"| {result['workload']} | {result['method']} | {result['tokens_per_s']:.1f} | "
            f"{result['speedup_vs_plain']:.2f}x | {result['output_tokens']} | {calls} | "
            f"{'yes' if result['identical_to_plain'] else 'NO'} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="specrag bench decode", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m", help="pack name, HF folder or .gguf path")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 where the CPU has native bf16), float32, bfloat16")
    parser.add_argument("--workload", action="append", choices=sorted(BENCH_CASES), help="repeatable; default all")
    parser.add_argument("--method", action="append", choices=METHODS, help="repeatable; default all")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=8, help="most draft tokens per cycle for ours")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", dest="json_path", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_model(args.model, dtype=args.dtype)
    methods = args.method or list(METHODS)
    if "plain" not in methods:
        methods.insert(0, "plain")  # every ratio is against plain
    rows = benchmark(target, args.workload or sorted(BENCH_CASES), methods, args.repeats, args.max_tokens, args.gamma)
    results = report(rows)
    info = {
        "machine": machine(),
        "model": args.model,
        "dtype": str(target.dtype),
        "repeats": args.repeats,
        "max_tokens": args.max_tokens,
        "gamma": args.gamma,
        "results": results,
    }
    print(f"model {args.model} ({target.dtype}), {args.repeats} repeats, medians; machine: {info['machine']}")
    print_table(results)
    if args.json_path:
        with Path(args.json_path).open("w") as handle:
            json.dump(info, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
