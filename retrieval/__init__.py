"""Retrieval: document loading, structural chunking, MiniLM embeddings, a FAISS index on disk
with atomic versioned writes and incremental rebuilds, and dense or hybrid search.

Heavy dependencies (torch, sentence-transformers, faiss, bs4, bm25s) are imported where they are
used, so importing this package stays cheap.
"""

from specrag import decoding  # noqa: F401  (first: it sets HF_HUB_OFFLINE before any hub library loads)
from specrag.retrieval.build import BuildReport, build_index
from specrag.retrieval.chunking import Chunk, Chunker, ChunkerSettings, chunk_text, whitespace_tokens
from specrag.retrieval.embed import MODEL_DIM, MODEL_NAME, Embedder, EmbedderLike, EmbeddingModelError, ensure_model
from specrag.retrieval.loaders import (
    DEFAULT_MAX_BYTES,
    Corpus,
    Document,
    LoadError,
    SkippedFile,
    html_to_text,
    load_folder,
    load_sample_corpus,
)
from specrag.retrieval.retriever import Passage, Retriever, SearchTimings
from specrag.retrieval.store import IndexLoadError, IndexLockedError, IndexVersion, StoredChunk, load_index
from specrag.retrieval.tokens import TokenCounter, load_token_counter

__all__ = [
    "DEFAULT_MAX_BYTES",
    "MODEL_DIM",
    "MODEL_NAME",
    "BuildReport",
    "Chunk",
    "Chunker",
    "ChunkerSettings",
    "Corpus",
    "Document",
    "Embedder",
    "EmbedderLike",
    "EmbeddingModelError",
    "IndexLoadError",
    "IndexLockedError",
    "IndexVersion",
    "LoadError",
    "Passage",
    "Retriever",
    "SearchTimings",
    "SkippedFile",
    "StoredChunk",
    "TokenCounter",
    "build_index",
    "chunk_text",
    "ensure_model",
    "html_to_text",
    "load_folder",
    "load_index",
    "load_sample_corpus",
    "load_token_counter",
    "whitespace_tokens",
]
