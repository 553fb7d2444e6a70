"""The irrelevance gate: whether a question gets to call tools at all.

Offered tools, the small models here call one for questions no tool can answer: in the
tool-use eval qwen2.5-coder-1.5b called a tool for 8 of the 12 irrelevance tasks ("What is
the chemical symbol for gold?" became ``stock_price("GLD")``). Told in the system prompt to
answer directly when no tool fits, they still did; asked yes/no whether a tool could answer,
the 1.5B said yes to every question (P(no) <= 0.37 on irrelevant and relevant alike). Two
signals did separate them, and the gate holds the first step to text when either is low:

- **relevance**: the highest cosine, under the retrieval embedder (all-MiniLM-L6-v2),
  between the question and each offered tool's name, description and parameter
  descriptions. Dev half: irrelevant questions at most 0.173, relevant at least 0.189.
- **intent**: the model's own probability that its first token opens a call (``{``, a code
  fence, the call tag), from one forward over the first step's prompt, which the prefix
  cache then serves to the step itself. Dev half, 1.5B: relevant at least 0.766, four of six
  irrelevant below 0.75; 0.5B: all six irrelevant below 0.75, two relevant too (0.56, 0.61).

The defaults (``RunOptions.min_tool_similarity``, ``min_call_probability``) are those dev
figures; ``None`` turns a signal off. A held step keeps the tools in its prompt (the cached
prefix) and answers under the text-only grammar.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch

DEFAULT_MIN_TOOL_SIMILARITY = 0.18
DEFAULT_MIN_CALL_PROBABILITY = 0.75


@dataclass(frozen=True)
class GateVerdict:
    similarity: float | None  # None: not measured
    call_probability: float | None
    held: bool  # the step may only answer in text

    def record(self) -> dict[str, Any]:
        return {"similarity": self.similarity, "call_probability": self.call_probability, "held": self.held}


def tool_text(schema: dict[str, Any]) -> str:
    """What a tool is about, as the embedder reads it: name, description, parameter descriptions."""
    function = schema.get("function", schema)
    properties = function.get("parameters", {}).get("properties", {})
    described = " ".join(f"{name}: {spec.get('description', '')}" for name, spec in properties.items())
    return f"{function['name'].replace('_', ' ')}: {function.get('description', '')} {described}".strip()


class ToolRelevance:
    """Highest question-to-tool cosine; tool vectors are encoded once per description."""

    def __init__(self, embedder: Any) -> None:
        self.embedder = embedder
        self._vectors: dict[str, np.ndarray] = {}

    def similarity(self, question: str, schemas: Sequence[dict[str, Any]]) -> float:
        texts = [tool_text(schema) for schema in schemas]
        missing = [text for text in texts if text not in self._vectors]
        if missing:
            for text, vector in zip(missing, self.embedder.encode(missing), strict=True):
                self._vectors[text] = vector
        question_vector = self.embedder.encode([question])[0]
        return float(max(float(self._vectors[text] @ question_vector) for text in texts))


@lru_cache(maxsize=8)
def call_opening_ids(tokenizer: Any, tag: str) -> tuple[int, ...]:
    """Token ids whose text, leading whitespace aside, opens a call: ``{``, a code fence
    (the lenient fenced call), or the call tag (``tag``; empty for bare JSON calls)."""
    openings = ("{", "```", *((tag,) if tag else ()))
    ids = []
    for token_id in sorted(tokenizer.get_vocab().values()):
        text = tokenizer.decode([token_id]).lstrip()
        # a tag split into several tokens opens with its first piece ("<tool", ...)
        if text.startswith(openings) or (len(text) > 1 and tag.startswith(text)):
            ids.append(token_id)
    return tuple(ids)


def call_probability(logits: torch.Tensor, opening_ids: Sequence[int]) -> float:
    """P(the first token opens a call) under the model's unconstrained next-token distribution."""
    probabilities = torch.softmax(logits.float(), dim=-1)
    return float(probabilities[list(opening_ids)].sum())
