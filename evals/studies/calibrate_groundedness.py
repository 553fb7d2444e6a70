"""How well the groundedness scorer detects planted unsupported answers.

    python -m specrag.evals.studies.calibrate_groundedness [--json docs/reports/groundedness_calibration.json]

Each item of ``evals/datasets/groundedness_calibration.jsonl`` is an answer, the passages it
is checked against, a label (supported / unsupported) and a kind (verbatim, paraphrase, or
the planted error: number, entity, invented, negation, wrong_passage). An answer is flagged
unsupported when any of its scorable sentences is. Reported: precision, recall and F1 of
"unsupported" detection; per plant kind its recall and an F1 against an equal number of
supported answers (false positives = the supported answers' false-positive rate times the
kind's count, so kinds of different sizes compare); per supported kind its false-positive rate.

The scorer's thresholds were tuned looking at the odd-numbered items only (the dev half);
the report gives dev, held-out (even) and all figures, so the tuning's optimism is visible.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specrag.agent.grounding import GroundednessScorer, ScorerSettings
from specrag.evals.groundedness.abstention import split
from specrag.evals.groundedness.nli import NliJudge, NliUnavailable

DEFAULT_SET = Path(__file__).parent.parent / "datasets" / "groundedness_calibration.jsonl"
PLANTS = ("number", "entity", "invented", "negation", "wrong_passage")
SUPPORTED_KINDS = ("verbatim", "paraphrase")


def load(path: Path = DEFAULT_SET) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def flagged(item: Mapping[str, Any], scorer: GroundednessScorer) -> tuple[bool, str]:
    """(scorer says unsupported, the first reason)."""
    result = scorer.score(item["answer"], item["passages"])
    for sentence in result.sentences:
        if sentence.supported is False:
            return True, sentence.reason
    return False, ""


def _f1(precision: float | None, recall: float | None) -> float | None:
    if not precision or not recall:
        return 0.0 if precision == 0 or recall == 0 else None
    return 2 * precision * recall / (precision + recall)


def evaluate(items: Sequence[Mapping[str, Any]], scorer: GroundednessScorer) -> dict[str, Any]:
    outcomes = [(item, *flagged(item, scorer)) for item in items]
    positives = [o for o in outcomes if o[0]["label"] == "unsupported"]
    negatives = [o for o in outcomes if o[0]["label"] == "supported"]
    true_pos = sum(1 for _, hit, _ in positives if hit)
    false_pos = sum(1 for _, hit, _ in negatives if hit)
    precision = true_pos / (true_pos + false_pos) if true_pos + false_pos else None
    recall = true_pos / len(positives) if positives else None
    false_pos_rate = false_pos / len(negatives) if negatives else 0.0
    by_kind: dict[str, dict[str, Any]] = {}
    for kind in PLANTS:
        rows = [o for o in positives if o[0]["kind"] == kind]
        if not rows:
            continue
        hits = sum(1 for _, hit, _ in rows if hit)
        kind_recall = hits / len(rows)
        expected_fp = false_pos_rate * len(rows)
        kind_precision = hits / (hits + expected_fp) if hits + expected_fp else None
        by_kind[kind] = {
            "items": len(rows),
            "detected": hits,
            "missed": len(rows) - hits,
            "recall": kind_recall,
            "f1": _f1(kind_precision, kind_recall),
        }
    for kind in SUPPORTED_KINDS:
        rows = [o for o in negatives if o[0]["kind"] == kind]
        if rows:
            wrong = sum(1 for _, hit, _ in rows if hit)
            by_kind[kind] = {"items": len(rows), "flagged": wrong, "false_positive_rate": wrong / len(rows)}
    return {
        "items": len(items),
        "precision": precision,
        "recall": recall,
        "f1": _f1(precision, recall),
        "false_positive_rate": false_pos_rate,
        "confusion": {
            "tp": true_pos,
            "fn": len(positives) - true_pos,
            "fp": false_pos,
            "tn": len(negatives) - false_pos,
        },
        "by_kind": by_kind,
        "errors": [
            {"id": item["id"], "label": item["label"], "kind": item["kind"], "reason": reason, "answer": item["answer"]}
            for item, hit, reason in outcomes
            if hit != (item["label"] == "unsupported")
        ],
    }


def report(items: Sequence[Mapping[str, Any]], scorer: GroundednessScorer | None = None) -> dict[str, Any]:
    scorer = scorer or GroundednessScorer()
    return {
        "settings": asdict(scorer.settings),
        "dev": evaluate(split(items, "dev"), scorer),
        "held_out": evaluate(split(items, "held_out"), scorer),
        "all": evaluate(items, scorer),
    }


def render(result: Mapping[str, Any]) -> str:
    def fmt(value: Any) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    lines = ["split     items  precision  recall  F1     FPR"]
    for part in ("dev", "held_out", "all"):
        row = result[part]
        lines.append(
            f"{part:<9} {row['items']:>5}  {fmt(row['precision']):>9}  {fmt(row['recall']):>6}  "
            f"{fmt(row['f1']):>5}  {fmt(row['false_positive_rate'])}"
        )
    lines.append("\nby kind (all items): detected/items, recall, F1 | supported kinds: flagged/items")
    for kind, row in result["all"]["by_kind"].items():
        if "recall" in row:
            counts = f"{row['detected']}/{row['items']}"
            lines.append(f"  {kind:<14} {counts}  recall {fmt(row['recall'])}  F1 {fmt(row['f1'])}")
        else:
            lines.append(f"  {kind:<14} {row['flagged']}/{row['items']} wrongly flagged")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", type=Path, default=DEFAULT_SET)
    parser.add_argument("--json", type=Path, help="write the full report (with every error) here")
    parser.add_argument("--errors", action="store_true", help="print every misjudged item")
    parser.add_argument("--lexical", action="store_true", help="without the embedding model")
    parser.add_argument(
        "--nli", type=Path, default=None, help="local NLI cross-encoder folder (evals/groundedness/nli.py)"
    )
    args = parser.parse_args(argv)
    try:
        nli = NliJudge(args.nli) if args.nli else None
    except NliUnavailable as error:
        print(f"calibrate_groundedness: {error}", file=sys.stderr)
        return 2
    result = report(load(args.dataset), GroundednessScorer(ScorerSettings(semantic=not args.lexical), nli=nli))
    print(render(result))
    if args.errors:
        for error in result["all"]["errors"]:
            reason = error["reason"] or "(not flagged)"
            print(f"{error['id']} {error['label']}/{error['kind']}: {reason}\n   {error['answer']}")
    if args.json:
        write_json(args.json, result)
    return 0


def write_json(path: Path, result: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
