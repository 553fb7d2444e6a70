"""Loading a folder of documents: every kind of file that must be skipped, and the sample corpus."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from specrag.retrieval import LoadError, html_to_text, load_folder, load_sample_corpus


def write(root: Path, relative: str, content: str | bytes) -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def test_loads_supported_files_in_nested_folders_with_posix_relative_names(tmp_path: Path) -> None:
    write(tmp_path, "guide/intro.md", "# Intro\n\nHello.")
    write(tmp_path, "guide/deep/er/notes.rst", "Notes\n=====\n\nText.")
    write(tmp_path, "top.txt", "plain text")
    write(tmp_path, "page.htm", "<p>web</p>")
    write(tmp_path, "image.png", b"\x89PNG")  # unsupported suffix: ignored, not a document
    write(tmp_path, ".git/config.txt", "tooling")  # hidden folders are not documents
    corpus = load_folder(tmp_path)
    assert [document.source for document in corpus.documents] == [
        "guide/deep/er/notes.rst",
        "guide/intro.md",
        "page.htm",
        "top.txt",
    ]
    assert corpus.skipped == []


def test_spaces_and_unicode_in_names(tmp_path: Path) -> None:
    write(tmp_path, "Mes documents/résumé été.md", "Bonjour")
    write(tmp_path, "日本語/ファイル.txt", "こんにちは")
    sources = {document.source: document.text for document in load_folder(tmp_path).documents}
    assert sources == {"Mes documents/résumé été.md": "Bonjour", "日本語/ファイル.txt": "こんにちは"}


def test_skips_are_reported_with_reasons_and_logged_by_name(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write(tmp_path, "good.md", "fine")
    write(tmp_path, "empty.txt", "")
    write(tmp_path, "blank.md", "  \n\n ")
    write(tmp_path, "binary.txt", b"abc\x00def")
    write(tmp_path, "latin1.txt", "café".encode("latin-1"))
    write(tmp_path, "huge.md", "x" * 2048)
    (tmp_path / "dangling.md").symlink_to(tmp_path / "nowhere.md")
    os.mkfifo(tmp_path / "pipe.txt")  # opening it would block: must be judged before any open()
    with caplog.at_level(logging.WARNING, logger="specrag.retrieval.loaders"):
        corpus = load_folder(tmp_path, max_bytes=1024)
    assert [document.source for document in corpus.documents] == ["good.md"]
    reasons = {item.source: item.reason for item in corpus.skipped}
    assert reasons == {
        "binary.txt": "binary",
        "blank.md": "empty",
        "dangling.md": "unreadable",
        "empty.txt": "empty",
        "huge.md": "too_large",
        "latin1.txt": "not_utf8",
        "pipe.txt": "not_regular",
    }
    assert corpus.skipped_by_reason() == {
        "binary": 1,
        "empty": 2,
        "not_regular": 1,
        "not_utf8": 1,
        "too_large": 1,
        "unreadable": 1,
    }
    for source in reasons:
        assert any(source in record.getMessage() for record in caplog.records), source
    assert "2048 bytes" in next(item.detail for item in corpus.skipped if item.reason == "too_large")


def test_unreadable_file_is_skipped(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads a chmod 000 file anyway; the broken-symlink case covers 'unreadable'")
    path = write(tmp_path, "secret.md", "hidden")
    path.chmod(0)
    try:
        corpus = load_folder(tmp_path)
    finally:
        path.chmod(0o644)
    assert [(item.source, item.reason) for item in corpus.skipped] == [("secret.md", "unreadable")]


def test_symlink_loop_is_followed_once(tmp_path: Path) -> None:
    write(tmp_path, "docs/a.md", "alpha")
    (tmp_path / "docs" / "loop").symlink_to(tmp_path / "docs")  # a folder linking to its own parent
    write(tmp_path, "elsewhere/b.md", "beta")
    (tmp_path / "docs" / "linked").symlink_to(tmp_path / "elsewhere")  # a real link to follow
    corpus = load_folder(tmp_path / "docs")
    assert [document.source for document in corpus.documents] == ["a.md", "linked/b.md"]


def test_a_byte_order_mark_is_not_text(tmp_path: Path) -> None:
    write(tmp_path, "bom.txt", "\ufeffhello".encode())
    assert load_folder(tmp_path).documents[0].text == "hello"


def test_missing_root_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(LoadError, match="not a folder"):
        load_folder(tmp_path / "absent")


def test_html_keeps_text_and_drops_scripts_styles_and_comments() -> None:
    html = """<!doctype html><html><head><title>Guide</title><style>p { color: red }</style>
    <script>var secret = "do not index";</script></head>
    <body><h1>Install</h1><p>Run <b>pip</b> install.</p><!-- a hidden note -->
    <ul><li>first</li><li>second</li></ul><noscript>enable js</noscript>
    <p>Line one<br>line two &amp; more</p></body></html>"""
    text = html_to_text(html)
    assert "secret" not in text and "color" not in text and "hidden note" not in text and "enable js" not in text
    assert "Run pip install." in text  # inline markup does not break the sentence
    assert "# Install" in text  # headings become Markdown, so the chunker sees the section
    assert "first\n\nsecond" in text
    assert "Line one\nline two & more" in text
    assert text.startswith("Guide")


def test_html_file_is_loaded_as_text(tmp_path: Path) -> None:
    write(tmp_path, "page.html", "<html><body><script>x=1</script><p>Only this.</p></body></html>")
    write(tmp_path, "scripts-only.html", "<html><script>x=1</script></html>")
    corpus = load_folder(tmp_path)
    assert [(document.source, document.text) for document in corpus.documents] == [("page.html", "Only this.")]
    assert [(item.source, item.reason) for item in corpus.skipped] == [("scripts-only.html", "empty")]


def test_sample_corpus_is_the_79_pydoc_topics() -> None:
    corpus = load_sample_corpus()
    assert len(corpus.documents) == 79
    assert all(document.source.startswith("pydoc/") for document in corpus.documents)
    with_statement = next(document for document in corpus.documents if document.source == "pydoc/with")
    assert "__enter__" in with_statement.text
    assert load_sample_corpus().documents[0].sha256 == corpus.documents[0].sha256


def test_a_file_name_that_is_not_utf8_is_skipped(tmp_path: Path) -> None:
    (tmp_path / os.fsdecode(b"caf\xe9.md")).write_bytes(b"text")  # a Latin-1 name on a UTF-8 system
    corpus = load_folder(tmp_path)
    assert corpus.documents == [] and [item.reason for item in corpus.skipped] == ["bad_name"]
