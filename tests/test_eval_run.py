"""`specrag eval groundedness`: the datasets are well formed, and a --quick run goes end to end
(real smollm2 agent over a real index, speculation on and off, report, plots, CI gate, rescore).
Quality is not asserted here; the scorer's own tests and calibration do that."""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

import pytest

from specrag.agent.attribution import DEFAULT_MIN_SIMILARITY
from specrag.agent.cli import main as cli_main
from specrag.agent.grounding.text_match import whitespace_normalized
from specrag.evals.groundedness.abstention import main as abstention_main
from specrag.evals.groundedness.run import (
    DEFAULT_DATASET,
    KINDS,
    DatasetError,
    _effective_min_similarity,
    gate,
    load_dataset,
    quick_subset,
)
from specrag.retrieval import load_sample_corpus
from tests.retrieval_helpers import sample_index


def test_groundedness_set_is_well_formed() -> None:
    items = load_dataset(DEFAULT_DATASET)
    assert len(items) >= 60
    assert len({item["id"] for item in items}) == len(items)
    kinds = Counter(item["kind"] for item in items)
    assert set(kinds) == set(KINDS) and min(kinds.values()) >= 10
    documents = {doc.source: whitespace_normalized(doc.text) for doc in load_sample_corpus().documents}
    for item in items:
        assert item["question"].strip() and item["reference"].strip()
        if item["kind"] == "unanswerable":
            assert not item["answerable"] and not item["supporting"]
        if item["answerable"]:
            assert item["supporting"], item["id"]
        for support in item["supporting"]:
            assert support["passage_id"].startswith(support["source"] + "#")
            assert whitespace_normalized(support["quote"]) in documents[support["source"]], item["id"]


def test_quick_subset_takes_one_question_per_kind() -> None:
    subset = quick_subset(load_dataset(DEFAULT_DATASET))
    assert [item["kind"] for item in subset] == list(KINDS)


def test_a_bad_dataset_line_names_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "x", "kind": "single"}\n', encoding="utf-8")
    with pytest.raises(DatasetError, match=r"bad\.jsonl:1: missing field 'question'"):
        load_dataset(path)
    path.write_text("{not json\n", encoding="utf-8")
    with pytest.raises(DatasetError, match=r"bad\.jsonl:1: not JSON"):
        load_dataset(path)


def test_gate_fails_below_the_threshold_or_without_a_score() -> None:
    assert gate({"groundedness": 0.9}, None) == 0
    assert gate({"groundedness": 0.9}, 0.85) == 0
    assert gate({"groundedness": 0.8}, 0.85) == 1
    assert gate({"groundedness": None}, 0.5) == 1


def test_quick_eval_end_to_end(tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]) -> None:
    index, _ = sample_index(tmp_path_factory.getbasetemp())
    out = tmp_path_factory.mktemp("eval")
    args = ["eval", "groundedness", "--quick", "--model", "smollm2-135m", "--index", str(index)]
    args += ["--out", str(out), "--max-tokens", "48", "--compare-off", "--no-progress", "--min-groundedness", "1.01"]
    args += ["--measure-answerability", "--citations", "attribute", "--citation-min-similarity", "0"]
    assert cli_main(args) == 1  # groundedness ≤ 1 < 1.01: the CI gate fails, after writing the report
    assert "below --min-groundedness 1.01" in capsys.readouterr().err

    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert [record["kind"] for record in report["records"]] == list(KINDS)
    summary = report["summary"]
    for key in ("groundedness", "citation_precision", "token_f1", "unanswerable_abstained", "retrieval_recall"):
        assert key in summary
    assert set(summary["stage_median_s"]) >= {"retrieve", "prefill", "decode", "verify", "wall"}
    assert summary["committed_per_target_call"] >= 1.0
    compare = report["compare_off"]
    assert compare["identical_answers"] == compare["questions"] == 5, compare["different_ids"]  # greedy: exact
    for record in report["records"]:
        assert 0.0 < record["p_unanswerable"] < 1.0 and not record["gated_abstention"]  # measured, not gated
        assert record["passages"] and all(p["label"].startswith("P") for p in record["passages"])
        for sentence in record["sentences"]:
            assert sentence["supported"] in (True, False, None) and sentence["reason"]
        # re-citing moves markers only; the model's own text is kept and scored separately
        assert unmarked(record["answer"]) == unmarked(record["model_answer"])
        assert "model_citation_precision" in record
    assert summary["citations"] > 0  # at threshold 0 every claim cites
    assert report["config"]["citations"] == "attribute" and "model_citation_precision" in summary
    assert report["config"]["citation_min_similarity"] == 0
    markdown = (out / "report.md").read_text(encoding="utf-8")
    assert "Greedy answers identical: **5 of 5**" in markdown and "| groundedness (mean per answer) |" in markdown
    for plot in ("score_distribution.png", "per_kind.png", "stage_latency.png", "accepted_length.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    capsys.readouterr()
    assert abstention_main([str(out / "report.json")]) == 0
    assert set(json.loads(capsys.readouterr().out)["auroc"]) == {"dev", "held_out", "all"}

    rescored = tmp_path_factory.mktemp("rescored")
    rescore = ["eval", "groundedness", "--rescore", str(out / "report.json"), "--out", str(rescored)]
    capsys.readouterr()
    assert cli_main([*rescore, "--min-groundedness", "0", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    again = json.loads((rescored / "report.json").read_text(encoding="utf-8"))
    assert again["summary"]["groundedness"] == summary["groundedness"] == printed["summary"]["groundedness"]
    assert again["compare_off"]["identical_answers"] == 5


def test_the_report_records_the_threshold_used_even_when_it_was_the_default() -> None:
    def args(citations: str, min_similarity: float | None) -> argparse.Namespace:
        return argparse.Namespace(citations=citations, citation_min_similarity=min_similarity)

    assert _effective_min_similarity(args("attribute", None)) == DEFAULT_MIN_SIMILARITY
    assert _effective_min_similarity(args("attribute", 0.7)) == 0.7
    assert _effective_min_similarity(args("model", None)) is None


def unmarked(text: str) -> str:
    return re.sub(r"\s+|\[P\d+\]", "", text)


def test_a_threshold_outside_zero_to_one_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["eval", "groundedness", "--out", "x", "--abstain-threshold", "1.5"])
    assert exit_info.value.code == 2
    assert "--abstain-threshold: must be within [0, 1], not 1.5" in capsys.readouterr().err
