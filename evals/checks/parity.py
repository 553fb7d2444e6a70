"""Greedy parity: speculative output against plain greedy output on the parity prompts.

    python -m specrag.evals.checks.parity --dtype float32      # every output must be identical
    python -m specrag.evals.checks.parity --dtype bfloat16     # divergences must sit at near-ties
    python -m specrag.evals.checks.parity --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --cases 2

Prints one row per prompt and, in bf16, the divergence rate and the distribution of the
plain top-2 gaps at the first divergent positions against the near-tie tolerance.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from specrag.decoding import Engine, GenerationRequest
from specrag.decoding.model import CausalLM, load_model
from specrag.decoding.numerics import Divergence, find_divergence
from specrag.evals.prompts import PARITY_CASES, PromptCase, encode_case


@dataclass
class ParityResult:
    case: str
    drafter: str
    output_tokens: int
    identical: bool
    accepted_tokens: int
    drafted_tokens: int
    target_calls: int
    divergence: Divergence | None


def generate(engine: Engine, request: GenerationRequest) -> tuple[list[int], object]:
    events = list(engine.generate(request))
    return [token for event in events for token in event.token_ids], events[-1].stats


def plain_greedy(target: CausalLM, case: PromptCase, max_tokens: int = 32) -> list[int]:
    prompt, _ = encode_case(case, target.tokenizer)
    return generate(Engine(target), GenerationRequest(prompt, max_tokens=max_tokens, speculation="off"))[0]


def check_case(
    target: CausalLM,
    case: PromptCase,
    drafter: str,
    draft: CausalLM | None = None,
    max_tokens: int = 32,
    gamma: int = 6,
    plain_output: list[int] | None = None,
) -> ParityResult:
    """Run plain and speculative greedy decoding for one case and compare them."""
    prompt, passages = encode_case(case, target.tokenizer)
    if plain_output is None:
        plain_output = plain_greedy(target, case, max_tokens)
    engine = Engine(target, draft, default_drafter="model" if draft is not None else "lookup", debug=True)
    request = GenerationRequest(
        prompt, max_tokens=max_tokens, speculation="on", num_speculative_tokens=gamma, lookup_sources=passages
    )
    spec_output, stats = generate(engine, request)
    identical = spec_output == plain_output
    divergence = None if identical else find_divergence(target, prompt, plain_output, spec_output)
    return ParityResult(
        case.name,
        drafter,
        len(spec_output),
        identical,
        stats.accepted_tokens,  # type: ignore[attr-defined]
        stats.drafted_tokens,
        stats.target_calls,
        divergence,
    )  # type: ignore[attr-defined]


def summarise(results: list[ParityResult]) -> dict[str, object]:
    divergent = [result for result in results if not result.identical]
    gaps = sorted(result.divergence.plain_top2_gap for result in divergent if result.divergence)
    return {
        "prompts": len(results),
        "divergent": len(divergent),
        "divergence_rate": len(divergent) / len(results) if results else 0.0,
        "divergence_gaps": gaps,
        "all_divergences_near_ties": all(result.divergence and result.divergence.near_tie for result in divergent),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--draft", help="draft model (pack, folder or .gguf); default: prompt lookup")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--cases", type=int, default=len(PARITY_CASES), help="run the first N parity prompts")
    parser.add_argument("--gamma", type=int, default=6)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    target = load_model(args.model, dtype=args.dtype)
    draft = load_model(args.draft, dtype=args.dtype) if args.draft else None
    drafter = "model" if draft is not None else "lookup"
    results = [
        check_case(target, case, drafter, draft, max_tokens=args.max_tokens, gamma=args.gamma)
        for case in PARITY_CASES[: args.cases]
    ]
    for result in results:
        gap = (
            f"gap {result.divergence.plain_top2_gap:.3f} tol {result.divergence.tolerance:.3f}"
            if result.divergence
            else ""
        )
        print(
            f"{result.case:20s} identical={result.identical!s:5s} accepted {result.accepted_tokens}/"
            f"{result.drafted_tokens} calls {result.target_calls} {gap}"
        )
    summary = summarise(results)
    print(json.dumps(summary, indent=2))
    if args.json_path:
        with Path(args.json_path).open("w") as handle:
            json.dump({"summary": summary, "results": [asdict(result) for result in results]}, handle, indent=2)
    return 0 if summary["all_divergences_near_ties"] else 1


if __name__ == "__main__":
    sys.exit(main())
