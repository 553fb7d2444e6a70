"""Benchmark workloads: JSON files in this folder, prompts built from the sample corpus.

Fields: ``name``, ``description``, ``question`` (may hold ``{code}``), ``system`` (may hold
``{tools}``), ``topics`` (passages from ``pydoc_data.topics``, shown as [P1]..[Pn]),
``passage_chars`` (cut each passage at a paragraph break before this; 0 = whole topic),
``prompt_token_budget`` (passages past it are not shown but still feed prompt lookup),
``min_passage_tokens`` (a check that the passages are really that long), ``code``
(``{"topic", "starts_with"}``: an indented code block taken from the corpus), ``tools``
(JSON schemas listed in the system prompt), ``constraint`` (``{"tool_choice": "required"}``: the
tool-call grammar over ``tools``; ``{"json_schema": {...}}``: response_format json_schema),
``versions`` (one list per topic of ``[old, new]`` replacements: the same document in
several versions, e.g. a renamed API), ``earlier_questions`` (asked first, in order, by the
same tenant, untimed: their outputs are the history the timed question may draft from) and
``max_tokens``.
"""

from __future__ import annotations

import dataclasses
import json
import pydoc_data.topics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specrag.evals.prompts import SYSTEM, corpus_passage
from specrag.retrieval.reflow import lookup_texts

FOLDER = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Encoded:
    prompt: list[int]
    passages: list[list[int]]  # every passage, shown or not, for prompt lookup (reflowed variants too)
    passage_names: list[str]
    shown_passages: int
    constraint: dict[str, Any] | None = None
    earlier: list[list[int]] = field(default_factory=list)  # prompts a tenant sent before this one


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    question: str
    max_tokens: int = 128
    topics: tuple[str, ...] = ()
    system: str | None = None
    passage_chars: int = 900
    prompt_token_budget: int | None = None
    min_passage_tokens: int = 0
    code: dict[str, str] | None = None
    tools: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    constraint: dict[str, Any] | None = None
    versions: tuple[tuple[tuple[str, str], ...], ...] = ()
    earlier_questions: tuple[str, ...] = ()

    def grammar_spec(self) -> dict[str, Any] | None:
        """What the decoder is constrained to: tool calls (name, parameters) or a JSON schema."""
        if self.constraint is None:
            return None
        if "json_schema" in self.constraint:
            return {"json_schema": self.constraint["json_schema"]}
        if self.constraint.get("tool_choice") == "required" and self.tools:
            return {"tools": [(tool["name"], tool["parameters"]) for tool in self.tools]}
        raise ValueError(f"workload {self.name}: unsupported constraint {self.constraint!r}")

    def passages(self) -> list[str]:
        texts = [
            corpus_passage(topic, self.passage_chars) if self.passage_chars else pydoc_data.topics.topics[topic].strip()
            for topic in self.topics
        ]
        for index, replacements in enumerate(self.versions):
            for old, new in replacements:
                if old not in texts[index]:
                    raise ValueError(f"workload {self.name}: {old!r} is not in passage {index + 1}")
                texts[index] = texts[index].replace(old, new)
        return texts

    def user_text(self, shown: list[str]) -> str:
        question = self.question.replace("{code}", corpus_code(**self.code)) if self.code else self.question
        if not shown:
            return question
        listed = "\n\n".join(f"[P{index}] {text}" for index, text in enumerate(shown, start=1))
        return f"Passages:\n{listed}\n\nQuestion: {question}"

    def messages(self, shown: list[str]) -> list[dict[str, str]]:
        system = self.system or (SYSTEM if self.topics else None)
        if system and self.tools:
            system = system.replace("{tools}", "\n".join(json.dumps(tool) for tool in self.tools))
        user = {"role": "user", "content": self.user_text(shown)}
        return [{"role": "system", "content": system}, user] if system else [user]

    def encode(self, tokenizer: Any, context_limit: int) -> Encoded:
        """Token ids of the prompt (passages shown while they fit) and of every passage."""
        texts = self.passages()
        total = sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts)
        if total < self.min_passage_tokens:
            raise ValueError(
                f"workload {self.name}: passages hold {total} tokens, fewer than {self.min_passage_tokens}"
            )
        budget = min(self.prompt_token_budget or context_limit, context_limit - self.max_tokens - 64)
        shown = len(texts)
        prompt = _chat_ids(tokenizer, self.messages(texts))
        while len(prompt) > budget and shown > 0:
            shown -= 1
            prompt = _chat_ids(tokenizer, self.messages(texts[:shown]))
        variants = [(f"P{index}", variant) for index, text in enumerate(texts, 1) for variant in lookup_texts(text)]
        passage_ids = [tokenizer(variant, add_special_tokens=False)["input_ids"] for _, variant in variants]
        names = [name for name, _ in variants]
        earlier = [
            dataclasses.replace(self, question=question, earlier_questions=()).encode(tokenizer, context_limit).prompt
            for question in self.earlier_questions
        ]
        return Encoded(prompt, passage_ids, names, shown, self.grammar_spec(), earlier)


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def corpus_code(topic: str, starts_with: str) -> str:
    """The indented block of the topic that starts with ``starts_with``, dedented."""
    lines = pydoc_data.topics.topics[topic].splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith(starts_with))
    block = [lines[start]]
    for line in lines[start + 1 :]:
        if line.strip() and not line.startswith("    "):
            break
        block.append(line)
    indent = len(starts_with) - len(starts_with.lstrip())
    return "\n".join(line[indent:] for line in block).strip("\n")


def load(name: str) -> Workload:
    data = json.loads((FOLDER / f"{name}.json").read_text())
    data["topics"] = tuple(data.get("topics", ()))
    data["tools"] = tuple(data.get("tools", ()))
    data["earlier_questions"] = tuple(data.get("earlier_questions", ()))
    data["versions"] = tuple(tuple(tuple(pair) for pair in edits) for edits in data.get("versions", ()))
    return Workload(**data)


def names() -> list[str]:
    return sorted(path.stem for path in FOLDER.glob("*.json"))
