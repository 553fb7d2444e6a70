"""Chunking: exact spans, the token budget, overlap, structure and stable ids."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specrag.retrieval import Chunker, ChunkerSettings, Document, chunk_text, load_sample_corpus, whitespace_tokens


def chars_as_tokens(text: str) -> int:
    """A counter that, unlike whitespace, counts separators too (as a BPE tokenizer does)."""
    return (len(text) + 3) // 4


WORDS = st.sampled_from(
    ["alpha", "beta", "gamma.", "delta!", "x", "über", "日本", "__init__()", "a-very-long-word" * 6]
)
LINE = st.lists(WORDS, min_size=1, max_size=12).map(" ".join)
BLOCK = st.one_of(
    st.lists(LINE, min_size=1, max_size=5).map("\n".join),
    LINE.map(lambda line: "# " + line),
    LINE.map(lambda line: line + "\n" + "=" * max(3, len(line))),
    st.just("```\n# not a heading\n\ncode()\n```"),
)
DOCUMENT = st.lists(BLOCK, max_size=12).flatmap(
    lambda blocks: st.lists(
        st.sampled_from(["\n\n", "\n\n\n", "\n \n", "\r\n\r\n"]), min_size=len(blocks), max_size=len(blocks)
    ).map(lambda separators: "".join(block + separator for block, separator in zip(blocks, separators, strict=True)))
)


@settings(max_examples=200, deadline=None)
@given(text=DOCUMENT, max_tokens=st.integers(1, 40), overlap_fraction=st.floats(0, 0.9))
def test_spans_are_exact_and_the_budget_holds(text: str, max_tokens: int, overlap_fraction: float) -> None:
    overlap = min(max_tokens - 1, int(max_tokens * overlap_fraction))
    for count in (whitespace_tokens, chars_as_tokens):
        chunks = chunk_text(text, "doc.md", count, max_tokens, overlap)
        for n, chunk in enumerate(chunks):
            assert text[chunk.start : chunk.end] == chunk.text
            assert chunk.id == f"doc.md#{n}" and chunk.source == "doc.md"
            assert chunk.text.strip(), "no chunk is blank"
            # Only a single unsplittable word may exceed the budget.
            assert count(chunk.text) <= max_tokens or len(chunk.text.split()) == 1
        assert [chunk.start for chunk in chunks] == sorted(chunk.start for chunk in chunks)
        # Every visible character of the document is in some chunk.
        covered = set()
        for chunk in chunks:
            covered.update(range(chunk.start, chunk.end))
        assert all(index in covered for index, char in enumerate(text) if not char.isspace())
        assert chunk_text(text, "doc.md", count, max_tokens, overlap) == chunks  # deterministic


def test_long_paragraphs_split_at_sentences_with_overlap() -> None:
    sentences = [f"Sentence number {n} talks about topic {n % 7} at some length." for n in range(60)]
    text = " ".join(sentences)
    chunks = chunk_text(text, "long.txt", whitespace_tokens, 50, 10)
    assert len(chunks) > 5
    for previous, following in itertools.pairwise(chunks):
        assert following.start < previous.end, "consecutive chunks of a section overlap"
        assert whitespace_tokens(text[following.start : previous.end]) <= 10
        assert following.text.startswith("Sentence"), "the overlap starts at a sentence when it can"
    assert all(chunk.text.endswith(".") for chunk in chunks), "cuts fall at sentence ends"


def test_an_over_long_sentence_splits_at_words_and_a_giant_word_stands_alone() -> None:
    giant = "x" * 500
    text = " ".join(["word"] * 30) + " " + giant + " tail"
    chunks = chunk_text(text, "w.txt", chars_as_tokens, 20, 0)
    assert any(chunk.text == giant for chunk in chunks)
    assert all(chars_as_tokens(chunk.text) <= 20 for chunk in chunks if chunk.text != giant)
    assert "".join(chunk.text.replace(" ", "") for chunk in chunks) == text.replace(" ", "")


def test_headings_start_chunks_and_bare_headings_join_the_next_section() -> None:
    text = "# Title\n\n## Part one\n\nFirst part text.\n\nSecond Part\n===========\n\nSecond part text."
    chunks = chunk_text(text, "s.md", whitespace_tokens, 100, 10)
    assert [chunk.text for chunk in chunks] == [
        "# Title\n\n## Part one\n\nFirst part text.",
        "Second Part\n===========\n\nSecond part text.",
    ]


def test_code_fence_comments_are_not_headings() -> None:
    text = "Intro text.\n\n```python\n# a comment\nx = 1\n```"
    assert len(chunk_text(text, "c.md", whitespace_tokens, 100, 0)) == 1


def test_ids_of_untouched_sections_survive_an_edit_elsewhere() -> None:
    sections = [f"# Section {n}\n\n" + " ".join(f"w{n}_{i}" for i in range(70)) for n in range(4)]
    before = chunk_text("\n\n".join(sections), "f.md", whitespace_tokens, 32, 4)
    sections[3] += " and an appended sentence."
    after = chunk_text("\n\n".join(sections), "f.md", whitespace_tokens, 32, 4)
    untouched = [chunk for chunk in before if "Section 3" not in chunk.text and "w3_" not in chunk.text]
    assert len(untouched) >= 6
    assert all(chunk in after for chunk in untouched)
    assert before[-1] not in after


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="overlap"):
        ChunkerSettings(max_tokens=10, overlap=10)
    with pytest.raises(ValueError, match="max_tokens"):
        ChunkerSettings(max_tokens=0, overlap=0)
    assert ChunkerSettings().as_dict()["version"] >= 1


@pytest.mark.slow
def test_budget_holds_with_the_real_target_tokenizer() -> None:
    from specrag.retrieval import load_token_counter

    counter = load_token_counter("smollm2-135m")
    assert counter.name == "pack:smollm2-135m"
    assert counter.count("hello world") == 2  # no BOS/EOS added
    chunker = Chunker(ChunkerSettings(96, 16, counter.name), counter.count)
    corpus = load_sample_corpus()
    for document in [d for d in corpus.documents if d.source in {"pydoc/with", "pydoc/for", "pydoc/try"}]:
        chunks = chunker.chunk(document)
        assert len(chunks) > 2
        for chunk in chunks:
            assert document.text[chunk.start : chunk.end] == chunk.text
            assert counter.count(chunk.text) <= 96 or len(chunk.text.split()) == 1
        assert [chunk.id for chunk in chunker.chunk(Document.from_text(document.source, document.text))] == [
            chunk.id for chunk in chunks
        ]
