"""Document loading: a folder of text, Markdown, reST and HTML files, or the built-in sample corpus.

Owns turning files into :class:`Document` objects (source name, text, SHA-256 of the text) and
deciding which files are skipped and why. Skips are never silent: each one is logged as a
warning naming the file and collected in :class:`Corpus` so the build report can count them.
HTML is reduced to text with BeautifulSoup over lxml rather than regexes, which mangle real pages.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = frozenset({".txt", ".md", ".markdown", ".rst"})
HTML_SUFFIXES = frozenset({".html", ".htm"})
SUPPORTED_SUFFIXES = TEXT_SUFFIXES | HTML_SUFFIXES
DEFAULT_MAX_BYTES = 20 * 1024 * 1024
SAMPLE_PREFIX = "pydoc/"

# Elements whose content is never prose a reader sees.
_HTML_DROP = ("script", "style", "noscript", "template", "svg", "canvas", "iframe", "object")
# Block elements end a paragraph: a blank line after them lets the chunker see structure.
_HTML_BLOCKS = (
    "p", "div", "section", "article", "main", "header", "footer", "nav", "aside", "blockquote", "pre",
    "ul", "ol", "li", "dl", "dt", "dd", "table", "tr", "figure", "figcaption", "hr", "form",
    "h1", "h2", "h3", "h4", "h5", "h6", "title",
)  # fmt: skip


@dataclass(frozen=True)
class Document:
    source: str  # POSIX path relative to the corpus root, or pydoc/<topic>
    text: str
    sha256: str  # of the UTF-8 text: what chunking and embedding depend on

    @classmethod
    def from_text(cls, source: str, text: str) -> Document:
        return cls(source, text, hashlib.sha256(text.encode("utf-8")).hexdigest())


@dataclass(frozen=True)
class SkippedFile:
    source: str
    reason: str  # short key: empty, too_large, binary, not_utf8, unreadable, not_regular, bad_name
    detail: str


@dataclass
class Corpus:
    documents: list[Document] = field(default_factory=list)
    skipped: list[SkippedFile] = field(default_factory=list)

    def skipped_by_reason(self) -> dict[str, int]:
        return dict(sorted(Counter(item.reason for item in self.skipped).items()))


class LoadError(ValueError):
    """The corpus root itself cannot be used (a missing folder, not a folder)."""


def load_sample_corpus() -> Corpus:
    """The Python language reference topics every Python install carries (``pydoc_data``)."""
    from pydoc_data.topics import topics

    return Corpus([Document.from_text(SAMPLE_PREFIX + name, topics[name]) for name in sorted(topics)])


def load_folder(root: str | os.PathLike[str], max_bytes: int = DEFAULT_MAX_BYTES) -> Corpus:
    """Every supported file under ``root`` (nested, symlinks followed), sorted by source name."""
    root_path = Path(root)
    if not root_path.is_dir():
        raise LoadError(f"{root_path} is not a folder")
    corpus = Corpus()
    for path in _walk(root_path):
        source = _source_name(path, root_path)
        outcome = _load_file(path, source, max_bytes)
        if isinstance(outcome, Document):
            corpus.documents.append(outcome)
        else:
            logger.warning("skipped %s: %s", outcome.source, outcome.detail)
            corpus.skipped.append(outcome)
    corpus.documents.sort(key=lambda document: document.source)
    corpus.skipped.sort(key=lambda item: item.source)
    return corpus


def _walk(root: Path) -> Iterator[Path]:
    """Supported files under ``root`` in a stable order; each real folder is entered once.

    Tracking resolved folder paths is what stops a symlink to a parent from looping forever
    (os.walk with followlinks=True would recurse until the path is too long).
    """
    seen: set[str] = set()
    for directory, subdirs, files in os.walk(root, followlinks=True):
        real = os.path.realpath(directory)
        if real in seen:
            subdirs[:] = []
            continue
        seen.add(real)
        # Hidden folders (.git, .venv) are tooling, not documents.
        subdirs[:] = sorted(name for name in subdirs if not name.startswith("."))
        for name in sorted(files):
            if not name.startswith(".") and Path(name).suffix.lower() in SUPPORTED_SUFFIXES:
                yield Path(directory) / name


def _source_name(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def _load_file(path: Path, source: str, max_bytes: int) -> Document | SkippedFile:
    try:
        source.encode("utf-8")
    except UnicodeEncodeError:
        return SkippedFile(source.encode("utf-8", "replace").decode(), "bad_name", "file name is not valid UTF-8")
    problem = _stat_problem(path, source, max_bytes)
    if problem is not None:
        return problem
    try:
        with path.open("rb") as handle:
            data = handle.read(max_bytes + 1)
    except OSError as error:
        return SkippedFile(source, "unreadable", f"unreadable ({error.strerror or error})")
    return _decode(data, path, source, max_bytes)


def _stat_problem(path: Path, source: str, max_bytes: int) -> SkippedFile | None:
    """Why the file cannot be read as a document, judged before opening it (a FIFO would block)."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return SkippedFile(source, "unreadable", "unreadable (broken symlink or vanished file)")
    except OSError as error:
        return SkippedFile(source, "unreadable", f"unreadable ({error.strerror or error})")
    if not stat.S_ISREG(info.st_mode):
        return SkippedFile(source, "not_regular", "not a regular file")
    if info.st_size == 0:
        return SkippedFile(source, "empty", "empty")
    if info.st_size > max_bytes:
        return SkippedFile(source, "too_large", f"too large ({info.st_size} bytes > cap of {max_bytes})")
    return None


def _decode(data: bytes, path: Path, source: str, max_bytes: int) -> Document | SkippedFile:
    if len(data) > max_bytes:  # grew after stat
        return SkippedFile(source, "too_large", f"too large (> cap of {max_bytes} bytes)")
    if b"\x00" in data:
        return SkippedFile(source, "binary", "binary (contains NUL bytes)")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        return SkippedFile(source, "not_utf8", f"not UTF-8 (invalid byte at offset {error.start})")
    if path.suffix.lower() in HTML_SUFFIXES:
        text = html_to_text(text)
    if not text.strip():
        return SkippedFile(source, "empty", "empty")
    return Document.from_text(source, text)


def html_to_text(html: str) -> str:
    """Visible text of an HTML page, one paragraph per block element, headings as Markdown."""
    from bs4 import BeautifulSoup, Comment

    soup = BeautifulSoup(html, "lxml")
    for element in soup(_HTML_DROP):
        element.decompose()
    for comment in soup.find_all(string=lambda node: isinstance(node, Comment)):
        comment.extract()
    for heading in soup(["h1", "h2", "h3", "h4", "h5", "h6"]):
        # Markdown markers let the structural chunker start a section here.
        heading.insert(0, "#" * int(heading.name[1]) + " ")
    for line_break in soup("br"):
        line_break.replace_with("\n")
    for block in soup(_HTML_BLOCKS):
        block.insert_before("\n\n")
        block.insert_after("\n\n")
    return _tidy(soup.get_text())


def _tidy(text: str) -> str:
    """Collapse runs of spaces within lines and of blank lines between paragraphs."""
    paragraphs: list[str] = []
    current: list[str] = []
    for raw_line in text.splitlines():
        line = " ".join(raw_line.split())
        if line:
            current.append(line)
        elif current:
            paragraphs.append("\n".join(current))
            current = []
    if current:
        paragraphs.append("\n".join(current))
    return "\n\n".join(paragraphs)
