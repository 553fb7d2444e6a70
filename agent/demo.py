"""The decoding demo that ``make serve`` runs until the agent server lands.

It answers one question over a passage of the sample corpus, streaming the committed
tokens as the speculative decoder produces them, then prints the speculation metrics,
and (with ``--compare``) the same answer decoded plainly, for the speed-up.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from specrag.agent.sample_prompts import PromptCase, encode_case
from specrag.decoding import Engine, GenerationRequest, GenerationStats
from specrag.decoding.model import CausalLM, load_model


def stream_answer(
    model: CausalLM, case: PromptCase, speculation: str, max_tokens: int, echo: bool
) -> tuple[str, GenerationStats, float]:
    prompt, passages = encode_case(case, model.tokenizer)
    request = GenerationRequest(
        prompt,
        max_tokens=max_tokens,
        speculation=speculation,  # type: ignore[arg-type]
        lookup_sources=passages,
        lookup_source_names=[f"P{i + 1}" for i in range(len(passages))],
    )
    tokens: list[int] = []
    shown = ""
    start = time.perf_counter()
    stats: GenerationStats | None = None
    for event in Engine(model).generate(request):
        tokens += event.token_ids
        text = model.tokenizer.decode(tokens, skip_special_tokens=True)
        if echo:
            sys.stdout.write(text[len(shown) :])
            sys.stdout.flush()
        shown = text
        stats = event.stats or stats
    assert stats is not None
    return shown, stats, time.perf_counter() - start


def summary(stats: GenerationStats, seconds: float) -> dict[str, Any]:
    return {
        "output_tokens": stats.output_tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(stats.output_tokens / seconds, 2),
        "target_calls": stats.target_calls,
        "committed_per_call": round(stats.committed_per_call, 3),
        "acceptance_rate": round(stats.acceptance_rate, 3),
        "accepted_by_source": dict(stats.accepted_by_source),
        "finish_reason": stats.finish_reason,
    }


def run_demo(
    model_name: str, topic: str, question: str, max_tokens: int, compare: bool, as_json: bool, dtype: str = "auto"
) -> int:
    model = load_model(model_name, dtype=dtype)
    case = PromptCase("demo", "rag_quote", question, (topic,))
    if not as_json:
        print(f"model {model_name} ({model.dtype}); passage [P1] = sample corpus topic {topic!r}")
        print(f"Q: {question}\nA: ", end="")
    answer, stats, seconds = stream_answer(model, case, "auto", max_tokens, echo=not as_json)
    result: dict[str, Any] = {"answer": answer, "speculative": summary(stats, seconds)}
    if compare:
        plain_answer, plain_stats, plain_seconds = stream_answer(model, case, "off", max_tokens, echo=False)
        result["plain"] = summary(plain_stats, plain_seconds)
        result["identical_to_plain"] = plain_answer == answer
        result["speedup_vs_plain"] = round(plain_seconds / seconds, 3)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print("\n\n" + json.dumps({key: value for key, value in result.items() if key != "answer"}, indent=2))
    return 0
