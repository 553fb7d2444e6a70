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
from pathlib import Path
from typing import TYPE_CHECKING, Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

if TYPE_CHECKING:
    from retrieval import BuildReport


def probability(text: str) -> float:
    """An argparse type: a float within [0, 1]."""
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be within [0, 1], not {text}")
    return value


def add_grounding_arguments(parser: argparse.ArgumentParser) -> None:
    """The groundedness check's options (agent/grounding/check.py), for ``ask`` and the eval."""
    from agent.grounding.check import DEFAULT_MIN_SUPPORTED, GROUNDING_MODES

    parser.add_argument(
        "--grounding",
        choices=GROUNDING_MODES,
        default="mark",
        help="check the answer against the passages: mark it (default), abstain when unsupported, or off",
    )
    parser.add_argument(
        "--min-supported",
        type=probability,
        default=DEFAULT_MIN_SUPPORTED,
        help="share of the answer's claims the passages must support for it to be grounded",
    )
    parser.add_argument(
        "--grounding-judge", action="store_true", help="the model also judges each claim the rules let through"
    )


def grounding_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"grounding": args.grounding, "min_supported": args.min_supported, "grounding_judge": args.grounding_judge}


def _pull(args: argparse.Namespace) -> int:
    from decoding import packs

    pulled = packs.pull(args.pack, progress=not args.json)
    if args.json:
        print(json.dumps({"pack": pulled.name, "path": str(pulled.path), "converted": pulled.converted}))
    else:
        print(f"{pulled.name}: {'converted into' if pulled.converted else 'already in'} {pulled.path}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from agent.demo import run_demo

    return run_demo(args.model, args.topic, args.question, args.max_tokens, args.compare, args.json, args.dtype)


def _index_build(args: argparse.Namespace) -> int:
    from retrieval import (
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
        print(_describe_build(report))
    return 0


def _silence_progress_bars() -> None:
    """Every bar, ours and the libraries' (transformers, huggingface_hub, sentence-transformers)."""
    os.environ["TQDM_DISABLE"] = "1"  # read by tqdm when a bar is created
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _describe_build(report: BuildReport) -> str:
    skipped = ", ".join(f"{reason}: {count}" for reason, count in report.skipped_by_reason.items())
    lines = [
        f"index {report.out_dir}: "
        + (f"wrote version {report.version}" if report.written else f"up to date (version {report.version})"),
        f"  files: {report.loaded} loaded, {len(report.skipped)} skipped" + (f" ({skipped})" if skipped else ""),
        f"  added {len(report.added)}, changed {len(report.changed)}, removed {len(report.removed)}, "
        f"unchanged {report.unchanged}",
        f"  chunks: {report.chunks_total} in the index, {report.chunks_embedded} embedded, "
        f"{report.chunks_reused} reused",
    ]
    if report.reembed_all_reason:
        lines.append(f"  re-embedded everything: {report.reembed_all_reason}")
    lines.append(
        f"  took {report.timings.get('total_s', 0.0):.1f} s (embedding {report.timings.get('embed_s', 0.0):.1f} s)"
    )
    return "\n".join(lines)


def _index_search(args: argparse.Namespace) -> int:
    from retrieval import IndexLoadError, Retriever

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


def sample_index_dir() -> Path:
    from decoding.packs import cache_root

    return cache_root() / "index" / "sample"


def ensure_sample_index(model: str, progress: bool = True) -> Path:
    """The sample-corpus index, built on first use; later calls are an up-to-date no-op."""
    from retrieval import Chunker, ChunkerSettings, Embedder, build_index, load_sample_corpus, load_token_counter

    try:
        counter = load_token_counter(model, progress=progress)  # chunk in the served model's tokens
    except ValueError:  # a .gguf path or hub id: no tokenizer folder to count with
        counter = load_token_counter("whitespace")
    out = sample_index_dir()
    chunker = Chunker(ChunkerSettings(256, 32, counter.name), counter.count)
    report = build_index(out, load_sample_corpus(), Embedder(), chunker, progress=progress)
    if progress:
        print(_describe_build(report), file=sys.stderr)
    return out


def _agent(args: argparse.Namespace, concurrent: bool, progress: bool) -> Any:
    from agent.runtime import Agent
    from agent.trace import Tracer, TraceStore

    index = args.index or ensure_sample_index(args.model, progress=progress)
    options: dict[str, Any] = {"max_in_flight": args.max_in_flight} if concurrent else {}
    trace_log = getattr(args, "trace_log", None) or os.environ.get("SPECRAG_TRACE_LOG")
    tracer = Tracer(store=TraceStore(jsonl_path=Path(trace_log) if trace_log else None))
    model = {"model": args.model, "draft": args.draft, "dtype": args.dtype}
    return Agent(index=index, concurrent=concurrent, tracer=tracer, **model, **options)


def _serve(args: argparse.Namespace) -> int:
    from agent.server import serve

    agent = _agent(args, concurrent=True, progress=True)
    # Measure the speculation cost model now (seconds), not inside the first request's TTFT.
    agent.engine.calibrate()
    try:
        serve(agent, host=args.host, port=args.port)
    finally:
        agent.close()
    return 0


def _ask(args: argparse.Namespace) -> int:
    from agent.trace import stage_durations

    agent = _agent(args, concurrent=False, progress=not args.json)
    options: dict[str, Any] = {"speculation": args.speculation, "max_tokens": args.max_tokens, "k": args.k}
    if args.max_steps is not None:
        options["max_steps"] = args.max_steps
    if args.abstain_threshold is not None:
        options["abstain_threshold"] = args.abstain_threshold
    options |= {"citations": args.citations, **grounding_options(args)}
    result = agent.run(args.question, **options)
    trace = agent.trace(result["trace_id"])
    if args.json:
        print(json.dumps({**result, "trace": trace}, indent=2))
        return 0
    print(result["answer"])
    grounding = result["grounding"]
    if grounding is not None and not grounding["grounded"]:
        print(f"\nnot grounded: {grounding['score']:.0%} of its claims are supported by the passages; unsupported:")
        for sentence in grounding["unsupported"]:
            print(f"  - {sentence['text']} ({sentence['reason']})")
    if result["citations"]:
        print("\ncitations:")
        for citation in result["citations"]:
            print(f"  [{citation['label']}] {citation['source']} ({citation['passage_id']})")
    if trace is not None:
        print("\n" + _timing_table(stage_durations(trace), trace))
    speculation, usage = result["speculation"], result["usage"]
    print(
        f"\ntokens: {usage['prompt_tokens']} prompt ({usage['cached_prompt_tokens']} cached), "
        f"{usage['completion_tokens']} generated; speculation {'on' if speculation['ran'] else 'off'}, "
        f"{speculation['accepted_tokens']}/{speculation['drafted_tokens']} drafted tokens accepted, "
        f"{speculation['committed_per_call']:.2f} tokens per target call"
    )
    return 0


def _timing_table(stages: dict[str, float], trace: dict[str, Any]) -> str:
    total = (trace["duration_ms"] or 0.0) / 1000
    rows = [(name, seconds) for name, seconds in stages.items()]
    width = max([len(name) for name, _ in rows] + [5])
    lines = [f"{'stage':<{width}}  {'ms':>9}  {'share':>6}"]
    for name, seconds in rows:
        share = seconds / total if total else 0.0
        lines.append(f"{name:<{width}}  {seconds * 1000:>9.1f}  {share:>6.1%}")
    lines.append(f"{'total':<{width}}  {total * 1000:>9.1f}")
    return "\n".join(lines)


def _add_agent_commands(commands: Any) -> None:
    def model_options(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="pack name, HF folder or .gguf path")
        parser.add_argument("--draft", default=None, help="draft model (pack, folder, .gguf), same vocabulary")
        parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
        parser.add_argument("--index", default=None, help="index directory (default: the sample corpus, built once)")

    serve = commands.add_parser("serve", help="serve the HTTP API (OpenAI-compatible chat, agent runs, metrics)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    model_options(serve)
    serve.add_argument("--max-in-flight", type=int, default=32, help="generations waiting or running; then 503")
    serve.add_argument("--trace-log", help="also append every finished trace as a JSON line to this file")
    serve.set_defaults(handler=_serve)

    ask = commands.add_parser("ask", help="answer one question with the agent, with citations and stage timings")
    ask.add_argument("question")
    model_options(ask)
    ask.add_argument("--speculation", choices=["auto", "on", "off"], default="auto")
    ask.add_argument("--max-tokens", type=int, default=256)
    ask.add_argument("--max-steps", type=int, default=None)
    ask.add_argument("-k", type=int, default=5, help="passages shown in the prompt")
    ask.add_argument(
        "--abstain-threshold",
        type=probability,
        default=None,
        help="reply 'The documents do not say.' when the answerability probe's P(no) reaches this",
    )
    ask.add_argument(
        "--citations",
        choices=["model", "attribute"],
        default="attribute",
        help="attribute (default): each sentence cites the shown passage closest in meaning; model: the model's own",
    )
    add_grounding_arguments(ask)
    ask.add_argument("--json", action="store_true", help="print the result with its trace as JSON")
    ask.set_defaults(handler=_ask)


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
    from decoding.packs import PACKS

    parser = argparse.ArgumentParser(
        prog="specrag", description="A RAG agent runtime with an exact speculative decoder."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    pull = commands.add_parser("pull", help="fetch, verify and convert a model pack")
    pull.add_argument("pack", choices=sorted(PACKS))
    pull.add_argument("--json", action="store_true", help="print the result as JSON")
    pull.set_defaults(handler=_pull)

    bench = commands.add_parser("bench", help="benchmarks (see evals/)")
    bench.add_argument("suite", choices=["decode", "lookup", "serve"])
    bench.add_argument("options", nargs=argparse.REMAINDER, help="passed to the benchmark; try `-- --help`")
    bench.set_defaults(handler=_bench)

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
    _add_agent_commands(commands)
    _add_eval_commands(commands)
    return parser


def _add_eval_commands(commands: Any) -> None:
    from evals.run import add_arguments

    evaluate = commands.add_parser("eval", help="evaluations of the agent (see evals/)")
    suites = evaluate.add_subparsers(dest="suite", required=True)
    grounded = suites.add_parser(
        "groundedness", help="answer the groundedness set; score support, citations, correctness, speculation"
    )
    add_arguments(grounded)
    grounded.set_defaults(handler=_eval_groundedness)
    from evals.tool_eval import add_arguments as add_tool_arguments

    tools = suites.add_parser("tools", help="the tool-use eval: tool selection, arguments, answers (report)")
    add_tool_arguments(tools)
    tools.set_defaults(handler=_eval_tools)


def _eval_groundedness(args: argparse.Namespace) -> int:
    from evals.run import run

    return run(args, command=" ".join(["specrag", *sys.argv[1:]]))


def _eval_tools(args: argparse.Namespace) -> int:
    from evals.tool_eval import run

    return run(args, command=" ".join(["specrag", *sys.argv[1:]]))


def _bench(args: argparse.Namespace) -> int:
    options = [option for option in args.options if option != "--"]
    if args.suite == "decode":
        from evals.bench_decode import main as bench_main
    elif args.suite == "serve":
        from evals.bench_serve import main as bench_main
    else:
        from evals.bench_lookup import main as bench_main
    return bench_main(options)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
