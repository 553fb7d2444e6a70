"""Prompt cases built from the sample corpus (``pydoc_data.topics``).

Shared by the parity tests and the decoding benchmark, so both exercise the same mix:
RAG prompts whose answer should quote a passage, RAG prompts asking for an explanation,
and open questions without retrieval. The case type and its encoding live in
``agent/sample_prompts.py`` (the demo uses them too).
"""

from __future__ import annotations

from specrag.agent.sample_prompts import SYSTEM, PromptCase, corpus_passage, encode_case

__all__ = ["BENCH_CASES", "PARITY_CASES", "SYSTEM", "PromptCase", "corpus_passage", "encode_case"]

PARITY_CASES: tuple[PromptCase, ...] = (
    PromptCase("quote_pass", "rag_quote", 'What does the "pass" statement do? Quote the passage exactly.', ("pass",)),
    PromptCase("quote_break", "rag_quote", 'Where may "break" occur? Quote the passage exactly.', ("break",)),
    PromptCase(
        "quote_lambda", "rag_quote", "What are lambda expressions used for? Quote the passage exactly.", ("lambda",)
    ),
    PromptCase("quote_continue", "rag_quote", 'What does "continue" do? Quote the passage exactly.', ("continue",)),
    PromptCase(
        "quote_return", "rag_quote", 'What does "return" do when no expression is given? Quote [P1].', ("return",)
    ),
    PromptCase(
        "quote_two_passages", "rag_quote", 'Quote what the passages say about "while" and "if".', ("while", "if")
    ),
    PromptCase(
        "explain_assert", "rag_explain", "Explain in your own words what an assert statement is for.", ("assert",)
    ),
    PromptCase("explain_truth", "rag_explain", "Which objects are false in Python? Answer briefly.", ("truth",)),
    PromptCase("open_recursion", "chat_open", "Explain recursion to a beginner in three sentences."),
    PromptCase("open_list_sort", "chat_open", "Write a Python function that returns a sorted copy of a list."),
)

BENCH_CASES: dict[str, PromptCase] = {
    "rag_quote": PromptCase(
        "rag_quote",
        "rag_quote",
        'What does the "with" statement do? Quote the passage exactly, sentence by sentence.',
        ("with",),
    ),
    "free_form": PromptCase("free_form", "chat_open", "Write a short story about a robot who learns to paint."),
}
