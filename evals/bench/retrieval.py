"""Retrieval quality and cost: recall@k and MRR on a labelled set, build time and memory,
HNSW against exact search, and query latency at 10k and 100k chunks.

    python -m specrag.evals.bench.retrieval                      # sample corpus, chunks of 128 and 256 tokens
    python -m specrag.evals.bench.retrieval --chunk-tokens 256 --sizes 10000 --queries 50   # quicker

Quality: every question of ``evals/datasets/retrieval_sample.jsonl`` names the sample-corpus
sources that answer it; a retrieved passage is relevant when its source is one of them.
recall@k is the share of questions with a relevant passage in the top k, MRR@10 the mean
reciprocal rank of the first relevant one. Modes: ``dense`` (exact inner product, the
default), ``hnsw`` (the approximate index over the same vectors), ``bm25`` alone, and
``hybrid`` (BM25 and dense fused by reciprocal rank). Latency: random unit vectors stand in
for chunks (only the count matters to the search), queried with real embeddings of the
labelled questions; the query's embedding time is reported beside it.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from specrag.retrieval import (
    Chunker,
    ChunkerSettings,
    Embedder,
    Retriever,
    build_index,
    load_sample_corpus,
    load_token_counter,
)
from specrag.retrieval.lexical import LexicalIndex
from specrag.retrieval.store import make_faiss_index

DATASET = Path(__file__).resolve().parent.parent / "datasets" / "retrieval_sample.jsonl"
KS = (1, 3, 5, 10)


def load_questions(path: Path = DATASET) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def quality(ranked_sources: list[list[str]], questions: list[dict[str, Any]]) -> dict[str, float]:
    """recall@k for each k and MRR@10 from each question's ranked passage sources."""
    first_hits = []
    for sources, question in zip(ranked_sources, questions, strict=True):
        relevant = set(question["relevant_sources"])
        ranks = [rank for rank, source in enumerate(sources[:10], start=1) if source in relevant]
        first_hits.append(ranks[0] if ranks else None)
    result = {f"recall@{k}": sum(1 for hit in first_hits if hit and hit <= k) / len(first_hits) for k in KS}
    result["mrr@10"] = sum(1 / hit for hit in first_hits if hit) / len(first_hits)
    return result


def percentile(values: list[float], share: float) -> float:
    return float(np.percentile(np.asarray(values), share * 100))


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_sample_index(out: Path, chunk_tokens: int, tokenizer: str, embedder: Embedder) -> dict[str, Any]:
    counter = load_token_counter(tokenizer)
    chunker = Chunker(ChunkerSettings(chunk_tokens, chunk_tokens // 8, counter.name), counter.count)
    rss_before = peak_rss_mib()
    started = time.perf_counter()
    report = build_index(out, load_sample_corpus(), embedder, chunker)
    return {
        "chunk_tokens": chunk_tokens,
        "chunks": report.chunks_total,
        "build_s": time.perf_counter() - started,
        "embed_s": report.timings.get("embed_s", 0.0),
        "peak_rss_growth_mib": peak_rss_mib() - rss_before,
        "index_bytes": sum(file.stat().st_size for file in out.rglob("*") if file.is_file()),
    }


def mode_rankers(retriever: Retriever, vectors: np.ndarray) -> dict[str, Callable[[int], list[int]]]:
    """Row rankings (top 10) per mode for question ``i``."""
    embeddings = retriever.index.embeddings()
    hnsw = make_faiss_index(embeddings, "hnsw")
    lexical = LexicalIndex([chunk.text for chunk in retriever.index.chunks])
    rows = {chunk.id: row for row, chunk in enumerate(retriever.index.chunks)}
    return {
        "dense": lambda i: retriever.index.index.search(vectors[i : i + 1], 10)[1][0].tolist(),
        "hnsw": lambda i: hnsw.search(vectors[i : i + 1], 10)[1][0].tolist(),
        "bm25": lambda i: [row for row, _ in lexical.top(QUESTION_TEXTS[i], 10)],
        "hybrid": lambda i: [rows[p.id] for p in retriever.search_with_timings(QUESTION_TEXTS[i], 10, hybrid=True)[0]],
    }


QUESTION_TEXTS: list[str] = []


def bench_quality(index_dir: Path, embedder: Embedder, questions: list[dict[str, Any]]) -> dict[str, Any]:
    retriever = Retriever.open(index_dir, embedder)
    vectors = embedder.encode(QUESTION_TEXTS)
    chunks = retriever.index.chunks
    result: dict[str, Any] = {}
    rankings: dict[str, list[list[int]]] = {}
    for mode, ranker in mode_rankers(retriever, vectors).items():
        rankings[mode] = [ranker(i) for i in range(len(questions))]
        result[mode] = quality([[chunks[row].source for row in ranked] for ranked in rankings[mode]], questions)
    overlap = [len(set(h) & set(d)) / 10 for h, d in zip(rankings["hnsw"], rankings["dense"], strict=True)]
    result["hnsw_recall@10_vs_flat"] = statistics.mean(overlap)
    return result


def synthetic_chunks(base: np.ndarray, size: int, seed: int = 0) -> np.ndarray:
    """``size`` unit vectors around the real ones (see the module docstring)."""
    rng = np.random.default_rng(seed)
    picked = base[rng.integers(0, len(base), size)]
    noisy = picked + 0.75 * rng.standard_normal(picked.shape).astype(np.float32) / np.sqrt(base.shape[1])
    return (noisy / np.linalg.norm(noisy, axis=1, keepdims=True)).astype(np.float32)


def bench_latency(
    sizes: list[int], queries: int, embedder: Embedder, base: np.ndarray, seed: int = 0
) -> list[dict[str, Any]]:
    texts = (QUESTION_TEXTS * (queries // len(QUESTION_TEXTS) + 1))[:queries]
    embed_s = []
    for text in texts:
        started = time.perf_counter()
        embedder.encode([text])
        embed_s.append(time.perf_counter() - started)
    vectors = embedder.encode(texts)
    rows = []
    for size in sizes:
        corpus = synthetic_chunks(base, size, seed)
        exact = make_faiss_index(corpus[:0], "flat")
        exact.add(corpus)
        for index_type in ("flat", "hnsw"):
            started = time.perf_counter()
            index = exact if index_type == "flat" else make_faiss_index(corpus, "hnsw")
            built_s = time.perf_counter() - started
            search_s, recall = [], []
            for row in range(len(texts)):
                started = time.perf_counter()
                found = index.search(vectors[row : row + 1], 10)[1][0]
                search_s.append(time.perf_counter() - started)
                recall.append(len(set(found.tolist()) & set(exact.search(vectors[row : row + 1], 10)[1][0])) / 10)
            rows.append(
                {
                    "chunks": size,
                    "index": index_type,
                    "build_s": built_s,
                    "search_p50_ms": percentile(search_s, 0.5) * 1000,
                    "search_p95_ms": percentile(search_s, 0.95) * 1000,
                    "embed_p50_ms": percentile(embed_s, 0.5) * 1000,
                    "embed_p95_ms": percentile(embed_s, 0.95) * 1000,
                    "recall@10_vs_flat": statistics.mean(recall),
                }
            )
            print(format_latency(rows[-1]), flush=True)
    return rows


def format_latency(row: dict[str, Any]) -> str:
    return (
        f"{row['chunks']:>7} chunks {row['index']:<5} search p50 {row['search_p50_ms']:.2f} ms "
        f"p95 {row['search_p95_ms']:.2f} ms  (+ embed p50 {row['embed_p50_ms']:.1f} ms)  "
        f"recall@10 vs flat {row['recall@10_vs_flat']:.3f}  build {row['build_s']:.1f} s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk-tokens", nargs="+", type=int, default=[128, 256])
    parser.add_argument("--tokenizer", default="qwen2.5-coder-0.5b", help="token counts for chunking")
    parser.add_argument("--sizes", nargs="+", type=int, default=[10_000, 100_000])
    parser.add_argument("--queries", type=int, default=200, help="queries per latency measurement")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    questions = load_questions()
    QUESTION_TEXTS[:] = [question["question"] for question in questions]
    embedder = Embedder()
    results: dict[str, Any] = {"questions": len(questions), "builds": [], "quality": {}}
    with tempfile.TemporaryDirectory(prefix="specrag-bench-retrieval-") as temp:
        for chunk_tokens in args.chunk_tokens:
            out = Path(temp) / f"index-{chunk_tokens}"
            build = build_sample_index(out, chunk_tokens, args.tokenizer, embedder)
            results["builds"].append(build)
            print(
                f"build {chunk_tokens}-token chunks: {build['chunks']} chunks in {build['build_s']:.1f} s "
                f"(embedding {build['embed_s']:.1f} s), peak RSS +{build['peak_rss_growth_mib']:.0f} MiB, "
                f"{build['index_bytes'] / 2**20:.1f} MiB on disk",
                flush=True,
            )
            scores = bench_quality(out, embedder, questions)
            results["quality"][str(chunk_tokens)] = scores
            for mode in ("dense", "hnsw", "bm25", "hybrid"):
                row = "  ".join(f"{name} {value:.3f}" for name, value in scores[mode].items())
                print(f"  {mode:<7} {row}", flush=True)
            print(f"  hnsw recall@10 vs flat {scores['hnsw_recall@10_vs_flat']:.3f}", flush=True)
        base = Retriever.open(out, embedder).index.embeddings()
        results["latency"] = bench_latency(args.sizes, args.queries, embedder, base)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
