"""Agreement of the groundedness scorer with labelled claims, per corpus and split.

    python -m specrag.evals.studies.calibrate_claims [--judge qwen2.5-coder-1.5b] [--split held_out] [--json PATH]

Two corpora:

- ``python``: ``evals/datasets/groundedness_calibration.jsonl`` (answers over the Python
  reference topics; the scorer's thresholds were first tuned on its odd ids, the ``dev``
  split; even ids are ``held_out``).
- ``prometheus_docs``: ``evals/datasets/groundedness_claims_prometheus_{dev,held_out}.jsonl``
  (one sentence, or a short answer, per item, with the question it answers, over pages of
  the Prometheus documentation; the held-out file uses other pages than the dev file and
  was written, blind to the scorer, before the scorer was changed for this corpus).

An item counts as flagged when any scorable sentence of its answer is judged unsupported.
Reported per corpus and split: agreement (accuracy against the labels), unsupported caught
(recall of "unsupported") and supported kept (the share of supported items not flagged),
and per kind its share judged right. Only ``held_out`` figures are ever asserted or quoted
as the scorer's quality: the ``dev`` splits are what it was tuned on.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specrag.agent.grounding import GroundednessScorer
from specrag.evals.groundedness.abstention import split as odd_even_split
from specrag.evals.studies.calibrate_groundedness import write_json

DATASETS = Path(__file__).parent.parent / "datasets"
PYTHON_SET = DATASETS / "groundedness_calibration.jsonl"
PROMETHEUS_SETS = {part: DATASETS / f"groundedness_claims_prometheus_{part}.jsonl" for part in ("dev", "held_out")}
SPLITS = ("dev", "held_out")


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def load_claims(corpus: str, part: str) -> list[dict[str, Any]]:
    """Items of one corpus and split, each with ``passages`` as plain texts and a ``question`` (or None)."""
    if corpus == "python":
        items = [dict(item, question=None) for item in odd_even_split(_read(PYTHON_SET), part)]
    elif corpus == "prometheus_docs":
        items = [
            dict(item, passages=[passage["text"] for passage in item["passages"]])
            for item in _read(PROMETHEUS_SETS[part])
        ]
    else:
        raise ValueError(f"unknown corpus {corpus!r}: python or prometheus_docs")
    return items


def verdict(item: Mapping[str, Any], scorer: GroundednessScorer) -> tuple[bool, str]:
    """(flagged unsupported, the first unsupported sentence's reason)."""
    result = scorer.score(item["answer"], item["passages"], question=item.get("question"))
    for sentence in result.sentences:
        if sentence.supported is False:
            return True, sentence.reason
    return False, ""


def agreement(items: Sequence[Mapping[str, Any]], scorer: GroundednessScorer) -> dict[str, Any]:
    outcomes = [(item, *verdict(item, scorer)) for item in items]
    unsupported = [hit for item, hit, _ in outcomes if item["label"] == "unsupported"]
    supported = [not hit for item, hit, _ in outcomes if item["label"] == "supported"]
    right = [hit == (item["label"] == "unsupported") for item, hit, _ in outcomes]
    by_kind: dict[str, list[int]] = {}
    for item, hit, _ in outcomes:
        counts = by_kind.setdefault(f"{item['label']}/{item['kind']}", [0, 0])
        counts[0] += hit == (item["label"] == "unsupported")
        counts[1] += 1
    return {
        "items": len(items),
        "agreement": _share(right),
        "unsupported_caught": _share(unsupported),
        "supported_kept": _share(supported),
        "by_kind": {kind: {"right": r, "items": n} for kind, (r, n) in sorted(by_kind.items())},
        "errors": [
            {"id": item["id"], "label": item["label"], "kind": item["kind"], "reason": reason, "answer": item["answer"]}
            for item, hit, reason in outcomes
            if hit != (item["label"] == "unsupported")
        ],
    }


def _share(flags: Sequence[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def report(scorer: GroundednessScorer, corpora: Sequence[str], parts: Sequence[str]) -> dict[str, Any]:
    return {
        "settings": asdict(scorer.settings),
        "judge": getattr(scorer.support_judge, "name", None),
        "results": {
            corpus: {part: agreement(load_claims(corpus, part), scorer) for part in parts} for corpus in corpora
        },
    }


def render(result: Mapping[str, Any]) -> str:
    def fmt(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    lines = [f"judge: {result['judge'] or 'none'}", "corpus           split     items  agreement  caught  kept"]
    for corpus, parts in result["results"].items():
        for part, row in parts.items():
            lines.append(
                f"{corpus:<16} {part:<9} {row['items']:>5}  {fmt(row['agreement']):>9}  "
                f"{fmt(row['unsupported_caught']):>6}  {fmt(row['supported_kept'])}"
            )
    for corpus, parts in result["results"].items():
        for part, row in parts.items():
            kinds = ", ".join(f"{kind} {v['right']}/{v['items']}" for kind, v in row["by_kind"].items())
            lines.append(f"\n{corpus} {part} by kind (right/items): {kinds}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", action="append", choices=["python", "prometheus_docs"])
    parser.add_argument("--split", action="append", choices=SPLITS)
    parser.add_argument("--judge", default=None, help="a model pack to ask yes/no (agent/grounding/support_judge.py)")
    parser.add_argument("--errors", action="store_true", help="print every misjudged item")
    parser.add_argument("--json", type=Path, help="write the full report here")
    args = parser.parse_args(argv)
    judge = None
    if args.judge:
        from specrag.agent.grounding.support_judge import SupportJudge

        judge = SupportJudge.for_model(args.judge)
    scorer = GroundednessScorer(judge=judge)
    result = report(scorer, args.corpus or ["python", "prometheus_docs"], args.split or list(SPLITS))
    print(render(result))
    if args.errors:
        for corpus, parts in result["results"].items():
            for part, row in parts.items():
                for error in row["errors"]:
                    print(f"{corpus}/{part} {error['id']} {error['label']}/{error['kind']}: {error['reason']}")
                    print(f"   {error['answer']}")
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
