"""The labelled claim sets of the groundedness scorer: well formed, quoting their corpus verbatim."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from specrag.evals.studies.calibrate_claims import PROMETHEUS_SETS

CORPUS = Path(__file__).resolve().parent.parent / "evals" / "datasets" / "corpora" / "prometheus_docs"
FIELDS = {"id", "corpus", "split", "question", "passages", "answer", "about", "label", "kind", "note"}


@pytest.mark.parametrize("part", sorted(PROMETHEUS_SETS))
def test_every_claim_quotes_its_pages_verbatim_and_the_labels_are_balanced(part: str) -> None:
    items = [json.loads(line) for line in PROMETHEUS_SETS[part].read_text(encoding="utf-8").splitlines()]
    assert all(set(item) == FIELDS and item["split"] == part for item in items)
    assert len({item["id"] for item in items}) == len(items) == 80
    assert Counter(item["label"] for item in items) == {"supported": 40, "unsupported": 40}
    pages = {item_passage["source"] for item in items for item_passage in item["passages"]}
    texts = {source: (CORPUS / source).read_text(encoding="utf-8") for source in pages}
    for item in items:
        assert 2 <= len(item["passages"]) <= 4
        assert item["about"] is None or 0 <= item["about"] < len(item["passages"])
        for passage in item["passages"]:
            assert passage["text"] in texts[passage["source"]], (item["id"], passage["source"])


def test_the_held_out_pages_are_not_the_dev_pages() -> None:
    def pages(part: str) -> set[str]:
        lines = PROMETHEUS_SETS[part].read_text(encoding="utf-8").splitlines()
        return {passage["source"] for line in lines for passage in json.loads(line)["passages"]}

    assert not pages("dev") & pages("held_out")
