"""``specrag eval`` and ``specrag bench``: the eval harness's commands, plugged into the
``specrag`` CLI through the ``specrag.commands`` entry point group (pyproject.toml)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_bench_command(commands: Any) -> None:
    bench = commands.add_parser("bench", help="benchmarks (see evals/bench/)")
    bench.add_argument("suite", choices=["decode", "lookup", "serve"])
    bench.add_argument("options", nargs=argparse.REMAINDER, help="passed to the benchmark; try `-- --help`")
    bench.set_defaults(handler=_bench)


def add_eval_commands(commands: Any) -> None:
    from specrag.evals.groundedness.run import add_arguments

    evaluate = commands.add_parser("eval", help="evaluations of the agent (see evals/)")
    suites = evaluate.add_subparsers(dest="suite", required=True)
    grounded = suites.add_parser(
        "groundedness", help="answer the groundedness set; score support, citations, correctness, speculation"
    )
    add_arguments(grounded)
    grounded.set_defaults(handler=_eval_groundedness)
    from specrag.evals.tool_use.run import add_arguments as add_tool_arguments

    tools = suites.add_parser("tools", help="the tool-use eval: tool selection, arguments, answers (report)")
    add_tool_arguments(tools)
    tools.set_defaults(handler=_eval_tools)


def _eval_groundedness(args: argparse.Namespace) -> int:
    from specrag.evals.groundedness.run import run

    return run(args, command=" ".join(["specrag", *sys.argv[1:]]))


def _eval_tools(args: argparse.Namespace) -> int:
    from specrag.evals.tool_use.run import run

    return run(args, command=" ".join(["specrag", *sys.argv[1:]]))


def _bench(args: argparse.Namespace) -> int:
    options = [option for option in args.options if option != "--"]
    if args.suite == "decode":
        from specrag.evals.bench.decode import main as bench_main
    elif args.suite == "serve":
        from specrag.evals.bench.serve import main as bench_main
    else:
        from specrag.evals.bench.lookup import main as bench_main
    return bench_main(options)
