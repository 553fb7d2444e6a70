"""The ``specrag`` command line.

    specrag pull PACK            fetch, check and convert a model pack (like ``ollama pull``)
    specrag bench decode         plain vs ours vs transformers, side by side
    specrag bench lookup         prompt-lookup cost per step at 2k and 32k tokens of sources
    specrag demo                 stream a speculative RAG answer over the sample corpus

``serve``, ``index``, ``ask`` and ``eval`` arrive with the agent, retrieval and eval issues.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")


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
    bench.add_argument("suite", choices=["decode", "lookup"])
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
    return parser


def _bench(args: argparse.Namespace) -> int:
    options = [option for option in args.options if option != "--"]
    if args.suite == "decode":
        from evals.bench_decode import main as bench_main
    else:
        from evals.bench_lookup import main as bench_main
    return bench_main(options)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
