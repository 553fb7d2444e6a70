"""Which probe wording separates unanswerable questions best: P(no) for each, no answers.

    python -m specrag.evals.studies.answerability --model qwen2.5-coder-1.5b --split dev --system citing \\
        --out docs/reports/answerability_study_qwen1.5b.json

Every question's prompt is prefilled once; each wording then costs a forward over its own
few tokens (the prefix cache holds the rest), and one answer token. The report gives each
wording's AUROC (unanswerable vs answerable) and the threshold ``specrag.evals.groundedness.abstention`` would
choose on these questions. The wording and threshold the agent uses were chosen this way on
the dev half (odd ids) only; the held-out half of ``specrag eval groundedness`` tests them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specrag.agent import answerability
from specrag.evals.groundedness.abstention import auroc, choose_threshold, rates, split
from specrag.evals.groundedness.run import DEFAULT_DATASET, load_dataset

WORDINGS = {
    "contain": "Do the passages above contain the answer to this question? Reply with yes or no only.",
    "stated": "Is the answer to this question stated in the passages above? Answer yes or no.",
    "only_passages": (
        "Can this question be answered using only the passages above, without outside knowledge? Answer yes or no."
    ),
    "says": "Does one of the passages above say what the question asks? Answer yes or no.",
}


def measure(agent: Any, items: Sequence[Mapping[str, Any]], wordings: Mapping[str, str]) -> list[dict[str, Any]]:
    """P(no) per question and wording."""
    rows = []
    original = answerability.PROBE
    try:
        for item in items:
            row = {"id": item["id"], "kind": item["kind"], "answerable": bool(item["answerable"])}
            for name, wording in wordings.items():
                answerability.PROBE = wording  # read by probe_messages at call time
                result = agent.run(item["question"], max_tokens=1, measure_answerability=True)
                row[name] = result["answerability"]["p_unanswerable"]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        answerability.PROBE = original
    return rows


def summarize(rows: Sequence[Mapping[str, Any]], wordings: Sequence[str]) -> dict[str, Any]:
    out = {}
    for name in wordings:
        records = [{**row, "p_unanswerable": row[name], "abstained": False} for row in rows]
        chosen = choose_threshold(records)
        out[name] = {
            "auroc": auroc(records),
            "chosen_threshold": chosen,
            "at_chosen": rates(records, chosen) if chosen is not None else None,
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specrag.evals.studies.answerability", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dataset", type=Path, default=DEFAULT_DATASET)
    parser.add_argument("--split", choices=["all", "dev", "held_out"], default="dev")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--system", choices=["default", "citing"], default="default", help="system prompt")
    parser.add_argument("--out", type=Path, required=True, help="JSON report")
    args = parser.parse_args(argv)

    from specrag.agent.prompt import SYSTEM_PROMPTS
    from specrag.agent.runtime import Agent
    from specrag.agent.sample_index import ensure_sample_index

    items = split(load_dataset(args.dataset), args.split)[: args.limit]
    index = ensure_sample_index(args.model, progress=False)
    agent = Agent(index=index, model=args.model, system=SYSTEM_PROMPTS[args.system])
    rows = measure(agent, items, WORDINGS)
    report = {"model": args.model, "split": args.split, "system": args.system, "wordings": WORDINGS}
    report["summary"] = summarize(rows, WORDINGS)
    report["rows"] = rows
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(report["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
