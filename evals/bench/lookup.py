"""Prompt-lookup cost per decoding step at 2k and 32k tokens of sources.

    python -m specrag.evals.bench.lookup

Our drafter keeps hash indexes extended by each committed token, so a step costs the
same at any source length; transformers' ``PromptLookupCandidateGenerator`` rescans the
whole input every step (the reference). Sources are sample-corpus text tokenized with
the smollm2 tokenizer; each step appends one token and asks for a draft, as decoding does.
"""

from __future__ import annotations

import argparse
import json
import pydoc_data.topics
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from specrag.decoding.drafters import PromptLookupDrafter
from specrag.decoding.model import load_model

SIZES = (2_000, 32_000)


def corpus_tokens(tokenizer: object, count: int) -> list[int]:
    text = "\n\n".join(pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics))
    tokens: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    while len(tokens) < count:
        tokens = tokens + tokens
    return tokens[:count]


def time_steps(step: object, continuation: list[int], context: list[int]) -> float:
    """Median seconds of one step (append a token, then draft) over ``continuation``."""
    timings = []
    for token in continuation:
        context.append(token)
        start = time.perf_counter()
        step(context)  # type: ignore[operator]
        timings.append(time.perf_counter() - start)
    return statistics.median(timings)


def measure(tokens: list[int], steps: int, gamma: int) -> dict[str, float]:
    source, continuation = tokens[:-steps], tokens[-steps:]
    drafter = PromptLookupDrafter(source[: len(source) // 2], [source[len(source) // 2 :]])
    ours = time_steps(lambda context: drafter.propose(context, gamma), continuation, list(source))
    reference = PromptLookupCandidateGenerator(
        num_output_tokens=gamma, max_matching_ngram_size=2, max_length=len(tokens) + gamma + 2
    )
    as_tensor = torch.tensor([tokens])  # a view per step, so only the lookup itself is timed
    hf = time_steps(lambda context: reference.get_candidates(as_tensor[:, : len(context)]), continuation, list(source))
    return {"sources_tokens": len(source), "ours_us_per_step": ours * 1e6, "hf_us_per_step": hf * 1e6}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--gamma", type=int, default=8)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    tokenizer = load_model("smollm2-135m", progress=False).tokenizer
    results = [measure(corpus_tokens(tokenizer, size + args.steps), args.steps, args.gamma) for size in SIZES]
    print("| sources (tokens) | ours µs/step | transformers µs/step |")
    print("| ---: | ---: | ---: |")
    for result in results:
        print(f"| {result['sources_tokens']:,} | {result['ours_us_per_step']:.1f} | {result['hf_us_per_step']:.1f} |")
    if args.json_path:
        with Path(args.json_path).open("w") as handle:
            json.dump(results, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
