"""Building an index, incrementally: only new or changed documents are chunked and embedded.

Owns the build plan and its report. Under the directory's lock it loads the live version (if
any), decides per document whether its chunks and vectors can be reused (same text SHA-256 under
the same embedding model and chunker settings; a renamed or copied file is matched by its SHA
too), embeds the rest in one batched pass, writes a new version atomically (``store``) and keeps
only the new and the previous versions.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from specrag.retrieval import store
from specrag.retrieval.chunking import Chunker
from specrag.retrieval.embed import EmbedderLike
from specrag.retrieval.loaders import Corpus, Document, SkippedFile
from specrag.retrieval.store import IndexLoadError, IndexVersion, StoredChunk

logger = logging.getLogger(__name__)


@dataclass
class BuildReport:
    out_dir: str
    version: str | None  # the live version after the build
    previous_version: str | None
    written: bool  # False when the index was already up to date
    index_type: str
    embedding_model: str
    chunker: dict[str, Any]
    loaded: int
    skipped: list[dict[str, str]]
    skipped_by_reason: dict[str, int]
    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    unchanged: int = 0
    chunks_total: int = 0
    chunks_embedded: int = 0
    chunks_reused: int = 0
    reembed_all_reason: str | None = None  # why no stored vector could be reused
    timings: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """A few lines for a person: what the build wrote, reused and skipped, and its time."""
        skipped = ", ".join(f"{reason}: {count}" for reason, count in self.skipped_by_reason.items())
        lines = [
            f"index {self.out_dir}: "
            + (f"wrote version {self.version}" if self.written else f"up to date (version {self.version})"),
            f"  files: {self.loaded} loaded, {len(self.skipped)} skipped" + (f" ({skipped})" if skipped else ""),
            f"  added {len(self.added)}, changed {len(self.changed)}, removed {len(self.removed)}, "
            f"unchanged {self.unchanged}",
            f"  chunks: {self.chunks_total} in the index, {self.chunks_embedded} embedded, {self.chunks_reused} reused",
        ]
        if self.reembed_all_reason:
            lines.append(f"  re-embedded everything: {self.reembed_all_reason}")
        total, embed = self.timings.get("total_s", 0.0), self.timings.get("embed_s", 0.0)
        lines.append(f"  took {total:.1f} s (embedding {embed:.1f} s)")
        return "\n".join(lines)


@dataclass
class _Part:
    """One document's chunks and their vector rows (None until embedded)."""

    document: Document
    chunks: list[StoredChunk]
    rows: np.ndarray | None


@dataclass
class _Reusable:
    """What a previous version offers: chunks and vector rows per document text SHA-256."""

    by_sha: dict[str, tuple[list[StoredChunk], np.ndarray]]
    files: dict[str, str]  # source -> sha256 in the previous version


def build_index(
    out_dir: str | os.PathLike[str],
    corpus: Corpus | Sequence[Document],
    embedder: EmbedderLike,
    chunker: Chunker,
    *,
    index_type: str = "flat",
    batch_size: int = 64,
    progress: bool = False,
    lock_timeout: float | None = None,
) -> BuildReport:
    """Build or update the index in ``out_dir`` from ``corpus``; see the module docstring."""
    if index_type not in store.INDEX_TYPES:
        raise ValueError(f"index type must be one of {', '.join(store.INDEX_TYPES)}, not {index_type!r}")
    corpus = corpus if isinstance(corpus, Corpus) else Corpus(list(corpus))
    documents = _sorted_unique(corpus.documents)
    root = Path(out_dir)
    started = time.monotonic()
    with store.build_lock(root, lock_timeout):
        store.clean_tmp(root)
        previous, reason = _previous(root, embedder, chunker)
        report = _new_report(root, corpus, embedder, chunker, index_type, previous, reason)
        reusable = _reusable(previous, reason)
        _classify(report, documents, reusable)
        report.timings["load_previous_s"] = time.monotonic() - started
        if _up_to_date(report, previous, index_type):
            report.chunks_total = report.chunks_reused = len(previous.chunks) if previous else 0
            report.timings["total_s"] = time.monotonic() - started
            return report
        parts = _assemble(report, documents, reusable, embedder, chunker, batch_size, progress)
        _publish(report, root, parts, store.current_or_none(root), index_type, embedder, chunker)
    report.timings["total_s"] = time.monotonic() - started
    return report


def _sorted_unique(documents: Sequence[Document]) -> list[Document]:
    ordered = sorted(documents, key=lambda document: document.source)
    for first, second in itertools.pairwise(ordered):
        if first.source == second.source:
            raise ValueError(f"two documents share the source name {first.source!r}")
    return ordered


def _previous(root: Path, embedder: EmbedderLike, chunker: Chunker) -> tuple[IndexVersion | None, str | None]:
    """The live version and, when its vectors cannot be reused, why."""
    if store.current_or_none(root) is None:
        return None, None
    try:
        previous = store.load_index(root)
        previous.embeddings()  # verified now, so a damaged file means re-embedding, not a crash later
    except IndexLoadError as error:
        logger.warning("the existing index cannot be reused, re-embedding everything: %s", error)
        return None, f"existing index unusable: {error}"
    if (previous.model_name, previous.dim) != (embedder.model_name, embedder.dim):
        return previous, f"embedding model changed from {previous.model_name!r} to {embedder.model_name!r}"
    if previous.manifest["chunker"] != chunker.settings.as_dict():
        return previous, f"chunker settings changed from {previous.manifest['chunker']} to {chunker.settings.as_dict()}"
    return previous, None


def _new_report(
    root: Path,
    corpus: Corpus,
    embedder: EmbedderLike,
    chunker: Chunker,
    index_type: str,
    previous: IndexVersion | None,
    reason: str | None,
) -> BuildReport:
    return BuildReport(
        out_dir=str(root),
        version=previous.version if previous else None,
        previous_version=previous.version if previous else None,
        written=False,
        index_type=index_type,
        embedding_model=embedder.model_name,
        chunker=chunker.settings.as_dict(),
        loaded=len(corpus.documents),
        skipped=[_skip_dict(item) for item in corpus.skipped],
        skipped_by_reason=corpus.skipped_by_reason(),
        reembed_all_reason=reason,
    )


def _skip_dict(item: SkippedFile) -> dict[str, str]:
    return {"source": item.source, "reason": item.reason, "detail": item.detail}


def _reusable(previous: IndexVersion | None, reason: str | None) -> _Reusable:
    if previous is None:
        return _Reusable({}, {})
    files = {source: entry["sha256"] for source, entry in previous.manifest["files"].items()}
    if reason is not None:
        return _Reusable({}, files)
    by_sha: dict[str, tuple[list[StoredChunk], np.ndarray]] = {}
    embeddings = previous.embeddings()
    row = 0
    for source, count in ((source, entry["chunks"]) for source, entry in previous.manifest["files"].items()):
        by_sha.setdefault(files[source], (previous.chunks[row : row + count], embeddings[row : row + count]))
        row += count
    return _Reusable(by_sha, files)


def _classify(report: BuildReport, documents: list[Document], reusable: _Reusable) -> None:
    current = {document.source for document in documents}
    for document in documents:
        before = reusable.files.get(document.source)
        if before is None:
            report.added.append(document.source)
        elif before != document.sha256:
            report.changed.append(document.source)
        else:
            report.unchanged += 1
    report.removed = sorted(source for source in reusable.files if source not in current)


def _up_to_date(report: BuildReport, previous: IndexVersion | None, index_type: str) -> bool:
    return (
        previous is not None
        and report.reembed_all_reason is None
        and not (report.added or report.changed or report.removed)
        and previous.manifest["index_type"] == index_type
    )


def _assemble(
    report: BuildReport,
    documents: list[Document],
    reusable: _Reusable,
    embedder: EmbedderLike,
    chunker: Chunker,
    batch_size: int,
    progress: bool,
) -> list[_Part]:
    """Chunks in source order with their vectors: reused rows where possible, fresh ones otherwise."""
    started = time.monotonic()
    parts: list[_Part] = []
    fresh: list[StoredChunk] = []
    for document in documents:
        if document.sha256 in reusable.by_sha:
            stored, rows = reusable.by_sha[document.sha256]
            parts.append(_Part(document, [_renamed(chunk, document.source, n) for n, chunk in enumerate(stored)], rows))
        else:
            new = [
                StoredChunk(chunk.id, chunk.source, chunk.start, chunk.end, chunk.text, document.sha256)
                for chunk in chunker.chunk(document)
            ]
            parts.append(_Part(document, new, None))
            fresh.extend(new)
    report.timings["chunk_s"] = time.monotonic() - started
    started = time.monotonic()
    encoded = embedder.encode([chunk.text for chunk in fresh], batch_size=batch_size, progress=progress)
    report.timings["embed_s"] = time.monotonic() - started
    report.chunks_embedded = len(fresh)
    _fill_fresh_rows(parts, encoded)
    return parts


def _renamed(chunk: StoredChunk, source: str, n: int) -> StoredChunk:
    """A reused chunk under its (possibly new) source name; ids follow the source."""
    if chunk.source == source:
        return chunk
    return StoredChunk(f"{source}#{n}", source, chunk.start, chunk.end, chunk.text, chunk.sha256)


def _fill_fresh_rows(parts: list[_Part], encoded: np.ndarray) -> None:
    row = 0
    for part in parts:
        if part.rows is None:
            part.rows = encoded[row : row + len(part.chunks)]
            row += len(part.chunks)


def _publish(
    report: BuildReport,
    root: Path,
    parts: list[_Part],
    previous_name: str | None,
    index_type: str,
    embedder: EmbedderLike,
    chunker: Chunker,
) -> None:
    started = time.monotonic()
    chunks = [chunk for part in parts for chunk in part.chunks]
    vectors = np.concatenate([part.rows for part in parts if part.rows is not None] or [np.empty((0, embedder.dim))])
    vectors = vectors.astype(np.float32, copy=False)
    index = store.make_faiss_index(vectors, index_type)
    manifest = {
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "embedding": {"model": embedder.model_name, "dim": embedder.dim},
        "chunker": chunker.settings.as_dict(),
        "index_type": index_type,
        "chunk_count": len(chunks),
        "files": {part.document.source: {"sha256": part.document.sha256, "chunks": len(part.chunks)} for part in parts},
    }
    report.version = store.write_version(root, manifest, chunks, vectors, index)
    report.written = True
    report.chunks_total = len(chunks)
    report.chunks_reused = len(chunks) - report.chunks_embedded
    keep = {report.version} | ({previous_name} if previous_name else set())
    store.collect_garbage(root, keep)
    report.timings["write_s"] = time.monotonic() - started
