"""``specrag serve`` and ``specrag ask``: the agent from the command line.

Both take the user's own tools with ``--tools module:attr`` (repeatable; ``tools/loading.py``
says what may be named), or the user's whole agent with ``--app module:factory``, a callable
returning an ``Agent`` (for ``serve``, built with ``concurrent=True``). A spec that fails to
import or names no tool stops the command before any model loads, naming the spec.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from specrag.agent.cli_options import add_grounding_arguments, grounding_options, probability
from specrag.agent.sample_index import ensure_sample_index


class StartupError(Exception):
    """The command cannot start as asked (a user module, a factory's result)."""


def engine_index_problem(args: argparse.Namespace) -> str | None:
    """Why ``args`` cannot start over a remote engine, or None: the sample index is built
    with a local pack's tokenizer, so ``--engine-url`` needs ``--index`` or ``--no-index``."""
    if getattr(args, "engine_url", None) and args.index is None and not args.no_index:
        return "--engine-url needs --index DIR or --no-index (the sample index needs a local pack)"
    return None


def build_agent(args: argparse.Namespace, concurrent: bool, progress: bool) -> Any:
    """The agent ``serve`` and ``ask`` run (and each Ray Serve replica); StartupError if it cannot start."""
    from specrag.agent.runtime import Agent
    from specrag.agent.trace import Tracer, TraceStore
    from specrag.agent.trace_otel import export_from_env
    from specrag.tools.loading import ToolLoadError, import_target, load_all

    try:
        if args.app is not None:
            if args.tools:
                raise StartupError("give --tools or --app, not both: an --app factory registers its own tools")
            return _agent_from_factory(args.app, import_target(args.app), concurrent)
        user_tools = load_all(args.tools)  # before any model loads: a bad module fails in a second
    except ToolLoadError as error:
        raise StartupError(str(error)) from error
    engine_url = getattr(args, "engine_url", None)
    problem = engine_index_problem(args)
    if problem is not None:
        raise StartupError(problem)
    index = None if args.no_index else args.index or ensure_sample_index(args.model, progress=progress)
    options: dict[str, Any] = {"max_in_flight": args.max_in_flight} if concurrent else {}
    trace_log = getattr(args, "trace_log", None) or os.environ.get("SPECRAG_TRACE_LOG")
    trace_dir = getattr(args, "trace_dir", None)
    store = TraceStore(
        jsonl_path=Path(trace_log) if trace_log else None,
        export=export_from_env(),
        shared_dir=Path(trace_dir) if trace_dir else None,
    )
    tracer = Tracer(store=store)
    if engine_url:
        from specrag.agent.remote import RemoteAgent

        key = getattr(args, "engine_api_key", None) or os.environ.get("SPECRAG_ENGINE_API_KEY") or None
        return RemoteAgent(engine_url, args.model, tools=user_tools, index=index, api_key=key, tracer=tracer)
    model = {"model": args.model, "draft": args.draft, "dtype": args.dtype}
    return Agent(tools=user_tools, index=index, concurrent=concurrent, tracer=tracer, **model, **options)


def _agent_from_factory(spec: str, factory: Any, concurrent: bool) -> Any:
    from specrag.agent.runtime import Agent

    if not callable(factory):
        raise StartupError(f"--app {spec!r}: not callable; name a function that returns an Agent")
    agent = factory()
    if not isinstance(agent, Agent):
        raise StartupError(f"--app {spec!r} returned {type(agent).__name__}, not an Agent")
    if concurrent and agent.worker is None:
        agent.close()
        raise StartupError(f"--app {spec!r}: serving needs Agent(..., concurrent=True) so requests interleave")
    return agent


def _started(args: argparse.Namespace, concurrent: bool, progress: bool) -> Any:
    """The agent, or None after saying on stderr why it cannot start."""
    try:
        return build_agent(args, concurrent=concurrent, progress=progress)
    except StartupError as error:
        print(f"specrag {args.command}: {error}", file=sys.stderr)
        return None


def _serve(args: argparse.Namespace) -> int:
    from specrag.agent.server import serve

    if _on_ray(args):
        return _serve_on_ray(args)
    agent = _started(args, concurrent=True, progress=True)
    if agent is None:
        return 2
    # Measure the speculation cost model now (seconds), not inside the first request's TTFT.
    if hasattr(agent.engine, "calibrate"):  # a remote engine measures nothing here
        agent.engine.calibrate()
    try:
        serve(agent, host=args.host, port=args.port)
    finally:
        agent.close()
    return 0


def _on_ray(args: argparse.Namespace) -> bool:
    return args.replicas is not None or args.max_replicas is not None


def _serve_on_ray(args: argparse.Namespace) -> int:
    try:
        from specrag.agent import ray_serve
    except ImportError as error:
        print(f"specrag serve: --replicas needs Ray Serve: pip install 'specrag[ray]' ({error})", file=sys.stderr)
        return 2
    if args.app is None:
        try:  # a bad --tools spec fails here, in a second, not in every replica
            from specrag.tools.loading import ToolLoadError, load_all

            load_all(args.tools)
        except ToolLoadError as error:
            print(f"specrag serve: {error}", file=sys.stderr)
            return 2
    problem = engine_index_problem(args)
    if problem is not None:
        print(f"specrag serve: {problem}", file=sys.stderr)
        return 2
    return ray_serve.run(args)


def _ask(args: argparse.Namespace) -> int:
    from specrag.agent.run_state import RunOptions
    from specrag.agent.trace import stage_durations

    agent = _started(args, concurrent=False, progress=not args.json)
    if agent is None:
        return 2
    fields: dict[str, Any] = {"speculation": args.speculation, "max_tokens": args.max_tokens, "k": args.k}
    if args.max_steps is not None:
        fields["max_steps"] = args.max_steps
    fields |= {"abstain_threshold": args.abstain_threshold, "citations": args.citations, **grounding_options(args)}
    result = agent.run(args.question, RunOptions(**fields))
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


def _model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="pack name, HF folder or .gguf path")
    parser.add_argument("--draft", default=None, help="draft model (pack, folder, .gguf), same vocabulary")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--index", default=None, help="index directory (default: the sample corpus, built once)")
    parser.add_argument("--no-index", action="store_true", help="no documents: the tools only, no search")
    parser.add_argument(
        "--tools",
        action="append",
        default=[],
        metavar="MODULE:ATTR",
        help="your tools: a @tool function, a list of them, a ToolRegistry, or a module (repeatable)",
    )
    parser.add_argument(
        "--app",
        default=None,
        metavar="MODULE:FACTORY",
        help="a function returning your Agent (the model and index options are then its own)",
    )


def _serve_options(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    _model_options(serve)
    serve.add_argument("--max-in-flight", type=int, default=32, help="generations waiting or running; then 503")
    serve.add_argument("--trace-log", help="also append every finished trace as a JSON line to this file")
    serve.add_argument(
        "--engine-url",
        default=None,
        metavar="URL",
        help="generate through this OpenAI-compatible engine (vLLM, SGLang, specrag); --model names its model",
    )
    ray = serve.add_argument_group("Ray Serve (docs/deployment.md); any of these runs the API on Ray")
    ray.add_argument("--replicas", type=int, default=None, help="replicas, each with its own engine (initial ones)")
    ray.add_argument("--min-replicas", type=int, default=None, help="autoscaling: the fewest replicas")
    ray.add_argument("--max-replicas", type=int, default=None, help="autoscaling: the most replicas")
    ray.add_argument("--target-ongoing-requests", type=float, default=4.0, help="autoscaling: requests per replica")
    ray.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves for each replica")
    ray.add_argument("--trace-dir", default=None, help="the replicas' shared traces (~/.cache/specrag/traces/ray)")


def serve_parser() -> argparse.ArgumentParser:
    """``specrag serve``'s options alone (Ray Serve's app builder parses its arguments with it)."""
    parser = argparse.ArgumentParser(prog="specrag serve")
    _serve_options(parser)
    return parser


def add_agent_commands(commands: Any) -> None:
    serve = commands.add_parser("serve", help="serve the HTTP API (OpenAI-compatible chat, agent runs, metrics)")
    _serve_options(serve)
    serve.set_defaults(handler=_serve)

    ask = commands.add_parser("ask", help="answer one question with the agent, with citations and stage timings")
    ask.add_argument("question")
    _model_options(ask)
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
