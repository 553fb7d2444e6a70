"""Reflowed lookup texts: a quoting model writes wrapped prose on one line."""

from __future__ import annotations

from specrag.retrieval.reflow import lookup_texts, reflowed


def test_wrapped_prose_is_joined_and_code_keeps_its_lines() -> None:
    text = "The with statement\nwraps a block with\nmethods.\n\nGrammar:\n\n   with_stmt ::= x\n   y ::= z\nend"
    assert (
        reflowed(text)
        == "The with statement wraps a block with methods.\n\nGrammar:\n\n   with_stmt ::= x\n   y ::= z end"
    )
    assert lookup_texts(text) == [reflowed(text), text]  # reflowed first: what a quote looks like
    assert lookup_texts("one line") == ["one line"]
