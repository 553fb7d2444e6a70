"""Time to first token, cold vs warm prefix cache, for RAG prompts of 1k, 4k and 8k tokens.

    python -m specrag.evals.bench.prefix                                   # smollm2 and qwen2.5-coder-0.5b
    python -m specrag.evals.bench.prefix --models smollm2-135m --lengths 1024 --repeats 1   # seconds

A prompt is the agent's (``agent/prompt.py``): system prompt and tool schemas, passages
from the sample corpus up to the length, then a question. Per repeat and length:
``cold`` is a fresh engine with an empty prefix cache; ``warm`` is the same engine right
after, asked a different question over the same passages (only the question changes);
``hf`` is transformers' ``generate(max_new_tokens=1)`` on the cold prompt, the reference
without a prefix cache. Medians over repeats; ``warm/cold`` is the headline ratio.
"""

from __future__ import annotations

import argparse
import json
import pydoc_data.topics
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specrag.agent.prompt import PromptParts, build_messages, encode_messages
from specrag.decoding import Engine, GenerationRequest
from specrag.decoding.model import CausalLM, load_model
from specrag.decoding.prefix_cache import PrefixCache

QUESTIONS = (
    "What does the with statement do?",
    "When is the else clause of a loop executed?",
    "How are default argument values evaluated?",
    "What happens when an exception is raised in a finally clause?",
    "Which objects are considered false?",
    "What does the global statement declare?",
)
TOOL_SCHEMAS = (
    {
        "name": "search_documents",
        "description": "Search the indexed documents.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
)


@dataclass(frozen=True)
class _Passage:
    id: str
    source: str
    text: str


def passages_for(tokenizer: Any, target_tokens: int) -> list[_Passage]:
    """Sample-corpus topics in sorted order until the prompt holds ``target_tokens``."""
    passages: list[_Passage] = []
    for topic in sorted(pydoc_data.topics.topics):
        passages.append(_Passage(f"pydoc/{topic}#0", f"pydoc/{topic}", pydoc_data.topics.topics[topic].strip()))
        if len(prompt_ids(tokenizer, passages, QUESTIONS[0])) >= target_tokens:
            break
    last = passages[-1]
    low, high = 0, len(last.text)
    while low < high:  # the longest cut of the last passage that keeps the prompt within the target
        middle = (low + high + 1) // 2
        passages[-1] = _Passage(last.id, last.source, last.text[:middle])
        if len(prompt_ids(tokenizer, passages, QUESTIONS[0])) <= target_tokens:
            low = middle
        else:
            high = middle - 1
    passages[-1] = _Passage(last.id, last.source, last.text[:low])
    return passages


def prompt_ids(tokenizer: Any, passages: list[_Passage], question: str) -> list[int]:
    parts = PromptParts(question=question, tool_schemas=TOOL_SCHEMAS, passages=passages)
    return encode_messages(tokenizer, build_messages(parts))


def ttft(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    """Seconds from submitting the request to its first committed token; cached tokens."""
    start = time.perf_counter()
    events = engine.generate(GenerationRequest(prompt, max_tokens=1, speculation="off"))
    first = next(events)
    elapsed = time.perf_counter() - start
    final = first if first.finished else [event for event in events if event.finished][-1]
    assert final.stats is not None
    return elapsed, final.stats.cached_prompt_tokens


def hf_ttft(model: CausalLM, prompt: list[int]) -> float:
    ids = torch.tensor([prompt], device=model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        model.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
    return time.perf_counter() - start


def bench_model(
    name: str,
    lengths: list[int],
    repeats: int,
    with_hf: bool,
    dtype: str,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    model = load_model(name, dtype=dtype, progress=False)
    limit = int(getattr(model.config, "max_position_embeddings", 32768)) - 8
    rows = []
    for length in lengths:
        passages = passages_for(model.tokenizer, min(length, limit))
        cold_s, warm_s, hf_s, cached = [], [], [], []
        tokens = 0
        for repeat in range(repeats):
            cold_prompt = prompt_ids(model.tokenizer, passages, QUESTIONS[(2 * repeat) % len(QUESTIONS)])
            warm_prompt = prompt_ids(model.tokenizer, passages, QUESTIONS[(2 * repeat + 1) % len(QUESTIONS)])
            tokens = len(cold_prompt)
            engine = Engine(model, prefix_cache=PrefixCache(namespace=name))
            cold_s.append(ttft(engine, cold_prompt)[0])
            seconds, cached_tokens = ttft(engine, warm_prompt)
            warm_s.append(seconds)
            cached.append(cached_tokens)
            cache_bytes = engine.prefix_cache.used_bytes if engine.prefix_cache else 0
            if with_hf:
                hf_s.append(hf_ttft(model, cold_prompt))
        row = {
            "model": name,
            "target_tokens": length,
            "prompt_tokens": tokens,
            "cached_tokens": statistics.median(cached),
            "cold_s": statistics.median(cold_s),
            "warm_s": statistics.median(warm_s),
            "hf_s": statistics.median(hf_s) if hf_s else None,
            "warm_over_cold": statistics.median(warm_s) / statistics.median(cold_s),
            "cache_mib": cache_bytes / 2**20,
            "repeats": repeats,
        }
        rows.append(row)
        print(format_row(row), flush=True)
        if on_row is not None:
            on_row(row)
    return rows


def format_row(row: dict[str, Any]) -> str:
    hf = f"{row['hf_s']:.3f}s" if row["hf_s"] is not None else "-"
    return (
        f"{row['model']:<20} {row['prompt_tokens']:>6} tok  cold {row['cold_s']:.3f}s  warm {row['warm_s']:.3f}s "
        f"(cached {row['cached_tokens']:.0f})  hf {hf}  warm/cold {row['warm_over_cold']:.3f}  "
        f"cache {row['cache_mib']:.0f} MiB"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers reference")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    rows = [
        row for name in args.models for row in bench_model(name, args.lengths, args.repeats, not args.no_hf, args.dtype)
    ]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"torch_threads": torch.get_num_threads(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
