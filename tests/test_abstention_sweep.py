"""The answerability gate's trade-off curve from recorded P(no) values (evals/groundedness/abstention.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specrag.evals.groundedness.abstention import auroc, choose_threshold, main, rates, split, sweep_report


def record(id_: str, answerable: bool, p: float | None, abstained: bool = False) -> dict:
    return {"id": id_, "answerable": answerable, "p_unanswerable": p, "abstained": abstained}


RECORDS = [
    record("g001", True, 0.1),
    record("g002", True, 0.6),
    record("g003", False, 0.7),
    record("g004", False, 0.4),
    record("g005", True, 0.3, abstained=True),  # the model refused by itself
    record("g006", False, 0.9),
]


def test_split_takes_odd_ids_for_dev_and_even_for_held_out() -> None:
    assert [r["id"] for r in split(RECORDS, "dev")] == ["g001", "g003", "g005"]
    assert [r["id"] for r in split(RECORDS, "held_out")] == ["g002", "g004", "g006"]
    assert len(split(RECORDS, "all")) == 6


def test_rates_count_the_gate_and_the_models_own_refusals() -> None:
    at = rates(RECORDS, 0.5)
    assert at["unanswerable_abstained"] == pytest.approx(2 / 3)  # 0.7 and 0.9
    assert at["answerable_abstained"] == pytest.approx(2 / 3)  # 0.6 by the gate, g005 by itself


def test_a_gated_abstention_is_not_the_models_own() -> None:
    gated = {**record("g1", False, 0.5, abstained=True), "gated_abstention": True}
    assert rates([gated], 0.4)["unanswerable_abstained"] == 1.0
    assert rates([gated], 0.6)["unanswerable_abstained"] == 0.0  # above the gate, nothing of its own


def test_auroc_counts_ranked_pairs_and_ties_as_half() -> None:
    # unanswerable {0.7, 0.4, 0.9} vs answerable {0.1, 0.6, 0.3}: 8 of 9 pairs ranked right
    assert auroc(RECORDS) == pytest.approx(8 / 9)
    tied = [record("g1", True, 0.5), record("g2", False, 0.5)]
    assert auroc(tied) == 0.5
    assert auroc([record("g1", True, 0.5)]) is None


def test_choose_threshold_maximises_youden_j_and_prefers_fewer_refusals() -> None:
    records = [record("a", True, 0.2), record("b", True, 0.5), record("c", False, 0.6), record("d", False, 0.8)]
    assert choose_threshold(records) == 0.6  # J = 1 at 0.6 (and none higher)
    swapped = [record("a", False, 0.2), record("b", True, 0.9)]
    assert choose_threshold(swapped) is None  # no threshold beats not gating


def test_sweep_report_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = sweep_report(RECORDS)
    assert report["chosen_on_dev"] == 0.7 and report["at_chosen"]["held_out"]["unanswerable_abstained"] == 0.5
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"records": RECORDS}))
    assert main([str(path)]) == 0 and json.loads(capsys.readouterr().out)["chosen_on_dev"] == 0.7
    path.write_text(json.dumps({"records": [record("g1", True, None)]}))
    assert main([str(path)]) == 2 and "--measure-answerability" in capsys.readouterr().err


def test_answerability_study_swaps_the_wording_and_restores_it() -> None:
    from specrag.agent import answerability
    from specrag.evals.studies.answerability import measure, summarize

    class WordingEcho:  # reports P(no) by wording, the way the probe would read PROBE
        def run(self, question: str, **options: object) -> dict:
            return {"answerability": {"p_unanswerable": 0.9 if "second" in answerability.PROBE else 0.2}}

    original = answerability.PROBE
    items = [{"id": "g001", "kind": "single", "answerable": True, "question": "q"}]
    rows = measure(WordingEcho(), items, {"a": "first", "b": "second"})
    assert rows == [{"id": "g001", "kind": "single", "answerable": True, "a": 0.2, "b": 0.9}]
    assert original == answerability.PROBE
    summary = summarize([*rows, {"id": "g002", "kind": "unanswerable", "answerable": False, "a": 0.5, "b": 0.1}], "ab")
    assert summary["a"]["auroc"] == 1.0 and summary["a"]["chosen_threshold"] == 0.5
    assert summary["b"]["auroc"] == 0.0 and summary["b"]["chosen_threshold"] is None
