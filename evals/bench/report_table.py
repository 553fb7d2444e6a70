"""Render a benchmark JSON (``specrag bench decode -- --json``) as the compact table docs/benchmarks.md shows.

python -m specrag.evals.bench.report_table docs/reports/bench_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from specrag.evals.bench.runs import METHODS


def table(report: dict[str, Any]) -> str:
    results = report["results"]
    workloads = list(dict.fromkeys(result["workload"] for result in results))
    methods = [method for method in METHODS if method != "plain" and any(r["method"] == method for r in results)]
    lines = [
        "| workload | plain tok/s | " + " | ".join(methods) + " | auto committed/call | all identical |",
        "| --- | ---: | " + " | ".join("---:" for _ in methods) + " | ---: | --- |",
    ]
    for workload in workloads:
        rows = {result["method"]: result for result in results if result["workload"] == workload}
        cells = []
        for method in methods:
            speedup = rows[method]["speedup_vs_plain"] if method in rows else None
            cell = "-" if speedup is None else f"{speedup:.2f}x"
            cells.append(f"**{cell}**" if method == "ours_auto" else cell)
        auto = rows.get("ours_auto", {}).get("committed_per_call")
        identical = "yes" if all(row["identical_to_plain"] for row in rows.values()) else "NO"
        plain_speed = rows["plain"]["tokens_per_s"]
        lines.append(
            f"| {workload} | {'-' if plain_speed is None else f'{plain_speed:.2f}'} | "
            + " | ".join(cells)
            + f" | {'-' if auto is None else f'{auto:.2f}'} | {identical} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report")
    args = parser.parse_args(argv)
    print(table(json.loads(Path(args.report).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
