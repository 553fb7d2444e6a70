"""A RAG prompt over passages of the sample corpus (``pydoc_data.topics``): the demo's, and
the prompt cases the parity checks and benchmarks build on (``evals/prompts.py``)."""

from __future__ import annotations

import pydoc_data.topics
from dataclasses import dataclass
from typing import Any

SYSTEM = (
    "You are a precise assistant. Answer from the passages only. "
    "When asked to quote, copy the passage's words exactly and cite it as [P1]."
)


@dataclass(frozen=True)
class PromptCase:
    name: str
    kind: str  # "rag_quote" | "rag_explain" | "chat_open"
    question: str
    topics: tuple[str, ...] = ()

    def passages(self, max_chars: int = 900) -> list[str]:
        return [corpus_passage(topic, max_chars) for topic in self.topics]

    def messages(self, max_chars: int = 900) -> list[dict[str, str]]:
        if not self.topics:
            return [{"role": "user", "content": self.question}]
        shown = "\n\n".join(f"[P{index}] {text}" for index, text in enumerate(self.passages(max_chars), start=1))
        return [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Passages:\n{shown}\n\nQuestion: {self.question}"},
        ]


def corpus_passage(topic: str, max_chars: int = 900) -> str:
    """The start of a topic, cut at the last paragraph break before ``max_chars``."""
    text = pydoc_data.topics.topics[topic]
    if len(text) <= max_chars:
        return text.strip()
    cut = text.rfind("\n\n", 0, max_chars)
    return text[: cut if cut > 0 else max_chars].strip()


def encode_case(case: PromptCase, tokenizer: Any, max_chars: int = 900) -> tuple[list[int], list[list[int]]]:
    """Token ids of the chat prompt, and of each passage on its own (for prompt lookup)."""
    prompt = tokenizer.apply_chat_template(case.messages(max_chars), add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt, list):  # transformers 5 returns a BatchEncoding
        prompt = prompt["input_ids"]
    passages = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in case.passages(max_chars)]
    return list(prompt), passages
