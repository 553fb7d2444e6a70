"""Search over a built index: the :class:`Retriever` the agent and ``search_documents`` use.

Owns query-time behaviour: embedding the query, FAISS inner-product search, optional hybrid
ranking (BM25 fused with the dense ranking by reciprocal rank), a deterministic order (score
descending, ties by chunk id) and per-query timings for the agent's ``retrieval`` span.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specrag.retrieval import store
from specrag.retrieval.embed import MODEL_NAME, Embedder, EmbedderLike
from specrag.retrieval.lexical import LexicalIndex, reciprocal_rank_fusion
from specrag.retrieval.store import IndexLoadError, IndexVersion

HYBRID_CANDIDATES = 50  # per ranking fed to the fusion: deep enough that RRF can promote a lexical hit
FOLLOW_INTERVAL_S = 1.0  # how often a search checks CURRENT for a newly published version
_TIE_MARGIN = 16  # extra dense results fetched so that ties at the k-th score are ordered by id
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Passage:
    id: str
    score: float  # cosine similarity; in hybrid mode the reciprocal-rank-fusion score
    source: str
    text: str
    start: int
    end: int
    rank: int  # 1-based position in the result list


@dataclass(frozen=True)
class SearchTimings:
    embed_s: float
    search_s: float  # FAISS
    lexical_s: float = 0.0  # BM25 and fusion, hybrid mode only

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class Retriever:
    """Top-k passages for a query; satisfies ``specrag.tools.builtin.Searcher``."""

    # Hybrid by default: on the labelled sample-corpus questions (python -m specrag.evals.bench.retrieval)
    # fusing BM25 raised recall@1 from 0.81 to 0.90 and MRR@10 from 0.89 to 0.94, recall@5 equal.
    def __init__(self, index: IndexVersion, embedder: EmbedderLike, hybrid: bool = True, follow: bool = True) -> None:
        self.embedder = embedder
        self.hybrid = hybrid
        self.last_timings: SearchTimings | None = None  # of the latest search; not per-thread
        # follow: switch to the version a rebuild publishes (CURRENT), checked at most every
        # FOLLOW_INTERVAL_S, so replicas sharing one index directory pick up a rebuild without a
        # restart. A search holds one _Live from start to end, so a switch never mixes versions.
        self.follow = follow
        self._live = _Live(index)
        self._checked_at = time.monotonic()
        self._switch_lock = threading.Lock()
        self._last_failure = ""

    @property
    def index(self) -> IndexVersion:
        """The version searches use now."""
        return self._live.index

    def refresh(self) -> bool:
        """Load the version CURRENT names if it is not the one in use; True if it switched.

        A version that fails to load leaves the one in use (the failure is logged): the next
        check tries again, and searches go on meanwhile.
        """
        with self._switch_lock:
            self._checked_at = time.monotonic()
            live = self._live.index
            if store.current_or_none(live.root) in (None, live.version):
                return False
            try:
                index = store.load_index(live.root, model_name=self.embedder.model_name, dim=self.embedder.dim)
            except IndexLoadError as error:
                if str(error) != self._last_failure:  # once per failure, not once a second
                    logger.warning("index %s: keeping version %s: %s", live.root, live.version, error)
                    self._last_failure = str(error)
                return False
            self._live = _Live(index)
            logger.info("index %s: switched from version %s to %s", live.root, live.version, index.version)
            return True

    def _current(self) -> _Live:
        if self.follow and time.monotonic() - self._checked_at >= FOLLOW_INTERVAL_S:
            self.refresh()
        return self._live

    @classmethod
    def open(
        cls,
        index_dir: str | os.PathLike[str],
        embedder: EmbedderLike | None = None,
        *,
        hybrid: bool = True,
        verify: bool = True,
        warm: bool = True,
        follow: bool = True,
    ) -> Retriever:
        """Load the live version of ``index_dir``, refusing one built with another embedding model.

        ``warm`` encodes one query up front, so the model load is not billed to the first search.
        """
        if embedder is None:
            embedder = _default_embedder(Path(index_dir))
        index = store.load_index(index_dir, model_name=embedder.model_name, dim=embedder.dim, verify=verify)
        if warm:
            embedder.encode(["warm-up"])
        return cls(index, embedder, hybrid=hybrid, follow=follow)

    @property
    def name(self) -> str:
        """The index folder's name, for the ``retrieval {index}`` trace span."""
        return self.index.root.resolve().name

    def __len__(self) -> int:
        return len(self._live.index.chunks)

    def search(self, query: str, k: int = 5) -> list[Passage]:
        passages, _ = self.search_with_timings(query, k)
        return passages

    def search_with_timings(
        self, query: str, k: int = 5, hybrid: bool | None = None
    ) -> tuple[list[Passage], SearchTimings]:
        if k < 1:
            raise ValueError(f"k must be at least 1, not {k}")
        hybrid = self.hybrid if hybrid is None else hybrid
        live = self._current()
        started = time.perf_counter()
        vector = self.embedder.encode([query])[0]
        embedded = time.perf_counter()
        dense = live.dense(vector, max(k, HYBRID_CANDIDATES) if hybrid else k)
        searched = time.perf_counter()
        ranked = live.fuse(query, dense, k) if hybrid else dense[:k]
        timings = SearchTimings(
            embedded - started, searched - embedded, time.perf_counter() - searched if hybrid else 0.0
        )
        self.last_timings = timings
        return [live.passage(row, score, rank) for rank, (row, score) in enumerate(ranked, start=1)], timings


class _Live:
    """One loaded version and its BM25 index (built on first hybrid search): what a search reads."""

    def __init__(self, index: IndexVersion) -> None:
        self.index = index
        self._lexical: LexicalIndex | None = None

    def dense(self, vector: np.ndarray, n: int) -> list[tuple[int, float]]:
        """The n best (row, score), score descending and ties by chunk id."""
        total = self.index.index.ntotal
        fetch = min(total, n + _TIE_MARGIN)
        while True:
            rows, scores = self._faiss_search(vector, fetch)
            # Fetch more while the cut might fall inside a run of equal scores.
            if fetch >= total or len(rows) <= n or scores[n - 1] != scores[-1]:
                break
            fetch = min(total, fetch * 2)
        pairs = sorted(zip(rows, scores, strict=True), key=lambda pair: (-pair[1], self.index.chunks[pair[0]].id))
        return pairs[:n]

    def _faiss_search(self, vector: np.ndarray, fetch: int) -> tuple[list[int], list[float]]:
        import faiss

        if fetch == 0:
            return [], []
        params: Any = None
        if self.index.manifest["index_type"] == "hnsw":
            params = faiss.SearchParametersHNSW(efSearch=max(store.HNSW_EF_SEARCH, fetch))
        scores, rows = self.index.index.search(vector.reshape(1, -1).astype(np.float32), fetch, params=params)
        kept = [(int(row), float(score)) for row, score in zip(rows[0], scores[0], strict=True) if row >= 0]
        return [row for row, _ in kept], [score for _, score in kept]

    def fuse(self, query: str, dense: list[tuple[int, float]], k: int) -> list[tuple[int, float]]:
        if self._lexical is None:
            self._lexical = LexicalIndex([chunk.text for chunk in self.index.chunks])
        lexical = self._lexical.top(query, max(k, HYBRID_CANDIDATES))
        fused = reciprocal_rank_fusion([[row for row, _ in dense], [row for row, _ in lexical]])
        ordered = sorted(fused.items(), key=lambda item: (-item[1], self.index.chunks[item[0]].id))
        return ordered[:k]

    def passage(self, row: int, score: float, rank: int) -> Passage:
        chunk = self.index.chunks[row]
        return Passage(chunk.id, score, chunk.source, chunk.text, chunk.start, chunk.end, rank)


def _default_embedder(index_dir: Path) -> EmbedderLike:
    """The pinned MiniLM pack; an index built with any other model needs its embedder passed in."""
    model = store.read_live_manifest(index_dir)["embedding"]["model"]
    if model != MODEL_NAME:
        raise IndexLoadError(
            f"{index_dir} was built with embedding model {model!r}; pass an embedder for it to Retriever.open"
        )
    return Embedder()
