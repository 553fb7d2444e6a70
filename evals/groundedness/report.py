"""report.md and the PNG plots of a groundedness eval (evals/groundedness/run.py writes report.json itself)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

PLOTS = ("score_distribution.png", "per_kind.png", "stage_latency.png", "accepted_length.png")


def _fmt(value: Any, percent: bool = False) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.1%}" if percent else f"{value:.3f}"
    return str(value)


def _threshold(config: Mapping[str, Any]) -> str:
    min_similarity = config.get("citation_min_similarity")
    return "" if min_similarity is None else f" at cosine ≥ {min_similarity}"


def _nli(config: Mapping[str, Any]) -> str:
    nli = f"NLI judge `{config['nli']}`, " if config.get("nli") else ""
    return nli + (f"support judge `{config['judge']}`, " if config.get("judge") else "")


def render_markdown(report: Mapping[str, Any]) -> str:
    summary, config = report["summary"], report["config"]
    lines = [
        "# specrag groundedness eval",
        "",
        f"model `{config['model']}`, draft `{config['draft']}`, speculation `{config['speculation']}`, "
        f"k {config['k']}, max steps {config['max_steps']}, max tokens {config['max_tokens']}, "
        f"system prompt `{config.get('system', 'not recorded')}`, abstain threshold {config.get('abstain_threshold')}, "
        f"citations `{config.get('citations', 'model')}`{_threshold(config)}, {_grounding(config)}{_nli(config)}"
        f"{summary['questions']} questions from `{config['dataset']}` over the index "
        f"`{config.get('index', 'not recorded')}`; {config['machine']}.",
        "",
        f"Command: `{report['command']}`",
        "",
        "| metric | value |",
        "|---|---|",
    ]
    rows = [
        ("groundedness (mean per answer)", _fmt(summary["groundedness"])),
        ("groundedness (supported ÷ scorable sentences)", _fmt(summary["groundedness_micro"])),
        ("answers with scorable claims", _fmt(summary["answers_with_claims"])),
        ("answers the run's check marked not grounded", _fmt(summary.get("not_grounded"), True)),
        ("citation precision", _fmt(summary["citation_precision"])),
        ("citation recall", _fmt(summary["citation_recall"])),
        ("citations / unresolved", f"{summary['citations']} / {summary['unresolved_citations']}"),
        (
            "citation precision of the model's own markers (pairs)",
            f"{_fmt(summary.get('model_citation_precision'))} ({summary.get('model_citations')})",
        ),
        ("token F1 (answerable)", _fmt(summary["token_f1"])),
        ("exact match (answerable)", _fmt(summary["exact_match"])),
        ("unanswerable answered 'not in the documents'", _fmt(summary["unanswerable_abstained"], True)),
        ("answerable wrongly refused", _fmt(summary["answerable_abstained"], True)),
        ("abstentions by the answerability gate", str(summary.get("gated_abstentions", 0))),
        ("answerability probe AUROC (unanswerable vs answerable)", _fmt(summary.get("answerability_auroc"))),
        (f"retrieval recall@{config['k']} of supporting passages", _fmt(summary["retrieval_recall"])),
        ("tool calls / validity", f"{summary['tool_calls']} / {_fmt(summary['tool_call_validity'])}"),
        ("committed tokens per target call", _fmt(summary["committed_per_target_call"])),
        ("mean accepted length (speculative cycles)", _fmt(summary["mean_accepted_length"])),
    ]
    lines += [f"| {name} | {value} |" for name, value in rows]
    compare = report.get("compare_off")
    if compare:
        same = compare["identical_answers"] == compare["questions"]
        lines += [
            "",
            "## Speculation on vs off",
            "",
            f"Greedy answers identical: **{compare['identical_answers']} of {compare['questions']}**"
            + ("" if same else f" (different: {', '.join(compare['different_ids'])})")
            + f". Decode {compare['decode_s_off']:.1f} s off vs {compare['decode_s_on']:.1f} s on: "
            f"**{_fmt(compare['decode_speedup'])}x**; wall {_fmt(compare['wall_speedup'])}x "
            + (
                "(the off pass reuses the on pass's cached prompt)."
                if report.get("config", {}).get("shared_prefix_cache")
                else "(both passes start from an empty prefix cache)."
            ),
        ]
    lines += ["", "## By kind", "", "| kind | n | groundedness | token F1 | abstained | retrieval recall |"]
    lines.append("|---|---|---|---|---|---|")
    for kind, row in summary["by_kind"].items():
        lines.append(
            f"| {kind} | {row['questions']} | {_fmt(row['groundedness'])} | {_fmt(row['token_f1'])} | "
            f"{_fmt(row['abstained'], True)} | {_fmt(row['retrieval_recall'])} |"
        )
    lines += ["", "## Median seconds per stage", "", "| stage | median s |", "|---|---|"]
    lines += [f"| {stage} | {seconds:.3f} |" for stage, seconds in summary["stage_median_s"].items()]
    lines += ["", "## Unsupported sentences", ""]
    for record in report["records"]:
        for sentence in record["sentences"]:
            if sentence["supported"] is False:
                lines.append(f"- {record['id']}: “{sentence['text'][:160]}” — {sentence['reason']}")
    lines += ["", "Plots: " + ", ".join(f"[{name}]({name})" for name in PLOTS), ""]
    return "\n".join(lines)


def write_plots(report: Mapping[str, Any], out: Path) -> list[str]:
    """The four PNGs; returns their names (none when matplotlib is missing, with the reason logged)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    records: Sequence[Mapping[str, Any]] = report["records"]
    summary = report["summary"]

    figure, axis = plt.subplots(figsize=(6, 3.5))
    scores = [r["groundedness"] for r in records if r["groundedness"] is not None]
    axis.hist(scores, bins=[i / 10 for i in range(11)], color="#4c72b0", edgecolor="white")
    axis.set(xlabel="groundedness of an answer", ylabel="answers", title="Groundedness per answer")
    _save(figure, out / PLOTS[0])

    figure, axis = plt.subplots(figsize=(7, 3.5))
    kinds = list(summary["by_kind"])
    values = [summary["by_kind"][k]["groundedness"] or 0.0 for k in kinds]
    abstained = [summary["by_kind"][k]["abstained"] or 0.0 for k in kinds]
    positions = range(len(kinds))
    axis.bar([p - 0.2 for p in positions], values, width=0.4, label="groundedness")
    axis.bar([p + 0.2 for p in positions], abstained, width=0.4, label="abstained")
    axis.set_xticks(list(positions), kinds)
    axis.set(ylim=(0, 1.05), title="By question kind")
    axis.legend()
    _save(figure, out / PLOTS[1])

    figure, axis = plt.subplots(figsize=(7, 3.5))
    stages = {k: v for k, v in summary["stage_median_s"].items() if k != "wall"}
    axis.barh(list(stages), list(stages.values()), color="#55a868")
    wall = summary["stage_median_s"].get("wall", 0.0)
    axis.set(xlabel="median seconds per question", title=f"Stage latency (wall median {wall:.2f} s)")
    _save(figure, out / PLOTS[2])

    figure, axis = plt.subplots(figsize=(6, 3.5))
    lengths = [length for r in records for length in r["accepted_lengths"]]
    top = max(lengths, default=0)
    axis.hist(lengths, bins=[b - 0.5 for b in range(top + 2)], color="#c44e52", edgecolor="white")
    axis.set(xlabel="accepted draft tokens in a cycle", ylabel="cycles", title="Accepted length")
    _save(figure, out / PLOTS[3])
    return list(PLOTS)


def _save(figure: Any, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(figure)


def _grounding(config: Mapping[str, Any]) -> str:
    if "grounding" not in config:
        return "grounding check not recorded, "
    judge = " with the model as judge" if config.get("grounding_judge") else ""
    return f"grounding `{config['grounding']}` at supported share ≥ {config.get('min_supported')}{judge}, "
