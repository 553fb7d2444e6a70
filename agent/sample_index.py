"""The sample-corpus index that ``specrag serve``/``ask`` and the evals use without ``--index``.

Built on first use into ``$SPECRAG_CACHE/index/sample`` (default ``~/.cache/specrag``),
chunked in the served model's tokens; later calls are an up-to-date no-op.
"""

from __future__ import annotations

import sys
from pathlib import Path


def sample_index_dir() -> Path:
    from specrag.decoding.packs import cache_root

    return cache_root() / "index" / "sample"


def ensure_sample_index(model: str, progress: bool = True) -> Path:
    """The sample-corpus index, built on first use; later calls are an up-to-date no-op."""
    from specrag.retrieval import (
        Chunker,
        ChunkerSettings,
        Embedder,
        build_index,
        load_sample_corpus,
        load_token_counter,
    )

    try:
        counter = load_token_counter(model, progress=progress)  # chunk in the served model's tokens
    except ValueError:  # a .gguf path or hub id: no tokenizer folder to count with
        counter = load_token_counter("whitespace")
    out = sample_index_dir()
    chunker = Chunker(ChunkerSettings(256, 32, counter.name), counter.count)
    report = build_index(out, load_sample_corpus(), Embedder(), chunker, progress=progress)
    if progress:
        print(report.describe(), file=sys.stderr)
    return out
