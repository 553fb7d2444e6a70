"""The Retriever over the sample topics: relevance, determinism, hybrid mode, timings, the tool."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from specrag.retrieval import Corpus, Document, Passage, Retriever, build_index
from specrag.tools.builtin import search_documents_tool
from tests.retrieval_helpers import chunker, sample_index, sample_subset, shared_embedder

pytestmark = pytest.mark.slow  # the real MiniLM model embeds the sample topics once per session


@pytest.fixture(scope="session")
def retriever(tmp_path_factory: pytest.TempPathFactory) -> Retriever:
    root, _ = sample_index(tmp_path_factory.getbasetemp())
    return Retriever.open(root, shared_embedder(), hybrid=False)


@pytest.mark.parametrize(
    ("query", "topic"),
    [
        ("with statement context manager __enter__", "pydoc/with"),
        ("anonymous inline function expression lambda", "pydoc/lambda"),
        ("terminate the nearest enclosing loop early", "pydoc/break"),
        ("raise an exception with a cause", "pydoc/raise"),
        ("declare that a name refers to a module-level global variable", "pydoc/global"),
    ],
)
def test_obvious_queries_find_their_topic(retriever: Retriever, query: str, topic: str) -> None:
    hits = retriever.search(query, k=3)
    assert topic in [hit.source for hit in hits], [hit.id for hit in hits]
    for hit in hybrid_hits(retriever, query, 3):
        assert isinstance(hit, Passage)


def hybrid_hits(retriever: Retriever, query: str, k: int) -> list[Passage]:
    return retriever.search_with_timings(query, k, hybrid=True)[0]


def test_results_are_deterministic_ranked_and_exact_slices(retriever: Retriever, tmp_path: Path) -> None:
    query = "what does the with statement do"
    first = retriever.search(query, k=5)
    assert first == retriever.search(query, k=5)
    root = retriever.index.root
    assert first == Retriever.open(root, shared_embedder(), hybrid=False).search(query, k=5)
    assert [hit.rank for hit in first] == [1, 2, 3, 4, 5]
    assert [hit.score for hit in first] == sorted((hit.score for hit in first), reverse=True)
    assert all(0.0 < hit.score <= 1.0 + 1e-6 for hit in first)
    chunks = {chunk.id: chunk for chunk in retriever.index.chunks}
    for hit in first:
        stored = chunks[hit.id]
        assert (hit.source, hit.text, hit.start, hit.end) == (stored.source, stored.text, stored.start, stored.end)
    with pytest.raises(dataclasses.FrozenInstanceError):
        first[0].score = 2.0  # type: ignore[misc]


def test_hybrid_returns_k_deterministic_results(retriever: Retriever) -> None:
    query = "__enter__ __exit__"
    hits = hybrid_hits(retriever, query, 4)
    assert len(hits) == 4 and hits == hybrid_hits(retriever, query, 4)
    assert hits[0].source in {"pydoc/with", "pydoc/context-managers"}
    assert [hit.score for hit in hits] == sorted((hit.score for hit in hits), reverse=True)
    assert len(hybrid_hits(retriever, "zzzz qqqq", 4)) == 4  # no lexical match: the dense ranking alone


def test_timings_are_recorded(retriever: Retriever) -> None:
    passages, timings = retriever.search_with_timings("for loop else clause", k=2)
    assert len(passages) == 2 and timings.embed_s > 0 and timings.search_s >= 0 and timings.lexical_s == 0
    assert retriever.last_timings == timings
    assert set(timings.as_dict()) == {"embed_s", "search_s", "lexical_s"}
    _, hybrid = retriever.search_with_timings("for loop else clause", k=2, hybrid=True)
    assert hybrid.lexical_s > 0


def test_k_larger_than_the_index_and_invalid_k(retriever: Retriever) -> None:
    assert len(retriever.search("anything", k=10_000)) == len(retriever)
    with pytest.raises(ValueError, match="k must be"):
        retriever.search("anything", k=0)


def test_equal_scores_are_ordered_by_id(tmp_path: Path) -> None:
    text = "Frogs are amphibians that live near ponds."
    documents = [Document.from_text(name, text) for name in ("c.md", "a.md", "b.md")]
    build_index(
        tmp_path,
        [*documents, Document.from_text("z.md", "Quarterly tax filing deadlines.")],
        shared_embedder(),
        chunker(),
    )
    hits = Retriever.open(tmp_path, shared_embedder(), hybrid=False).search("frogs near ponds", k=3)
    assert [hit.id for hit in hits] == ["a.md#0", "b.md#0", "c.md#0"]
    assert hits[0].score == hits[1].score == hits[2].score


def test_the_search_documents_tool_accepts_the_retriever(retriever: Retriever) -> None:
    tool = search_documents_tool(retriever)
    passages = tool(query="context manager protocol", k=2).split("\n\n[")
    assert len(passages) == 2
    label, source = passages[0].split("\n", 1)[0].split(" ", 1)
    assert label.startswith("[") and label[1:-1].startswith(source.strip("()") + "#")  # [a.md#0] (a.md)


def test_an_empty_index_answers_nothing(tmp_path: Path) -> None:
    report = build_index(tmp_path, [], shared_embedder(), chunker())
    assert report.written and report.chunks_total == 0
    assert Retriever.open(tmp_path, shared_embedder()).search("anything", k=3) == []


def test_hybrid_is_the_default(retriever: Retriever) -> None:
    assert Retriever(retriever.index, retriever.embedder).hybrid


def test_a_retriever_follows_a_rebuild_of_its_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas sharing one index directory switch to a new version without a restart, and
    keep the one they have when CURRENT names a version that does not load."""
    built, _ = sample_index(tmp_path.parent)
    root = tmp_path / "index"
    shutil.copytree(built, root)
    retriever = Retriever.open(root, shared_embedder(), hybrid=False)
    assert retriever.refresh() is False and retriever.index.version == "00000001"
    quokkas = Document.from_text("notes/quokkas.md", "# Quokkas\n\nQuokkas are small marsupials of Rottnest Island.")
    build_index(root, Corpus([*sample_subset().documents, quokkas]), shared_embedder(), chunker())
    monkeypatch.setattr("specrag.retrieval.retriever.FOLLOW_INTERVAL_S", 0.0)  # check on every search
    assert retriever.search("small marsupials of Rottnest Island", k=1)[0].source == "notes/quokkas.md"
    assert retriever.index.version == "00000002"
    (root / "CURRENT").write_text("00000099\n")  # a version that is not there
    assert retriever.refresh() is False and retriever.index.version == "00000002"
    assert retriever.search("small marsupials of Rottnest Island", k=1)[0].source == "notes/quokkas.md"
