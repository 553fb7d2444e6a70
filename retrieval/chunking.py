"""Structural chunking with a token budget and an overlap.

Owns cutting a document into :class:`Chunk` spans. Sections start at Markdown (ATX or setext)
and reST headings; paragraphs are runs of non-blank lines; a paragraph over the budget is split
at sentence ends, and a sentence over the budget at spaces. Pieces are packed greedily up to
``max_tokens`` as measured by ``count_tokens`` on the exact chunk text, and each next chunk of a
section starts up to ``overlap`` tokens before the previous one ended. Every chunk is a slice:
``doc.text[chunk.start:chunk.end] == chunk.text``. The algorithm is deterministic, so the id
``"{source}#{n}"`` of an unchanged file's chunks is stable across rebuilds.

Written here rather than taken from a splitter library because the span invariant, the structure
rules and an arbitrary token-count callable together are not what those libraries offer.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass

from specrag.retrieval.loaders import Document

TokenCount = Callable[[str], int]

# Bump when chunk boundaries could change for the same input: a build then re-embeds everything.
CHUNKER_VERSION = 1

_ATX_HEADING = re.compile(r"#{1,6}(?:[ \t]+\S|$)")
_ADORNMENT = re.compile(r"([=\-~^\"'`*+#:._])\1{2,}[ \t]*")
_FENCE = re.compile(r"[ \t]{0,3}(```|~~~)")
_SENTENCE_END = re.compile(r"[.!?:;][\"')\]’”]*\s+")
_WORD = re.compile(r"\S+")


@dataclass(frozen=True)
class ChunkerSettings:
    max_tokens: int = 256
    overlap: int = 32
    tokenizer: str = "whitespace"  # names the count_tokens callable; part of the index's identity

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, not {self.max_tokens}")
        if not 0 <= self.overlap < self.max_tokens:
            raise ValueError(f"overlap must be in [0, max_tokens), not {self.overlap}")

    def as_dict(self) -> dict[str, int | str]:
        return {**asdict(self), "version": CHUNKER_VERSION}


@dataclass(frozen=True)
class Chunk:
    id: str
    source: str
    text: str
    start: int
    end: int


@dataclass(frozen=True)
class _Piece:
    start: int
    end: int
    tokens: int


@dataclass(frozen=True)
class _Block:
    start: int
    end: int
    heading: bool


class Chunker:
    """Cuts documents into chunks; one instance per (settings, count_tokens) pair."""

    def __init__(self, settings: ChunkerSettings, count_tokens: TokenCount) -> None:
        self.settings = settings
        self.count_tokens = count_tokens

    def chunk(self, document: Document) -> list[Chunk]:
        return chunk_text(
            document.text, document.source, self.count_tokens, self.settings.max_tokens, self.settings.overlap
        )


def whitespace_tokens(text: str) -> int:
    """A model-free token count for tests and quick builds: whitespace-separated words."""
    return len(text.split())


def chunk_text(text: str, source: str, count_tokens: TokenCount, max_tokens: int, overlap: int) -> list[Chunk]:
    spans: list[tuple[int, int]] = []
    for section in _sections(_blocks(text)):
        pieces = [piece for block in section for piece in _pieces(text, block, count_tokens, max_tokens)]
        spans.extend(_Packer(text, pieces, count_tokens, max_tokens, overlap).pack())
    return [Chunk(f"{source}#{n}", source, text[start:end], start, end) for n, (start, end) in enumerate(spans)]


def _lines(text: str) -> list[tuple[int, str]]:
    """(offset, line without its newline) for every line."""
    offset, lines = 0, []
    for line in text.splitlines(keepends=True):
        lines.append((offset, line.rstrip("\r\n")))
        offset += len(line)
    return lines


def _blocks(text: str) -> list[_Block]:
    """Paragraphs (runs of non-blank lines); an ATX heading line also opens a new paragraph."""
    blocks: list[_Block] = []
    current: list[tuple[int, str]] = []
    in_fence = False
    for offset, line in _lines(text):
        if _FENCE.match(line):
            in_fence = not in_fence
        opens_heading = not in_fence and _ATX_HEADING.match(line) is not None
        if (not line.strip() or opens_heading) and current:
            blocks.append(_make_block(current, in_fence))
            current = []
        if line.strip():
            current.append((offset, line))
    if current:
        blocks.append(_make_block(current, in_fence))
    return blocks


def _make_block(lines: list[tuple[int, str]], in_fence: bool) -> _Block:
    # Start at the line start so indented code keeps its indentation; end after the last visible char.
    start = lines[0][0]
    end = lines[-1][0] + len(lines[-1][1].rstrip())
    return _Block(start, end, not in_fence and _is_heading([line for _, line in lines]))


def _is_heading(lines: list[str]) -> bool:
    if _ATX_HEADING.match(lines[0]):
        return True
    if len(lines) >= 2 and _ADORNMENT.fullmatch(lines[1]) and not _ADORNMENT.fullmatch(lines[0]):
        return True  # reST title + underline, or Markdown setext
    return len(lines) >= 3 and bool(_ADORNMENT.fullmatch(lines[0]) and _ADORNMENT.fullmatch(lines[2]))


def _sections(blocks: list[_Block]) -> list[list[_Block]]:
    """Blocks grouped by heading; consecutive headings stay together so no chunk is a bare title."""
    sections: list[list[_Block]] = []
    for block in blocks:
        if block.heading and sections and any(not earlier.heading for earlier in sections[-1]):
            sections.append([block])
        elif sections:
            sections[-1].append(block)
        else:
            sections.append([block])
    return sections


def _pieces(text: str, block: _Block, count_tokens: TokenCount, max_tokens: int) -> list[_Piece]:
    """The block itself if it fits, else its sentences, and over-long sentences as words."""
    whole = count_tokens(text[block.start : block.end])
    if whole <= max_tokens:
        return [_Piece(block.start, block.end, whole)]
    pieces: list[_Piece] = []
    for start, end in _sentences(text, block.start, block.end):
        tokens = count_tokens(text[start:end])
        if tokens <= max_tokens:
            pieces.append(_Piece(start, end, tokens))
        else:
            words = _words(text, start, end)
            pieces.extend(_Piece(left, right, count_tokens(text[left:right])) for left, right in words)
    return pieces


def _sentences(text: str, start: int, end: int) -> list[tuple[int, int]]:
    cuts = [start, *(start + match.end() for match in _SENTENCE_END.finditer(text[start:end])), end]
    spans = []
    for left, right in itertools.pairwise(cuts):
        segment = text[left:right]
        stripped = segment.strip()
        if stripped:
            lead = len(segment) - len(segment.lstrip())
            spans.append((left + lead, left + lead + len(stripped)))
    return spans


def _words(text: str, start: int, end: int) -> list[tuple[int, int]]:
    return [(start + match.start(), start + match.end()) for match in _WORD.finditer(text[start:end])]


class _Packer:
    """Greedy packing of one section's consecutive pieces into spans of at most ``max_tokens``.

    Piece counts summed give an estimate (tokenizing is the cost that matters: about a microsecond
    per character for a BPE tokenizer); each span is then measured exactly and shrunk by binary
    search when the separators between pieces pushed it over the budget.
    """

    def __init__(
        self, text: str, pieces: list[_Piece], count_tokens: TokenCount, max_tokens: int, overlap: int
    ) -> None:
        self.text, self.pieces, self.count_tokens = text, pieces, count_tokens
        self.max_tokens, self.overlap = max_tokens, overlap

    def fits(self, start: int, last: int) -> bool:
        return self.count_tokens(self.text[start : self.pieces[last].end]) <= self.max_tokens

    def pack(self) -> list[tuple[int, int]]:
        spans: list[tuple[int, int]] = []
        index, carried = 0, 0
        start = self.pieces[0].start if self.pieces else 0
        while index < len(self.pieces):
            last = self._measured_last(start, index, self._estimated_last(index, carried))
            if last is None:  # the overlap crowds out the next piece: start afresh at that piece
                start, carried = self.pieces[index].start, 0
                continue
            spans.append((start, self.pieces[last].end))
            index = last + 1
            if index < len(self.pieces):
                start, carried = self._overlap_start(spans[-1], index)
        return spans

    def _estimated_last(self, first: int, carried: int) -> int:
        total, last = carried + self.pieces[first].tokens, first
        while last + 1 < len(self.pieces) and total + self.pieces[last + 1].tokens <= self.max_tokens:
            last += 1
            total += self.pieces[last].tokens
        return last

    def _measured_last(self, start: int, first: int, estimate: int) -> int | None:
        """The largest j <= estimate whose span from ``start`` fits; None if even ``first`` does not."""
        if self.fits(start, estimate):
            return estimate
        if not self.fits(start, first):
            # A lone piece over the budget is a single word longer than it: its own chunk.
            return first if start == self.pieces[first].start else None
        low, high = first, estimate - 1
        while low < high:
            middle = (low + high + 1) // 2
            if self.fits(start, middle):
                low = middle
            else:
                high = middle - 1
        return low

    def _overlap_start(self, previous: tuple[int, int], next_index: int) -> tuple[int, int]:
        """(start, estimated tokens) of the next chunk's overlap: a tail of at most ``overlap`` tokens."""
        prev_start, prev_end = previous
        next_start = self.pieces[next_index].start
        text, count = self.text, self.count_tokens
        starts = [prev_start + match.start() for match in _WORD.finditer(text[prev_start:prev_end])][1:]
        if self.overlap == 0 or not starts or count(text[starts[-1] : prev_end]) > self.overlap:
            return next_start, 0  # no overlap wanted, or even the last word alone is over it
        low, high = 0, len(starts) - 1
        while low < high:  # earliest word start whose tail fits the overlap budget
            middle = (low + high) // 2
            if count(text[starts[middle] : prev_end]) <= self.overlap:
                high = middle
            else:
                low = middle + 1
        # Prefer a sentence or line start within the budget, so chunks rarely open mid-sentence.
        chosen = next((p for p in starts[low:] if _starts_sentence(text, p)), starts[low])
        return chosen, count(text[chosen:prev_end])


def _starts_sentence(text: str, position: int) -> bool:
    before = text[:position].rstrip(" \t")
    return not before or before[-1] in "\n.!?:;"
