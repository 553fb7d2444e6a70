"""The decoding benchmark matrix: workloads x methods, interleaved, medians.

    python -m specrag.evals.bench.decode                              # or: specrag bench decode
    python -m specrag.evals.bench.decode --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b
    python -m specrag.evals.bench.decode --quick                      # seconds: proves it runs

Methods: ``plain`` (our engine, speculation off: the baseline of every ratio), ``hf``
(transformers ``generate``), ``hf_prompt_lookup`` (``prompt_lookup_num_tokens=10``),
``hf_assisted`` (``assistant_model``, with ``--draft``), ``ours_lookup`` (speculation on,
prompt lookup), ``ours_draft`` (on, the draft model, with ``--draft``), ``ours_auto``
(the policy: prompt lookup first, the draft model as fallback when one is given) and
``ours_tree`` (``ours_auto`` growing draft trees from every lookup match,
``decoding/tree_sizing.py``).
Within each repeat every method runs once per workload, in the same order, so drift of
the machine hits all alike. By default every method decodes greedily, so every output should
equal plain's; where one does not, ``first_divergence`` gives the position and plain's top-2
logit gap there (the near-tie rule of ``decoding/numerics.py``). ``--temperature`` /
``--top-p`` sample instead, every method of repeat r with seed r (transformers through its
seeded global RNG, since ``generate`` takes no generator): acceptance and speed-ups under
sampling, beside greedy; outputs then differ by design and ``identical_to_plain`` is null.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

import torch

from specrag.decoding.batch_invariance import linear_kernels
from specrag.decoding.model import load_model
from specrag.decoding.policy import PolicyConfig
from specrag.decoding.sampling import SamplingParams
from specrag.evals import workloads
from specrag.evals.bench.runs import METHODS, MethodRunner, Row, machine, position_sums, summarise, write_outputs

QUICK = {
    "workloads": ["rag_quote"],
    "methods": ["plain", "ours_lookup", "ours_auto", "hf_prompt_lookup"],
    "repeats": 1,
    "max_tokens": 12,
}


def run_matrix(
    runner: MethodRunner, workload_names: list[str], methods: list[str], repeats: int, max_tokens: int | None
) -> list[Row]:
    encoded = {}
    for name in workload_names:
        workload = workloads.load(name)
        limit = int(getattr(runner.target.config, "max_position_embeddings", 32768))
        encoded[name] = (workload.encode(runner.target.tokenizer, limit), max_tokens or workload.max_tokens)
    # transformers' generate cannot apply our grammar, so constrained workloads compare ours only.
    constrained = {name for name in workload_names if encoded[name][0].constraint}
    plan = {name: [m for m in methods if not (name in constrained and m.startswith("hf"))] for name in workload_names}
    rows = {(name, method): Row(name, method) for name in workload_names for method in plan[name]}
    for name in workload_names:  # warm-up, untimed: first calls at a new length allocate
        runner.run("plain", encoded[name][0], min(encoded[name][1], 4))
    for repeat in range(repeats):
        for name in workload_names:
            for method in plan[name]:
                rows[name, method].runs.append(runner.run(method, *encoded[name], seed=repeat))
        print(f"repeat {repeat + 1}/{repeats} done", file=sys.stderr, flush=True)
    return list(rows.values())


def _identical_cell(result: dict[str, Any]) -> str:
    if result["identical_to_plain"] is None:
        return "sampled"
    if result["identical_to_plain"]:
        return "yes"
    divergence = result["first_divergence"]
    return f"no (at {divergence['position']}, gap {divergence['plain_top2_gap']:.3f})" if divergence else "no"


def print_table(results: list[dict[str, Any]]) -> None:
    print("| workload | method | decode tok/s | vs plain | TTFT s | target calls | committed/call | identical |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for result in results:
        calls = "-" if result["target_calls"] is None else f"{result['target_calls']:g}"
        per_call = "-" if result["committed_per_call"] is None else f"{result['committed_per_call']:.2f}"
        speed = "-" if result["tokens_per_s"] is None else f"{result['tokens_per_s']:.2f}"
        ratio = "-" if result["speedup_vs_plain"] is None else f"{result['speedup_vs_plain']:.2f}x"
        print(
            f"| {result['workload']} | {result['method']} | {speed} | {ratio} | {result['ttft_s']:.2f} | "
            f"{calls} | {per_call} | "
            f"{_identical_cell(result)} |"
        )


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({result["workload"] for result in results})
    methods = [method for method in METHODS if any(result["method"] == method for result in results)]
    figure, (bars, hist) = plt.subplots(1, 2, figsize=(14, 5))
    width = 0.8 / len(methods)
    for index, method in enumerate(methods):
        speedups = [
            next((r["speedup_vs_plain"] or 0 for r in results if r["workload"] == name and r["method"] == method), 0)
            for name in names
        ]
        bars.bar([x + index * width for x in range(len(names))], speedups, width, label=method)
    bars.axhline(1.0, color="black", linewidth=0.8)
    bars.set_xticks([x + 0.4 - width / 2 for x in range(len(names))], names, rotation=20)
    bars.set_ylabel("decode tokens/s vs plain")
    bars.legend(fontsize=8)
    for method in ("ours_lookup", "ours_draft", "ours_auto", "ours_tree"):
        histograms = [result["accepted_len_hist"] or [] for result in results if result["method"] == method]
        total = position_sums(histograms)
        if total:
            hist.plot(range(len(total)), total, marker="o", label=method)
    hist.set_xlabel("accepted prefix length per verify")
    hist.set_ylabel("cycles (all workloads)")
    hist.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def policy_config(overrides: list[str]) -> PolicyConfig:
    fields = {field.name: field.type for field in dataclasses.fields(PolicyConfig)}
    values: dict[str, Any] = {}
    for override in overrides:
        name, _, value = override.partition("=")
        if name not in fields:
            raise SystemExit(f"--policy: unknown field {name!r}; fields: {', '.join(fields)}")
        values[name] = float(value) if "." in value else int(value)
    return PolicyConfig(**values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="specrag bench decode", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m", help="pack name, HF folder or .gguf path")
    parser.add_argument("--draft", help="draft model for hf_assisted, ours_draft and ours_auto")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 where the CPU has native bf16), float32, bfloat16")
    parser.add_argument("--workload", action="append", choices=workloads.names(), help="repeatable; default all")
    parser.add_argument("--method", action="append", choices=METHODS, help="repeatable; default all that apply")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, help="override every workload's max_tokens")
    parser.add_argument("--gamma", type=int, default=8, help="γ of ours_lookup")
    parser.add_argument("--draft-gamma", type=int, default=4, help="γ of ours_draft")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a PolicyConfig field of ours_auto, e.g. acceptance_prior=0.7",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature)")
    parser.add_argument("--quick", action="store_true", help="one workload, one repeat, a few tokens")
    parser.add_argument(
        "--few-rows",
        action="store_true",
        help="load the model with few_rows: row-exact linears for one sequence at a time (load_model)",
    )
    parser.add_argument("--json", dest="json_path", help="write the results as JSON here")
    parser.add_argument("--plot", dest="plot_path", help="write a PNG: speed-ups and accepted lengths")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_model(args.model, dtype=args.dtype, few_rows=args.few_rows)
    draft = load_model(args.draft, dtype=args.dtype, few_rows=args.few_rows) if args.draft else None
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    runner = MethodRunner(target, draft, args.gamma, args.draft_gamma, policy_config(args.policy), sampling)
    methods = args.method or [method for method in METHODS if draft is not None or method not in runner.needs_draft]
    workload_names = args.workload or workloads.names()
    repeats, max_tokens = args.repeats, args.max_tokens
    if args.quick:
        workload_names, repeats, max_tokens = QUICK["workloads"], QUICK["repeats"], QUICK["max_tokens"]
        methods = [method for method in QUICK["methods"] if method in methods or not args.method]
    if "plain" not in methods:
        methods.insert(0, "plain")  # every ratio is against plain
    rows = run_matrix(runner, workload_names, methods, repeats, max_tokens)
    results = summarise(rows, runner)
    info = {
        "machine": machine(),
        "model": args.model,
        "draft": args.draft,
        "dtype": str(target.dtype),
        "linears": linear_kernels(target.model),
        "sampling": {"temperature": args.temperature, "top_p": args.top_p, "seeds": f"0..{repeats - 1}"},
        "repeats": repeats,
        "results": results,
    }
    decoding = "greedy"
    if not sampling.greedy:
        decoding = f"sampled at T={args.temperature}, top-p {args.top_p}, seeds 0..{repeats - 1}"
    print(f"model {args.model} ({target.dtype}), draft {args.draft}, {repeats} repeat(s), medians, {decoding}")
    print(f"linears: {info['linears']}")
    print_table(results)
    write_outputs(info, args.json_path, args.plot_path, lambda path: plot(results, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
