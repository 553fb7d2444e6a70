"""The ``specrag`` command line.

    specrag pull PACK            fetch, check and convert a model pack (like ``ollama pull``)
    specrag bench decode         plain vs ours vs transformers, side by side
    specrag bench lookup         prompt-lookup cost per step at 2k and 32k tokens of sources
    specrag bench serve          open-loop Poisson arrivals through the HTTP server, speculation off/on/auto
    specrag demo                 stream a speculative RAG answer over the sample corpus
    specrag index build DOCS --out DIR    build or update a document index (``--sample``: pydoc topics)
    specrag index search DIR "QUERY"      top passages from an index
    specrag serve                the HTTP API (agent/server.py) under uvicorn
    specrag ask "QUESTION"       run the agent once: answer, citations, per-stage timings
                                 (serve and ask: --tools module:attr serves your own tools)
    specrag eval groundedness --out DIR   score the agent's answers over the groundedness set

``serve`` and ``ask`` without ``--index`` use the sample-corpus index, built on first use
into ``$SPECRAG_CACHE/index/sample`` (default ``~/.cache/specrag``) and reused afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from importlib.metadata import entry_points
from typing import Any


def _pull(args: argparse.Namespace) -> int:
    from specrag.decoding import packs

    pulled = packs.pull(args.pack, progress=not args.json)
    if args.json:
        print(json.dumps({"pack": pulled.name, "path": str(pulled.path), "converted": pulled.converted}))
    else:
        print(f"{pulled.name}: {'converted into' if pulled.converted else 'already in'} {pulled.path}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from specrag.agent.demo import run_demo

    return run_demo(args.model, args.topic, args.question, args.max_tokens, args.compare, args.json, args.dtype)


def _index_build(args: argparse.Namespace) -> int:
    from specrag.retrieval import (
        Chunker,
        ChunkerSettings,
        Embedder,
        IndexLockedError,
        LoadError,
        build_index,
        load_folder,
        load_sample_corpus,
        load_token_counter,
    )

    if args.sample == (args.docs is not None):
        print("specrag index build: give a DOCS folder or --sample (not both)", file=sys.stderr)
        return 2
    progress = not (args.json or args.no_progress)
    if not progress:
        _silence_progress_bars()
    try:
        ChunkerSettings(args.max_tokens, args.overlap)  # refuse bad numbers before loading a tokenizer
        corpus = load_sample_corpus() if args.sample else load_folder(args.docs, int(args.max_file_mb * 2**20))
        counter = load_token_counter(args.tokenizer, progress=progress)
        chunker = Chunker(ChunkerSettings(args.max_tokens, args.overlap, counter.name), counter.count)
        report = build_index(args.out, corpus, Embedder(), chunker, index_type=args.index_type, progress=progress)
    except (LoadError, IndexLockedError, ValueError) as error:
        print(f"specrag index build: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(report.describe())
    return 0


def _silence_progress_bars() -> None:
    """Every bar, ours and the libraries' (transformers, huggingface_hub, sentence-transformers)."""
    os.environ["TQDM_DISABLE"] = "1"  # read by tqdm when a bar is created
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _index_search(args: argparse.Namespace) -> int:
    from specrag.retrieval import IndexLoadError, Retriever

    try:
        retriever = Retriever.open(args.index, hybrid=not args.dense)
    except IndexLoadError as error:
        print(f"specrag index search: {error}", file=sys.stderr)
        return 1
    passages, timings = retriever.search_with_timings(args.query, args.k)
    if args.json:
        print(json.dumps({"passages": [asdict(p) for p in passages], "timings": timings.as_dict()}, indent=2))
        return 0
    for passage in passages:
        preview = " ".join(passage.text.split())[:200]
        print(f"{passage.rank}. {passage.id}  score {passage.score:.4f}\n   {preview}")
    print(f"embed {timings.embed_s * 1000:.1f} ms, faiss {timings.search_s * 1000:.1f} ms", file=sys.stderr)
    return 0


def _add_index_commands(commands: Any) -> None:
    index = commands.add_parser("index", help="build, update and search a document index")
    actions = index.add_subparsers(dest="action", required=True)

    build = actions.add_parser("build", help="build or incrementally update an index (atomic, versioned)")
    build.add_argument("docs", nargs="?", help="folder of .txt, .md, .rst and .html files")
    build.add_argument("--out", required=True, help="index directory")
    build.add_argument("--sample", action="store_true", help="index the Python reference topics (pydoc_data)")
    build.add_argument("--max-tokens", type=int, default=256, help="token budget of a chunk")
    build.add_argument("--overlap", type=int, default=32, help="tokens shared by consecutive chunks")
    build.add_argument("--tokenizer", default="qwen2.5-coder-0.5b", help="pack name, tokenizer folder, or 'whitespace'")
    build.add_argument("--index-type", choices=["flat", "hnsw"], default="flat")
    build.add_argument("--max-file-mb", type=float, default=20.0, help="skip files larger than this")
    build.add_argument("--json", action="store_true", help="print the build report as JSON")
    build.add_argument("--no-progress", action="store_true", help="no progress bars (the libraries' too)")
    build.set_defaults(handler=_index_build)

    search = actions.add_parser("search", help="top passages for a query")
    search.add_argument("index", help="index directory")
    search.add_argument("query")
    search.add_argument("-k", type=int, default=5, help="how many passages")
    search.add_argument("--dense", action="store_true", help="dense ranking only (default: fused with BM25)")
    search.add_argument("--json", action="store_true", help="print passages and timings as JSON")
    search.set_defaults(handler=_index_search)


def build_parser() -> argparse.ArgumentParser:
    from specrag.decoding.packs import PACKS

    parser = argparse.ArgumentParser(
        prog="specrag", description="A RAG agent runtime with an exact speculative decoder."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    pull = commands.add_parser("pull", help="fetch, verify and convert a model pack")
    pull.add_argument("pack", choices=sorted(PACKS))
    pull.add_argument("--json", action="store_true", help="print the result as JSON")
    pull.set_defaults(handler=_pull)

    demo = commands.add_parser("demo", help="stream a speculative RAG answer over the sample corpus")
    demo.add_argument("--model", default="smollm2-135m", help="pack name, HF folder or .gguf path")
    demo.add_argument("--dtype", default="auto")
    demo.add_argument("--topic", default="with", help="sample-corpus topic used as passage [P1]")
    demo.add_argument("--question", default='What does the "with" statement do? Quote the passage exactly.')
    demo.add_argument("--max-tokens", type=int, default=96)
    demo.add_argument("--compare", action="store_true", help="also decode plainly and report the speed-up")
    demo.add_argument("--json", action="store_true", help="print the result as JSON")
    demo.set_defaults(handler=_demo)

    _add_index_commands(commands)
    from specrag.agent.cli_agent import add_agent_commands

    add_agent_commands(commands)
    _add_plugin_commands(commands)
    return parser


def _add_plugin_commands(commands: Any) -> None:
    """Commands other packages register under the ``specrag.commands`` entry point group
    (``specrag eval`` and ``specrag bench`` come from ``evals``, pyproject.toml): the
    product's CLI does not import its own eval harness, the harness plugs into it."""
    for entry in sorted(entry_points(group="specrag.commands"), key=lambda entry: entry.name):
        entry.load()(commands)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
