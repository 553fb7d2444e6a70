"""Shared pieces of the retrieval tests: one real MiniLM embedder and one sample index per session.

Session fixtures defined in a test module run once per module that imports them, so the expensive
parts are memoised here instead and every retrieval test module's fixtures call these.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from specrag.retrieval import (
    BuildReport,
    Chunker,
    ChunkerSettings,
    Corpus,
    Embedder,
    build_index,
    load_sample_corpus,
    whitespace_tokens,
)

# Topics small enough that embedding them takes seconds on two cores (the whole sample corpus
# takes about a minute), yet enough neighbours that the right topic has to win on merit.
SAMPLE_TOPICS = (
    "assert", "break", "continue", "context-managers", "del", "for", "global", "if", "lambda",
    "nonlocal", "pass", "raise", "return", "while", "with", "yield", "bltin-null-object", "truth",
)  # fmt: skip
SETTINGS = ChunkerSettings(max_tokens=128, overlap=16, tokenizer="whitespace")


@functools.cache
def shared_embedder() -> Embedder:
    return Embedder()


def chunker() -> Chunker:
    return Chunker(SETTINGS, whitespace_tokens)


def sample_subset() -> Corpus:
    corpus = load_sample_corpus()
    return Corpus([document for document in corpus.documents if document.source[len("pydoc/") :] in SAMPLE_TOPICS])


_built: dict[str, tuple[Path, BuildReport]] = {}


def sample_index(base: Path) -> tuple[Path, BuildReport]:
    """The subset's index, built once per session under ``base`` (a session temp folder)."""
    if "sample" not in _built:
        out = base / "sample-index"
        _built["sample"] = (out, build_index(out, sample_subset(), shared_embedder(), chunker()))
    return _built["sample"]


class CountingEmbedder:
    """The real embedder, counting what it is asked to encode (the incremental build's evidence)."""

    def __init__(self, inner: Embedder, model_name: str | None = None) -> None:
        self.inner = inner
        self.model_name = model_name or inner.model_name
        self.dim = inner.dim
        self.calls: list[int] = []

    def encode(self, texts: list[str], batch_size: int = 64, progress: bool = False) -> np.ndarray:
        self.calls.append(len(texts))
        return self.inner.encode(texts, batch_size=batch_size, progress=progress)

    @property
    def encoded(self) -> int:
        return sum(self.calls)
