"""The grounding check's trade-off, from a report's saved answers.

    python -m specrag.evals.studies.grounding_gate docs/reports/groundedness_prometheus_qwen0.5b/report.json

The run's check (``agent/grounding/check.py``) is a function of the answer, the question and
the passages shown, all of which a report keeps, so ``grounding="abstain"`` at every
``min_supported`` follows from one run in the default ``"mark"`` mode: a question is abstained
on when the model said the documents do not say, or when the share of its answer's claims the
scorer finds supported is below ``min_supported``. Printed per report: unanswerable questions
abstained and answerable ones refused at each share. Runs that called tools are not replayed
exactly (their tool results are not in the report), so records with tool calls are counted
apart.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specrag.agent.grounding import GroundednessResult, GroundednessScorer
from specrag.agent.grounding import text_match as tm
from specrag.agent.grounding.check import DEFAULT_MIN_SUPPORTED, is_grounded

SHARES = (0.2, 0.34, 0.5, 0.67, 0.75, 1.0)


def drafted_answer(record: Mapping[str, Any]) -> str:
    """The answer as the check saw it: before an abstention replaced it, when one did."""
    return (record.get("grounding") or {}).get("withheld_answer") or record["answer"]


def grounding_results(records: Sequence[Mapping[str, Any]], scorer: GroundednessScorer) -> list[GroundednessResult]:
    """Each drafted answer scored as the run's check scores it."""
    return [scorer.score(drafted_answer(r), [p["text"] for p in r["passages"]], r["question"]) for r in records]


def rates(records: Sequence[Mapping[str, Any]], results: Sequence[GroundednessResult], share: float) -> dict[str, Any]:
    """Abstention rates had the check run with ``grounding="abstain", min_supported=share``."""

    def abstains(record: Mapping[str, Any], result: GroundednessResult) -> bool:
        return tm.is_abstention(drafted_answer(record)) or not is_grounded(result, share)

    flags = [(r["answerable"], abstains(r, s)) for r, s in zip(records, results, strict=True)]
    unanswerable = [flag for answerable, flag in flags if not answerable]
    answerable = [flag for answerable, flag in flags if answerable]
    return {
        "min_supported": share,
        "unanswerable_abstained": sum(unanswerable) / len(unanswerable) if unanswerable else None,
        "answerable_refused": sum(answerable) / len(answerable) if answerable else None,
        "unanswerable": len(unanswerable),
        "answerable": len(answerable),
    }


def gate_report(report: Mapping[str, Any], scorer: GroundednessScorer) -> dict[str, Any]:
    records = report["records"]
    results = grounding_results(records, scorer)
    config = report.get("config", {})
    return {
        "model": config.get("model"),
        "dataset": config.get("dataset"),
        "citations": config.get("citations"),
        "records_with_tool_calls": sum(1 for r in records if r.get("tool_calls")),
        "rows": [rates(records, results, share) for share in SHARES],
    }


def render(path: str, result: Mapping[str, Any]) -> str:
    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.0%}"

    header = "min_supported  unanswerable abstained  answerable refused"
    lines = [f"{path} ({result['model']}, {result['dataset']})", header]
    for row in result["rows"]:
        abstained, refused = pct(row["unanswerable_abstained"]), pct(row["answerable_refused"])
        lines.append(f"{row['min_supported']:>13}  {abstained:>22}  {refused:>18}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specrag.evals.studies.grounding_gate", description=__doc__.split("\n")[0]
    )
    parser.add_argument("reports", type=Path, nargs="+", help="report.json files of eval runs")
    parser.add_argument("--judge", default=None, help="a model pack that also judges claims (as --grounding-judge)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    judge = None
    if args.judge:
        from specrag.agent.grounding.support_judge import SupportJudge

        judge = SupportJudge.for_model(args.judge)
    scorer = GroundednessScorer(judge=judge)
    results = {}
    for path in args.reports:
        results[str(path)] = gate_report(json.loads(path.read_text(encoding="utf-8")), scorer)
        print(render(str(path), results[str(path)]) + "\n")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"default_min_supported": DEFAULT_MIN_SUPPORTED, "judge": args.judge, "reports": results}
        args.json.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
