"""Post-hoc citations at several similarity thresholds, from a report's saved answers.

    python -m specrag.evals.studies.attribution_sweep docs/reports/groundedness_qwen1.5b_attributed/report.json

Every record keeps the text the model generated (``model_answer``) and the passages shown, so
the attributor (agent/attribution.py) can cite them again at any ``min_similarity`` without
running a model; the scorer then checks each citation as the eval does. Printed per threshold
and split (dev: odd ids, held_out: even ids): citation pairs and their precision, and the
threshold the rule picks: the lowest one whose dev precision reaches ``--target``. These are
offline figures: an eval run at the chosen threshold is what a report should quote.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specrag.agent.attribution import Attributor, Embedder
from specrag.agent.grounding import GroundednessScorer, citation_scores
from specrag.agent.results import ShownPassage
from specrag.evals.groundedness.abstention import split

THRESHOLDS = (0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9)


def precision_at(
    records: Sequence[Mapping[str, Any]], threshold: float, attributor: Attributor, scorer: GroundednessScorer
) -> dict[str, Any]:
    """Citation pairs and precision over ``records`` re-cited at ``threshold``."""
    pairs = supported = 0
    for record in records:
        shown = [ShownPassage(p["label"], p["id"], p.get("source", ""), p["text"]) for p in record["passages"]]
        answer, _ = attributor.attribute(record.get("model_answer", record["answer"]), shown, threshold)
        scores = citation_scores(answer, {p.label: p.text for p in shown}, scorer)
        pairs += scores["citations"]
        supported += round((scores["precision"] or 0.0) * scores["citations"])
    return {"pairs": pairs, "precision": supported / pairs if pairs else None}


def sweep(
    records: Sequence[Mapping[str, Any]],
    embedder: Embedder,
    thresholds: Sequence[float] = THRESHOLDS,
    scorer: GroundednessScorer | None = None,
) -> list[dict[str, Any]]:
    attributor, scorer = Attributor(embedder), scorer or GroundednessScorer(embedder=embedder)
    parts = {part: split(records, part) for part in ("dev", "held_out")}
    return [
        {"threshold": t} | {part: precision_at(rows, t, attributor, scorer) for part, rows in parts.items()}
        for t in thresholds
    ]


def choose(rows: Sequence[Mapping[str, Any]], target: float) -> float | None:
    """The lowest threshold whose dev precision reaches ``target`` (None when none does)."""
    for row in sorted(rows, key=lambda r: r["threshold"]):
        if row["dev"]["precision"] is not None and row["dev"]["precision"] >= target:
            return row["threshold"]
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specrag.evals.studies.attribution_sweep", description=__doc__.split("\n")[0]
    )
    parser.add_argument("report", type=Path, help="report.json of an eval run")
    parser.add_argument("--target", type=float, default=0.9, help="dev precision the chosen threshold must reach")
    args = parser.parse_args(argv)
    from specrag.retrieval import Embedder as MiniLM

    records = json.loads(args.report.read_text(encoding="utf-8"))["records"]
    rows = sweep(records, MiniLM())
    print(json.dumps({"rows": rows, "chosen": choose(rows, args.target), "target": args.target}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
