"""Text out of a token stream, one piece per event, never splitting a character.

Decoding the tokens so far and emitting what is new is exact for any tokenizer (byte-level
BPE merges and SentencePiece spaces included); a piece that would end inside a multi-byte
character (decoded as U+FFFD) is held back until the next tokens complete it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_INCOMPLETE = "\ufffd"


class IncrementalDecoder:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""  # everything emitted so far

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the new text that is complete."""
        self.token_ids.extend(token_ids)
        decoded = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if decoded.endswith(_INCOMPLETE) or not decoded.startswith(self.text):
            return ""
        piece = decoded[len(self.text) :]
        self.text = decoded
        return piece

    def finish(self) -> str:
        """The whole text, held-back characters included."""
        self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        return self.text
