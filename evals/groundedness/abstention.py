"""The answerability gate's trade-off, from records that carry the probe's P(no).

A run with ``--measure-answerability`` records every question's ``p_unanswerable`` and the
answer the model gave anyway. Gating at a threshold t turns an answer into the abstention
exactly when p >= t, so the whole curve (unanswerable questions abstained vs answerable
ones refused) follows from one run; ``choose_threshold`` picks t on the dev half
(odd-numbered ids) and the held-out half shows what the choice is worth.

    python -m specrag.evals.groundedness.abstention docs/reports/groundedness_qwen1.5b_dev/report.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def split(items: Sequence[Mapping[str, Any]], part: str) -> list[Mapping[str, Any]]:
    """``dev``: odd-numbered ids (g001, p003, ...); ``held_out``: even; ``all``: every item."""
    if part == "all":
        return list(items)
    odd = part == "dev"
    return [item for item in items if (int(re.sub(r"^\D+", "", str(item["id"]))) % 2 == 1) == odd]


def rates(records: Sequence[Mapping[str, Any]], threshold: float) -> dict[str, Any]:
    """Abstention rates had the gate been at ``threshold``: a record abstains when the model's
    own answer did or its P(no) reaches the threshold. A record the run's gate already turned
    into an abstention has no answer of its own, so in a gated report the curve above the
    gate's threshold counts it as answered: exact curves come from --measure-answerability."""
    unanswerable = [r for r in records if not r["answerable"]]
    answerable = [r for r in records if r["answerable"]]

    def abstains(r: Mapping[str, Any]) -> bool:
        own = bool(r["abstained"]) and not r.get("gated_abstention")
        return own or (r.get("p_unanswerable") is not None and r["p_unanswerable"] >= threshold)

    return {
        "threshold": threshold,
        "unanswerable_abstained": _share([abstains(r) for r in unanswerable]),
        "answerable_abstained": _share([abstains(r) for r in answerable]),
        "unanswerable": len(unanswerable),
        "answerable": len(answerable),
    }


def _share(flags: Sequence[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def auroc(records: Sequence[Mapping[str, Any]]) -> float | None:
    """P(a random unanswerable question gets a higher P(no) than a random answerable one)."""
    positive = [r["p_unanswerable"] for r in records if not r["answerable"] and r.get("p_unanswerable") is not None]
    negative = [r["p_unanswerable"] for r in records if r["answerable"] and r.get("p_unanswerable") is not None]
    if not positive or not negative:
        return None
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in positive for n in negative)
    return wins / (len(positive) * len(negative))


def candidates(records: Sequence[Mapping[str, Any]]) -> list[float]:
    """Every threshold that changes a decision: the distinct P(no) values, highest first."""
    return sorted({r["p_unanswerable"] for r in records if r.get("p_unanswerable") is not None}, reverse=True)


def choose_threshold(records: Sequence[Mapping[str, Any]]) -> float | None:
    """The threshold with the best Youden J (abstained unanswerable minus refused answerable);
    on a tie the highest, which refuses least. None when no threshold beats not gating (J = 0)."""
    best_j, best = 0.0, None
    for threshold in candidates(records):
        r = rates(records, threshold)
        if r["unanswerable_abstained"] is None or r["answerable_abstained"] is None:
            return None
        j = r["unanswerable_abstained"] - r["answerable_abstained"]
        if j > best_j:
            best_j, best = j, threshold
    return best


def sweep_report(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """AUROC per split, the dev-chosen threshold, and its rates on every split."""
    parts = {part: split(records, part) for part in ("dev", "held_out", "all")}
    chosen = choose_threshold(parts["dev"])
    return {
        "auroc": {part: auroc(rs) for part, rs in parts.items()},
        "chosen_on_dev": chosen,
        "at_chosen": {part: rates(rs, chosen) for part, rs in parts.items()} if chosen is not None else None,
        "curve_all": [rates(parts["all"], t) for t in candidates(parts["all"])],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specrag.evals.groundedness.abstention", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("report", type=Path, help="report.json of a run with --measure-answerability")
    args = parser.parse_args(argv)
    records = json.loads(args.report.read_text(encoding="utf-8"))["records"]
    if not any(r.get("p_unanswerable") is not None for r in records):
        print(f"{args.report}: no record has p_unanswerable (run with --measure-answerability)", file=sys.stderr)
        return 2
    if any(r.get("gated_abstention") for r in records):
        print(f"{args.report}: a gated run; above its threshold the curve is approximate", file=sys.stderr)
    print(json.dumps(sweep_report(records), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
