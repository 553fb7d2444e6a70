"""The on-disk index: builds, incremental rebuilds, versions, locking and every load error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from specrag.retrieval import (
    BuildReport,
    Chunker,
    ChunkerSettings,
    Corpus,
    Document,
    IndexLoadError,
    IndexLockedError,
    Retriever,
    build_index,
    load_index,
    store,
    whitespace_tokens,
)
from tests.retrieval_helpers import CountingEmbedder, chunker, sample_index, sample_subset, shared_embedder

pytestmark = pytest.mark.slow  # the real MiniLM model embeds the sample topics once per session


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, BuildReport]:
    return sample_index(tmp_path_factory.getbasetemp())


@pytest.fixture
def index_copy(built: tuple[Path, BuildReport], tmp_path: Path) -> Path:
    """A private copy of the sample index that a test may rebuild or damage."""
    return Path(shutil.copytree(built[0], tmp_path / "index", symlinks=True))


def test_first_build_reports_and_lays_out_one_version(built: tuple[Path, BuildReport]) -> None:
    root, report = built
    subset = sample_subset()
    assert report.written and report.version == "00000001" and report.previous_version is None
    assert report.loaded == len(subset.documents) and report.added == sorted(d.source for d in subset.documents)
    assert report.chunks_embedded == report.chunks_total > len(subset.documents)
    assert (root / "CURRENT").read_text().strip() == "00000001"
    assert sorted(path.name for path in (root / "versions" / "00000001").iterdir()) == [
        "chunks.jsonl",
        "embeddings.npy",
        "index.faiss",
        "manifest.json",
    ]
    manifest = json.loads((root / "versions" / "00000001" / "manifest.json").read_text())
    assert manifest["embedding"] == {"model": "all-minilm-l6-v2", "dim": 384}
    assert manifest["chunker"] | {"version": 0} == {"max_tokens": 128, "overlap": 16, "tokenizer": "whitespace"} | {
        "version": 0
    }
    assert manifest["index_type"] == "flat" and manifest["chunk_count"] == report.chunks_total
    assert sum(entry["chunks"] for entry in manifest["files"].values()) == report.chunks_total
    loaded = load_index(root)
    texts = {document.source: document.text for document in subset.documents}
    assert all(texts[chunk.source][chunk.start : chunk.end] == chunk.text for chunk in loaded.chunks)
    assert np.load(loaded.path / "embeddings.npy").dtype == np.float32


def test_rebuilding_unchanged_files_embeds_nothing(index_copy: Path) -> None:
    embedder = CountingEmbedder(shared_embedder())
    report = build_index(index_copy, sample_subset(), embedder, chunker())
    assert not report.written and report.unchanged == len(sample_subset().documents)
    assert embedder.encoded == 0 and report.chunks_embedded == 0
    assert (index_copy / "CURRENT").read_text().strip() == "00000001"


def test_incremental_rebuild_touches_only_changed_files(index_copy: Path) -> None:
    before = load_index(index_copy)
    documents = {document.source: document for document in sample_subset().documents}
    documents["pydoc/lambda"] = Document.from_text("pydoc/lambda", documents["pydoc/lambda"].text + "\n\nA new note.")
    documents["notes/new.md"] = Document.from_text("notes/new.md", "# Fresh\n\nA brand new file about frogs.")
    del documents["pydoc/pass"]
    renamed = documents.pop("pydoc/truth")  # same text under a new name: its vectors are reused
    documents["moved/truth.rst"] = Document("moved/truth.rst", renamed.text, renamed.sha256)
    embedder = CountingEmbedder(shared_embedder())

    report = build_index(index_copy, Corpus(list(documents.values())), embedder, chunker())

    assert report.written and report.version == "00000002" and report.previous_version == "00000001"
    assert report.added == ["moved/truth.rst", "notes/new.md"] and report.changed == ["pydoc/lambda"]
    assert report.removed == ["pydoc/pass", "pydoc/truth"] and report.unchanged == len(documents) - 3
    after = load_index(index_copy)
    fresh = [chunk for chunk in after.chunks if chunk.source in {"pydoc/lambda", "notes/new.md"}]
    assert embedder.calls == [len(fresh)] and report.chunks_embedded == len(fresh)
    assert report.chunks_reused == report.chunks_total - len(fresh)
    old_rows = {chunk.id: row for row, chunk in enumerate(before.chunks)}
    old_vectors, new_vectors = before.embeddings(), after.embeddings()
    for row, chunk in enumerate(after.chunks):
        if chunk.source in {"pydoc/lambda", "notes/new.md"}:
            continue
        old_id = chunk.id.replace("moved/truth.rst", "pydoc/truth")
        assert old_id in old_rows, "unchanged files keep their chunk ids"
        assert new_vectors[row].tobytes() == old_vectors[old_rows[old_id]].tobytes()
    assert not any(chunk.source == "pydoc/pass" for chunk in after.chunks)
    assert sorted(path.name for path in (index_copy / "versions").iterdir()) == ["00000001", "00000002"]
    assert load_index(index_copy, version="00000001").chunks == before.chunks  # the previous one is kept

    build_index(index_copy, Corpus(list(documents.values())[:-1]), embedder, chunker())
    assert sorted(path.name for path in (index_copy / "versions").iterdir()) == ["00000002", "00000003"]


def test_changed_chunker_settings_or_model_re_embed_everything(tmp_path: Path) -> None:
    documents = [Document.from_text(f"d{n}.md", f"# Doc {n}\n\nText number {n} about things.") for n in range(3)]
    embedder = CountingEmbedder(shared_embedder())
    build_index(tmp_path, documents, embedder, chunker())
    other = Chunker(ChunkerSettings(max_tokens=64, overlap=8, tokenizer="whitespace"), whitespace_tokens)
    report = build_index(tmp_path, documents, embedder, other)
    assert report.written and "chunker settings changed" in (report.reembed_all_reason or "")
    assert report.chunks_embedded == report.chunks_total == 3 and report.unchanged == 3
    renamed_model = CountingEmbedder(shared_embedder(), model_name="another-model")
    report = build_index(tmp_path, documents, renamed_model, other)
    assert "embedding model changed" in (report.reembed_all_reason or "") and renamed_model.encoded == 3


def test_index_type_change_reuses_vectors_and_hnsw_searches(index_copy: Path) -> None:
    embedder = CountingEmbedder(shared_embedder())
    report = build_index(index_copy, sample_subset(), embedder, chunker(), index_type="hnsw")
    assert report.written and report.chunks_embedded == 0 and embedder.encoded == 0
    assert load_index(index_copy).manifest["index_type"] == "hnsw"
    live = Retriever.open(index_copy, shared_embedder()).index  # now the HNSW version
    assert type(live.index).__name__ == "IndexHNSWFlat"
    hits = Retriever.open(index_copy, shared_embedder()).search("anonymous function lambda expression", k=3)
    assert len(hits) == 3 and hits[0].source == "pydoc/lambda"


def test_duplicate_source_names_are_refused(tmp_path: Path) -> None:
    twice = [Document.from_text("a.md", "one"), Document.from_text("a.md", "two")]
    with pytest.raises(ValueError, match="share the source name"):
        build_index(tmp_path, twice, shared_embedder(), chunker())


def test_a_second_build_waits_for_the_lock(index_copy: Path) -> None:
    with store.build_lock(index_copy), pytest.raises(IndexLockedError, match="another build"):
        build_index(index_copy, sample_subset(), shared_embedder(), chunker(), lock_timeout=0.2)


# ---------------------------------------------------------------- load errors


def test_missing_directory_or_current(tmp_path: Path) -> None:
    with pytest.raises(IndexLoadError, match="does not exist"):
        load_index(tmp_path / "nothing")
    with pytest.raises(IndexLoadError, match="no CURRENT"):
        load_index(tmp_path)


def test_current_naming_a_missing_version(index_copy: Path) -> None:
    (index_copy / "CURRENT").write_text("00000042\n")
    with pytest.raises(IndexLoadError, match="00000042"):
        load_index(index_copy)


def version_dir(root: Path) -> Path:
    return root / "versions" / (root / "CURRENT").read_text().strip()


def test_corrupt_faiss_file(index_copy: Path) -> None:
    path = version_dir(index_copy) / "index.faiss"
    data = bytearray(path.read_bytes())
    data[200:260] = b"\xff" * 60
    path.write_bytes(bytes(data))
    with pytest.raises(IndexLoadError, match=r"index\.faiss does not match its manifest"):
        load_index(index_copy)
    path.write_bytes(bytes(data[: len(data) // 3]))  # truncated: FAISS itself refuses it
    with pytest.raises(IndexLoadError, match=r"index\.faiss cannot be read by FAISS"):
        load_index(index_copy, verify=False)
    with pytest.raises(IndexLoadError):
        Retriever.open(index_copy, shared_embedder(), warm=False)


def test_truncated_chunks_file(index_copy: Path) -> None:
    path = version_dir(index_copy) / "chunks.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-2]))
    with pytest.raises(IndexLoadError, match=r"chunks\.jsonl does not match its manifest"):
        load_index(index_copy)
    with pytest.raises(IndexLoadError, match=rf"has {len(lines) - 2} chunks but the manifest says {len(lines)}"):
        load_index(index_copy, verify=False)
    path.write_text("".join(lines[:-1]) + lines[-1][:20])
    with pytest.raises(IndexLoadError, match="malformed record"):
        load_index(index_copy, verify=False)


def test_truncated_embeddings_file(index_copy: Path) -> None:
    path = version_dir(index_copy) / "embeddings.npy"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(IndexLoadError, match=r"embeddings\.npy"):
        load_index(index_copy)


def rewrite_manifest(root: Path, **changes: object) -> None:
    path = version_dir(root) / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.update(changes)
    path.write_text(json.dumps(manifest))


def test_manifest_built_with_another_model(index_copy: Path) -> None:
    rewrite_manifest(index_copy, embedding={"model": "bge-large", "dim": 1024})
    with pytest.raises(IndexLoadError, match=r"'bge-large'.*'all-minilm-l6-v2'"):
        load_index(index_copy, model_name="all-minilm-l6-v2", dim=384)
    with pytest.raises(IndexLoadError, match="bge-large"):
        Retriever.open(index_copy, shared_embedder(), warm=False)
    with pytest.raises(IndexLoadError, match="pass an embedder"):
        Retriever.open(index_copy)


def test_same_model_name_other_dimension(index_copy: Path) -> None:
    rewrite_manifest(index_copy, embedding={"model": "all-minilm-l6-v2", "dim": 768})
    with pytest.raises(IndexLoadError, match="768"):
        load_index(index_copy, model_name="all-minilm-l6-v2", dim=384)


def test_unsupported_format_version_and_broken_manifest(index_copy: Path) -> None:
    rewrite_manifest(index_copy, format_version=99)
    with pytest.raises(IndexLoadError, match="unsupported index format version 99"):
        load_index(index_copy)
    (version_dir(index_copy) / "manifest.json").write_text('{"format_version": 1, "embed')
    with pytest.raises(IndexLoadError, match="not valid JSON"):
        load_index(index_copy)


def test_a_damaged_live_index_is_rebuilt_from_scratch(index_copy: Path) -> None:
    path = version_dir(index_copy) / "embeddings.npy"
    path.write_bytes(path.read_bytes()[:-100])
    small = sample_subset().documents[:2]
    report = build_index(index_copy, small, shared_embedder(), chunker())
    assert report.written and "unusable" in (report.reembed_all_reason or "")
    assert report.chunks_embedded == report.chunks_total
    assert len(load_index(index_copy).chunks) == report.chunks_total
