"""Lexical scoring (BM25 via ``bm25s``) and reciprocal-rank fusion with the dense ranking.

Owns the hybrid half of search. No stopword list is applied: in technical corpora words such as
``with``, ``for``, ``if`` and ``in`` are the very keywords a query is about, and BM25's IDF already
gives common words little weight.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

RRF_K = 60  # the constant of Cormack et al. (2009); it damps the weight of the very first ranks


class LexicalIndex:
    """BM25 over a fixed list of texts, addressed by row number."""

    def __init__(self, texts: Sequence[str]) -> None:
        import bm25s

        self._size = len(texts)
        self._bm25 = bm25s.BM25()
        if texts:
            tokens = bm25s.tokenize(list(texts), stopwords=None, show_progress=False)
            self._bm25.index(tokens, show_progress=False)

    def scores(self, query: str) -> np.ndarray:
        """One BM25 score per row (zeros for a query with no indexed word)."""
        import bm25s

        if self._size == 0:
            return np.zeros(0, dtype=np.float32)
        words = bm25s.tokenize([query], stopwords=None, show_progress=False, return_ids=False)[0]
        if not words:
            return np.zeros(self._size, dtype=np.float32)
        return np.asarray(self._bm25.get_scores(words), dtype=np.float32)

    def top(self, query: str, n: int) -> list[tuple[int, float]]:
        """Up to ``n`` (row, score) with a positive score, best first, ties by row."""
        scores = self.scores(query)
        rows = np.flatnonzero(scores > 0)
        ordered = sorted(rows.tolist(), key=lambda row: (-float(scores[row]), row))
        return [(row, float(scores[row])) for row in ordered[:n]]


def reciprocal_rank_fusion(rankings: Sequence[Sequence[int]], k: int = RRF_K) -> dict[int, float]:
    """Sum over rankings of 1 / (k + rank), rank counted from 1: robust to incomparable score scales."""
    fused: dict[int, float] = {}
    for ranking in rankings:
        for rank, row in enumerate(ranking, start=1):
            fused[row] = fused.get(row, 0.0) + 1.0 / (k + rank)
    return fused
