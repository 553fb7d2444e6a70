"""`specrag eval groundedness`: run the agent over the groundedness set and score every answer.

    python -m specrag.evals.groundedness.run --out docs/reports/groundedness_0.5b --compare-off
    specrag eval groundedness --model qwen2.5-coder-1.5b --out DIR --min-groundedness 0.85

Writes report.json (config, summary, every record), report.md and four PNG plots into --out.
With --compare-off each question is also answered with speculation off, right after the
speculative run of the same question (so the machine's load hits both alike): greedy answers
must be identical, and the report says whether they were and what speculation bought. Both
passes start from an empty prefix cache, so the comparison is of speculation alone; with
--shared-prefix-cache the off pass reuses the on pass's cached prompt instead (before prompt
rows were attended in aligned blocks, a prefill cut there rounded differently in bfloat16:
29 of 71 smollm2 answers differed that way; now none).
Exit status 1 when --min-groundedness is given and missed (a CI gate); 2 for bad options.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specrag.agent.cli_options import add_grounding_arguments, grounding_options, probability
from specrag.agent.grounding import GroundednessScorer
from specrag.agent.run_state import RunOptions
from specrag.evals.groundedness.abstention import split
from specrag.evals.groundedness.metrics import answer_scores, compare_passes, record, summarize
from specrag.evals.groundedness.nli import NliJudge, NliUnavailable
from specrag.evals.groundedness.report import render_markdown, write_plots

DEFAULT_DATASET = Path(__file__).parent.parent / "datasets" / "groundedness.jsonl"
KINDS = ("single", "two_passage", "exact", "unanswerable", "bait")
REQUIRED_FIELDS = ("id", "kind", "question", "reference", "answerable", "supporting")


class DatasetError(ValueError):
    """A dataset line that is not a valid groundedness item (names the line and field)."""


def load_dataset(path: Path) -> list[dict[str, Any]]:
    items = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise DatasetError(f"{path}:{number}: not JSON ({error.msg})") from None
        missing = [name for name in REQUIRED_FIELDS if name not in item]
        if missing:
            raise DatasetError(f"{path}:{number}: missing field {missing[0]!r}")
        items.append(item)
    return items


def quick_subset(items: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One question of each kind, the first in file order: five questions for a smoke run."""
    first: dict[str, dict[str, Any]] = {}
    for item in items:
        first.setdefault(item["kind"], item)
    return [first[kind] for kind in KINDS if kind in first]


def per_kind(items: Sequence[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """The first ``count`` questions of each kind, in file order."""
    taken: dict[str, int] = {}
    out = []
    for item in items:
        if taken.get(item["kind"], 0) < count:
            taken[item["kind"]] = taken.get(item["kind"], 0) + 1
            out.append(item)
    return out


def build_parser(prog: str = "python -m specrag.evals.groundedness.run") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Groundedness eval of the agent over a question set.")
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="report folder (report.json, report.md, *.png)")
    parser.add_argument("--dataset", type=Path, default=DEFAULT_DATASET, help="groundedness JSONL")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="pack name, HF folder or .gguf path")
    parser.add_argument("--draft", default=None, help="draft model (pack, folder, .gguf), same vocabulary")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--index", default=None, help="index directory (default: the sample corpus, built once)")
    parser.add_argument(
        "--system",
        choices=["default", "citing"],
        default="default",
        help="system prompt (specrag.agent.prompt.SYSTEM_PROMPTS)",
    )
    parser.add_argument("--speculation", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("-k", type=int, default=5, help="passages shown in the prompt")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--tools", nargs="*", default=None, help="tools offered (default: the agent's default)")
    parser.add_argument("--compare-off", action="store_true", help="also answer with speculation off; compare")
    parser.add_argument(
        "--shared-prefix-cache",
        action="store_true",
        help="with --compare-off: keep the prefix caches between the passes (the off pass reuses the on pass's prompt)",
    )
    parser.add_argument("--min-groundedness", type=float, default=None, help="exit 1 when groundedness is below")
    parser.add_argument("--quick", action="store_true", help="one question per kind (5)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N questions")
    parser.add_argument("--per-kind", type=int, default=None, help="only the first N questions of each kind")
    parser.add_argument(
        "--split", choices=["all", "dev", "held_out"], default="all", help="dev: odd ids, held_out: even ids"
    )
    parser.add_argument(
        "--abstain-threshold",
        type=probability,
        default=None,
        help="abstain when the answerability probe's P(no) reaches this (agent/answerability.py)",
    )
    parser.add_argument(
        "--measure-answerability", action="store_true", help="record the probe's P(no) without gating on it"
    )
    parser.add_argument(
        "--citations",
        choices=["model", "attribute"],
        default="attribute",
        help="attribute (the agent's default): re-cite each answer sentence post hoc (agent/attribution.py)",
    )
    add_grounding_arguments(parser)
    parser.add_argument(
        "--citation-min-similarity",
        type=probability,
        default=None,
        help="cosine a sentence needs to cite a passage under --citations attribute (default: the agent's)",
    )
    parser.add_argument(
        "--nli",
        type=Path,
        default=None,
        help="local NLI cross-encoder folder: it judges the scorer's uncertain sentences (evals/groundedness/nli.py)",
    )
    parser.add_argument(
        "--judge",
        default=None,
        help="a model pack asked yes/no about each sentence the rules let through (agent/grounding/support_judge.py)",
    )
    parser.add_argument(
        "--engine-url",
        default=None,
        metavar="URL",
        help="answer through this OpenAI-compatible engine (--model names its model; --index required)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the summary (and on/off comparison) as JSON")
    parser.add_argument(
        "--rescore", type=Path, default=None, help="score the answers of this report.json again (no model run)"
    )


def main(argv: Sequence[str] | None = None, prog: str = "python -m specrag.evals.groundedness.run") -> int:
    args = build_parser(prog).parse_args(argv)
    return run(args, command=" ".join([prog, *(argv if argv is not None else sys.argv[1:])]))


def _judge(model: str | None) -> Any:
    if model is None:
        return None
    from specrag.agent.grounding.support_judge import SupportJudge

    return SupportJudge.for_model(model)


def run(args: argparse.Namespace, command: str) -> int:
    try:
        scorer = GroundednessScorer(nli=NliJudge(args.nli) if args.nli else None, judge=_judge(args.judge))
    except NliUnavailable as error:
        print(f"eval groundedness: {error}", file=sys.stderr)
        return 2
    if args.rescore is not None:
        return _rescore(args, command, scorer)
    try:
        items = load_dataset(args.dataset)
    except (OSError, DatasetError) as error:
        print(f"eval groundedness: {error}", file=sys.stderr)
        return 2
    items = split(items, args.split)
    items = quick_subset(items) if args.quick else items
    items = per_kind(items, args.per_kind) if args.per_kind else items
    items = items[: args.limit] if args.limit else items
    if args.engine_url and (args.index is None or args.compare_off):
        print("eval groundedness: --engine-url needs --index, and cannot --compare-off", file=sys.stderr)
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    agent = _agent(args)
    try:
        started = time.perf_counter()
        on, off = _run_all(agent, scorer, items, args)
        elapsed = time.perf_counter() - started
    finally:
        agent.close()
    report = _report(args, command, on, off, elapsed)
    return _finish(report, args)


def _finish(report: dict[str, Any], args: argparse.Namespace) -> int:
    out = Path(args.out)
    write_report(report, out)
    if args.json:
        print(json.dumps({"summary": report["summary"], "compare_off": report.get("compare_off")}, indent=2))
    else:
        print(_headline(report["summary"], report.get("compare_off"), out))
    return gate(report["summary"], args.min_groundedness)


def gate(summary: Mapping[str, Any], threshold: float | None) -> int:
    """Exit status for CI: 1 when a threshold is given and groundedness is below it (or unknown)."""
    value = summary["groundedness"]
    if threshold is not None and (value is None or value < threshold):
        print(f"eval groundedness: {value} is below --min-groundedness {threshold}", file=sys.stderr)
        return 1
    return 0


def _rescore(args: argparse.Namespace, command: str, scorer: GroundednessScorer) -> int:
    """Score a saved report's answers with the current scorer; the runs themselves are kept."""
    report = json.loads(args.rescore.read_text(encoding="utf-8"))
    for key in ("records", "records_off"):
        report[key] = [{**r, **answer_scores(r, scorer)} for r in report.get(key, [])]
    report["summary"] = summarize(report["records"])
    if report["records_off"]:
        report["compare_off"] = compare_passes(report["records"], report["records_off"])
    else:
        report.pop("records_off")
    report["rescored_by"] = command
    report["config"]["nli"] = scorer.nli.folder if scorer.nli else None
    report["config"]["judge"] = getattr(scorer.support_judge, "name", None)
    return _finish(report, args)


def _agent(args: argparse.Namespace) -> Any:
    from specrag.agent.prompt import SYSTEM_PROMPTS
    from specrag.agent.runtime import Agent
    from specrag.agent.sample_index import ensure_sample_index

    system = SYSTEM_PROMPTS[args.system]
    if args.engine_url:  # generation there, the agent and the scoring here (agent/remote.py)
        from specrag.agent.remote import RemoteAgent

        return RemoteAgent(args.engine_url, args.model, index=args.index, system=system)
    index = args.index or ensure_sample_index(args.model, progress=not args.no_progress)
    return Agent(index=index, model=args.model, draft=args.draft, dtype=args.dtype, system=system)


def _run_all(
    agent: Any, scorer: GroundednessScorer, items: Sequence[dict[str, Any]], args: argparse.Namespace
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from tqdm import tqdm

    fields: dict[str, Any] = {
        "k": args.k,
        "max_steps": args.max_steps,
        "max_tokens": args.max_tokens,
        "tools": args.tools,
        "abstain_threshold": args.abstain_threshold,
        "measure_answerability": args.measure_answerability,
        "citations": args.citations,
        **grounding_options(args),
    }
    if args.citation_min_similarity is not None:
        fields["citation_min_similarity"] = args.citation_min_similarity
    options = RunOptions(**fields)
    on: list[dict[str, Any]] = []
    off: list[dict[str, Any]] = []
    bar = tqdm(items, desc="eval groundedness", unit="q", disable=args.no_progress, file=sys.stderr)
    for item in bar:
        if args.compare_off and not args.shared_prefix_cache:
            _clear_prefix_caches(agent)
        on.append(_answer(agent, scorer, item, dataclasses.replace(options, speculation=args.speculation)))
        if args.compare_off:
            if not args.shared_prefix_cache:
                _clear_prefix_caches(agent)
            off.append(_answer(agent, scorer, item, dataclasses.replace(options, speculation="off")))
        scores = [r["groundedness"] for r in on if r["groundedness"] is not None]
        bar.set_postfix(groundedness=f"{sum(scores) / len(scores):.2f}" if scores else "n/a")
    return on, off


def _clear_prefix_caches(agent: Any) -> None:
    for cache in (agent.engine.prefix_cache, agent.engine.draft_prefix_cache):
        if cache is not None:
            cache.clear()


def _answer(agent: Any, scorer: GroundednessScorer, item: Mapping[str, Any], options: RunOptions) -> dict[str, Any]:
    result = agent.run(item["question"], options)
    return record(item, result, agent.trace(result["trace_id"]), scorer)


def _effective_min_similarity(args: argparse.Namespace) -> float | None:
    """The threshold the run used, so a report stays readable after the default moves."""
    if args.citations != "attribute":
        return args.citation_min_similarity
    if args.citation_min_similarity is not None:
        return args.citation_min_similarity
    from specrag.agent.attribution import DEFAULT_MIN_SIMILARITY

    return DEFAULT_MIN_SIMILARITY


def _report(
    args: argparse.Namespace, command: str, on: list[dict[str, Any]], off: list[dict[str, Any]], elapsed: float
) -> dict[str, Any]:
    import torch

    config = {
        "model": args.model,
        "engine_url": args.engine_url,
        "draft": args.draft,
        "dtype": args.dtype,
        "system": args.system,
        "speculation": args.speculation,
        "k": args.k,
        "max_steps": args.max_steps,
        "max_tokens": args.max_tokens,
        "tools": args.tools,
        "dataset": _shown_path(args.dataset),
        "quick": args.quick,
        "split": args.split,
        "abstain_threshold": args.abstain_threshold,
        "measure_answerability": args.measure_answerability,
        "citations": args.citations,
        **grounding_options(args),
        "index": args.index or "the sample corpus",
        "shared_prefix_cache": args.shared_prefix_cache,
        "citation_min_similarity": _effective_min_similarity(args),
        "nli": str(args.nli) if args.nli else None,
        "judge": args.judge,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip()
        + f", {torch.get_num_threads()} torch threads, cuda {torch.cuda.is_available()}",
        "elapsed_s": round(elapsed, 1),
    }
    report: dict[str, Any] = {"command": command, "config": config, "summary": summarize(on), "records": on}
    if off:
        report["compare_off"] = compare_passes(on, off)
        report["records_off"] = off
    return report


def _shown_path(path: Path) -> str:
    """The dataset path relative to the working directory when it lies inside it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def write_report(report: Mapping[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    (out / "report.md").write_text(render_markdown(report), encoding="utf-8")
    write_plots(report, out)


def _headline(summary: Mapping[str, Any], compare: Mapping[str, Any] | None, out: Path) -> str:
    def fmt(value: Any) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    line = (
        f"groundedness {fmt(summary['groundedness'])}, citation precision {fmt(summary['citation_precision'])}, "
        f"recall {fmt(summary['citation_recall'])}, token F1 {fmt(summary['token_f1'])}, "
        f"unanswerable abstained {fmt(summary['unanswerable_abstained'])}, "
        f"retrieval recall {fmt(summary['retrieval_recall'])} over {summary['questions']} questions"
    )
    if compare:
        line += (
            f"\nspeculation on vs off: {compare['identical_answers']}/{compare['questions']} answers identical, "
            f"decode speed-up {fmt(compare['decode_speedup'])}x"
        )
    return line + f"\nreport: {out / 'report.md'}"


if __name__ == "__main__":
    sys.exit(main())
